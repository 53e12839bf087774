"""Reward models as reward functions: a local sequence-classification folder scores the completions.

An entry of `rewards.functions` may be the folder of a Hugging Face reward model
(`AutoModelForSequenceClassification` with `num_labels = 1`, e.g. one trained with TRL's
`RewardTrainer`), as TRL's `GRPOTrainer` accepts a model id in `reward_funcs`. `load_reward_model`
turns the folder into a `RewardModel`: a callable with the reward calling convention of `core.py`
(`f(prompts, completions, **kwargs) -> list[float]`), so it is weighted, logged and timed like any
function, under the folder's name.

It scores exactly as TRL 1.16's `GRPOTrainer._calculate_rewards` scores a `PreTrainedModel`:

- the text is `prompt + completion` for plain prompts; for conversational ones (lists of messages)
  the reward tokenizer's own chat template renders the messages `prompt + completion`
  (`tokenizer.apply_chat_template(..., tools=None, tokenize=False)`, what TRL's `apply_chat_template`
  does for a `{"messages": ...}` example);
- the tokenizer is the folder's own (`AutoTokenizer`), padding on the right, `add_special_tokens=False`;
  without a pad token its EOS token pads, and the model's `pad_token_id` is set to the tokenizer's,
  since the model pools at the last token that is not padding;
- the reward is `logits[:, 0]`, under `torch.inference_mode()`, as float32 values.

What differs from TRL, all in the user's favour:

- The samples are scored in chunks of `batch_size` (TRL scores the whole batch in one forward), so
  a large group does not run out of memory. Each chunk pads to its own longest text; with right
  padding the scores are the same (up to float rounding in the last bits).
- The folder is checked before any weight is read (`check_reward_model_folder`): a causal LM, a
  classifier with `num_labels != 1` or a folder without tokenizer files is one `RewardLoadError` line.
  TRL would load a causal LM folder with a freshly initialised (random) score head and train on
  noise; here a checkpoint that lacks weights of the model (the head) is an error too (transformers'
  multi-line load report held back), and so is a tokenizer with more tokens than the model's embedding
  has rows (TRL: an IndexError at the first batch).
- The name is the folder's base name even for "path/" or "." (TRL's `_name_or_path.split("/")[-1]`
  gives "" and "." there).
- Conversational prompts with plain string completions (a direct call) get the completions wrapped
  as assistant messages, as `core.as_trl_completions` does (TRL would fail on list + str); chat
  prompts for a reward tokenizer without a chat template are a ValueError naming the reward model,
  and `RewardModel.unreadable` lets start-up refuse them before the policy loads.
- A loaded `PreTrainedModel` is taken where TRL takes one (`reward_model_from_object`), by the TRL
  drop-in and by `train(reward_functions=[...])` alike.
- No remote code (`trust_remote_code` stays False, TRL's default), and no Hub ids: a local folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

from grpokit.errors import RewardLoadError, UserError
from grpokit.rewards.core import as_trl_completions

# Any one of these means the folder has a tokenizer (the vocabulary files of the common tokenizer kinds).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")

# Architecture names of generative models: a policy folder given where a reward model belongs.
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")

_WHAT = ("a reward model is an AutoModelForSequenceClassification with num_labels = 1 (e.g. one trained with "
         "TRL's RewardTrainer), saved with save_pretrained together with its tokenizer")

_DTYPES = ("float32", "float16", "bfloat16")


def _where(path: str | os.PathLike) -> str:
    return f"reward model {str(path)!r}"


def _one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one short line (transformers' messages span several)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


@contextlib.contextmanager
def _no_load_report() -> Iterator[None]:
    """transformers' warnings while a reward model loads held back: its LOAD REPORT (a table of missing and
    unexpected weights) would print several lines before the one-line error that names what is missing
    here (`load_reward_model`), and unexpected weights (a causal LM's head) do not change the scores."""
    logger = logging.getLogger("transformers.modeling_utils")

    def errors_only(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR

    # A filter, not setLevel: transformers runs (and logs) a tensor-parallel plan check when that logger's
    # level is set to WARNING or above.
    logger.addFilter(errors_only)
    try:
        yield
    finally:
        logger.removeFilter(errors_only)


def is_reward_model_folder(ref: str) -> bool:
    """True when `ref` names an existing local folder with a config.json.

    Cheap (two stat calls): it routes a `rewards.functions` entry to the reward-model loader. A folder
    is required to hold config.json so that a stray folder that happens to share a built-in reward's
    name ("format", "countdown") in the working directory does not shadow that reward."""
    if not ref:  # "" would be the working directory
        return False
    try:
        p = Path(ref)
        return p.is_dir() and (p / "config.json").is_file()
    except (TypeError, ValueError, OSError):
        return False


def check_reward_model_folder(path: str) -> None:
    """Raise `RewardLoadError` (one line naming the folder and the fix) for a folder that cannot be
    a reward model; reads config.json alone, no weights.

    Meant to run before the policy model loads, so a wrong entry costs a second, not a model load."""
    from transformers import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING, AutoConfig

    p = Path(path)
    if not p.is_dir():
        raise RewardLoadError(f"{_where(path)}: no such folder (relative paths start at {os.getcwd()}); "
                              f"fix the path, or name a built-in reward or a 'file.py:function'")
    if not (p / "config.json").is_file():
        raise RewardLoadError(f"{_where(path)}: the folder has no config.json, so it is not a Hugging Face model "
                              f"folder; {_WHAT}")
    try:
        config = AutoConfig.from_pretrained(str(p))
    except Exception as e:  # bad JSON, an unknown model_type, a file that cannot be read
        raise RewardLoadError(f"{_where(path)}: its config.json cannot be read ({type(e).__name__}: "
                              f"{_one_line(e)}); repair it or save the model again with save_pretrained") from e
    archs = [str(a) for a in (getattr(config, "architectures", None) or [])]
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        if any(a.endswith(_CAUSAL_SUFFIXES) for a in archs):
            raise RewardLoadError(f"{_where(path)} is a causal LM ({archs[0]}), not a reward model; {_WHAT}")
        if archs:
            raise RewardLoadError(f"{_where(path)} is a {archs[0]}, not a sequence-classification model; {_WHAT}")
        if type(config) not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
            raise RewardLoadError(f"{_where(path)}: model type {config.model_type!r} has no sequence-classification "
                                  f"class in transformers; {_WHAT}")
        # No architectures recorded but a known type: the load checks that the score head's weights exist.
    if config.num_labels != 1:
        raise RewardLoadError(f"{_where(path)} has num_labels = {config.num_labels} (a classifier with "
                              f"{config.num_labels} classes), but a reward is one logit; {_WHAT}")
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise RewardLoadError(f"{_where(path)}: the folder has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, "
                              f"...); save the reward model's tokenizer there with tokenizer.save_pretrained(folder)")


def _dtype_kwargs(path: str, dtype: Any) -> dict:
    """`from_pretrained`'s dtype argument: none for None (the checkpoint's dtype, as TRL loads it)."""
    import torch

    if dtype is None:
        return {}
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return {"dtype": dtype}
    if isinstance(dtype, str) and dtype in _DTYPES:
        return {"dtype": getattr(torch, dtype)}
    raise RewardLoadError(f"{_where(path)}: dtype {dtype!r} is not one of None, 'auto', {', '.join(_DTYPES)} "
                          f"or a torch.dtype")


class RewardModel:
    """A loaded reward model, called like a reward function: one float per completion.

    `__name__` is the folder's base name, the name TRL logs a model reward under. The model is in
    eval mode with gradients off; it stays on `device`, and each call moves only token ids there.
    """

    def __init__(self, model, tokenizer, *, name: str, device: Any = None, batch_size: int = 32,
                 chat_template_kwargs: dict | None = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"reward model '{name}': batch_size must be an integer >= 1, got {batch_size!r}")
        self.model, self.tokenizer = model, tokenizer
        self.__name__ = name
        self.device = model.device if device is None else device
        self.batch_size = batch_size
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def __repr__(self) -> str:
        return f"RewardModel({self.__name__!r}, {type(self.model).__name__}, device={str(self.device)!r})"

    def unreadable(self, prompt: Any) -> str | None:
        """Why this reward model cannot read `prompt`, None when it can: chat messages need the reward
        tokenizer's chat template. Start-up asks it of the data's prompts (training/setup.py), so that a
        run fails before the policy loads rather than at its first step."""
        if _is_chat(prompt) and getattr(self.tokenizer, "chat_template", None) is None:
            return (f"reward model '{self.__name__}': the prompts are chat messages but its tokenizer has no chat "
                    f"template; give the reward model's folder the chat template it was trained with, or use "
                    f"plain-text prompts")
        return None

    def texts(self, prompts: Sequence, completions: Sequence) -> list[str]:
        """The strings the reward model reads: what TRL builds for it (see the module docstring)."""
        if len(prompts) != len(completions):
            raise ValueError(f"reward model '{self.__name__}' got {len(prompts)} prompts for "
                             f"{len(completions)} completions; give one prompt per completion")
        if not prompts:
            return []
        first = prompts[0]
        if _is_chat(first):
            if why := self.unreadable(first):
                raise ValueError(why)
            completions = as_trl_completions(prompts, completions)
            return [self.tokenizer.apply_chat_template(list(p) + list(c), tools=None, tokenize=False,
                                                       **self.chat_template_kwargs)
                    for p, c in zip(prompts, completions)]
        return [p + c for p, c in zip(prompts, completions)]

    def __call__(self, prompts: Sequence, completions: Sequence, **kwargs) -> list[float]:
        """The score of each `prompt + completion`; the other arguments (completion_ids, dataset columns,
        trainer_state, ...) are accepted and ignored, as TRL ignores them for a model."""
        import torch

        texts = self.texts(prompts, completions)
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(text=texts[start: start + self.batch_size], return_tensors="pt",
                                       padding=True, padding_side="right", add_special_tokens=False)
                batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                logits = self.model(**batch).logits  # [B, 1]
                scores.extend(logits[:, 0].float().tolist())  # TRL writes them into a float32 tensor
        return scores


def load_reward_model(path: str, *, device: Any = "cpu", dtype: Any = None, batch_size: int = 32,
                      chat_template_kwargs: dict | None = None) -> RewardModel:
    """The reward model in the local folder `path`, with its own tokenizer, ready to score.

    `device`: where the model sits and scores ("auto": CUDA when present, else CPU).
    `dtype`: None loads the checkpoint's own dtype (what TRL does with no `model_init_kwargs`), or
    "auto", "float32", "bfloat16", "float16", a torch.dtype. `chat_template_kwargs` are passed to the
    reward tokenizer's chat template (TRL's `GRPOConfig.chat_template_kwargs`). Any failure is one
    `RewardLoadError` line naming the folder."""
    check_reward_model_folder(path)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise RewardLoadError(f"{_where(path)}: batch_size must be an integer >= 1, got {batch_size!r}")
    kwargs = _dtype_kwargs(path, dtype)
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if device == "auto":  # as the policy's model.device: CUDA when present
        device = "cuda" if torch.cuda.is_available() else "cpu"
    step = "the tokenizer"
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        step = "the model"
        with _no_load_report():
            model, info = AutoModelForSequenceClassification.from_pretrained(
                str(path), num_labels=1, output_loading_info=True, **kwargs)
        step = f"moving the model to {device!r}"
        model.to(device)
    except Exception as e:  # a damaged or truncated weight file, a broken tokenizer, a device this machine lacks
        raise RewardLoadError(f"{_where(path)}: loading {step} failed ({type(e).__name__}: {_one_line(e)}); check "
                              f"the folder's files or save the model again with save_pretrained") from e
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise RewardLoadError(f"{_where(path)}: the checkpoint has no weights for {shown}, so they would be random "
                              f"and so would the rewards; {_WHAT}")
    model.eval()
    model.requires_grad_(False)
    return wrap_reward_model(model, tokenizer, name=Path(os.path.abspath(path)).name, device=device,
                             where=_where(path), batch_size=batch_size, chat_template_kwargs=chat_template_kwargs)


def wrap_reward_model(model, tokenizer, *, name: str, device: Any, where: str,
                      error: type[UserError] = RewardLoadError, **options) -> RewardModel:
    """A `RewardModel` over a loaded model and tokenizer, after TRL's fix-up: EOS pads when the tokenizer has
    no pad token, and the model learns the pad id (it scores the last token that is not padding). A tokenizer
    that cannot pad, or whose ids run past the model's embedding (an IndexError deep in torch at the first
    batch otherwise), is one `error` line starting with `where`. `options`: RewardModel's."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token_id is None:
        raise error(f"{where}: the tokenizer of reward model {name!r} has neither a pad nor an EOS token, so a "
                    f"batch cannot be padded; set its pad_token (in a folder: pad_token in tokenizer_config.json)")
    try:
        rows = model.get_input_embeddings().weight.shape[0]
    except (AttributeError, NotImplementedError, TypeError):  # a model that does not say: nothing to compare
        rows = None
    if rows is not None and len(tokenizer) > rows:
        raise error(f"{where}: the tokenizer of reward model {name!r} has {len(tokenizer)} tokens but the model's "
                    f"embedding only {rows} rows, so a text with a token id >= {rows} would fail at the first "
                    f"batch; pair the model with the tokenizer it was trained with, or resize_token_embeddings("
                    f"len(tokenizer)) and train it again")
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    return RewardModel(model, tokenizer, name=name, device=device, **options)


def reward_model_name(name_or_path: str, fallback: str) -> str:
    """TRL's metric name of a reward model: the last part of its name or path ("" or "." only when the path
    ends in a slash or is "."; then `fallback`)."""
    name = str(name_or_path).split("/")[-1]
    return name if name not in ("", ".", "..") else fallback


def is_model_object(f: Any) -> bool:
    """True for a torch module (a loaded model) where a reward function goes; torch is not imported for it
    (without torch imported there is no module)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(f, torch.nn.Module)


_OBJECT_WHAT = "a reward model is an AutoModelForSequenceClassification with num_labels = 1"


def reward_model_from_object(model, tokenizer=None, *, device: Any, field: str, tokenizer_field: str,
                             tokenizer_fix: str, error: type[UserError] = RewardLoadError) -> RewardModel:
    """A loaded `PreTrainedModel` (sequence classification, one label) as a `RewardModel` on `device`, as
    TRL takes one in `reward_funcs`: named by its `config._name_or_path`'s last part, reading its text with
    `tokenizer` or, without one, with `AutoTokenizer.from_pretrained(config._name_or_path)` (TRL's rule; no
    remote code); put in eval mode (dropout off: deterministic scores). What is not a reward model is one
    `error` line naming `field` (the argument that held it); a tokenizer that cannot be found or used names
    `tokenizer_field` and says `tokenizer_fix`. The TRL drop-in and `train(reward_functions=...)` both
    come here, each naming its own arguments."""
    from transformers import AutoTokenizer, PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise error(f"{field}: a {type(model).__name__} is a torch module but no transformers PreTrainedModel; "
                    f"{_OBJECT_WHAT} (a peft model: merge it first, merge_and_unload())")
    kind, labels = type(model).__name__, getattr(model.config, "num_labels", None)
    if not kind.endswith("ForSequenceClassification") or labels != 1:
        raise error(f"{field}: a {kind} with num_labels = {labels} is not a reward model; {_OBJECT_WHAT}")
    source = getattr(model.config, "_name_or_path", "") or ""
    if tokenizer is None:
        if not source:
            raise error(f"{tokenizer_field}: the reward model {kind} names no folder (config._name_or_path is "
                        f"empty) to load its tokenizer from; {tokenizer_fix}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as e:
            raise error(f"{tokenizer_field}: loading the reward model's tokenizer from {source!r} failed "
                        f"({type(e).__name__}); {tokenizer_fix}") from e
    model.to(device)
    model.eval()
    return wrap_reward_model(model, tokenizer, name=reward_model_name(source, "reward_model"), device=device,
                             where=tokenizer_field, error=error)

"""`GRPOTrainer(model=..., processing_class=..., peft_config=...)`: the model and tokenizer, loaded as TRL loads them.

TRL loads the policy in its constructor and trains that object: `trainer.model` is the module, and the
user's own reference to it sees the trained weights. The drop-in does the same; grpokit's loop trains the
object in place (`training.loop.train(model=...)`). What grpokit still reads from a folder (the config,
the tokenizer files, the context length, the KL reference with beta > 0, the checkpoints' metadata) is
`model.path`:

- a Hub id or a local folder: loaded here (grpokit's `load_model`: the folder checks, the dtype rules
  below) on the training device; `model.path` is the folder (a Hub id: its cached snapshot);
- a `PreTrainedModel` object: trained as it is; its weights and tokenizer are also written to
  `<output_dir>/trl-model/`, the folder grpokit reads (so is a folder given with another
  `processing_class`: its other files are linked, not copied);
- a peft `PeftModel` (LoRA): its adapter is trained, as TRL trains it; the base weights (without the
  adapter) go to `trl-model/`, and the LoRA settings to `model.lora`. With `peft_config` (TRL refuses
  both together), or with beta > 0 (TRL's reference is then a copy of the adapter, grpokit's the base
  with the adapter off), it is refused.

With `peft_config`, LoRA is applied here, as TRL applies it, so `trainer.model` is the `PeftModel`. TRL
1.16's refusals of peft configurations come first, naming what they refuse: an adapter on `lm_head` (the
log-probs are computed from `lm_head.weight` in a fused path, grpokit's as TRL's and Liger's with
`use_liger_kernel`), and a prompt-learning config (its virtual tokens; grpokit trains LoRA only).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from grpokit.errors import ConfigError

MODEL_FOLDER = "trl-model"  # under output_dir: a model object (or a folder with another tokenizer) saved for grpokit
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json"}
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "torch.float32": "float32",
                "torch.bfloat16": "bfloat16", "torch.float16": "float16", "fp32": "float32", "bf16": "bfloat16",
                "fp16": "float16"}


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - without peft nobody can pass one
        return False
    return isinstance(model, PeftModel)


def load(model, processing_class, args, peft_config) -> tuple[object, object, str, str, dict | None]:
    """(the module, the tokenizer, model.path, the dtype, model.lora) for TRL's `model` and `peft_config`; the
    module is None for a model given by name (the trainer loads it once every check has passed). The LoRA
    settings are checked before anything is written."""
    if isinstance(model, str):
        return _by_name(model, processing_class, args, peft_config)
    if is_peft_model(model):
        return _peft_object(model, processing_class, args, peft_config)
    return _plain_object(model, processing_class, args, peft_config)


def wanted_dtype(args):
    kwargs = args.model_init_kwargs or {}
    return kwargs.get("dtype", kwargs.get("torch_dtype", "auto"))


def _by_name(name: str, processing_class, args, peft_config):
    from grpokit.models.loading import check_model_folder, load_tokenizer

    folder = check_model_folder(name, field="model")  # a local folder, or a Hub id's cached snapshot
    saved = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    wanted = wanted_dtype(args)
    dtype = dtype_name(saved.get("dtype") or saved.get("torch_dtype") if str(wanted) == "auto" else wanted)
    lora = peft_lora(None, saved.get("model_type"), peft_config, liger=args.use_liger_kernel)
    tokenizer = processing_class or load_tokenizer(folder, field="model")
    path = str(folder) if Path(name).is_dir() else name
    if processing_class is not None:  # grpokit reads the tokenizer from the folder: one with the given tokenizer
        merged = fresh_folder(args)
        processing_class.save_pretrained(str(merged))
        for p in folder.iterdir():  # the model's own files, linked
            if p.name not in TOKENIZER_FILES and not (merged / p.name).exists():
                _link(p, merged / p.name)
        path = str(merged)
    return None, tokenizer, path, dtype, lora


def _tokenizer_of(model, processing_class):
    if processing_class is not None:
        return processing_class
    source = getattr(model, "name_or_path", "") or model.config._name_or_path
    if not source:
        raise ConfigError("processing_class: required with a model object that names no folder to load its "
                          "tokenizer from")
    from grpokit.models.loading import load_tokenizer

    return load_tokenizer(source, field="model.name_or_path")


def _plain_object(model, processing_class, args, peft_config):
    """A loaded PreTrainedModel: trained as it is, and written to <output_dir>/trl-model with its tokenizer."""
    from grpokit.models.loading import no_progress_bars

    if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        raise ConfigError(f"model: give a folder, a Hub id, a transformers PreTrainedModel or a peft PeftModel, not "
                          f"a {type(model).__name__}")
    if args.model_init_kwargs:
        raise ConfigError("model_init_kwargs: the model is already loaded (a PreTrainedModel object); "
                          "model_init_kwargs apply only to a model given by name")
    lora = peft_lora(model, getattr(model.config, "model_type", None), peft_config, liger=args.use_liger_kernel)
    tokenizer = _tokenizer_of(model, processing_class)
    folder = fresh_folder(args)
    with no_progress_bars():  # transformers' "Writing model shards" (grpokit's saves print none)
        model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return model, tokenizer, str(folder), dtype_name(model.dtype), lora


def _peft_object(model, processing_class, args, peft_config):
    """A PeftModel with a LoRA adapter: the adapter trains (TRL's behaviour); trl-model/ gets the base weights."""
    from grpokit.models.loading import no_progress_bars

    if args.beta != 0:
        raise ConfigError("model: a PeftModel with beta > 0 is not supported: TRL's KL reference is then a copy of "
                          "your adapter, grpokit's the base model with the adapter off. Merge the adapter "
                          "(model.merge_and_unload()) and pass that model with peft_config, or set beta=0")
    if args.model_init_kwargs:
        raise ConfigError("model_init_kwargs: the model is already loaded (a PeftModel); leave them unset")
    inner = model.get_base_model()
    lora = peft_lora(model, getattr(inner.config, "model_type", None), peft_config, liger=args.use_liger_kernel)
    tokenizer = _tokenizer_of(inner, processing_class)
    folder = fresh_folder(args)
    base = {k.replace(".base_layer.", "."): v for k, v in inner.state_dict().items() if "lora_" not in k}
    with no_progress_bars():
        inner.save_pretrained(str(folder), state_dict=base)
    tokenizer.save_pretrained(str(folder))
    return model, tokenizer, str(folder), dtype_name(inner.dtype), lora


def peft_lora(model, model_type: str | None, peft_config, *, liger: bool = False) -> dict | None:
    """model.lora for a PeftModel given as `model` (its active adapter), or for peft_config; None without LoRA.
    TRL's refusals of peft configurations come first, in its terms (`liger`: use_liger_kernel=True)."""
    from grpokit.trl.mapping import lora_options

    if is_peft_model(model):
        if peft_config is not None:  # TRL's own refusal
            raise ConfigError("peft_config: you passed a PeftModel instance together with a peft_config; merge and "
                              "unload the existing adapter, save the resulting base model, and pass that base model "
                              "with the new peft_config (or drop peft_config to train the adapter as it is)")
        adapter = model.peft_config[model.active_adapter]
        _refuse_prompt_learning(adapter, "model (its adapter)", liger)
        lora = lora_options(adapter, model_type, field="model (its adapter)", allowed=("lora_dropout",))
        _refuse_head_adapter(lora, "model (its adapter)", liger)
        return lora
    if peft_config is None:
        return None
    _refuse_prompt_learning(peft_config, "peft_config", liger)
    lora = lora_options(peft_config, model_type)
    _refuse_head_adapter(lora, "peft_config", liger)
    return lora


def _refuse_prompt_learning(config, field: str, liger: bool) -> None:
    """TRL refuses prompt-learning methods with use_liger_kernel (their virtual tokens are prepended by
    PeftModel.forward(), which a fused loss bypasses); grpokit trains LoRA adapters only, so it names them always."""
    if not getattr(config, "is_prompt_learning", False):
        return
    why = ("use_liger_kernel=True is incompatible with prompt-learning PEFT methods: their virtual tokens are "
           "prepended by PeftModel.forward(), which the fused loss bypasses (TRL's refusal); and ") if liger else ""
    raise ConfigError(f"{field}: {type(config).__name__} is a prompt-learning PEFT method (PromptTuning, "
                      f"PrefixTuning, P-Tuning); {why}grpokit trains LoRA adapters only: use a peft LoraConfig")


def _refuse_head_adapter(lora: dict, field: str, liger: bool) -> None:
    """TRL 1.16's refusal of a peft adapter on `lm_head` (with or without use_liger_kernel): the log-probs are
    computed from `lm_head.weight` directly, which an adapter on the head does not change."""
    import re

    targets = lora["target_modules"]
    on_head = re.fullmatch(targets, "lm_head") is not None if isinstance(targets, str) and targets != "all-linear" \
        else not isinstance(targets, str) and any(t == "lm_head" or t.endswith(".lm_head") for t in targets)
    if not on_head:
        return
    how = "Liger's fused loss (use_liger_kernel=True) and grpokit's fused log-probs, which stand for it," if liger \
        else "grpokit's fused log-probs, as TRL's,"
    raise ConfigError(f"{field}: a LoRA adapter on `lm_head` (target_modules={targets!r}) is not supported (TRL "
                      f"refuses it too): {how} compute the log-probs from `lm_head.weight` directly, so the adapter "
                      "on the head would not be trained; remove 'lm_head' from target_modules")


def policy_module(model):
    """What grpokit's loop trains: the module itself, or for a PeftModel its base model carrying the LoRA
    layers (grpokit's own LoRA convention, models/lora.py), the adapter's weights trainable."""
    if not is_peft_model(model):
        return model
    from grpokit.models.lora import ADAPTER_ATTR, adapter_of  # apply_lora's convention, for a peft-made wrapper

    inner = model.get_base_model()
    if adapter_of(inner) is None:
        inner.__dict__[ADAPTER_ATTR] = model
        for name, p in inner.named_parameters():
            p.requires_grad_("lora_" in name)  # a PeftModel loaded for inference has its adapter frozen
    return inner


def with_lora(module, lora: dict | None, seed: int):
    """peft_config applied now, as TRL applies it in its constructor: the PeftModel (seeded as TRL seeds it)."""
    if not lora or is_peft_model(module):
        return module
    import torch

    from grpokit.models.lora import adapter_of, apply_lora

    torch.manual_seed(seed)
    return adapter_of(apply_lora(module, lora))


def fresh_folder(args) -> Path:
    folder = Path(args.output_dir) / MODEL_FOLDER
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder.resolve()


def _link(source: Path, target: Path) -> None:
    try:
        os.symlink(source.resolve(), target, target_is_directory=source.is_dir())
    except OSError:  # a file system without links
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, target)


def dtype_name(value) -> str:
    """A dtype as grpokit's model.dtype; None (config.json without one) is transformers' float32."""
    if value is None:
        return "float32"
    name = _DTYPE_NAMES.get(str(value))
    if name is None:
        raise ConfigError(f"model dtype {value!s}: grpokit loads float32, bfloat16 or float16")
    return name

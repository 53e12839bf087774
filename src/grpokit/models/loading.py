"""Loading a Hugging Face causal LM and its tokenizer from a local folder or a Hub id, checked first.

A damaged folder (a missing or truncated weight file, an unreadable config, no tokenizer)
is one error naming the file and the fix, found before transformers is asked to load it;
`resolve_device` names a device this machine lacks before anything is written.

A path that is no local folder and reads as a Hub id (`Qwen/Qwen2.5-0.5B-Instruct`) is the
repo's snapshot folder in the Hugging Face cache (`model_folder`): downloaded there by
huggingface_hub when online (config, tokenizer and the safetensors weights, else the .bin ones),
read from the cache alone when offline; the same checks then run on that folder, and
`from_pretrained` loads it. What the cache lacks offline is one error line with the fix.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch

from grpokit.data.hub import hub_id, not_cached
from grpokit.errors import ModelLoadError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# The weights `from_pretrained` looks for, in its order of preference.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


# Any one of these means the folder has a tokenizer (the vocabulary files of the common tokenizer kinds).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


_REFETCH = "re-download the model (or save it again with save_pretrained)"


def _where(p: Path, field: str) -> str:
    return f"{field} {str(p)!r}"


def _read_json(p: Path, name: str, field: str, fix: str):
    try:
        return json.loads((p / name).read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{_where(p, field)}: {name} is not UTF-8 text (byte {e.start}); {fix}") from e
    except ValueError as e:  # json.JSONDecodeError
        raise ModelLoadError(f"{_where(p, field)}: {name} is not valid JSON ({getattr(e, 'msg', e)} at line "
                             f"{getattr(e, 'lineno', '?')}); {fix}") from e
    except OSError as e:
        raise ModelLoadError(f"{_where(p, field)}: {name} cannot be read ({e.strerror}); {fix}") from e


def _check_config(p: Path, field: str) -> None:
    cfg = _read_json(p, "config.json", field, f"repair the file or {_REFETCH}")
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{_where(p, field)}: config.json holds a {type(cfg).__name__}, not a JSON object; "
                             f"{_REFETCH}")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelLoadError(f"{_where(p, field)}: config.json has no \"model_type\" (the architecture, e.g. "
                             f"\"qwen2\" or \"llama\"); add it or {_REFETCH}")
    if "auto_map" in cfg:  # custom code: transformers' own error says what it needs
        return
    import difflib

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ModelLoadError(f"{_where(p, field)}: config.json has model_type {model_type!r}{hint}, which "
                             f"transformers {transformers.__version__} does not know; fix the name or upgrade "
                             "transformers (pip install -U transformers)")


def _check_safetensors(p: Path, name: str, field: str) -> None:
    """The header parses and the tensors' data offsets fit in the file: catches a truncated or
    overwritten file without reading the weights."""
    import struct

    f = p / name
    damaged = f"{_where(p, field)}: {name} is damaged"
    try:
        size = f.stat().st_size
        with f.open("rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or n > size - 8 or n > 256 * 2**20:
                raise ModelLoadError(f"{damaged} (no valid safetensors header; {size} bytes); {_REFETCH}")
            header = json.loads(fh.read(n).decode("utf-8"))
    except OSError as e:
        raise ModelLoadError(f"{_where(p, field)}: {name} cannot be read ({e.strerror}); {_REFETCH}") from e
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{damaged} (its safetensors header is not valid JSON); {_REFETCH}") from e
    if not isinstance(header, dict):
        raise ModelLoadError(f"{damaged} (its safetensors header is not a JSON object); {_REFETCH}")
    ends = [t.get("data_offsets", [None, None])[1] if isinstance(t, dict) else None
            for k, t in header.items() if k != "__metadata__"]
    if any(not isinstance(e, int) or isinstance(e, bool) for e in ends):
        raise ModelLoadError(f"{damaged} (a tensor in its header has no data offsets); {_REFETCH}")
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise ModelLoadError(f"{_where(p, field)}: {name} is truncated ({size} bytes, its header describes {need}); "
                             f"the download or copy was cut short: {_REFETCH}")


def _check_weights(p: Path, field: str) -> None:
    found = next((name for name in WEIGHT_FILES if (p / name).is_file()), None)
    if found is None:
        raise ModelLoadError(f"{_where(p, field)} has no weights file (model.safetensors, model.safetensors.index.json "
                             "with its shards, or pytorch_model.bin); copy the weights into the folder or "
                             f"{_REFETCH}")
    if found == "model.safetensors":
        _check_safetensors(p, found, field)
    elif found.endswith(".index.json"):
        index = _read_json(p, found, field, _REFETCH)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{_where(p, field)}: {found} has no \"weight_map\" of tensors to shard files; "
                                 f"{_REFETCH}")
        shards = sorted({str(v) for v in weight_map.values()})
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise ModelLoadError(f"{_where(p, field)}: {found} lists {len(shards)} shard(s) but {missing[0]!r}"
                                 f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} is missing; copy "
                                 f"every shard into the folder or {_REFETCH}")
        for shard in shards:
            if shard.endswith(".safetensors"):
                _check_safetensors(p, shard, field)


def _check_tokenizer_files(p: Path, field: str) -> None:
    present = [name for name in TOKENIZER_FILES if (p / name).is_file()] or sorted(x.name for x in p.glob("*.tiktoken"))
    if not present:
        raise ModelLoadError(f"{_where(p, field)} has no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...); "
                             "copy them from the base model, e.g. AutoTokenizer.from_pretrained(base)"
                             ".save_pretrained(folder)")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if name in present:
            _read_json(p, name, field, "copy the tokenizer files from the base model again")
    for name in _PROCESSOR_FILES:  # a vision-language folder's: AutoProcessor would fail on them with a traceback
        if (p / name).is_file():
            _read_json(p, name, field, "copy the processor files from the base model again")


_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


# What a Hub model's snapshot needs: config, tokenizer, chat template, the weights transformers
# reads first (model*.safetensors), else the PyTorch ones. Never other formats (gguf, onnx, original/).
_HUB_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]
_HUB_SAFETENSORS, _HUB_BIN = ["model*.safetensors"], ["pytorch_model*.bin"]


def model_folder(path: str | Path, *, field: str = "model.path") -> Path:
    """The local folder `path` names: itself, or for a Hub id (no local folder of that name) the
    repo's snapshot folder in the Hugging Face cache, downloaded first when online."""
    p = Path(path)
    repo = None if p.is_dir() else hub_id(path)
    if repo is None:
        if not p.is_dir():
            raise ModelLoadError(f"{field} {str(p)!r} is not a folder; give a local Hugging Face model folder "
                                 "(one with config.json, weights and tokenizer files) or a Hugging Face Hub id "
                                 "such as Qwen/Qwen2.5-0.5B-Instruct")
        return p
    return _hub_snapshot(repo, field)


def _hub_snapshot(repo: str, field: str) -> Path:
    from huggingface_hub import snapshot_download, try_to_load_from_cache
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from grpokit.data.hub import offline

    if offline():  # the cache alone; the folder checks below say which files it lacks
        cached = try_to_load_from_cache(repo, "config.json")
        if not isinstance(cached, str):
            raise ModelLoadError(not_cached(field, repo, "folder", extra=" (no config.json)"))
        return Path(cached).parent
    try:
        folder = Path(snapshot_download(repo, allow_patterns=_HUB_FILES + _HUB_SAFETENSORS))
        if not any(folder.glob("model*.safetensors")):
            folder = Path(snapshot_download(repo, allow_patterns=_HUB_BIN))
    except LocalEntryNotFoundError as e:  # the Hub unreachable and the repo not cached
        raise ModelLoadError(not_cached(field, repo, "folder")) from e
    except GatedRepoError as e:
        raise ModelLoadError(f"{field} {repo!r} is a gated model on the Hugging Face Hub: accept its terms on "
                             f"https://huggingface.co/{repo} and log in with `hf auth login`") from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ModelLoadError(f"{field} {repo!r} is not a local folder (nothing at {Path(repo).resolve()}), and the "
                             f"Hugging Face Hub has no model of that name that you can read; fix the name, or log "
                             f"in with `hf auth login` for a private one") from e
    except (HfHubHTTPError, OSError) as e:
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        raise ModelLoadError(f"{field} {repo!r}: downloading from the Hugging Face Hub failed ({why}); try again, "
                             f"or fetch it with `hf download {repo}`") from e
    return folder


def check_model_folder(path: str | Path, *, field: str = "model.path") -> Path:
    """Fail fast, before any weights load, when `path` is not a loadable model folder; return the folder
    (for a Hub id, its snapshot in the Hugging Face cache: see `model_folder`).

    Cheap checks only: config.json parses and names a model type transformers knows; a weights
    file exists (model.safetensors, a sharded index with its shards, or pytorch_model.bin) and a
    safetensors header parses with data offsets that fit in the file (a truncated copy); tokenizer
    files are present. `field` is how the message names the folder ("model.path", "--model")."""
    p = model_folder(path, field=field)
    try:
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{field} {str(p)!r} has no config.json; is it a Hugging Face model folder?")
        _check_config(p, field)
        _check_weights(p, field)
        _check_tokenizer_files(p, field)
    except ModelLoadError as e:
        if p == Path(path):
            raise
        raise ModelLoadError(f"{e} [{field} {str(path)!r} is this folder in the Hugging Face cache; "
                             f"`hf download {path}` fetches it again]") from e
    return p


def _load_errors() -> tuple[type[BaseException], ...]:
    """What `from_pretrained` raises for a folder it cannot use (not for a bug in our code)."""
    import pickle

    errors: tuple = (OSError, ValueError, KeyError, ImportError, pickle.UnpicklingError)
    try:
        from safetensors import SafetensorError

        errors += (SafetensorError,)
    except ImportError:  # pragma: no cover
        pass
    return errors


def _raised_by_torch_load(e: BaseException) -> bool:
    """True when `e` came out of `torch.load`: its weights-only unpickler, fed a damaged file, raises
    whatever the garbage provokes (IndexError, EOFError, struct.error, ...), not only UnpicklingError."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith(("torch/serialization.py",
                                                                     "torch/_weights_only_unpickler.py")):
            return True
        tb = tb.tb_next
    return False


def _load_failed(p: Path, field: str, what: str, e: BaseException) -> ModelLoadError:
    import pickle

    if isinstance(e, pickle.UnpicklingError) or _raised_by_torch_load(e):
        return ModelLoadError(f"{field} {str(p)!r}: pytorch_model.bin is not a readable PyTorch checkpoint (damaged, "
                              f"or it holds objects that only an unsafe torch.load would accept); {_REFETCH}")
    text = " ".join(str(e).split()) or type(e).__name__
    if len(text) > 300:
        text = text[:297] + "..."
    return ModelLoadError(f"{field} {str(p)!r}: loading the {what} failed ({type(e).__name__}: {text}); "
                          f"check the folder's files or {_REFETCH}")


def resolve_device(device: str, field: str = "model.device") -> torch.device:
    """The torch device for `device` ("auto": CUDA when present, else CPU); a device this machine does not
    have is a user error here, not a torch assertion at the first `.to()`."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except RuntimeError as e:
        raise ModelLoadError(f"{field} {device!r} is not a device name ({e}); use auto, cpu, cuda or cuda:N") from None
    backends = {"cuda": lambda: torch.cuda.is_available() and (d.index or 0) < torch.cuda.device_count(),
                "mps": lambda: torch.backends.mps.is_available(),
                "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available()}
    if d.type in backends and not backends[d.type]():
        raise ModelLoadError(f"{field} {device!r}: this machine has no such device (torch sees "
                             f"{torch.cuda.device_count()} CUDA device(s)); use \"auto\" or \"cpu\"")
    return d


def load_tokenizer(path: str | Path, *, field: str = "model.path"):
    from transformers import AutoTokenizer

    p = check_model_folder(path, field=field)
    try:
        tokenizer = _generic_tokenizer(p) or AutoTokenizer.from_pretrained(str(p))
    except _load_errors() as e:
        raise _load_failed(p, field, "tokenizer", e) from e
    try:
        vocab = set(tokenizer.get_vocab()) - set(tokenizer.get_added_vocab()) - set(tokenizer.all_special_tokens)
    except NotImplementedError:  # pragma: no cover - a tokenizer class without get_vocab
        vocab = None
    if vocab is not None and len(vocab) <= 1:
        # From tokenizer_config.json alone (tokenizer.json missing) transformers builds a tokenizer whose
        # vocabulary is its unknown token plus the special ones: every prompt would encode to nothing.
        raise ModelLoadError(f"{field} {str(p)!r}: the tokenizer has no vocabulary (only special tokens), so its "
                             "tokenizer files are incomplete (tokenizer.json?); copy them from the base model")
    if tokenizer.pad_token_id is None:  # many base models ship without one
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _generic_tokenizer(folder: Path):
    """A word-level tokenizer.json (a character tokenizer such as the tiny models') loaded as it is,
    when tokenizer_config.json declares the generic class (`TokenizersBackend` /
    `PreTrainedTokenizerFast`); else None, and `AutoTokenizer` decides.

    For qwen2 folders `AutoTokenizer` ignores that declaration and rebuilds the tokenizer with Qwen's
    byte-level pre-tokenizer: a character tokenizer saved next to such a model then silently loses
    every blank and newline. Real Qwen tokenizers (BPE) are left to transformers."""
    import json

    from transformers import PreTrainedTokenizerFast

    try:
        declared = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
        if declared not in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            return None
        kind = json.loads((folder / "tokenizer.json").read_text())["model"]["type"]
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None
    return PreTrainedTokenizerFast.from_pretrained(str(folder)) if kind == "WordLevel" else None


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' own bars ("Loading weights", "Writing model shards") off while grpokit loads or saves a
    model (on every start and checkpoint, beside grpokit's own progress); as they were afterwards."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_model(path: str | Path, *, dtype: str = "float32", device: str = "auto", field: str = "model.path"):
    from transformers import AutoModelForCausalLM

    p = check_model_folder(path, field=field)
    target = resolve_device(device, "--device" if field.startswith("--") else "model.device")  # before the load
    try:
        with no_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(str(p), dtype=DTYPES[dtype])
    except Exception as e:
        if not (isinstance(e, _load_errors()) or _raised_by_torch_load(e)):
            raise
        raise _load_failed(p, field, "model", e) from e
    model.to(target)
    model.config.use_cache = False  # the training forward needs no cache; rollout passes its own
    return model


def load_model_and_tokenizer(path: str | Path, *, dtype: str = "float32", device: str = "auto",
                             field: str = "model.path"):
    """`AutoModelForCausalLM` + `AutoTokenizer` from a local folder or a Hub id, ready for GRPO; `field`
    is how errors name the folder ("model.path", "--model")."""
    tokenizer = load_tokenizer(path, field=field)  # first: it fails in a second, the weights take longer
    return load_model(path, dtype=dtype, device=device, field=field), tokenizer


def max_positions_of(model_path: str) -> int | None:
    """The model's context length from its config.json (read without loading weights)."""
    cfg = json.loads((model_folder(model_path) / "config.json").read_text(encoding="utf-8"))
    return cfg.get("max_position_embeddings") or cfg.get("n_positions") or cfg.get("max_sequence_length")

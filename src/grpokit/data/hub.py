"""Hugging Face Hub names: telling a Hub id from a local path, and Hub datasets read by name.

`model.path` and `data.path` name a local folder or file first; only a value that is not there and
is spelled like a Hub repo id (`name` or `org/name`) is looked up on the Hub, through the libraries'
own loading and caching (huggingface_hub's cache, `datasets.load_dataset`). Offline
(`HF_HUB_OFFLINE=1`) or without network, what the cache lacks is one error line saying how to
fetch it (`hf download ...`).

`load_dataset(name)` offline only finds datasets it has prepared before (its arrow cache); a dataset
fetched with `hf download --repo-type dataset` sits in the Hub cache as the repo's files, so that
copy is read next, with `load_dataset(<snapshot folder>, config, split=...)`, the same README configs.
"""

from __future__ import annotations

import re
from pathlib import Path

from grpokit.errors import DataError

# huggingface_hub's `validate_repo_id` rule, without importing it: `name` or `org/name`, word
# characters, `-` and `.`, no `--` or `..`, at most 96 characters.
_REPO_ID = re.compile(r"(\b[\w\-.]+\b/)?\b[\w\-.]+\b")

# A missing file with one of these suffixes is a typo'd local file, never a Hub name.
_FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt", ".toml", ".py", ".safetensors", ".bin", ".gz")


def hub_id(value: str | Path) -> str | None:
    """`value` as a Hub repo id when it can only be one: nothing exists at that local path, and it is
    spelled `name` or `org/name` (no ./, ../, /, ~ or backslash, no file suffix); else None."""
    text = str(value)
    if not text or isinstance(value, Path) and value.is_absolute() or Path(text).exists():
        return None
    if (_REPO_ID.fullmatch(text) is None or len(text) > 96 or "--" in text or ".." in text
            or text.startswith((".", "-")) or text.endswith((".git", ".ipynb", *_FILE_SUFFIXES))):
        return None
    return text


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def fetch_hint(repo: str, *, dataset: bool = False) -> str:
    """How to get `repo` into the cache, for the end of an error line."""
    command = f"hf download {repo}" + (" --repo-type dataset" if dataset else "")
    if offline():
        return (f"downloads are off (HF_HUB_OFFLINE=1): fetch it with `{command}` on a machine with network "
                f"(into this cache), or unset HF_HUB_OFFLINE")
    return f"the Hub could not be reached: check the network, or fetch it with `{command}` where there is one"


def not_cached(field: str, repo: str, what: str, *, dataset: bool = False, extra: str = "") -> str:
    """The one line for a Hub name that is neither a local path nor in the cache."""
    local = Path(repo).resolve()
    typo = f" (its folder {local.parent} exists: a typo?)" if local.parent.is_dir() and "/" in repo else ""
    return (f"{field} {repo!r} is not a local {what} (nothing at {local}){typo}, and as a Hugging Face Hub "
            f"{'dataset' if dataset else 'model'} it is not in the cache {hub_cache()}{extra}; "
            f"{fetch_hint(repo, dataset=dataset)}")


def load_hub_dataset(repo: str, *, name: str | None, split: str, field: str = "data.path") -> list[dict]:
    """The rows of split `split` of config `name` of the Hub dataset `repo`: `load_dataset(repo, name)`
    (the Hub, or its own cache of a dataset it has prepared before), else the repo's files as
    `hf download` left them in the Hub cache; DataError with the fix when neither has it."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    bars_on = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    folder = None
    try:
        try:
            ds = datasets.load_dataset(repo, name, split=split)
        except (ConnectionError, ValueError) as e:
            # Offline or the Hub unreachable (OfflineModeIsEnabled is a ConnectionError), and datasets' own
            # cache lacks the dataset (a ConnectionError) or this config of it (a ValueError): the Hub cache.
            if isinstance(e, ValueError) and not (offline() and "find cache" in str(e)):
                raise
            folder = _cached_dataset_repo(repo)
            if folder is None and isinstance(e, ConnectionError):
                raise DataError(not_cached(field, repo, "file or folder", dataset=True)) from e
            if folder is None:
                raise DataError(f"{field} {repo!r}{f' (data.name {name!r})' if name else ''}: "
                                f"{' '.join(str(e).split())}; {fetch_hint(repo, dataset=True)}") from e
            ds = datasets.load_dataset(folder, name, split=split)
    except DatasetNotFoundError as e:
        raise DataError(f"{field} {repo!r} is not a local file or folder (nothing at {Path(repo).resolve()}), and "
                        f"the Hugging Face Hub has no dataset of that name that you can read; fix the name, or log "
                        f"in with `hf auth login` for a private or gated one") from e
    except RuntimeError as e:
        if "script" not in str(e):
            raise
        raise DataError(f"{field} {repo!r} is a dataset with a loading script, which datasets {datasets.__version__} "
                        f"no longer runs; use a dataset repo with data files (Parquet, JSONL, CSV)") from e
    except (ValueError, FileNotFoundError) as e:  # a config or split it does not have, missing data files
        if isinstance(e, DataError):
            raise
        text = " ".join(str(e).split())
        if folder is not None:  # the cached copy: name the repo, not its snapshot folder
            text = text.replace(folder, repo).replace(Path(folder).name, repo)
        fix = ("set data.name to one of them" if "config" in text.lower() else
               "set data.split to one of them" if "split" in text.lower() else
               f"fetch the dataset again with `hf download {repo} --repo-type dataset`")
        raise DataError(f"{field} {repo!r}{f' (data.name {name!r})' if name else ''}: "
                        f"{text[:300].rstrip('.')}; {fix}") from e
    finally:
        if bars_on:
            datasets.enable_progress_bars()
    return ds.to_list()


def _cached_dataset_repo(repo: str) -> str | None:
    """The snapshot folder of dataset `repo` in the Hub cache (its `refs/main` commit), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo, repo_type="dataset", local_files_only=True)
    except IncompleteSnapshotError as e:  # part of the repo: enough when it holds the config asked for
        return e.snapshot_path
    except LocalEntryNotFoundError:
        return None

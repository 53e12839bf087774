"""Prompt sources, validation, chat templates, and a resumable stream of prompt batches.

`load_prompts` reads a local JSONL / JSON / CSV / Parquet file, a folder written
by `datasets.save_to_disk`, or any iterable of dicts, and checks every row
before any model is loaded: each error names the file, the row and the fix.
Rows come back as plain dicts with the prompt under "prompt" whatever
`prompt_column` was; the other columns are passed to reward functions.

JSONL and JSON are parsed here with `json.loads`, line by line, rather than by
`datasets`: its errors name neither the line nor the cause, and it coerces
mixed-type columns. CSV and Parquet go through `datasets.load_dataset`.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator
from .errors import UserError

SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


class DataError(UserError, ValueError):
    """A prompt source that cannot be used as it is; the message says where and how to fix it."""


# ---------------------------------------------------------------------------------------------
# Loading


def _decode_lines(path: Path) -> list[str]:
    """The file's lines as text; DataError naming the first line that is not UTF-8."""
    lines = path.read_bytes().split(b"\n")
    out = []
    for i, raw in enumerate(lines, start=1):
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: line {i} is not valid UTF-8 (byte {raw[e.start]:#04x} at column "
                            f"{e.start + 1}); re-save the file as UTF-8") from None
    return out


def _read_jsonl(path: Path) -> tuple[list[Any], list[int]]:
    """The rows and the 1-based line number of each (blank lines are skipped)."""
    rows, line_numbers = [], []
    for i, line in enumerate(_decode_lines(path), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {i} is not valid JSON ({e.msg} at column {e.colno}); "
                            f"each line must be one JSON object like {{\"prompt\": \"...\"}}") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}: line {i} is a JSON {type(row).__name__}, not an object; "
                            f"each line must be one JSON object like {{\"prompt\": \"...\"}}")
        rows.append(row)
        line_numbers.append(i)
    return rows, line_numbers


def _read_json(path: Path) -> tuple[list[Any], list[int] | None]:
    text = "\n".join(_decode_lines(path))
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return _read_jsonl(path)  # JSON Lines under a .json name, as `datasets` accepts
    if isinstance(data, dict):  # {"data": [...]}: the one list of objects it holds
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(f"{path}: a JSON object must hold exactly one list of rows, found {len(lists)}; "
                            f"write a list of objects or JSON Lines (.jsonl)")
        data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of objects, got a JSON {type(data).__name__}")
    for i, row in enumerate(data, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i} is a JSON {type(row).__name__}, not an object")
    return data, None


def _read_with_datasets(path: Path, kind: str, split: str) -> list[dict]:
    import datasets

    if kind == "csv":
        _decode_lines(path)  # pandas' UnicodeDecodeError names no line
    bars_on = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(kind, data_files=str(path), split=split)
    except Exception as e:
        raise DataError(f"{path}: cannot read as {kind.upper()}: {type(e).__name__}: {e}") from e
    finally:
        if bars_on:
            datasets.enable_progress_bars()
    return ds.to_list()


def _read_saved_folder(path: Path, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise DataError(f"{path}: is a folder but not one written by Dataset.save_to_disk ({e}); pass a "
                        f"{'/'.join(SUFFIXES)} file or a saved dataset folder") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: has no split {split!r}; its splits are {sorted(ds)}; "
                            f"pass split=<one of them>")
        ds = ds[split]
    return ds.to_list()


def _read_source(source: Any, split: str) -> tuple[list, str, list[int] | None]:
    """(rows, name for messages, the 1-based line number of each row when rows are lines)."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            return _read_saved_folder(path, split), str(path), None
        if not path.exists():
            raise DataError(f"{path}: file not found (relative paths start at {Path.cwd()}); fix the path "
                            f"(Hub dataset names are not downloaded: save one with Dataset.save_to_disk "
                            f"or to_json and pass that)")
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            rows, lines = (_read_jsonl if suffix == ".jsonl" else _read_json)(path)
            return rows, str(path), lines
        if suffix in (".csv", ".parquet"):
            return _read_with_datasets(path, suffix[1:], split), str(path), None
        raise DataError(f"{path}: unsupported file type {suffix or '(none)'}; use one of {', '.join(SUFFIXES)} "
                        f"or a folder written by Dataset.save_to_disk")
    datasets = sys.modules.get("datasets")  # a DatasetDict implies datasets is imported: no ~100 MB import for lists
    if datasets is not None and isinstance(source, datasets.DatasetDict):
        if split not in source:
            raise DataError(f"DatasetDict has no split {split!r}; its splits are {sorted(source)}")
        source = source[split]
    if isinstance(source, dict) or not isinstance(source, Iterable):
        raise DataError(f"prompt source must be a file path, a saved dataset folder or an iterable of dicts, "
                        f"got {type(source).__name__}")
    rows = list(source)
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"<rows>: row {i} is a {type(row).__name__}, not a dict")
    return rows, "<rows>", None


def _check_prompt(prompt: Any, where: str, column: str) -> None:
    if prompt is None or (isinstance(prompt, (str, list)) and not (prompt.strip() if isinstance(prompt, str)
                                                                  else prompt)):
        raise DataError(f"{where}: empty {column!r}; remove the row or give it a prompt")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list):
        for j, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: {column!r} message {j} is {m!r}; a conversational prompt is a list "
                                f"of {{\"role\": str, \"content\": str}} messages")
        return
    raise DataError(f"{where}: {column!r} is a {type(prompt).__name__} ({prompt!r:.60}); a prompt is a string "
                    f"or a list of {{\"role\", \"content\"}} messages")


def load_prompts(source: Any, *, prompt_column: str = "prompt", split: str = "train") -> list[dict]:
    """Validated prompt rows from a file, a saved dataset folder, or an iterable of dicts.

    Every row gets its prompt under "prompt" (renamed from `prompt_column`).
    Raises DataError naming the file and the row (the 1-based line for JSONL).
    """
    rows, name, lines = _read_source(source, split)
    if not rows:
        raise DataError(f"{name}: no rows; the dataset is empty")
    out = []
    for i, row in enumerate(rows, start=1):
        where = f"{name}: line {lines[i - 1]}" if lines else f"{name}: row {i}"
        if prompt_column not in row:
            if all(prompt_column not in r for r in rows):
                present = list(columns_of(rows, exclude=()))
                raise DataError(f"{name}: no column {prompt_column!r}; the columns are {present}; "
                                f"rename the column or pass prompt_column=<one of them>")
            raise DataError(f"{where}: has no {prompt_column!r} (its keys: {sorted(row)}); every row needs one")
        _check_prompt(row[prompt_column], where, prompt_column)
        if prompt_column != "prompt":
            if "prompt" in row:
                raise DataError(f"{name}: has both 'prompt' and prompt_column={prompt_column!r}; rename one")
            row = {"prompt": row[prompt_column], **{k: v for k, v in row.items() if k != prompt_column}}
        out.append(dict(row))
    return out


# ---------------------------------------------------------------------------------------------
# Rendering and columns


def render_prompt(tokenizer, prompt: str | list[dict], **template_kwargs) -> str:
    """The text the model continues: a string unchanged, messages through the chat template."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"conversational prompts (lists of messages) need a chat template, but the tokenizer "
                        f"{type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '') or 'unnamed'}) "
                        f"has none; set tokenizer.chat_template or give plain-string prompts")
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **template_kwargs)


def columns_of(rows: list[dict], *, repeat: int = 1, exclude: Iterable[str] = ("prompt",)) -> dict[str, list]:
    """Every non-prompt column as a list (None where a row lacks it), each value repeated `repeat` times.

    With `repeat=G` the columns line up with the B*G completions of a generation
    batch laid out prompt by prompt, as reward functions receive them.
    """
    skip = set(exclude)
    keys = list(dict.fromkeys(k for row in rows for k in row if k not in skip))
    return {k: [row.get(k) for row in rows for _ in range(repeat)] for k in keys}


# ---------------------------------------------------------------------------------------------
# Batches


class PromptStream:
    """An endless stream of prompt batches, reshuffled each epoch, that can be checkpointed.

    Epoch e visits the rows in a permutation drawn from (seed, e) alone, so the
    order does not depend on how the stream got there. A batch that runs past
    the end of an epoch continues into the next one: every batch is full and no
    row is skipped. `state_dict()` / `load_state_dict()` hold (epoch, index).
    """

    def __init__(self, rows: list[dict], batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if not rows:
            raise DataError("PromptStream needs at least one row")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.rows, self.batch_size, self.seed, self.shuffle = list(rows), batch_size, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[dict]:
        batch = []
        while len(batch) < self.batch_size:
            if self.index == len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(self.batch_size - len(batch), len(self.rows) - self.index)
            batch.extend(self.rows[j] for j in self._order[self.index: self.index + take])
            self.index += take
        return batch

    def __iter__(self) -> Iterator[list[dict]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_rows": len(self.rows),
                "batch_size": self.batch_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("num_rows", len(self.rows)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume the prompt stream: the checkpoint has {key}={state[key]!r} but "
                                 f"this run has {mine!r}; resume with the same data and seed")
        if not 0 <= state["index"] <= len(self.rows) or state["epoch"] < 0:
            raise ValueError(f"cannot resume the prompt stream: bad position {state!r}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)


def prompt_batches(rows: list[dict], batch_size: int, *, seed: int, epoch_shuffle: bool = True) -> PromptStream:
    """A `PromptStream` over `rows` (iterate it, or call `next_batch()`)."""
    return PromptStream(rows, batch_size, seed=seed, shuffle=epoch_shuffle)

"""Prompt sources: reading and validating every row before any model loads.

`load_prompts` reads a local JSONL / JSON / CSV / Parquet file, a folder written
by `datasets.save_to_disk`, a Hugging Face Hub dataset by name (`data/hub.py`; a local
path of that name wins), or any iterable of dicts, and checks every row
before any model is loaded: each error names the file, the row and the fix.
Rows come back as plain dicts with the prompt under "prompt" whatever
`prompt_column` was; the other columns are passed to reward functions.

JSONL and JSON are parsed here with `json.loads`, line by line, rather than by
`datasets`: its errors name neither the line nor the cause, and it coerces
mixed-type columns. CSV is read with the `csv` module, every cell as text (no type
inference: "02" stays "02"; see `load_prompts`). Parquet goes through
`datasets.load_dataset`.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import sys
from pathlib import Path
from typing import Any, Iterable

from grpokit.data.hub import hub_id, load_hub_dataset
from grpokit.data.prompts import columns_of
from grpokit.errors import DataError

SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def _decode_lines(path: Path) -> list[str]:
    """The file's lines as text, a leading UTF-8 BOM dropped (Excel and Notepad write one);
    DataError naming the first line that is not UTF-8 or holds a NUL byte."""
    data = path.read_bytes()
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    out = []
    for i, raw in enumerate(data.split(b"\n"), start=1):
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: line {i} is not valid UTF-8 (byte {raw[e.start]:#04x} at column "
                            f"{e.start + 1}); re-save the file as UTF-8") from None
        nul = raw.find(b"\0")
        if nul >= 0:
            raise DataError(f"{path}: line {i} contains a NUL byte (column {nul + 1}); the file is damaged "
                            f"or not UTF-8 text (UTF-16?): re-save it as UTF-8")
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
            msg = e.msg.removesuffix(" at")  # "Unterminated string starting at" + " at column 5"
            raise DataError(f"{path}: line {i} is not valid JSON ({msg} at column {e.colno}); "
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


CSV_TYPES = ("int", "float", "str", "json")


_CSV_TYPE_NAMES = {int: "int", float: "float", str: "str"}


def _csv_types(column_types: dict | None) -> dict[str, str]:
    """`csv_column_types` with Python types (int, float, str) spelled as names; DataError for others."""
    out = {}
    for column, kind in (column_types or {}).items():
        if isinstance(kind, type):
            kind = _CSV_TYPE_NAMES.get(kind, kind.__name__)
        if kind not in CSV_TYPES:
            raise DataError(f"csv_column_types[{column!r}] is {kind!r}; use one of {', '.join(map(repr, CSV_TYPES))}")
        out[column] = kind
    return out


def _convert_cell(cell: str, kind: str, where: str, column: str) -> Any:
    if kind == "str":
        return cell
    try:
        return json.loads(cell) if kind == "json" else (int if kind == "int" else float)(cell)
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        why = (f"not valid JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else
               "not an int" if kind == "int" else "not a float")
        raise DataError(f"{where}: column {column!r} is {cell!r:.60}, {why}; fix the cell (or leave it empty "
                        f"for a missing value), or change csv_column_types[{column!r}]") from None


def _read_csv(path: Path, column_types: dict[str, str]) -> tuple[list[dict], list[int]]:
    """The rows of a comma-separated file with a header line, and the 1-based line each row starts on.

    Every cell is a str; an empty cell is None (as a key missing from a JSONL
    row); `column_types` converts the named columns. Blank lines and rows of
    empty cells are skipped. Line numbers are physical lines of the file (the
    header is line 1), so a quoted field holding newlines moves the rows below it.
    """
    text = "\n".join(_decode_lines(path))  # UTF-8 errors name their line; a BOM is dropped
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header, header_line, rows, line_numbers = None, 0, [], []
    old_limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # the default 128 KiB per field would refuse long prompts
    try:
        while True:
            start = reader.line_num + 1
            try:
                record = next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                if "unexpected end of data" in str(e):
                    raise DataError(f"{path}: line {start}: a quoted field is never closed (the file ends inside "
                                    f"it); add the closing double quote, and double any quote inside a quoted "
                                    f"field (\"say \"\"hi\"\"\")") from None
                raise DataError(f"{path}: line {reader.line_num} is not valid CSV ({e}); put the whole field in "
                                f"double quotes and double any quote inside it (\"say \"\"hi\"\"\")") from None
            if all(not cell.strip() for cell in record):
                continue  # a blank line, or a row of empty cells as spreadsheets export
            if header is None:
                header, header_line = [name.strip() for name in record], start
                _check_header(path, header, header_line, column_types)
                continue
            lines = f"line {start}" + (f" (a quoted field runs on to line {reader.line_num})"
                                       if reader.line_num > start else "")
            if len(record) != len(header):
                fix = ("put double quotes around each field that contains a comma, e.g. \"a, b\""
                       if len(record) > len(header) else
                       "add the missing fields (an empty field is nothing between two commas: a,,c)")
                raise DataError(f"{path}: {lines} has {len(record)} field{'s' * (len(record) != 1)}, expected "
                                f"{len(header)} like the header (line {header_line}); {fix}")
            row = {}
            for column, cell in zip(header, record):
                kind = column_types.get(column)
                row[column] = (None if cell == "" else
                               cell if kind is None else _convert_cell(cell, kind, f"{path}: line {start}", column))
            rows.append(row)
            line_numbers.append(start)
    finally:
        csv.field_size_limit(old_limit)
    return rows, line_numbers


def _check_header(path: Path, header: list[str], line: int, column_types: dict[str, str]) -> None:
    if len(header) == 1 and (sep := next((s for s in ";\t|" if s in header[0]), None)):
        raise DataError(f"{path}: line {line}: the header is the one column {header[0]!r:.60}; the file looks "
                        f"separated by {sep!r}, not commas: save it as comma-separated CSV")
    seen: dict[str, int] = {}
    for j, name in enumerate(header, start=1):
        if not name:
            raise DataError(f"{path}: line {line}: header column {j} has no name; name it (e.g. answer) or "
                            f"delete that column (a trailing comma on each line makes an empty one)")
        if name in seen:
            raise DataError(f"{path}: line {line}: the header names column {name!r} twice (columns {seen[name]} "
                            f"and {j}); rename one of them")
        seen[name] = j
    unknown = [c for c in column_types if c not in seen]
    if unknown:
        raise DataError(f"{path}: csv_column_types names {unknown} but the header (line {line}) has only "
                        f"{header}; fix the column names")


def _read_with_datasets(path: Path, kind: str, split: str) -> list[dict]:
    import datasets

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


def _read_source(source: Any, split: str, csv_types: dict[str, str], name: str | None = None,
                 field: str = "data.path") -> tuple[list, str, list[int] | None]:
    """(rows, name for messages, the 1-based line number of each row when rows are lines)."""
    if isinstance(source, (str, Path)) and (repo := hub_id(source)) is not None:
        if csv_types:
            raise DataError(f"{field} {repo!r}: csv_column_types applies to local .csv files only; drop it")
        return load_hub_dataset(repo, name=name, split=split, field=field), repo, None
    if name:
        raise DataError(f"data.name {name!r} picks a config of a Hugging Face Hub dataset, and {field} {source!r:.60} "
                        f"is not one (a local file or folder, or rows); drop data.name")
    if isinstance(source, (str, Path)):
        path = Path(source)
        if csv_types and path.suffix.lower() != ".csv":
            raise DataError(f"{path}: csv_column_types applies to .csv files only (JSONL, JSON and Parquet keep "
                            f"their own types); drop it")
        if path.is_dir():
            return _read_saved_folder(path, split), str(path), None
        if not path.exists():
            raise DataError(f"{path}: file not found (relative paths start at {Path.cwd()}); fix the path "
                            f"(a Hugging Face Hub dataset is named org/name, e.g. openai/gsm8k)")
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            rows, lines = (_read_jsonl if suffix == ".jsonl" else _read_json)(path)
            return rows, str(path), lines
        if suffix == ".csv":
            rows, lines = _read_csv(path, csv_types)
            return rows, str(path), lines
        if suffix == ".parquet":
            return _read_with_datasets(path, "parquet", split), str(path), None
        raise DataError(f"{path}: unsupported file type {suffix or '(none)'}; use one of {', '.join(SUFFIXES)} "
                        f"or a folder written by Dataset.save_to_disk")
    if csv_types:
        raise DataError("csv_column_types applies to .csv files only; convert the values in your rows instead")
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


def _is_content(content: Any) -> bool:
    """A message's content: a string, or (TRL's multimodal layout) a list of {"type": ...} parts."""
    return isinstance(content, str) or (isinstance(content, list) and all(
        isinstance(part, dict) and isinstance(part.get("type"), str) for part in content))


def _check_prompt(prompt: Any, where: str, column: str) -> None:
    if prompt is None or (isinstance(prompt, (str, list)) and not (prompt.strip() if isinstance(prompt, str)
                                                                  else prompt)):
        raise DataError(f"{where}: empty {column!r}; remove the row or give it a prompt")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list):
        for j, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and _is_content(m.get("content"))):
                raise DataError(f"{where}: {column!r} message {j} is {m!r}; a conversational prompt is a list "
                                f"of {{\"role\": str, \"content\": str}} messages (or content as a list of "
                                f"{{\"type\": \"text\" | \"image\", ...}} parts, with images)")
        return
    raise DataError(f"{where}: {column!r} is a {type(prompt).__name__} ({prompt!r:.60}); a prompt is a string "
                    f"or a list of {{\"role\", \"content\"}} messages")


def load_prompts(source: Any, *, prompt_column: str = "prompt", split: str = "train",
                 csv_column_types: dict[str, str | type] | None = None, name: str | None = None,
                 field: str = "data.path") -> list[dict]:
    """Validated prompt rows from a file, a saved dataset folder, a Hub dataset, or an iterable of dicts.

    A string that is no local path and reads as a Hub id (`org/name`) is a Hugging Face Hub dataset:
    `name` is its config ("main" for openai/gsm8k), `split` its split; `field` is how errors name
    the source ("data.path", "--data").

    Every row gets its prompt under "prompt" (renamed from `prompt_column`).
    Raises DataError naming the file and the row (the 1-based line for JSONL
    and CSV, counting a CSV's header as line 1).

    CSV: the first non-blank line is the header (names stripped of spaces; an
    empty or repeated name is an error); every row must have as many fields.
    Cells are not type-inferred: every value is the cell's text as a `str`
    ("02" stays "02", "2" does not become 2.0 in a column with gaps), which is
    what the built-in rewards compare `answer` against. An empty cell is None,
    the value reward functions get for a key a JSONL row lacks. Blank lines and
    rows of empty cells are skipped; a UTF-8 BOM and CRLF line ends are fine.
    `csv_column_types` maps column names to "int", "float", "str" or "json"
    (or int, float, str) to get typed values instead; a cell that does not
    convert is a DataError naming its line and column (empty cells stay None).
    """
    csv_types = _csv_types(csv_column_types)
    rows, label, lines = _read_source(source, split, csv_types, name, field)
    if not rows:
        raise DataError(f"{label}: no rows; the dataset is empty")
    out = []
    for i, row in enumerate(rows, start=1):
        where = f"{label}: line {lines[i - 1]}" if lines else f"{label}: row {i}"
        if prompt_column not in row:
            if all(prompt_column not in r for r in rows):
                present = list(columns_of(rows, exclude=()))
                raise DataError(f"{label}: no column {prompt_column!r}; the columns are {present}; "
                                f"rename the column or pass prompt_column=<one of them>")
            raise DataError(f"{where}: has no {prompt_column!r} (its keys: {sorted(row)}); every row needs one")
        _check_prompt(row[prompt_column], where, prompt_column)
        if prompt_column != "prompt":
            if "prompt" in row:
                raise DataError(f"{label}: has both 'prompt' and prompt_column={prompt_column!r}; rename one")
            row = {"prompt": row[prompt_column], **{k: v for k, v in row.items() if k != prompt_column}}
        out.append(dict(row))
    return out

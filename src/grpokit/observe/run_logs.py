"""A run folder's logs as `grpokit report` reads them: what is damaged is skipped and said, never a traceback.

`load_run` reads `metrics.jsonl` (required: without a step row there is nothing to report),
`config.toml`, `completions.jsonl` and `config_history.jsonl` (each optional). A line that is not
valid JSON in the middle of `metrics.jsonl` is one error naming the file and the line (a last line
cut mid-write is dropped, as every reader does); in the optional files it drops that file's section.
Rows that are JSON but not a step's object (a list, a number, a row whose `step` is no integer) and
fields of the wrong type (a table that is a number, a group size that is not a positive integer)
are left out, and each left-out part is one note on the page and on the console.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from grpokit.errors import DamagedLogError, ReportError
from grpokit.observe.tracking import HISTORY, read_jsonl


def load_run(run_dir: str | Path) -> dict:
    """metrics rows, the raw config dict, a Config when it still validates, completions rows, the
    segments of config_history.jsonl ([] for a run older than that file), and `notes`: what was
    skipped as damaged."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ReportError(f"{run_dir} has no metrics.jsonl; give the run folder (output.dir) of a grpokit run")
    notes: list[str] = []
    metrics = _step_rows(run_dir / "metrics.jsonl", read_log(run_dir / "metrics.jsonl", notes, required=True), notes)
    if not metrics:
        raise ReportError(f"{run_dir / 'metrics.jsonl'} holds no step rows: the run has not finished a step yet"
                          " (or the file is not a grpokit metrics log)")
    raw, config = _raw_config(run_dir / "config.toml", notes), None
    if raw:
        try:
            from grpokit.config.loading import config_from_dict

            config = config_from_dict(raw)
        except Exception:  # an older or hand-edited config: the page still shows what it can
            config = None
    completions = _step_rows(run_dir / "completions.jsonl", read_log(run_dir / "completions.jsonl", notes), notes)
    history = [h for h in read_log(run_dir / HISTORY, notes) if isinstance(h, dict)]
    return {"dir": run_dir, "metrics": metrics, "raw_config": raw, "config": config, "completions": completions,
            "history": history, "notes": notes}


def read_log(path: Path, notes: list[str], *, required: bool = False) -> list:
    if not path.is_file():
        return []
    try:
        return read_jsonl(path)
    except DamagedLogError as e:
        if required:
            raise
        notes.append(f"{e}; this report leaves it out")
    except OSError as e:
        if required:
            raise ReportError(f"{path} cannot be read ({e.strerror}); fix its permissions and try again") from e
        notes.append(f"{path} cannot be read ({e.strerror}); this report leaves it out")
    return []


def _step_rows(path: Path, rows: list, notes: list[str]) -> list[dict]:
    """The rows that are objects with an integer `step` (what grpokit writes); say how many were not."""
    kept = [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)
            and not isinstance(r.get("step"), bool)]
    if len(kept) < len(rows):
        notes.append(f"{path}: {len(rows) - len(kept)} of {len(rows)} rows are not a step's JSON object with an "
                     "integer \"step\"; this report leaves them out")
    return kept


def _raw_config(path: Path, notes: list[str]) -> dict:
    """config.toml as tables of values; damaged: {} (the summary shows "?"), and a note."""
    if not path.is_file():
        return {}
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        notes.append(f"{path} cannot be read ({e}); this report shows no config")
        return {}
    bad = [k for k, v in raw.items() if not isinstance(v, dict)]
    if bad:
        notes.append(f"{path}: {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a [table]; this report "
                     "leaves it out")
    raw = {k: v for k, v in raw.items() if isinstance(v, dict)}
    g = raw.get("rollout", {}).get("group_size")
    if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g < 1):
        notes.append(f"{path}: rollout.group_size = {g!r} is not a positive integer; sampled groups are formed by "
                     "prompt instead")
        raw["rollout"] = {k: v for k, v in raw["rollout"].items() if k != "group_size"}
    return raw

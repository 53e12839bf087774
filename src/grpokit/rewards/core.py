"""Reward functions: the calling convention, their combination, their metrics.

A reward function follows TRL's `GRPOTrainer` convention, so a function written
for TRL works here unchanged:

    f(prompts, completions, completion_ids, **dataset_columns) -> list[float | None]

with one value per completion. `None` means "this function does not grade this
sample" (e.g. a code grader on a math prompt); it becomes NaN in the per-function
table and is skipped in the weighted sum. Besides the dataset columns (each
repeated so that it lines up with the completions), the function receives the
extras TRL 1.16 passes: `trainer_state`, `log_extra(column, values)` and
`log_metric(name, value)`.

Deviations from TRL, all in the user's favour:

- A function without `**kwargs` receives only the arguments it names, so
  `def f(completions, answer)` works; a named argument that no column provides
  is reported before the call, with the columns that exist.
- Anything that TRL would turn into an opaque tensor error — a raise, a result
  of the wrong type or length, NaN, inf, a string — stops with `RewardError`
  naming the function, the sample index and a preview of that sample. When the
  function raised on the whole batch it is re-run one sample at a time to find
  the first failing index.
- `async def` functions are awaited (TRL runs them on a daemon event loop).
- A spec with a `timeout` (seconds; by default `rewards.timeout_s` = 600 for your own
  functions, none for the built-ins) runs its function in a daemon worker thread
  and waits at most that long; past it, `RewardTimeoutError` names the function
  and the limit. A Python thread cannot be killed, so the hung call is abandoned
  (it runs on in the background until the process exits) and the run stops with
  the error. With `rewards.isolation = "process"` (rewards/worker_pool.py) functions
  run in worker processes instead, which a timeout or a crash kills and replaces.
- In the trainer's process a function's `os._exit`, `os.abort` or signal to that
  process stops the run with `RewardError` naming the function and
  `rewards.isolation = "process"`, not the trainer's silent end (exit_guard.py).
  For untrusted code use the sandboxed "code_execution" reward.
- Reward *models* (`nn.Module`) are not handled here; wrap one in a function.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import parent_process
from typing import Any, Callable, Sequence

import torch

from grpokit.errors import RewardError, RewardLoadError, RewardTimeoutError
from grpokit.exit_guard import ToolExit, guarded, reward_function

# Keys TRL passes to every reward function besides the dataset columns.
EXTRA_KWARGS = ("trainer_state", "log_extra", "log_metric")


# Dataset columns TRL never forwards (they would collide with the call's own arguments).
RESERVED_COLUMNS = ("prompt", "completion", "completion_ids", "prompts", "completions")


_RERUN_LIMIT = 256  # samples re-run one at a time to locate a raise


@dataclass(frozen=True)
class RewardSpec:
    """One reward function and its weight in the total.

    `timeout` (seconds): `compute_rewards` stops with `RewardTimeoutError` when
    one call takes longer (the call itself is abandoned in a daemon thread).
    `source`: how a worker process rebuilds `fn` (rewards.isolation = "process"):
    (reference or registered name, its arguments); None: `fn` itself, pickled.
    """

    name: str
    fn: Callable
    weight: float = 1.0
    timeout: float | None = None
    source: tuple[str, dict] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"RewardSpec.name must be a non-empty string, got {self.name!r}")
        if not callable(self.fn):
            raise ValueError(f"RewardSpec {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, numbers.Real) \
                or not math.isfinite(self.weight):
            raise ValueError(f"RewardSpec {self.name!r}: weight must be a finite number, got {self.weight!r}")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"RewardSpec {self.name!r}: timeout must be > 0 seconds or None, got {self.timeout!r}")


def is_conversational(prompt: Any) -> bool:
    """True for a prompt given as a list of {"role", "content"} messages."""
    return isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], dict)


def as_trl_completions(prompts: Sequence, completions: Sequence) -> list:
    """Completions in the form TRL hands to reward functions.

    For conversational prompts TRL passes each completion as
    `[{"role": "assistant", "content": text}]`; plain string completions of
    such prompts are wrapped that way. Anything else is passed through.
    """
    if not prompts or not is_conversational(prompts[0]):
        return list(completions)
    return [[{"role": "assistant", "content": c}] if isinstance(c, str) else c for c in completions]


def _preview(x: Any, limit: int = 60) -> str:
    if is_conversational(x):
        x = x[-1].get("content", x)
    if isinstance(x, str):
        return repr(x if len(x) <= limit else x[: limit - 3] + "...")
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _where(name: str, i: int, prompts: Sequence, completions: Sequence) -> str:
    return (f"reward function '{name}' at sample {i} "
            f"(prompt {_preview(prompts[i])}, completion {_preview(completions[i])})")


def _call_kwargs(spec: RewardSpec, call: dict) -> dict:
    """The arguments `spec.fn` accepts: everything with **kwargs, else only what it names."""
    try:
        params = inspect.signature(spec.fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: pass everything
        return call
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return call
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and p.default is p.empty and p.name not in call]
    if missing:
        columns = sorted(k for k in call if k not in ("prompts", "completions", "completion_ids", *EXTRA_KWARGS))
        raise RewardError(
            f"reward function '{spec.name}' needs argument(s) {missing} but the dataset has no such column "
            f"(columns: {columns}); add the column to the data or give the argument a default")
    return {k: v for k, v in call.items() if k in named}


def check_columns(specs: Sequence[RewardSpec], rows: Sequence[dict], where: str = "the data") -> None:
    """Raise RewardLoadError, before any step, when a reward function needs an argument (one without a default,
    `tests` of code_execution) that is neither grpokit's nor a column of `rows`: at the first step it
    would fail with a TypeError."""
    columns = set().union(*(row.keys() for row in rows)) if rows else None
    for spec in specs if columns is not None else ():
        try:
            params = inspect.signature(spec.fn).parameters.values()
        except (TypeError, ValueError):
            continue
        given = {"prompts", "completions", "completion_ids", "environments", *EXTRA_KWARGS}
        missing = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                   and p.default is p.empty and p.name not in given | columns]
        if missing:
            raise RewardLoadError(f"reward function '{spec.name}' needs the column(s) {missing}, which {where} lacks "
                              f"(columns: {sorted(columns)}); add {', '.join(map(repr, missing))} to every row "
                              f"(None leaves a row ungraded), or remove '{spec.name}' from rewards.functions")


def _run(fn: Callable, kwargs: dict):
    out = fn(**kwargs)
    if inspect.isawaitable(out):
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(_await(out))
        with ThreadPoolExecutor(1) as pool:  # inside a running loop (a notebook): await on a fresh one
            return pool.submit(asyncio.run, _await(out)).result()
    return out


async def _await(awaitable):
    return await awaitable


_watchers: list[Callable[[str | None], None]] = []  # a rollout worker's (`watch_calls`)


def watch_calls(record: Callable[[str | None], None]) -> None:
    """Have `record(name)` called before each reward function's call in this process, `record(None)` after it: a
    rollout worker keeps the name where the trainer reads it (training/rollout_workers.py), which then names the
    function whose call ended the worker's process (an os._exit, a crash in native code, a kill)."""
    _watchers[:] = [record]


@contextmanager
def _watched(name: str):
    for record in _watchers:
        record(name)
    try:
        yield
    finally:
        for record in _watchers:
            record(None)


def _run_guarded(spec: RewardSpec, kwargs: dict):
    """`_run(spec.fn, kwargs)`, in the trainer's process with its exits guarded (exit_guard.py): an `os._exit`
    there is one `RewardError` naming the function and the fix, not the run's end without a word. A rollout
    worker (a process multiprocessing started) runs it unguarded: the exit ends the worker, which the trainer
    names, with the function the worker was running (`watch_calls`)."""
    try:
        if parent_process() is not None:
            with _watched(spec.name):
                return _run(spec.fn, kwargs)
        return guarded(lambda: _run(spec.fn, kwargs), reward_function(spec.name))()
    except ToolExit as e:
        raise RewardError(str(e)) from None
    except SystemExit as e:  # sys.exit is an exception: uncaught, it ended the run as if it had finished
        raise RewardError(f"reward function '{spec.name}' called sys.exit({e.code!r}), which would end the run "
                          "as if it had finished; return a reward (or None: not graded) instead") from None


def _call(spec: RewardSpec, kwargs: dict, n: int):
    """`_run_guarded(spec, kwargs)`, within `spec.timeout` seconds when it has one."""
    if spec.timeout is None:
        return _run_guarded(spec, kwargs)
    box: dict = {}

    def target():
        try:
            box["out"] = _run_guarded(spec, kwargs)
        except BaseException as e:  # handed to the caller's thread below
            box["error"] = e

    worker = threading.Thread(target=target, name=f"reward-{spec.name}", daemon=True)
    worker.start()
    worker.join(spec.timeout)
    if worker.is_alive():  # cannot be killed: left running as a daemon, the run stops here
        raise RewardTimeoutError(
            f"reward function '{spec.name}' took longer than {float(spec.timeout)} s (its timeout) on a batch of "
            f"{n} samples; the call was abandoned in a background thread and the run stops. Make the function "
            f"faster, raise its timeout (rewards.timeout_s, or rewards.args = {{{spec.name} = {{timeout = ...}}}}; "
            f"0 = no limit), or grade untrusted "
            f"code with the sandboxed 'code_execution' reward")
    if "error" in box:
        raise box["error"]
    return box["out"]


def _slice_call(call: dict, i: int) -> dict:
    return {k: (v if k in EXTRA_KWARGS else v[i: i + 1]) for k, v in call.items()}


def _locate_raise(spec: RewardSpec, kwargs: dict, n: int) -> int | None:
    for i in range(min(n, _RERUN_LIMIT)):
        try:
            _call(spec, _slice_call(kwargs, i), 1)
        except RewardError:
            raise
        except Exception:
            return i
    return None


def _to_float(v: Any) -> float | None:
    """A reward value as a float; None for None; raises TypeError for a non-number."""
    if v is None:
        return None
    if isinstance(v, numbers.Real):  # bool, int, float, numpy scalars
        return float(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex():
        return float(v.item())
    raise TypeError(type(v).__name__)


def wrong_count(name: str, got: int, n: int, where: str = "") -> RewardError:
    """The error for a call of `name` on `n` completions that returned `got` values; `where` says which
    share of the batch the call had, when it had only part of it (an isolated reward's worker)."""
    return RewardError(f"reward function '{name}' returned {got} values for {n} completions{where}; "
                       f"return exactly one value (float or None) per completion")


def _column_values(spec: RewardSpec, out: Any, prompts: Sequence, completions: Sequence) -> list[float]:
    n = len(completions)
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):  # numpy array / tensor
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise RewardError(
            f"reward function '{spec.name}' returned {type(out).__name__} {_preview(out)}; it must return a list "
            f"with one float (or None) per completion, {n} here")
    if len(out) != n:
        raise wrong_count(spec.name, len(out), n)
    values = []
    for i, v in enumerate(out):
        try:
            x = _to_float(v)
        except TypeError:
            raise RewardError(f"{_where(spec.name, i, prompts, completions)} returned {v!r} "
                              f"({type(v).__name__}); return a float, or None to skip the sample") from None
        if x is not None and not math.isfinite(x):
            raise RewardError(f"{_where(spec.name, i, prompts, completions)} returned {x}; "
                              f"rewards must be finite (return None to skip a sample)")
        if x is not None and abs(x) > _FLOAT32_MAX:  # it would be inf in the float32 reward table
            raise RewardError(f"{_where(spec.name, i, prompts, completions)} returned {x}, beyond float32's "
                              f"range (|r| <= {_FLOAT32_MAX:.3g}); scale the reward down")
        values.append(math.nan if x is None else x)
    return values


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _check_lengths(prompts, completions, completion_ids, columns) -> None:
    n = len(completions)
    sizes = {"prompts": len(prompts), "completion_ids": len(completion_ids)}
    sizes.update({f"column '{k}'": len(v) for k, v in columns.items()})
    wrong = {k: m for k, m in sizes.items() if m != n}
    if wrong:
        raise ValueError(f"compute_rewards got {n} completions but {wrong}; repeat each prompt's columns "
                         f"once per completion (columns_of(rows, repeat=G))")


def compute_rewards(
    specs: Sequence[RewardSpec],
    prompts: Sequence,
    completions: Sequence,
    completion_ids: Sequence[Sequence[int]],
    columns: dict[str, list] | None = None,
    *,
    trainer_state: Any = None,
    log_extra: Callable[[str, list], None] | None = None,
    log_metric: Callable[[str, float], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every reward function on N samples.

    Returns `(per_fn, total)`: `per_fn` [N, F] float32 with NaN where a function
    returned None, and `total` [N] the weighted sum over the functions that
    graded the sample (NaN only where none did). `columns` holds one list of N
    values per dataset column; `prompt`/`completion` columns are not forwarded.
    """
    if not specs:
        raise ValueError("compute_rewards needs at least one RewardSpec")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"reward names must be unique (they name metrics), got {names}")
    columns = {k: list(v) for k, v in (columns or {}).items() if k not in RESERVED_COLUMNS}
    _check_lengths(prompts, completions, completion_ids, columns)
    prompts, completion_ids = list(prompts), [list(c) for c in completion_ids]
    completions = as_trl_completions(prompts, completions)
    call = dict(columns, prompts=prompts, completions=completions, completion_ids=completion_ids,
                trainer_state=trainer_state,
                log_extra=log_extra or (lambda column, values: None),
                log_metric=log_metric or (lambda name, value: None))
    n = len(completions)
    per_fn = torch.full((n, len(specs)), math.nan, dtype=torch.float32)  # [N, F]
    for j, spec in enumerate(specs):
        kwargs = _call_kwargs(spec, call)
        try:
            out = _call(spec, kwargs, n)
        except RewardError:  # a grader's own one-line error (a timeout, a remote grader that gave up): as it is
            raise
        except Exception as e:
            i = _locate_raise(spec, kwargs, n)
            where = _where(spec.name, i, prompts, completions) if i is not None else \
                f"reward function '{spec.name}' on a batch of {n} samples (each alone succeeds)"
            raise RewardError(f"{where} raised {type(e).__name__}: {e}") from e
        per_fn[:, j] = torch.tensor(_column_values(spec, out, prompts, completions), dtype=torch.float32)
    weights = torch.tensor([float(s.weight) for s in specs], dtype=torch.float32)  # [F]
    total = torch.nansum(per_fn * weights, dim=1)  # [N]
    if torch.isinf(total).any():
        i = int(torch.isinf(total).nonzero()[0])
        raise RewardError(f"the weighted total of the rewards at sample {i} is beyond float32's range "
                          f"({per_fn[i].tolist()} x weights {weights.tolist()}); scale the rewards or weights down")
    total[torch.isnan(per_fn).all(dim=1)] = math.nan
    return per_fn, total


def reward_metrics(specs: Sequence[RewardSpec], per_fn: torch.Tensor) -> dict[str, float]:
    """`rewards/<name>/mean` and `rewards/<name>/std` per function, ignoring NaN (skipped samples).

    std is the sample (Bessel) std as in TRL; 0.0 with fewer than two graded
    samples, and both are NaN when the function graded nothing.
    """
    if per_fn.ndim != 2 or per_fn.shape[1] != len(specs):
        raise ValueError(f"per_fn must be [N, {len(specs)}], got {tuple(per_fn.shape)}")
    out: dict[str, float] = {}
    for j, spec in enumerate(specs):
        col = per_fn[:, j].double()
        col = col[~torch.isnan(col)]
        k = col.numel()
        out[f"rewards/{spec.name}/mean"] = float(col.mean()) if k else math.nan
        out[f"rewards/{spec.name}/std"] = float(col.std()) if k > 1 else (0.0 if k else math.nan)
    return out

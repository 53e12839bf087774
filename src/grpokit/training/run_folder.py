"""The run folder (`output.dir`): one run at a time, what it holds, and what a resume may change.

    RUN_DIR/
      config.toml            the config of the newest segment (a segment: one start or one --resume)
      config_history.jsonl   a line per segment: the step it started from, when, the command, what changed
      metrics.jsonl          a line per step; completions.jsonl, tensorboard/ when asked for
      timeline.jsonl         an asynchronous run's spans: what each process did when
      checkpoint-N/          Hugging Face model folder + trainer_state.pt + grpokit_config.toml
      .grpokit.lock          who holds the folder (pid, command, since) while a run is alive

A run holds an advisory lock on the folder itself (`flock` on its descriptor) from
its start-up checks to its end, so a second run or a resume of the same folder is
refused with the other process named (run_lock.py). The OS drops the lock when the
process dies, even by SIGKILL, so a crash never leaves a folder locked.

What a start does with what it finds:
- nothing, or an earlier attempt that stopped before its first checkpoint: start
  (that attempt's logs are moved to `earlier-attempts/<time>/`, never deleted);
- a run with checkpoints: refuse, unless `--resume` (continue) or
  `output.overwrite = true` (the earlier run's files are removed, and listed);
- `--resume`: only the fields in `RESUMABLE_FIELDS` may differ from the config
  that wrote the newest checkpoint; any other difference is refused with the list.
  A newest checkpoint that is damaged (a missing or cut file) is moved to
  `damaged-checkpoints/` and the run resumes from the newest intact one, said in a note.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from grpokit.config.loading import to_toml
from grpokit.config.schema import SECTIONS, Config, EvalConfig
from grpokit.data.hub import hub_id
from grpokit.errors import RunFolderError
from grpokit.observe.tracking import HISTORY, append_jsonl, read_jsonl
from grpokit.training.checkpoint import (
    BEST_FILE,
    CHECKPOINT_CONFIG,
    PREFIX,
    TMP_PREFIX,
    checkpoint_damage,
    checkpoint_step,
    list_checkpoints,
)
from grpokit.training.run_lock import RunFolderLock  # the lock itself (run_lock.py); callers import it from here

# Fields a --resume may change: how long to train, where and how to log, and knobs that change memory
# or speed but not the math (micro-batches accumulate to the same gradient; the fast paths have tests
# showing the same loss and gradient). Everything else would make the resumed run a different run.
RESUMABLE_FIELDS = frozenset({
    "train.steps", "train.micro_batch_size", "train.logprob_chunk_size", "train.max_consecutive_skips",
    "train.fused_logprobs", "train.fused_backward", "train.skip_zero_advantage", "train.shared_prompt_forward",
    "train.packed_sequences",
    "train.gradient_checkpointing", "train.optimizer_in_backward",  # (the same AdamW state either way)
    "train.keep_freed_memory", "train.onednn_linear", "train.embedding_rows_into_grad", "train.num_threads",
    "rollout.preallocated_kv_cache", "rollout.shared_prefill",
    "rollout.packed_weights", "rollout.layer_loop",
    # where and how far ahead the answers are sampled (sync or async workers), and the lag's correction:
    # the trainer's state is the same either way
    "rollout.mode", "rollout.max_staleness", "rollout.weight_sync_every", "rollout.workers", "rollout.worker_threads",
    "rollout.worker_timeout_s", "algorithm.is_correction",
    "model.device", "rollout.vllm", "rewards.timeout_s", "tools.timeout_s",
    "rewards.isolation", "rewards.workers", "rewards.on_error",  # where graders run, what a failure does
    "tools.isolation", "tools.workers",  # where tools and environments run
    "output.dir", "output.save_every", "output.keep_last", "output.overwrite", "output.completions_every",
    "output.console", "output.tensorboard", "output.wandb", "output.keep_best",
    # [eval] samples with its own generator: the training run is the same with or without it
    *(f"eval.{f.name}" for f in dataclasses.fields(EvalConfig)),
})


# What grpokit writes into a run folder; `output.overwrite` removes exactly these, nothing else.
RUN_FILES = ("config.toml", "config_history.jsonl", "metrics.jsonl", "completions.jsonl", "timeline.jsonl",
             "tensorboard", "best.json", "report.html", "wandb", "damaged-checkpoints")
DAMAGED_DIR = "damaged-checkpoints"  # where --resume moves a checkpoint it cannot read


@dataclass
class RunFolder:
    """What the start-up checks found in `output.dir` (plain data: it is broadcast under torchrun)."""

    path: Path
    resume_step: int = 0  # the newest checkpoint's step when resuming, else 0
    changes: dict = field(default_factory=dict)  # "section.key" -> [before, now] of a resume
    notes: list[str] = field(default_factory=list)  # what was moved or removed, said once at the start



def prepare_run_folder(config: Config, *, resume: bool, lock: RunFolderLock | None = None) -> RunFolder:
    """Check `output.dir` for this start, lock it, and clear the way (see the module docstring).

    Every refusal happens before anything in the folder changes."""
    run_dir = Path(config.output.dir)
    checkpoints = list_checkpoints(run_dir)
    if resume and not checkpoints:
        raise RunFolderError(f"--resume: {run_dir} has no checkpoint to resume from; run without --resume to start")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise RunFolderError(f"output.dir {str(run_dir)!r} is not writable ({e.strerror}); choose another folder") \
            from e
    if lock is not None:
        lock.acquire()
    try:
        checkpoints = list_checkpoints(run_dir)  # again, now that no other run can change them
        folder = RunFolder(run_dir.absolute())  # every later write: a tool may chdir (os.chdir) mid-run
        damaged = []
        if resume:
            newest, damaged = _newest_intact(checkpoints)
            folder.resume_step = checkpoint_step(newest)
            folder.changes = _resume_changes(config, newest)
            if config.output.overwrite:  # --resume is the explicit ask; say that the other one is not acted on
                folder.notes.append("--resume: output.overwrite = true is ignored; the run continues")
        elif checkpoints and not config.output.overwrite:
            raise RunFolderError(f"output.dir {str(run_dir)!r} already holds a run (newest: {checkpoints[-1].name}); "
                                 "continue it with --resume, choose another output.dir, or set "
                                 "output.overwrite = true to start over")
        _check_free_space(run_dir, Path(config.model.path))
        ours = (run_dir / "metrics.jsonl").exists() or (run_dir / HISTORY).exists() or bool(checkpoints)
        if (run_dir / "config.toml").exists() and not ours:
            raise RunFolderError(f"output.dir {str(run_dir)!r} holds a config.toml that no grpokit run wrote (a run "
                                 "keeps its own config.toml there); choose another output.dir")
        if not resume and checkpoints:
            folder.notes.append(_remove_earlier_run(run_dir, config))
        elif not resume and ours:
            folder.notes.append(_move_earlier_attempt(run_dir))
        if damaged:
            folder.notes.append(_set_aside(run_dir, damaged, folder.resume_step))
        if resume and "output.keep_best" in folder.changes and (note := _retire_best(run_dir, folder.changes)):
            folder.notes.append(note)
        if lock is not None:
            lock.announce()
        return folder
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _newest_intact(checkpoints: list[Path]) -> tuple[Path, list[tuple[Path, str]]]:
    """The newest checkpoint a resume can read, and the damaged ones after it (with why); none intact:
    one error naming the newest's damaged file."""
    damaged = []
    for checkpoint in reversed(checkpoints):
        why = checkpoint_damage(checkpoint)
        if why is None:
            return checkpoint, damaged
        damaged.append((checkpoint, why))
    newest, why = damaged[0]
    others = "no earlier checkpoint is intact" if len(damaged) > 1 else "it is the only checkpoint"
    raise RunFolderError(f"--resume: {newest} is damaged ({why}) and {others}, so the run cannot continue; start "
                         "again without --resume (output.overwrite = true, or another output.dir)")


def _set_aside(run_dir: Path, damaged: list[tuple[Path, str]], step: int) -> str:
    """Move damaged checkpoints to `damaged-checkpoints/` (kept, never deleted; the resumed run writes
    its own checkpoint of those steps); the note that says which, why, and where the run goes on from."""
    aside = run_dir / DAMAGED_DIR
    moved = []
    for checkpoint, _ in damaged:
        target, n = aside / checkpoint.name, 1
        while target.exists():
            n += 1
            target = aside / f"{checkpoint.name}-{n}"
        try:
            aside.mkdir(exist_ok=True)
            checkpoint.rename(target)
        except OSError as e:
            raise RunFolderError(f"--resume: {checkpoint} is damaged, and moving it aside to {aside} failed "
                                 f"({e.strerror}); move it out of {run_dir} yourself and --resume again") from e
        moved.append(target)
    why = "; ".join(f"{c.name}: {w}" for c, w in damaged)
    return (f"--resume: the newest checkpoint is damaged ({why}); resuming from {PREFIX}{step}, the newest intact "
            f"one (the steps after it are trained again). Moved aside, not deleted: {', '.join(map(str, moved))}")


def _retire_best(run_dir: Path, changes: dict) -> str | None:
    """A resume that changes or clears `output.keep_best`: best.json's record of the old metric moves under
    "earlier", where its checkpoint stays kept (never pruned by keep_last); the note that says so."""
    path = run_dir / BEST_FILE
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        current = {k: v for k, v in saved.items() if k != "earlier"}
        earlier = [r for r in saved.get("earlier") or [] if isinstance(r, dict)]
        name = str(current["checkpoint"])
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        return None  # no best recorded (or damaged): nothing is kept
    if not (run_dir / name).is_dir():
        return None
    earlier = [r for r in earlier if r.get("metric") != current.get("metric")] + [current]
    _write_atomically(path, json.dumps({"earlier": earlier}) + "\n")
    before, now = changes["output.keep_best"]
    return (f"output.keep_best: {_show(before)} -> {_show(now or None)}: {name}, the best {current.get('metric')} so "
            f"far, stays (best.json lists it under \"earlier\", and keep_last never removes it); delete it yourself "
            "when you no longer need it")


def _resume_changes(config: Config, checkpoint: Path) -> dict:
    """The fields that differ from the config that wrote `checkpoint`; refuse any outside RESUMABLE_FIELDS."""
    step = checkpoint_step(checkpoint)
    if config.train.steps < step:
        raise RunFolderError(f"train.steps = {config.train.steps} is below the step of the newest checkpoint "
                             f"({checkpoint}); to continue, set train.steps above {step}, e.g. "
                             f"--set train.steps={2 * step}")
    before = _saved_config(checkpoint)
    if before is None:  # written before checkpoints kept their config: nothing to compare against
        return {}
    before = _cispo_cap({**_defaults(), **_in_current_spelling(before)})  # a field added later: its default
    before = _resolve_paths(before)
    now = _resolve_paths(_cispo_cap(_flat(tomllib.loads(to_toml(config)))))
    changes = {k: [before.get(k), now.get(k)] for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)}
    refused = {k: v for k, v in changes.items() if k not in RESUMABLE_FIELDS}
    if refused:
        listed = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in refused.items())
        raise RunFolderError(
            f"--resume: this config differs from the one that wrote {checkpoint} in {listed}. A resumed run must "
            f"keep these (only train.steps, output.*, and memory/speed knobs may change); restore them, or start "
            f"a new run from these weights with model.path = {str(checkpoint)!r} and another output.dir")
    return changes


def _in_current_spelling(saved: dict) -> dict:
    """A checkpoint's flat config as this release writes the same run: `algorithm.tis_cap = C` is
    `is_correction = "token_truncate"` with `is_cap_max = C`; and in a config written before
    `is_correction` existed, cispo's `epsilon_high = e >= 1` meant a cap of 1 + e, which is now
    `epsilon_high = 1 + e` (below 1 it is still read the old way)."""
    saved = dict(saved)
    old = "algorithm.is_correction" not in saved
    if saved.get("algorithm.tis_cap"):
        saved.update({"algorithm.is_correction": "token_truncate", "algorithm.is_cap_max": saved["algorithm.tis_cap"],
                      "algorithm.tis_cap": 0.0})
    cap = saved.get("algorithm.epsilon_high") or saved.get("algorithm.epsilon", 0.2)
    if old and saved.get("algorithm.loss_type") == "cispo" and isinstance(cap, (int, float)) and cap >= 1:
        saved["algorithm.epsilon_high"] = 1.0 + cap
    return saved


def _cispo_cap(flat: dict) -> dict:
    """With loss_type = "cispo", epsilon_high as the cap it means (AlgorithmConfig.cispo_cap): the old spelling
    (a value below 1, or unset: 1 + it) and the one its deprecation note asks for are the same run."""
    if flat.get("algorithm.loss_type") != "cispo":
        return flat
    e = flat.get("algorithm.epsilon_high") or flat.get("algorithm.epsilon", 0.2)
    if not isinstance(e, (int, float)):
        return flat
    return {**flat, "algorithm.epsilon_high": e if e >= 1 else 1.0 + e}


def _saved_config(checkpoint: Path) -> dict | None:
    for path in (checkpoint / CHECKPOINT_CONFIG, checkpoint.parent / "config.toml"):
        if path.is_file():
            try:
                return _flat(tomllib.loads(path.read_text(encoding="utf-8")))
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
                raise RunFolderError(f"{path} is damaged ({e}); restore it from the config file you started the run "
                                     "with") from e
    return None


PATH_FIELDS = ("model.path", "data.path")  # compared as the folders/files they name, not as typed


def with_resolved_paths(config: Config) -> Config:
    """`config` with model.path and data.path absolute: what a checkpoint records, so that a resume from
    another working directory, or with the path spelled otherwise, is compared by what it names."""
    def absolute(value: str) -> str:
        return str(Path(value).resolve()) if value and hub_id(value) is None else value  # a Hub id stays as is

    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, path=absolute(config.model.path)),
        data=dataclasses.replace(config.data, path=absolute(config.data.path)))


def _resolve_paths(flat: dict) -> dict:
    return {k: (str(Path(v).resolve()) if k in PATH_FIELDS and v and hub_id(v) is None else v) for k, v in flat.items()}


def _defaults() -> dict:
    """Every field's default, as a config written to TOML and read back holds it."""
    out = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out[f"{section}.{f.name}"] = list(value) if isinstance(value, tuple) else value
    out["algorithm.is_correction"] = "none"  # "auto" as a run written before it existed resolved it (sync)
    return out


def _flat(raw: dict) -> dict:
    return {f"{section}.{key}": value for section, values in raw.items() for key, value in values.items()}


def _show(value) -> str:
    return "(unset)" if value is None else json.dumps(value)


def _check_free_space(run_dir: Path, model_dir: Path) -> None:
    """A checkpoint holds the weights and the optimizer's two moments (about 3x the weights); ask for
    room for one more while the previous one still exists."""
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) or \
        sum(p.stat().st_size for p in model_dir.glob("*.bin"))
    needed, free = 4 * weights, shutil.disk_usage(run_dir).free
    if free < needed:
        raise RunFolderError(f"output.dir {str(run_dir)!r} has {free / 2**20:.0f} MiB free; checkpoints of this model "
                             f"need about {needed / 2**20:.0f} MiB (weights + optimizer state); free space or choose "
                             "another output.dir")


def _remove_earlier_run(run_dir: Path, config: Config) -> str:
    """`output.overwrite = true`: remove what grpokit wrote (checkpoints, logs), leave anything else;
    refuse if this run's own inputs (model, data) live in what would be removed."""
    doomed = [p for p in sorted(run_dir.iterdir())
              if p.name in RUN_FILES or p.name.startswith((PREFIX, TMP_PREFIX))]
    for field_name, value in (("model.path", config.model.path), ("data.path", config.data.path)):
        inside = [p for p in doomed if value and _is_within(Path(value), p)]
        if inside:
            raise RunFolderError(f"{field_name} {value!r} is inside {inside[0]}, which output.overwrite = true would "
                                 "remove; copy it elsewhere first, or choose another output.dir")
    try:
        for path in doomed:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    except OSError as e:
        raise RunFolderError(f"output.overwrite: could not remove {e.filename} ({e.strerror}); fix its permissions "
                             "or choose another output.dir") from e
    return f"output.overwrite: removed the earlier run from {run_dir} ({', '.join(p.name for p in doomed)})"


def _is_within(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def _move_earlier_attempt(run_dir: Path) -> str:
    """An attempt that stopped before its first checkpoint cannot be resumed; keep its logs aside."""
    last = _last_logged_step(run_dir / "metrics.jsonl")
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    while (aside := run_dir / "earlier-attempts" / (stamp if n == 1 else f"{stamp}-{n}")).exists():
        n += 1
    try:
        aside.mkdir(parents=True)
        for name in RUN_FILES:
            if (run_dir / name).exists():
                (run_dir / name).rename(aside / name)
        for stale in run_dir.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(stale)
    except OSError as e:
        raise RunFolderError(f"{run_dir} holds an attempt that stopped before its first checkpoint, and moving its "
                             f"logs aside failed on {e.filename} ({e.strerror}); fix its permissions or choose another "
                             "output.dir") from e
    return (f"{run_dir} held an attempt that stopped before its first checkpoint "
            f"({f'last logged step {last}' if last else 'no step logged'}); starting over. Its logs are in {aside}")


def _last_logged_step(path: Path) -> int:
    rows = read_jsonl(path) if path.is_file() else []
    return rows[-1].get("step", 0) if rows else 0


def record_segment(run_dir: Path, config: Config, folder: RunFolder, start_step: int, command: str | None) -> None:
    """Write the config of this segment (`config.toml`) and add its line to `config_history.jsonl`."""
    _write_atomically(run_dir / "config.toml", to_toml(config))
    append_jsonl(run_dir / HISTORY, [{
        "start_step": start_step, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command,
        "changes": folder.changes, "config": tomllib.loads(to_toml(config))}])


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)

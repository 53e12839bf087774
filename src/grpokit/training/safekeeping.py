"""What keeps a run's work safe: when a checkpoint is written, what a failure leaves behind, when the run stops.

The loop (loop.py) hands each step to one `Safekeeping`; every rule about saving, recovery and stopping
lives here, so the loop itself reads as the algorithm:

- a rollout worker dies (async): the finished steps are saved, the error names the command that continues;
- an `[eval]` fails: the step itself finished, so its metrics row and a checkpoint stay, then the error;
- `train.max_consecutive_skips` steps in a row with only NaN/inf updates, or with no answer graded: the
  run stops (it learns nothing), the newest checkpoint untouched;
- a save is due (`output.save_every`, the last step), the `output.keep_best` metric improved, or a stop
  was asked (SIGINT / SIGTERM on any process): the step is saved; a stop ends the loop there;
- another torchrun process is lost (killed, out of memory, its machine down): the checkpoints are as they were,
  and one `error:` line names the process and the command that continues (`lost_process_error`; which process
  and who says it: models/parallel.py `peer_loss`), instead of gloo's "Connection reset by peer" tracebacks.

The messages themselves (and the signal handlers) are stopping.py's.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from grpokit.config.loading import to_toml
from grpokit.config.schema import Config
from grpokit.errors import RewardError, RolloutWorkerError, TrainingDiverged
from grpokit.models.parallel import DistributedContext, LostProcessError, mark_left, peer_loss
from grpokit.training.checkpoint import CheckpointWeights, list_checkpoints, save_checkpoint, trainer_state
from grpokit.training.evaluation import BestCheckpoint
from grpokit.training.run_folder import with_resolved_paths
from grpokit.training.setup import Run
from grpokit.training.stopping import GracefulStop, diverged_message, ungraded_message


class Safekeeping:
    """One run's saving, recovery and stop rules. As a context manager it holds the graceful SIGINT / SIGTERM
    handlers: the first signal asks the loop to finish its step, save and stop."""

    def __init__(self, config: Config, run: Run, dist: DistributedContext, hint: str, console, writer):
        self.config, self.run, self.dist, self.hint = config, run, dist, hint
        self.console, self.writer = console, writer  # rank 0's; elsewhere objects that do nothing
        self.run_dir = run.inputs.folder.path
        self.config_text = to_toml(with_resolved_paths(config))  # each checkpoint records it; a resume checks it
        self.best = BestCheckpoint(self.run_dir, config.output.keep_best) \
            if config.output.keep_best and dist.is_main else None
        self.saved = run.start_step  # the newest step with a checkpoint
        self.failed_steps = 0  # consecutive steps whose every update was skipped as non-finite
        self.ungraded_steps = 0  # consecutive steps in which no reward function graded any answer
        self.stop = GracefulStop()

    def __enter__(self) -> "Safekeeping":
        self.stop.__enter__()
        if self.dist.world_size > 1 and threading.current_thread() is threading.main_thread():
            graceful = signal.getsignal(signal.SIGTERM)

            def on_sigterm(signum, frame):  # torchrun stops the others once one of its processes is gone:
                if (lost := lost_process_error(None, self.run_dir, self.hint)) is not None:  # no step to finish
                    raise _Lost(lost)
                graceful(signum, frame)

            signal.signal(signal.SIGTERM, on_sigterm)  # (the graceful stop's __exit__ puts the one before back)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop.__exit__(exc_type, exc, tb)
        if exc is None or self.dist.world_size == 1:
            return
        self.dist.failed = True  # its close waits for no one: the others may never come
        if isinstance(exc, _Lost):  # raised on torchrun's SIGTERM, which the line above let through again
            _heed_no_stop_signal()
            raise exc.error from None
        if isinstance(exc, LostProcessError):
            return
        if (lost := lost_process_error(exc, self.run_dir, self.hint)) is None:
            mark_left("error")  # its own error, which it prints: the others' connections to it close, not lost
            return
        raise lost from None

    @contextmanager
    def on_rollout_error(self, step: int) -> Iterator[None]:
        """A rollout worker's error: the finished steps are kept (step - 1 saved), the folder resumable."""
        try:
            yield
        except RolloutWorkerError as e:
            path = self._save(step - 1) if step - 1 > self.saved and self.dist.world_size == 1 else None
            kept = f"step {step - 1} is saved ({path})" if path else "the newest checkpoint stays"
            then = "once that is fixed, " if e.users_code else ""  # a restart as it is meets the same error
            if path is None and not list_checkpoints(self.run_dir):  # nothing to --resume from
                raise RolloutWorkerError(f"{e}; no checkpoint was written yet: {then}start again with the same "
                                         "command", users_code=e.users_code) from None
            go_on = f"Once that is fixed, continue with: {self.hint}" if e.users_code else f"Continue with: {self.hint}"
            raise RolloutWorkerError(f"{e}; {kept}. {go_on}", users_code=e.users_code) from None

    @contextmanager
    def on_eval_error(self, step: int, metrics: dict) -> Iterator[None]:
        """A failed evaluation: the step itself finished, so (on one process) its row and a checkpoint stay."""
        try:
            yield
        except Exception:
            if self.dist.world_size == 1:
                self.writer.write(step, metrics)
                path = self._save(step, self._best_step())
                self.console.print(f"step {step} finished and is saved ({path}); its evaluation failed. "
                                   f"Continue with: {self.hint}")
            raise

    def guard(self, step: int, metrics: dict, batch) -> None:
        """Stop a run that learns nothing: `train.max_consecutive_skips` steps in a row whose every update was
        NaN/inf, or in which no answer was graded (rewards.on_error = "skip" with a grader that is down)."""
        limit = self.config.train.max_consecutive_skips
        self.failed_steps = self.failed_steps + 1 if math.isnan(metrics["grad_norm"]) else 0
        if limit and self.failed_steps >= limit:
            raise TrainingDiverged(diverged_message(self.run_dir, self.failed_steps))
        graded = self.dist.any(bool((~batch.draw.total.isnan()).any()))  # on any process
        self.ungraded_steps = 0 if graded else self.ungraded_steps + 1
        if limit and self.ungraded_steps >= limit:
            raise RewardError(ungraded_message(self.run_dir, self.ungraded_steps, metrics, self.hint))

    def save(self, step: int, metrics: dict) -> bool:
        """Save the step when a save is due, the best metric improved or a stop was asked; True: stop now."""
        config, best, dist = self.config, self.best, self.dist
        due = step == config.train.steps or (config.output.save_every and step % config.output.save_every == 0)
        improved = dist.any(best is not None and best.improves(metrics))  # rank 0 decides
        stopping = dist.any(bool(self.stop.requested))  # a signal to any process stops them all
        if due or stopping or improved:
            path = self._save(step, step if improved else self._best_step())
        if improved and best is not None:
            best.record(step, metrics[best.metric], path)
            self.console.print(f"step {step}: best {best.metric} so far ({best.value:.4f}): {path.name} is kept")
        if stopping:
            self.console.print(f"{self.stop.requested or 'a stop on another process'}: stopped after step {step}; "
                               f"saved {path}. Continue with: {self.hint}")
        return stopping

    def _best_step(self) -> int | None:
        return self.best.step if self.best else None

    def _save(self, step: int, keep_step: int | None = None) -> Path:
        """The checkpoint of `step` (every process takes part; rank 0 writes it); `keep_step`'s is never pruned."""
        policy = self.run.policy
        state = trainer_state(step, policy, self.run.sampling_generator, self.run.stream)
        weights = CheckpointWeights(policy.model)  # gathered under FSDP; with LoRA the merged model + adapter/
        path = self.dist.run_on_main(save_checkpoint, self.run_dir, step, weights, self.run.inputs.tokenizer, state,
                                     self.config.output.keep_last, self.config_text, self.hint, keep_step)
        self.saved = step
        return path


class _Lost(BaseException):
    """A lost process found on a stop signal, raised from its handler wherever the main thread is: a BaseException,
    so that the code it lands in (a reward function's `except Exception`, a retry) cannot take it for its own
    error; `Safekeeping.__exit__` turns it into its `error`."""

    def __init__(self, error: LostProcessError):
        super().__init__(str(error))
        self.error = error


def lost_message(what: str, run_dir: str | Path, hint: str) -> str:
    """`what` happened to a process of the run (models/parallel.py names it), then what the run folder keeps and
    the command that continues it."""
    last = list_checkpoints(run_dir)
    if not last:
        return f"{what}; the run stopped before its first checkpoint: start it again with the same command"
    return f"{what}; the checkpoints are intact (the newest: {last[-1]}); continue with: {hint}"


def lost_process_error(error: BaseException | None, run_dir: str | Path, hint: str) -> LostProcessError | None:
    """The error that replaces `error` (a collective's "Connection reset by peer"; None: a stop signal) when another
    process of the run is gone, or None. Under torchrun `hint` is the command each machine's launcher ran again
    with `--resume`. One process per machine says it; the others leave without a word (`quiet`), and stop heeding
    torchrun's SIGTERM, which comes for them now that one process has ended: this one line is printed first."""
    loss = peer_loss(error)
    if loss is None:
        return None
    mark_left("reported" if loss.says else "quiet")
    _heed_no_stop_signal()
    if os.environ.get("TORCHELASTIC_RUN_ID") and "--resume" in hint.split():
        hint = f"{hint}, launched as before (on every machine, with the same number of processes)"
    return LostProcessError(lost_message(loss.what, run_dir, hint), quiet=not loss.says)


def _heed_no_stop_signal() -> None:
    """Under torchrun, a process leaving after a loss ignores SIGTERM (its launcher's, once another process has
    ended: it would cut the line short); it is leaving anyway, and torchrun's SIGKILL follows in 30 s."""
    if threading.current_thread() is threading.main_thread() and os.environ.get("TORCHELASTIC_RUN_ID"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

"""What keeps a run's work safe: when a checkpoint is written, what a failure leaves behind, when the run stops.

The loop (loop.py) hands each step to one `Safekeeping`; every rule about saving, recovery and stopping
lives here, so the loop itself reads as the algorithm:

- a rollout worker dies (async): the finished steps are saved, the error names the command that continues;
- an `[eval]` fails: the step itself finished, so its metrics row and a checkpoint stay, then the error;
- `train.max_consecutive_skips` steps in a row with only NaN/inf updates, or with no answer graded: the
  run stops (it learns nothing), the newest checkpoint untouched;
- a save is due (`output.save_every`, the last step), the `output.keep_best` metric improved, or a stop
  was asked (SIGINT / SIGTERM on any process): the step is saved; a stop ends the loop there.

The messages themselves (and the signal handlers) are stopping.py's.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from grpokit.config.loading import to_toml
from grpokit.config.schema import Config
from grpokit.errors import RewardError, RolloutWorkerError, TrainingDiverged
from grpokit.models.parallel import DistributedContext
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
        return self

    def __exit__(self, *exc) -> None:
        self.stop.__exit__(*exc)

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

"""How a run stops: signals, Ctrl-C, a full disk, diverging updates; each ends in one line saying
what was kept and the exact command that continues the run."""

from __future__ import annotations

import errno
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from grpokit.errors import CheckpointError, StoppedNow
from grpokit.training.checkpoint import list_checkpoints


def diverged_message(run_dir: Path, failed_steps: int) -> str:
    last = list_checkpoints(run_dir)
    where = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written yet"
    return (f"{failed_steps} steps in a row had a NaN/inf loss or gradient, so no update was applied; "
            f"stopping ({where}, untouched). Lower train.learning_rate, check the reward functions for "
            f"extreme values, or raise train.max_consecutive_skips.")


def ungraded_message(run_dir: Path, steps: int, metrics: dict, hint: str) -> str:
    """No reward graded any answer `steps` steps in a row (rewards.on_error = "skip" and a grader that is down):
    the run learns nothing, so it stops, naming the functions that left answers ungraded."""
    failing = [k.split("/")[1] for k, v in metrics.items() if k.endswith("/ungraded") and v]
    who = (f"reward function{'s' if len(failing) > 1 else ''} {', '.join(repr(n) for n in failing)} failed on every "
           "answer (rewards.on_error = \"skip\" left them ungraded)" if failing
           else "every reward function returned None for every answer")
    last = list_checkpoints(run_dir)
    then = (f"the newest checkpoint is {last[-1]}). Fix the grader (its URL, its worker, the function), then "
            f"continue with: {hint}" if last else "no checkpoint was written yet). Fix the grader (its URL, its "
            "worker, the function), then start again with the same command")
    return (f"no answer was graded in {steps} steps in a row: {who}, so nothing was learned; stopping ({then} "
            f"(train.max_consecutive_skips = {steps} sets how many such steps a run tolerates; 0 = no limit)")


class GracefulStop:
    """SIGINT / SIGTERM ask the loop to finish its step, save and exit; a second SIGINT stops at once.
    The first one says so at once (a step may take long, or hang in a reward function)."""

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        # os.write, not print: a signal handler may run in the middle of another print
        os.write(2, f"\n{self.requested}: stopping after the current step, which is then saved; press Ctrl-C "
                    "again to stop at once (that step is lost, the newest checkpoint stays)\n".encode())

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def continue_command(command: str | None) -> str:
    """The command that continues a run started with `command` (the CLI's words), for stop messages."""
    if command and "--resume" not in command.split():
        return f"{command} --resume"
    return command or "train(config, resume=True)"


@contextmanager
def stop_messages(run_dir: str | Path, hint: str) -> Iterator[None]:
    """Turn a Ctrl-C outside the graceful path and a full disk into one user error naming the newest
    checkpoint and `hint`, the command that continues the run."""
    try:
        yield
    except KeyboardInterrupt:  # a second Ctrl-C (or one before the loop): stop now, without a traceback
        last = list_checkpoints(run_dir)
        raise StoppedNow("interrupted (Ctrl-C): the run stopped at once; a step in progress is lost. "
                         + (f"The newest checkpoint is {last[-1]}; continue with: {hint}" if last
                            else "No checkpoint was written yet; start again with the same command")) from None
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        last = list_checkpoints(run_dir)
        raise CheckpointError(f"{e.filename or run_dir}: could not write ({e.strerror}); "
                              + (f"the newest checkpoint is {last[-1]}; free space and continue with: {hint}"
                                 if last else "no checkpoint was written yet; free space and start again")) from e

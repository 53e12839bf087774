"""The one base class of every error a user can fix.

Every user-facing error class lives here (ConfigError, DataError, ...); each is
raised with a message that names the field, file or row and the fix; `cli.main`
catches `UserError` alone and prints that message as one `error:` line with exit code 2. Anything
else is a bug and keeps its traceback. This module imports nothing at load, so the CLI
can catch errors without importing torch.
"""

from __future__ import annotations


class UserError(Exception):
    """A fault in the user's input or environment; the message says what to change."""

    label = "error"  # the CLI prints `{label}: {message}` and exits with `exit_code`
    exit_code = 2
    # Found by the start-up checks, which every torchrun process runs alike on the same files: the CLI prints it
    # on one process per machine (LOCAL_RANK 0), not once per process. A fault in a run is printed wherever it is.
    at_start_up = False


def say(e: UserError) -> None:
    """Print `e` as its one line, a start-up error once per machine (LOCAL_RANK 0). A quiet process waits a moment
    before it exits: torchrun stops the others when one exits, and the one that prints must not be stopped first."""
    import os
    import sys
    import time

    if not e.at_start_up or os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"{e.label}: {e}", file=sys.stderr, flush=True)
    else:
        time.sleep(5)


class ConfigError(UserError, ValueError):
    """A config field has a bad value; the message names the field and the fix."""

    at_start_up = True


class DataError(UserError, ValueError):
    """A prompt source that cannot be used as it is; the message says where and how to fix it."""

    at_start_up = True


class ModelLoadError(UserError, ValueError):
    """The model folder is missing or is not a Hugging Face causal-LM folder."""

    at_start_up = True


class SetupError(UserError, ValueError):
    """The run cannot start as configured; the message says why and what to change."""

    at_start_up = True


class RewardLoadError(UserError, ValueError):
    """A reward name or "file.py:function" reference that cannot be resolved."""

    at_start_up = True


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be written; the message says which ones are intact and how to go on."""


class TrainingDiverged(UserError, RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient."""


class StoppedNow(UserError, KeyboardInterrupt):
    """Ctrl-C stopped the run at once (a second one in the loop, or one before the loop started): the
    CLI says so in one line and exits 130 (as shells expect of Ctrl-C); Python callers can still catch
    it as KeyboardInterrupt."""

    label, exit_code = "stopped", 130


class ReportError(UserError, ValueError):
    """The run folder cannot be reported on; the message says why."""


class ExplainError(UserError, ValueError):
    """The prompt, answer or checkpoints cannot be explained; the message says why."""


class PresetError(UserError, ValueError):
    """A preset cannot be applied to this config (the message says what to set)."""

    at_start_up = True


class TaskError(UserError, ValueError):
    """An unknown built-in task name, or arguments the task does not accept."""

    at_start_up = True


class RunFolderError(UserError, ValueError):
    """The run folder cannot be used as asked; the message says why and what to do."""

    at_start_up = True


class DamagedLogError(UserError, ValueError):
    """A run log has an unreadable line before its last one; the message names the file and the line."""


class RewardError(UserError, RuntimeError):
    """A reward function failed or returned something that is not one number (or None) per sample."""


class RewardTimeoutError(RewardError):
    """A reward function ran past its `RewardSpec.timeout`."""


class EnvironmentFault(UserError, RuntimeError):
    """An environment's own code (`reset`, the factory) raised during the run; the message names it."""


class RolloutWorkerError(UserError, RuntimeError):
    """A sampler outside the training loop (an asynchronous rollout worker, a vLLM server) crashed, hung, fell
    behind or failed its weight transfer; the message names it, what happened and how to continue (the loop
    saves the finished steps first). `users_code`: the worker stopped on the user's own code or input (a reward
    that raised, a bad row), which a restart meets again: the fix comes before the command to continue."""

    def __init__(self, message: str, *, users_code: bool = False):
        super().__init__(message)
        self.users_code = users_code


def keywords_moved_into(parameter: str, options_class, home: str):
    """A decorator for a public function whose loose keywords were gathered into one options dataclass: the old
    spelling, `fn(..., a=..., b=...)`, still works, folded into `parameter` (an `options_class`), with a
    DeprecationWarning that names the new spelling (`home`: the module to import the class from); both spellings
    in one call is an error naming the new one."""
    import dataclasses
    import functools
    import inspect
    import warnings

    names = tuple(f.name for f in dataclasses.fields(options_class))

    def wrap(fn):
        position = list(inspect.signature(fn).parameters).index(parameter)  # where it sits when passed positionally

        @functools.wraps(fn)
        def call(*args, **kwargs):
            old = {name: kwargs.pop(name) for name in names if name in kwargs}
            if old:
                cls, spelled = options_class.__name__, ", ".join(f"{k}={v!r}" for k, v in old.items())
                if parameter in kwargs or len(args) > position:
                    raise TypeError(f"{fn.__qualname__}() got {parameter}= and {', '.join(old)}=: pass "
                                    f"{parameter}={cls}({spelled}) alone")
                warnings.warn(f"{fn.__qualname__}: the keywords {', '.join(old)} moved into `{parameter}`; pass "
                              f"{parameter}={cls}({spelled}) (from {home} import {cls})", DeprecationWarning,
                              stacklevel=2)
                kwargs[parameter] = options_class(**old)
            return fn(*args, **kwargs)

        return call

    return wrap

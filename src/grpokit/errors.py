"""The one base class of every error a user can fix.

Each module raises its own subclass (ConfigError, DataError, ...) with a message
that names the field, file or row and the fix; `cli.main` catches `UserError`
alone and prints that message as one `error:` line with exit code 2. Anything
else is a bug and keeps its traceback. This module imports nothing, so the CLI
can catch errors without importing torch.
"""

from __future__ import annotations


class UserError(Exception):
    """A fault in the user's input or environment; the message says what to change."""

    label = "error"  # the CLI prints `{label}: {message}` and exits with `exit_code`
    exit_code = 2

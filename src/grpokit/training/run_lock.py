"""The run folder's lock: one run at a time in `output.dir`.

A run holds an advisory lock on the folder itself (`flock` on its descriptor) from its start-up checks
to its end, so a second run or a resume of the same folder is refused with the other process named.
The OS drops the lock when the process dies, even by SIGKILL, so a crash never leaves a folder locked.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

from grpokit.errors import RunFolderError

LOCK_FILE = ".grpokit.lock"


class RunFolderLock:
    """An exclusive advisory lock on a run folder, held from the start-up checks to the end of the run.

    The lock is `flock` on the folder's own descriptor, so it needs no lock file and the OS drops it
    when the process ends in any way. `.grpokit.lock` only tells a refused second run who holds it.
    Where a file system cannot lock a directory (NFS emulates flock with POSIX locks, which need a file
    open for writing), the lock is taken on `.grpokit.lock` itself; where it cannot lock at all
    (Lustre without the flock option, Windows) the run goes on unlocked, with a warning."""

    def __init__(self, path: str | Path, command: str | None = None):
        self.path, self.command, self.fd, self.on_file = Path(path), command, None, False

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:  # Windows
            return self._unlocked("this platform has no fcntl")
        try:
            self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            self._close()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise self._busy() from None
            first = e
        try:  # no flock on directories here: a POSIX lock on a file opened for writing
            self.fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.on_file = True
        except OSError as e:
            self._close()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._busy() from None
            self._unlocked(f"{first.strerror}; {e.strerror}")

    def _unlocked(self, why: str) -> None:
        print(f"warning: output.dir {str(self.path)!r} cannot be locked ({why}); make sure no other run uses it",
              flush=True)

    def _busy(self) -> "RunFolderError":
        return RunFolderError(f"output.dir {str(self.path)!r} is in use by another grpokit run ({self._holder()}); "
                              "wait for it to finish or stop it, or choose another output.dir")

    def announce(self) -> None:
        """Say who holds the folder (written once every check has passed: a refused start adds no file)."""
        if self.fd is None:
            return
        info = json.dumps({"pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": self.command})
        if self.on_file:  # the locked file itself: rewrite it through the locked descriptor
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, (info + "\n").encode(), 0)
        else:
            (self.path / LOCK_FILE).write_text(info + "\n", encoding="utf-8")

    def release(self) -> None:
        if self.fd is None:
            return
        if not self.on_file:  # still holding the lock: no one else reads the file now
            (self.path / LOCK_FILE).unlink(missing_ok=True)
        self._close()  # closing the descriptor releases the lock

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _holder(self) -> str:
        try:
            info = json.loads((self.path / LOCK_FILE).read_text(encoding="utf-8"))
            what = f": {info['command']}" if info.get("command") else ""
            return f"pid {info['pid']}, since {info['since']}{what}"
        except (OSError, ValueError, KeyError):  # the holder is still starting up
            return "a process that is starting up"

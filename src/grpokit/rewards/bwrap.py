"""Isolation levels of `code_execution`: choosing one, and the bubblewrap command line.

    choose_mode(sandbox, python, bwrap, as_root, probe) -> Mode (level, message, ...)
    bwrap_argv(bwrap, python, userns=...) -> the argv prefix that runs one answer

`choose_mode` takes the strongest level that `probe` (a real answer run at that
level) shows to work, and words the one-line message that names it and the way to
a stronger one; a required level it cannot give is a RewardLoadError naming the fix.

The sandbox an answer sees (why each piece is there):

- A new root of its own: only the system's program and library folders (/usr and
  the /bin, /lib... links), a few /etc files the dynamic linker and libc read, and
  the Python installation that runs the answer (its prefixes, which for a venv
  includes the venv), all read-only. The run folder, the home directory, /tmp and
  the trainer's code are not there at all, so there is nothing to read or overwrite.
- One writable place, `WORKDIR`: a tmpfs of `WORK_BYTES`, empty, the working
  directory and $HOME/$TMPDIR. Filling it ends in ENOSPC; it costs memory, never
  the host's disk. The rest of the tree, /dev included, is remounted read-only
  (bubblewrap leaves its own root tmpfs and /dev writable otherwise: unbounded).
- Fresh /proc and a minimal /dev (null, zero, random, urandom, tty...).
- New network (loopback only, nothing listening), PID (the trainer and every
  other process are invisible, so they cannot be signalled), IPC, UTS and,
  where the kernel has them, cgroup namespaces; --die-with-parent.
- uid/gid 65534, in a user namespace where possible: an ordinary user's bwrap
  maps 65534 onto the caller's uid; root first becomes uid 65534 (Popen's
  `user=`), so that the answer's kuid is 65534, not 0, which the kernel's process
  limit (RLIMIT_NPROC) exempts. In a user namespace that limit counts the answer's
  own processes only (Linux >= 5.14), and nested user namespaces are refused
  (--disable-userns, bwrap >= 0.8) to keep the kernel's attack surface small.
  Where uid 65534 cannot read the Python (a pyenv under /root), root runs bwrap
  itself without a user namespace and the harness switches to 65534 before the
  answer runs: the limit is then shared by the answers running at once, and
  nested user namespaces stay possible.
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from typing import Callable

from grpokit.errors import RewardLoadError

__all__ = ["SANDBOX_UID", "WORKDIR", "WORK_BYTES", "Mode", "bwrap_argv", "choose_mode", "find_bwrap", "python_dirs"]


SANDBOX_UID = 65534  # "nobody" on Debian; the answers' uid and gid at every level that switches


WORKDIR = "/sandbox"


WORK_BYTES = 64 * 2**20  # size of the answer's tmpfs working folder


_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


# What the dynamic linker, libc's name lookups and Python's time module read; nothing secret.
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd",
              "/etc/group", "/etc/nsswitch.conf", "/etc/alternatives")


def find_bwrap() -> str | None:
    """The bwrap executable on PATH, or None (tests replace this to simulate a machine without it)."""
    return shutil.which("bwrap")


@functools.lru_cache(maxsize=8)
def bwrap_version(bwrap: str) -> tuple[int, ...]:
    """bwrap's version as numbers ((0,) when it does not say): options arrived over the releases."""
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return (0,)
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(x) for x in match.groups() if x is not None) if match else (0,)


@functools.lru_cache(maxsize=8)
def python_dirs(python: str) -> tuple[str, ...]:
    """The folders `python` needs to start and import its packages: its prefixes (a venv's and its base's).

    For the running interpreter they are known; another one is asked once. "/" is never
    returned: binding it would undo the sandbox.
    """
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        prefixes = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
    else:
        ask = ("import json, sys; "
               "print(json.dumps([sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]))")
        done = subprocess.run([python, "-I", "-c", ask], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)
        try:
            prefixes = json.loads(done.stdout)
        except ValueError:
            raise ValueError(f"code_execution: {python!r} does not run as a Python interpreter "
                             f"({(done.stderr.strip().splitlines() or ['no output'])[-1]}); "
                             f"give the path of a Python 3 executable") from None
    real = os.path.realpath(python)
    candidates = [*prefixes, os.path.dirname(os.path.dirname(real))]
    out: list[str] = []
    for path in candidates + [os.path.realpath(p) for p in candidates]:
        path = os.path.normpath(path)
        if path != "/" and os.path.isdir(path) and path not in out:
            out.append(path)
    return tuple(out)


def _covered(path: str, by: list[str]) -> bool:
    return any(path == b or path.startswith(b.rstrip("/") + "/") for b in by)


def _ancestors(path: str) -> list[str]:
    """/a/b/c -> ["/a", "/a/b"]."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]


def bwrap_argv(bwrap: str, python: str, *, userns: bool) -> list[str]:
    """The bwrap command line, up to and including "--", that runs `python` inside the sandbox.

    `userns`: bwrap runs unprivileged and maps `SANDBOX_UID` in a user namespace; without
    one (bwrap run by root) the harness must switch to `SANDBOX_UID` itself.
    """
    argv = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "sandbox", "--die-with-parent"]
    if userns:
        argv += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        if bwrap_version(bwrap) >= (0, 8):
            argv.append("--disable-userns")
    bound: list[str] = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
            bound.append(path)
    for path in _ETC_FILES:
        argv += ["--ro-bind-try", path, path]
    made: set[str] = set()
    for path in sorted(python_dirs(python), key=len):  # a prefix before the venvs inside it
        if _covered(path, bound):
            continue
        # bwrap copies the modes of the host's parents (/root is 0700): make them traversable for uid 65534
        parents = [p for p in _ancestors(path) if p not in made and not _covered(p, bound)]
        for parent in parents:
            argv += ["--perms", "0755", "--dir", parent]
        made.update(parents)
        argv += ["--ro-bind", path, path]
        bound.append(path)
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "0700", "--size", str(WORK_BYTES), "--tmpfs", WORKDIR,
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKDIR, "--"]
    return argv


@dataclass(frozen=True)
class Mode:
    """How answers run: the isolation level in force, its message, the interpreter."""

    level: str  # "bubblewrap" | "unprivileged-uid" | "rlimits-only"
    message: str
    python: str
    bwrap: str | None = None
    as_root: bool = False  # the trainer is root: answers are switched to uid 65534
    userns: bool = True  # bubblewrap in a user namespace (root starts it as uid 65534); False: the harness switches


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


def _namespaces_fix(as_root: bool) -> str:
    if as_root:
        return "in a container, allow namespaces (docker run --security-opt seccomp=unconfined --cap-add SYS_ADMIN)"
    return "allow unprivileged user namespaces (sysctl -w kernel.unprivileged_userns_clone=1)"


def choose_mode(sandbox: str, python: str, found: str | None, as_root: bool,
                probe: Callable[[Mode], str | None]) -> Mode:
    """The mode for option `sandbox` ("auto", "bubblewrap", "uid", "none") on this machine.

    found: the bwrap executable or None; probe(mode): None when a test answer runs
    correctly at that mode, else why not (the error line becomes part of the message).
    """
    name = "code_execution"
    if sandbox == "none":
        return Mode("rlimits-only", f"{name}: sandbox = 'none': answers run as {_user()} with rlimits only "
                                    f"(no file-system, network or process isolation)", python)
    if sandbox in ("auto", "bubblewrap") and found:
        mode = Mode("bubblewrap", f"{name}: answers run under bubblewrap (read-only system files, private "
                                  f"{WORK_BYTES >> 20} MiB working folder, no network, own PID namespace, "
                                  f"uid {SANDBOX_UID})", python, found, as_root)
        why = probe(mode)
        if why is not None and as_root:  # uid 65534 cannot read the Python, or has no user namespaces
            without = (f"{mode.message[:-1]} without a user namespace: {why}; a Python that uid {SANDBOX_UID} can "
                       f"read, set as python, gives each answer its own process limit)")
            mode = replace(mode, userns=False, message=without)
            why = probe(mode)
        if why is None:
            return mode
        reason, fix = f"bubblewrap cannot start a sandbox here ({why})", _namespaces_fix(as_root)
    else:
        reason, fix = "bubblewrap not found", "apt-get install bubblewrap"
    if sandbox == "bubblewrap":
        raise RewardLoadError(f"{name}: sandbox = 'bubblewrap' but {reason}; {fix}, or set sandbox = 'auto'")
    if sandbox == "uid" and not as_root:
        raise RewardLoadError(f"{name}: sandbox = 'uid' needs root (to switch answers to uid {SANDBOX_UID}); "
                              f"run as root or set sandbox = 'auto'")
    if as_root:
        mode = Mode("unprivileged-uid", f"{name}: {reason}, answers run as uid {SANDBOX_UID} with rlimits only; "
                                        f"{fix} for file-system and network isolation", python)
        why = probe(mode)
        if why is None:
            return mode
        if sandbox == "uid":
            raise RewardLoadError(f"{name}: sandbox = 'uid' but uid {SANDBOX_UID} cannot run {python} ({why}); "
                                  f"set python = a Python other users can read (e.g. /usr/bin/python3)")
        return Mode("rlimits-only", f"{name}: {reason} and uid {SANDBOX_UID} cannot run {python} ({why}); answers "
                                    f"run as root with rlimits only; {fix} for isolation, or set python = a Python "
                                    f"other users can read", python)
    return Mode("rlimits-only", f"{name}: {reason}, answers run as {_user()} with rlimits only (they can read your "
                                f"files and use the network); {fix} for file-system and network isolation", python)

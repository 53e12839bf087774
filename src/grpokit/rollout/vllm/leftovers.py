"""What killed runs left behind, removed by the next run's first push.

Why: a run that is SIGKILLed (the OOM killer, a scheduler's preemption, `kill -9`) runs no `close()`. With LoRA
through a vLLM server its last adapter stays registered there (`/v1/models` lists it, vLLM keeps it in its LoRA
cache until the server restarts) and its adapter folder stays under TMPDIR (or rollout.vllm.weight_folder); a
full-weight run's weight folder stays too. A resumed run loads adapters under new names, and nothing else ever
frees the old ones: each kill would leave one more. So a run's first push sweeps them (vllm/weights.py
`AdapterFolders`, `_run_folder`).

Whose they are: a run's folders are named by `owned` after the process that owns them and where its pid means
something, `grpokit-lora-<pid>-<pid namespace>-<host>-XXXXXXXX` (`grpokit-weights-...` for full weights). A
folder is a dead run's when it was made here (this host, this pid namespace: containers on one host, even with
one hostname, each have their own) and no process `<pid>` runs (a zombie has ended). A server may be shared by
runs on several machines and weight_folder may be on a shared filesystem: another machine's or container's folder
is never touched (its pid means nothing here), and an adapter is unloaded only when the folder vLLM loaded it
from (`root` in `/v1/models`, the lora_path) is such a dead run's folder, present here. A live run's adapter and
folders (its pid runs) are never touched; a folder named before pids were (`grpokit-lora-XXXXXXXX`) is left
alone: whose it is cannot be known.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import sys
from pathlib import Path

from grpokit.errors import RolloutWorkerError

KINDS = ("grpokit-lora-", "grpokit-weights-")
# pid, then where: the pid namespace and the host; mkdtemp's random part is 8 of [a-z0-9_] (the host may hold
# dashes, the random part none)
_RUN_FOLDER = re.compile(r"^(grpokit-lora-|grpokit-weights-)(\d+)-(\d+-.+)-[a-z0-9_]{8}$")


def here() -> str:
    """Where this process's pids mean something, as a folder name holds it: its pid namespace (the inode
    /proc/self/ns/pid names; 0 without one) and this machine's name."""
    try:
        space = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        space = 0
    return f"{space}-{re.sub(r'[^A-Za-z0-9.-]', '_', socket.gethostname()) or 'localhost'}"


def owned(prefix: str) -> str:
    """The mkdtemp prefix of a run folder of this process: `prefix` (one of KINDS), its pid, `here()`."""
    return f"{prefix}{os.getpid()}-{here()}-"


def is_dead(pid: int) -> bool:
    """Whether no process `pid` runs on this machine (a zombie, ended and waiting for its parent, counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's: it runs
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def dead_run_folder(path) -> bool:
    """Whether `path` is a run folder (`owned`'s name) made here whose process has ended."""
    match = _RUN_FOLDER.match(Path(path).name)
    return bool(match) and match[3] == here() and is_dead(int(match[2]))


def remove_dead_folders(parent) -> list[str]:
    """Remove the dead runs' folders directly under `parent` (TMPDIR or rollout.vllm.weight_folder); the paths
    removed."""
    try:
        entries = list(Path(parent).iterdir())
    except OSError:  # not there yet, or not ours to read: nothing of ours in it
        return []
    removed = []
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink() and dead_run_folder(entry):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
    return removed


def unload_dead_adapters(backend) -> list[str]:
    """Unload, from the vLLM server `backend` talks to, the adapters that dead runs of this machine loaded (each
    one's folder, `root` in /v1/models, inside a dead run's folder here); their names. A colocated engine has
    none (it died with its run); a server that does not answer is left to the push that follows to report."""
    from grpokit.rollout.vllm.server import ServerLLM

    if not isinstance(backend, ServerLLM):
        return []
    client = backend.client
    try:
        listed = client.call("GET", "/v1/models").get("data") or []
    except (RolloutWorkerError, AttributeError):
        return []
    unloaded = []
    for model in listed:
        name, root = (model.get("id"), model.get("root")) if isinstance(model, dict) else (None, None)
        if not (isinstance(name, str) and name.startswith("grpokit-") and isinstance(root, str)):
            continue
        folder = next((p for p in (Path(root), *Path(root).parents) if _RUN_FOLDER.match(p.name)), None)
        if folder is None or not folder.is_dir() or not dead_run_folder(folder):
            continue
        with contextlib.suppress(RolloutWorkerError):  # gone already (another run's sweep): nothing to free
            client.call("POST", "/v1/unload_lora_adapter", text=True, json={"lora_name": name})
            unloaded.append(name)
    if unloaded:
        print(f"note: unloaded {len(unloaded)} LoRA adapter(s) that ended runs left on the vLLM server at "
              f"{client.url}: {', '.join(unloaded)}", file=sys.stderr, flush=True)
    return unloaded

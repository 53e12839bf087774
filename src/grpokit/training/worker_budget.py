"""How many rollout workers this machine can hold (`rollout.mode = "async"`), checked before any starts.

Each worker is a process of its own with a copy of the policy. Unbounded, `rollout.workers = 16` on 2 cores
started 16 processes of ~400 MB (6.4 GB, 88 s), 13 of which never sampled, and `workers = 1000` was accepted.
So, before the model loads:

- refused (`ConfigError` naming `rollout.workers` and a count that fits): workers whose memory, at least
  `WORKER_OVERHEAD_BYTES` each plus their copy of the weights where they sample on the CPU, is more than the
  memory available now less the trainer's own copy of the weights. A lower bound: a worker also holds its KV
  cache and, on the CPU, packed weights (`rollout.packed_weights`), so a count near the limit may still be
  too many; one past it cannot work.
- warned (one line): workers whose torch threads outnumber the usable cores. They take turns on the cores,
  so each extra worker adds memory and start-up time, not speed.

The weights are counted from the model folder's files (safetensors headers: parameters x the bytes of
`model.dtype`), without loading them. Workers on a GPU hold their weights there; only their overhead is
counted against the machine's memory.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from grpokit.errors import ConfigError
from grpokit.models.loading import resolve_device
from grpokit.models.threads import usable_cores

# One worker's memory besides its copy of the weights: the interpreter, torch, transformers, the tokenizer,
# the rows and prompts it is handed. Measured on a worker of `grpokit tiny-model --hidden-size 32 --layers 1`
# (100 KB of weights; Linux x86-64, CPU torch, Python 3.11), sampling: 396 MiB resident, of which 282 MiB
# private (the rest is library pages it shares with the trainer). Counted as 300 MiB.
WORKER_OVERHEAD_BYTES = 300 * 2**20
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_HEADER_LIMIT = 256 * 2**20


def available_memory() -> int | None:
    """Bytes this process may still use: Linux's MemAvailable, lowered to what its cgroup's limit leaves
    (a container); None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found.append(next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) * 1024)
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _safetensors_parameters(path: Path) -> int:
    """The number of values the tensors of one safetensors file hold, from its header alone."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _SAFETENSORS_HEADER_LIMIT:
            raise ValueError(f"{path.name}: no safetensors header")
        header = json.loads(f.read(n))
    return sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")


def parameter_count(folder: Path) -> int | None:
    """Parameters in a model folder's weight files (safetensors headers; a .bin file's size / 4); None when
    the folder has none that can be read (a Hub id, a damaged file: the loader says so later)."""
    try:
        index = folder / "model.safetensors.index.json"  # the shards transformers loads (a consolidated copy
        if index.is_file():                                # beside them, as some repositories ship, is not)
            files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() \
                else sorted(folder.glob("*.safetensors"))
        if files:
            return sum(_safetensors_parameters(p) for p in files)
        size = sum(p.stat().st_size for p in folder.glob("*.bin"))
        return size // 4 or None
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def _sampling_devices(config) -> list[torch.device]:
    r = config.rollout
    if r.vllm_options.server is not None:  # the worker only sends requests: no weights of its own
        return []
    return [resolve_device(d, field="rollout.worker_devices") for d in r.worker_devices] or \
        [resolve_device(config.model.device)] * r.workers


def check_memory(config, available: int | None) -> None:
    """Refuse `rollout.workers` that `available` bytes cannot hold beside the trainer's own weights."""
    workers = config.rollout.workers
    params = parameter_count(Path(config.model.path))
    if available is None or params is None:
        return
    weights = params * _BYTES[config.model.dtype]
    on_cpu = sum(d.type == "cpu" for d in _sampling_devices(config))  # workers whose weights are in memory
    trainer = weights if resolve_device(config.model.device).type == "cpu" else 0
    need = WORKER_OVERHEAD_BYTES * workers + weights * on_cpu
    if need <= available - trainer:
        return
    fits = max(0, (available - trainer) // (WORKER_OVERHEAD_BYTES + (weights if on_cpu else 0)))
    fix = f"set rollout.workers = {fits} or fewer" if fits else \
        "not even one fits: set rollout.mode = \"sync\" (it samples on the trainer's own model)"
    besides = f", {_size(trainer)} of which the trainer's own weights take" if trainer else ""
    raise ConfigError(
        f"rollout.workers: {workers} workers need at least {_size(need)} ({_size(WORKER_OVERHEAD_BYTES)} each for "
        f"the interpreter and libraries, plus {_size(weights)} of {config.model.dtype} weights each sampling on the "
        f"CPU), but this machine has {_size(available)} available{besides}; {fix}")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def crowded_cores(config, threads_each: int) -> str | None:
    """One warning line when the workers' torch threads outnumber the usable cores, else None."""
    workers, cores = config.rollout.workers, len(usable_cores())
    if workers * threads_each <= cores:
        return None
    fix = f"keep rollout.workers x rollout.worker_threads <= {cores}" if config.rollout.worker_threads else \
        f"set rollout.workers = {cores} or fewer"
    return (f"warning: rollout.workers = {workers} x {threads_each} torch thread(s) each = {workers * threads_each} "
            f"threads on {cores} usable cores: they take turns, so the extra ones add memory and start-up time, not "
            f"speed; {fix}")

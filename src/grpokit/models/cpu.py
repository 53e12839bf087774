"""What this CPU is: its model name and the widest vector instructions torch and oneDNN can use.

The host under one project changes from one machine to the next (AVX-512 with BF16 on some, AVX2 only
on others), and both the kernels grpokit may pick (models/onednn.py) and every speed figure depend on
it, so start-up notes and benchmark results name it.
"""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo; ("", set()) where it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "", set()

    def field(key: str) -> str:
        return next((ln.split(":", 1)[1].strip() for ln in lines if ln.split(":")[0].strip() == key), "")

    return field("model name"), set(field("flags").split())


def isa_of(flags: set[str]) -> str:
    """The vector extensions that matter for the float kernels, from /proc/cpuinfo's flags:
    "AMX", "AVX-512 (BF16)", "AVX-512", "AVX2", or "no AVX2"."""
    if {"amx_tile", "amx_bf16"} <= flags:
        return "AMX"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "AVX-512 (BF16)" if "avx512_bf16" in flags else "AVX-512"
    return "AVX2" if "avx2" in flags else "no AVX2"


@lru_cache(maxsize=1)
def cpu_description() -> dict:
    """{"cpu": model name, "isa": isa_of(flags), "torch_capability": what torch's kernels dispatch to}."""
    import torch

    model, flags = _cpuinfo()
    return {"cpu": model or platform.processor() or "unknown", "isa": isa_of(flags) if flags else "unknown",
            "torch_capability": torch.backends.cpu.get_cpu_capability()}


def describe_cpu() -> str:
    d = cpu_description()
    return f"{d['cpu']}, {d['isa']}"

"""Keep freed memory inside the process when training on the CPU (glibc only).

PyTorch's CPU tensors come from ``malloc``. glibc serves blocks above its mmap
threshold with a fresh ``mmap`` and unmaps them again at ``free``, and it returns
the top of the heap to the system once more than the trim threshold is free. A
GRPO step allocates and frees the same large buffers over and over (a [rows, V]
logits block every decode step; activations every micro-batch), so each reuse
starts from pages the kernel must fault in and zero again: 5-10% of a step on the
benchmark's M configuration in paired runs, and far more for code that materialises
[N, T, V] logits (TRL's CPU step: 1.65 -> 0.74 s on the benchmark's S; BENCHMARKS.md).
Raising both thresholds keeps those pages mapped for the next allocation. Peak
resident memory stays what the live tensors need; what changes is that memory
freed after the peak is not handed back while the process runs.

It is the ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` environment
tuning, done with ``mallopt`` so that it also applies to library use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)


M_MMAP_THRESHOLD = -3


KEEP_BYTES = 2**31 - 1  # the largest value mallopt's int takes: blocks up to 2 GiB come from the heap


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where that is not possible
    (another C library, or mallopt refused)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))

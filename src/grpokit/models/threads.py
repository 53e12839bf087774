"""How many CPU threads torch uses, and a warning when they would fight other processes for cores.

On a small CPU machine the threads of two torch processes compete: measured on 2 cores (docs/SCALING.md),
a 10-step addition run took 14.5 s with 2 threads and 13.2 s with 1 alone, but 41.6 s with 2 threads
and 28.9 s with 1 beside another torch process using both cores. torch sizes its thread pool from the
machine, not from the cores this process may run on (a container or `taskset` may allow fewer), and
it cannot see other processes.
"""

from __future__ import annotations

import os
import time


def usable_cores() -> set[int]:
    """The cores this process may run on (its CPU affinity), else all of the machine's."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def busy_elsewhere(cores: set[int], window_s: float = 0.25) -> float | None:
    """How many of `cores` other processes keep busy right now (from /proc/stat over `window_s`, minus
    this process's own CPU time); None where /proc/stat cannot be read."""

    def busy_seconds() -> float:
        total = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                    v = [int(x) for x in values[:8]]  # user nice system idle iowait irq softirq steal
                    total += sum(v) - v[3] - v[4]
        return total / os.sysconf("SC_CLK_TCK")

    try:
        before, own_before, t0 = busy_seconds(), sum(os.times()[:2]), time.monotonic()
        time.sleep(window_s)
        after, own_after, t1 = busy_seconds(), sum(os.times()[:2]), time.monotonic()
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, (after - before) - (own_after - own_before)) / (t1 - t0)


def configure_threads(requested: int = 0) -> tuple[int, str | None]:
    """Set torch's intra-op threads: `requested` (train.num_threads), else OMP_NUM_THREADS when set
    (torch read it at import), else the usable cores. Returns (threads, a one-line note or None): the
    note when other processes already keep enough of those cores busy that the threads would compete."""
    import torch

    cores = usable_cores()
    if requested > 0:
        threads = requested
    elif os.environ.get("OMP_NUM_THREADS"):
        threads = torch.get_num_threads()
    else:
        threads = len(cores)
    torch.set_num_threads(threads)
    others = busy_elsewhere(cores) if threads > 1 else None
    if others is None or others < 0.5 or threads + others <= len(cores) + 0.5:
        return threads, None
    return threads, (f"note: other processes keep about {others:.1f} of the {len(cores)} usable cores busy; "
                     f"{threads} torch threads would compete with them, which can make each step several times "
                     f"slower. Set train.num_threads = 1 (or OMP_NUM_THREADS=1), or run one job at a time")

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


def _descendants_seconds() -> float:
    """CPU seconds used so far by this process's live descendants (isolated-reward workers starting up, tool
    workers): this run's own work, not a competing job; 0 where /proc cannot be read."""
    children: dict[int, list[tuple[int, float]]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        ppid, used = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        children.setdefault(ppid, []).append((int(entry.name), used))
    total, todo = 0.0, [os.getpid()]
    while todo:
        for pid, used in children.get(todo.pop(), []):
            total += used
            todo.append(pid)
    return total


def busy_elsewhere(cores: set[int], window_s: float = 0.25) -> float | None:
    """How many of `cores` other processes keep busy right now (from /proc/stat over `window_s`, minus the
    CPU time of this process and its descendants); None where /proc/stat cannot be read."""

    def busy_seconds() -> float:
        total = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                    v = [int(x) for x in values[:8]]  # user nice system idle iowait irq softirq steal
                    total += sum(v) - v[3] - v[4]
        return total / os.sysconf("SC_CLK_TCK")

    def own_seconds() -> float:
        return sum(os.times()[:4]) + _descendants_seconds()  # ([2:4]: children already reaped)

    try:
        before, own_before, t0 = busy_seconds(), own_seconds(), time.monotonic()
        time.sleep(window_s)
        after, own_after, t1 = busy_seconds(), own_seconds(), time.monotonic()
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

    def crowded(others: float | None) -> bool:
        return others is not None and others >= 0.5 and threads + others > len(cores) + 0.5

    others = busy_elsewhere(cores) if threads > 1 else None
    if crowded(others):  # again a moment later: a process just ending (the run before this one) is not a job
        time.sleep(0.5)
        others = busy_elsewhere(cores)
    if not crowded(others):
        return threads, None
    return threads, (f"note: other processes keep about {others:.1f} of the {len(cores)} usable cores busy; "
                     f"{threads} torch threads would compete with them, which can make each step several times "
                     f"slower. Set train.num_threads = 1 (or OMP_NUM_THREADS=1), or run one job at a time")

"""What `rewards.isolation = "process"` costs per batch: the addition task's reward in-process vs in a RewardPool.

    .venv/bin/python bench/reward_isolation.py [--prompts 16] [--group 8] [--batches 30]

A batch is 16 prompts x G = 8 sampled answers (right, off by one, padded, junk), graded by the task's own
reward spec through `compute_rewards`. Each variant: the median of `--batches` timed batches after 5 warm-up
ones, and its cold start (pool creation to the first batch's rewards: interpreter start, imports, building the
function). The reward is resolved in the worker by name ("addition", through the registry) and, for comparison,
sent as the function itself (pickled by reference); neither imports torch in the worker. The machine's
load average is printed with the figures: on a busy machine they are upper bounds. Runs in seconds.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

from grpokit.data.prompts import columns_of
from grpokit.rewards.core import compute_rewards
from grpokit.rewards.pooled_reward import isolate
from grpokit.rewards.worker_pool import RewardPool
from grpokit.tasks import get_task


def make_batch(prompts: int, G: int, seed: int = 0) -> dict:
    """Rows of the addition task and G answers each, as a policy in training samples them."""
    task, rng = get_task("addition"), random.Random(seed)
    rows = task.generate(prompts, seed)
    answers = []
    for row in rows:
        right = int(row["answer"])
        for _ in range(G):
            answers.append(rng.choice([str(right), str(right), f" {right}\n", str(right + rng.choice([-1, 1])),
                                       str(right * 10), row["prompt"] + str(right), "", "=" * rng.randint(1, 4)]))
    return dict(prompts=[r["prompt"] for r in rows for _ in range(G)], completions=answers,
                completion_ids=[[ord(ch) for ch in a] for a in answers], columns=columns_of(rows, repeat=G))


def grade(specs, b) -> list:
    per_fn, _ = compute_rewards(specs, b["prompts"], b["completions"], b["completion_ids"], b["columns"])
    return per_fn.flatten().tolist()


def timed(specs, b, batches: int) -> float:
    for _ in range(5):
        grade(specs, b)
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        grade(specs, b)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def rss_mb(pids) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024 / max(1, len(pids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8, help="answers per prompt (G)")
    parser.add_argument("--batches", type=int, default=30, help="timed batches per variant (after 5 warm-up)")
    args = parser.parse_args()
    b, G = make_batch(args.prompts, args.group), args.group
    specs = get_task("addition").reward_functions()
    want = grade(specs, b)
    rows = [("in-process", None, timed(specs, b, args.batches), None)]
    variants = [("1 worker, by name", 1, ("addition", {})), ("2 workers, by name", 2, ("addition", {})),
                ("2 workers, the function", 2, None)]
    for label, workers, source in variants:
        with RewardPool(workers) as pool:
            start = time.perf_counter()
            isolated = [isolate(s, pool, source=source, group_size=G) for s in specs]
            assert grade(isolated, b) == want, "isolated rewards differ from in-process ones"
            cold = time.perf_counter() - start
            rows.append((label, cold, timed(isolated, b, args.batches), rss_mb(pool.pids)))
    load = os.getloadavg()
    print(f"addition task, {args.prompts} prompts x G = {G} answers = {len(want)} per batch; median of "
          f"{args.batches} batches after 5 warm-up; {os.cpu_count()} CPUs, load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min)")
    base = rows[0][2]
    print(f"{'variant':<26} {'ms/batch':>9} {'x in-process':>13} {'+ms/batch':>10} {'cold start s':>13} "
          f"{'RSS/worker MB':>14}")
    for label, cold, ms, rss in rows:
        print(f"{label:<26} {ms:>9.3f} {ms / base:>13.1f} {ms - base:>10.3f} "
              f"{'-' if cold is None else f'{cold:.2f}':>13} {'-' if rss is None else f'{rss:.0f}':>14}")


if __name__ == "__main__":
    main()

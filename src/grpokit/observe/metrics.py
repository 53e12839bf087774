"""What a step's numbers mean: completion and reward statistics, and their reduction over processes.

`reduce_metrics` makes one process's metrics the whole run's under torchrun: reward and
completion statistics recomputed from the gathered per-answer values, token means weighted by
token counts, times the slowest rank's (a no-op on one process).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as tdist

from grpokit.models.parallel import global_sum, is_distributed, rank
from grpokit.rewards.core import reward_metrics


def completion_metrics(completion_mask: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """`completions/*` length statistics of one generation batch."""
    lengths = completion_mask.sum(-1).float()  # [N]
    terminated = lengths[~truncated]
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item() if len(terminated) else 0.0,
    }


def version_metrics(token_version: torch.Tensor, action_mask: torch.Tensor, trainer_version: int) -> dict[str, float]:
    """How old the weights were that sampled a batch, token by token (in-flight weight updates and streaming
    groups, where one answer can span versions). `token_version` [N, T]: each token's policy version (-1 on
    padding); `action_mask` [N, T]: the sampled tokens; `trainer_version`: the weights the update starts from
    (step - 1). A token's lag is trainer_version - its version, in optimizer steps.

    - `async/token_lag_mean`, `async/token_lag_max`: over the batch's sampled tokens;
    - `async/versions_per_answer_max`: the most versions one answer was sampled under (1: none spans);
    - `async/answers_spanning_versions`: the share of answers sampled under more than one version."""
    sampled = action_mask.bool() & (token_version >= 0)  # [N, T]
    if not sampled.any():
        return {"async/token_lag_mean": 0.0, "async/token_lag_max": 0.0, "async/versions_per_answer_max": 1.0,
                "async/answers_spanning_versions": 0.0}
    lag = (trainer_version - token_version[sampled]).double()  # [n_tokens]
    big = torch.iinfo(torch.long).max
    newest = token_version.masked_fill(~sampled, -1).amax(-1)  # [N]
    oldest = token_version.masked_fill(~sampled, big).amin(-1)  # [N]
    has = sampled.any(-1)  # [N]
    # versions per answer: distinct values among its sampled tokens; a row's versions only grow, so count where a
    # sampled token's version exceeds the newest before it (across tool results and padding between them)
    newest_so_far = token_version.masked_fill(~sampled, -1).cummax(-1).values  # [N, T]
    changes = sampled[:, 1:] & (newest_so_far[:, :-1] >= 0) & (token_version[:, 1:] > newest_so_far[:, :-1])
    spans = (changes.sum(-1) + 1).masked_fill(~has, 1)  # [N]
    return {"async/token_lag_mean": float(lag.mean()), "async/token_lag_max": float(lag.max()),
            "async/versions_per_answer_max": float(spans.max()),
            "async/answers_spanning_versions": float(((newest > oldest) & has).double().sum() / has.sum())}


def input_tokens(rollout) -> int:
    """The tokens one generation batch fed the model, as TRL counts them for `num_tokens`: each answer's
    prompt (a group's prompt once per answer) plus the tokens the model generated (a tool's result,
    inserted between them, is not counted: TRL's tool_mask)."""
    return int(rollout.prompt_mask.sum().item() + rollout.action_mask.sum().item())


def num_tokens(metrics_path: Path, rollout) -> float:
    """TRL's `num_tokens`: the input tokens (`input_tokens`, all processes) of every step so far, this one
    included. The running total is the previous row's in metrics.jsonl, so it needs no state of its own and
    a resume continues it (rows after the checkpoint are dropped first). Process 0 reads it (the one that
    writes the rows); elsewhere it is this step's count. A run folder without it starts from 0."""
    step = float(global_sum(torch.tensor(input_tokens(rollout), dtype=torch.float64)))
    before = _last_row(metrics_path).get("num_tokens") if rank() == 0 else None
    return step + (before if isinstance(before, (int, float)) else 0.0)


def _last_row(path: Path, tail_bytes: int = 1 << 20) -> dict:
    """The last row of a JSONL log ({} when there is none or it cannot be read)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - tail_bytes))
            lines = f.read().splitlines()
        row = json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}
    return row if isinstance(row, dict) else {}


def reward_summary(total: torch.Tensor, group_size: int) -> dict[str, float]:
    """`reward`, `reward_std` (mean of per-group stds, as TRL) and `frac_reward_zero_std`: the share of
    graded groups (a group no reward graded at all, rewards.on_error = "skip", is not one) whose answers
    all scored the same; NaN when no group was graded (its cause is the grader, not the prompts)."""
    grouped = total.view(-1, group_size)  # [B, G]
    valid = ~torch.isnan(grouped)
    counts = valid.sum(-1).clamp(min=1)
    filled = torch.where(valid, grouped, torch.zeros_like(grouped))
    mean = filled.sum(-1) / counts  # [B]
    var = (torch.where(valid, grouped - mean[:, None], torch.zeros_like(grouped)) ** 2).sum(-1) / counts
    std = var.sqrt()
    graded = valid.any(-1)  # [B]
    return {
        "reward": torch.nanmean(total).item(),
        "reward_std": std.mean().item(),
        "frac_reward_zero_std": (std[graded] < 1e-8).float().mean().item() if graded.any() else math.nan,
    }


def tool_metrics(stats: list) -> dict[str, float]:
    """`tools/*` of one step's multi-turn rollouts (every draw, before any filtering), TRL's names where
    TRL has them: `tools/call_frequency` calls per answer, `tools/failure_frequency` failed calls per
    call; `tools/turns_per_answer`, `tools/calls/<name>` per answer, `time/tools` waiting on tools."""
    n = sum(len(s.calls) for s in stats)
    calls, failures = sum(sum(s.calls) for s in stats), sum(sum(s.failures) for s in stats)
    out = {"tools/call_frequency": calls / n, "tools/failure_frequency": failures / calls if calls else 0.0,
           "tools/turns_per_answer": sum(sum(s.turns) for s in stats) / n,
           "time/tools": sum(s.seconds for s in stats)}
    for s in stats:
        for name, count in s.per_tool.items():
            out[f"tools/calls/{name}"] = out.get(f"tools/calls/{name}", 0.0) + count / n
    return out


_MAX = ("completions/max_length", "sampling/logprob_gap_max", "sampling/is_ratio_max")
_MIN = ("completions/min_length", "sampling/is_ratio_min")
_SUM = ("tokens_per_sec", "dynamic_sampling/groups_kept")
_SUM_SUFFIXES = ("/ungraded",)  # rewards/<name>/ungraded: answers a failing grader left ungraded, a count


def _token_weighted(key: str) -> bool:
    return key == "kl" or key.startswith(("clip_ratio/", "cispo/", "sampling/", "off_policy/", "vespo/"))


def reduce_metrics(metrics: dict, batch, specs, config) -> dict:
    """One step's metrics over all ranks (identical on every rank afterwards).

    Reward and completion statistics are recomputed from the gathered per-answer values (exact);
    token means are weighted by each rank's loss tokens (entropy: tokens that went through the
    model); `loss` adds up when the loss sums over global tokens (dapo/cispo: each rank's share of
    one global normaliser) and is averaged otherwise; times are the slowest rank's; anything else is
    averaged (equal on every rank for grad_norm, learning_rate). One process: `metrics` unchanged."""
    if not is_distributed():
        return metrics
    r, algo = batch.rollout, config.algorithm
    mask = batch.loss_mask
    skip = config.skips_zero_advantage
    entropy_rows = (batch.advantages != 0) if skip else torch.ones_like(batch.advantages, dtype=torch.bool)
    weights = {"tokens": float(mask.sum()), "entropy": float(mask[entropy_rows.to(mask.device)].sum())}
    rows = (r.action_mask.sum(-1).cpu(), r.truncated.cpu(), batch.draw.total.cpu(), batch.draw.per_fn.cpu())
    parts: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(parts, (metrics, weights, rows))
    out = {}
    for key in dict.fromkeys(k for p in parts for k in p[0]):  # a tool called on one rank only: 0 elsewhere
        values = [p[0].get(key, 0.0) for p in parts]
        if key == "tools/failure_frequency":  # failures per call: weighted by each rank's calls
            out[key] = _weighted_mean(values, [p[0]["tools/call_frequency"] for p in parts])
        elif key.startswith("time/") or key in _MAX:
            out[key] = max(values)
        elif key in _MIN:
            out[key] = min(values)
        elif key in _SUM or key.endswith(_SUM_SUFFIXES) or (key == "loss" and algo.sums_over_global_tokens):
            out[key] = sum(values)
        elif _token_weighted(key) or key == "entropy":
            w = [p[1]["entropy" if key == "entropy" else "tokens"] for p in parts]
            out[key] = _weighted_mean(values, w)
        else:
            finite = [v for v in values if v is not None and math.isfinite(v)]
            out[key] = sum(finite) / len(finite) if len(finite) == len(values) else float("nan")
    lengths = torch.cat([p[2][0] for p in parts])
    truncated = torch.cat([p[2][1] for p in parts])
    total, per_fn = torch.cat([p[2][2] for p in parts]), torch.cat([p[2][3] for p in parts])
    width = int(lengths.max()) if len(lengths) else 0
    fake_mask = (torch.arange(max(width, 1))[None, :] < lengths[:, None]).long()
    out.update(completion_metrics(fake_mask, truncated))
    summary = reward_summary(total, config.rollout.group_size)
    out["reward"], out["reward_std"] = summary["reward"], summary["reward_std"]
    if not algo.dynamic_sampling:  # with it, the metric describes the groups seen before filtering (a mean)
        out["frac_reward_zero_std"] = summary["frac_reward_zero_std"]
    out.update(reward_metrics(specs, per_fn))
    return out


def _weighted_mean(values, weights) -> float:
    total = sum(weights)
    if not total:
        return sum(values) / len(values)
    return sum(v * w for v, w in zip(values, weights) if w) / total

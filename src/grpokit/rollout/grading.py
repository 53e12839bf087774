"""Grading a batch of sampled answers, and keeping only the groups that carry signal.

A `Draw` is one batch of rollouts with everything the rewards said about them (rollout/side.py draws it);
dynamic sampling (DAPO) filters draws to the groups whose rewards are not all
equal and joins several draws into one generation batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from grpokit.data.prompts import columns_of
from grpokit.rewards.core import as_trl_completions, compute_rewards
from grpokit.rollout.batch import Rollout, concat_rollouts
from grpokit.rollout.multiturn import ToolStats


@dataclass
class Draw:
    """One batch of sampled answers with their grades; rows group by group."""

    rollout: Rollout
    per_fn: torch.Tensor  # [N, F]
    total: torch.Tensor  # [N]
    prompts: list  # [N] the prompt of each answer (string or messages)
    texts: list[str]  # [N] decoded answers
    conversations: list | None = None  # [N] multi-turn: each answer as messages (assistant turns, tool results)
    # how it was drawn (the step's metrics read them; `select` and `join` keep the answers, not these)
    tool_stats: ToolStats | None = None  # multi-turn: what the tools did (an agent engine's: its agents)
    agent_metrics: dict = field(default_factory=dict)  # an agent engine's: failed agents, model calls, rewrites
    sample_s: float = 0.0  # seconds sampling
    grade_s: float = 0.0  # seconds grading

    @property
    def size(self) -> int:
        return len(self.total)

    def select(self, keep: torch.Tensor) -> "Draw":  # keep: [N] bool
        idx = keep.nonzero().flatten().tolist()
        rows = keep.to(self.rollout.completion_ids.device)
        parts = {f.name: getattr(self.rollout, f.name) for f in fields(Rollout)}
        rollout = Rollout(**{name: None if t is None else t[rows] for name, t in parts.items()})
        return Draw(rollout, self.per_fn[keep], self.total[keep], [self.prompts[i] for i in idx],
                    [self.texts[i] for i in idx],
                    None if self.conversations is None else [self.conversations[i] for i in idx])

    def with_signal(self, G: int) -> "Draw":
        """Only the groups whose rewards are not all equal (DAPO's dynamic sampling filter)."""
        grouped = torch.nan_to_num(self.total.view(-1, G), nan=0.0)  # [B, G]
        return self.select(((grouped.amax(-1) - grouped.amin(-1)) > 0).repeat_interleave(G))

    @staticmethod
    def join(draws: list["Draw"], n: int, pad_id: int, fallback: "Draw") -> "Draw":
        """The first `n` rows of several draws, padded to a common width; `fallback` if all are empty."""
        draws = [d for d in draws if d.size] or [fallback]
        both = concat_rollouts([d.rollout for d in draws], pad_id)
        joined = Draw(both, torch.cat([d.per_fn for d in draws]), torch.cat([d.total for d in draws]),
                      [p for d in draws for p in d.prompts], [t for d in draws for t in d.texts],
                      None if draws[0].conversations is None else [c for d in draws for c in d.conversations])
        return joined.select(torch.arange(joined.size) < n)


def grade(rollout: Rollout, rows: list[dict], tokenizer, specs, G: int, *, prompt_column: str = "prompt",
          conversations: list[list[dict]] | None = None, environments: list | None = None,
          log_metric=None, trainer_state=None) -> Draw:
    """Decode the answers and run every reward function on them (TRL's calling convention); the
    prompt is the rows' `prompt_column`, every other column goes to the reward functions. Multi-turn
    answers (`conversations`) reach the reward functions as their messages, and each answer's
    environment instance as the keyword `environments`, as in TRL. What the functions report through
    TRL's `log_metric(name, value)` goes to `log_metric`; `trainer_state` is TRL's keyword of that name."""
    ids = [row[m.bool()].tolist() for row, m in zip(rollout.completion_ids, rollout.completion_mask)]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    prompt_values = [r[prompt_column] for r in rows for _ in range(G)]
    completions = conversations if conversations is not None else as_trl_completions(prompt_values, texts)
    columns = columns_of(rows, repeat=G) | ({} if environments is None else {"environments": environments})
    per_fn, total = compute_rewards(specs, prompt_values, completions, ids, columns, log_metric=log_metric,
                                    trainer_state=trainer_state)
    return Draw(rollout, per_fn, total, prompt_values, texts, conversations)

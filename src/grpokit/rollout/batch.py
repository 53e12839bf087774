"""A `Rollout`: the tensors of one batch of sampled answers, whatever engine drew them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from grpokit.models.media import RowMedia


@dataclass(frozen=True)
class Turns:
    """The assistant turns of N multi-turn answers, for per-turn credit (algorithms/turn_advantages.py).
    Indexed by rows like a tensor (`turns[rows]`), so it is selected and joined with its answers."""

    token_turn: Tensor  # [N, T] long: the turn (0, 1, ...) of each sampled token; -1 on tool results and padding
    rewards: Tensor  # [N, K] float32: each turn's step reward; NaN where none was reported or there is no turn k
    states: Tensor  # [N, K] long: the state each turn started from as an id (equal ids, same state); -1 = none
    counts: Tensor  # [N] long: the answer's turns (1 .. K)

    def __getitem__(self, rows) -> "Turns":
        return Turns(self.token_turn[rows], self.rewards[rows], self.states[rows], self.counts[rows])

    @staticmethod
    def concat(parts: Sequence["Turns"], T: int) -> "Turns":
        """Rows of several in order; token_turn right-padded to T, the per-turn columns to the most turns."""
        K = max(p.rewards.shape[1] for p in parts)
        pad = torch.nn.functional.pad
        return Turns(torch.cat([pad(p.token_turn, (0, T - p.token_turn.shape[1]), value=-1) for p in parts]),
                     torch.cat([pad(p.rewards, (0, K - p.rewards.shape[1]), value=float("nan")) for p in parts]),
                     torch.cat([pad(p.states, (0, K - p.states.shape[1]), value=-1) for p in parts]),
                     torch.cat([p.counts for p in parts]))


@dataclass(frozen=True)
class Forks:
    """Where the answers of a rollout sampled with `tools.history = "split"` (rollout/history.py) go on as a new
    training row: the chat template's rendering of the conversation no longer continued the tokens sampled so far.
    Per answer, the completion positions where its rows 2, 3, ... begin and those rows' prompts (token ids, the
    conversation as the template rendered it there); an answer that never forked has none. Indexed by rows like a
    tensor, so it is selected and joined with its answers."""

    starts: tuple[tuple[int, ...], ...]  # [N] per answer: positions in its completion, increasing
    prompts: tuple[tuple[tuple[int, ...], ...], ...]  # [N] per answer: one prompt per start

    @property
    def any(self) -> bool:
        return any(self.starts)

    def __getitem__(self, rows) -> "Forks":
        if isinstance(rows, Tensor):
            rows = (rows.nonzero().flatten() if rows.dtype == torch.bool else rows.flatten()).tolist()
        elif isinstance(rows, slice):
            rows = range(len(self.starts))[rows]
        return Forks(tuple(self.starts[i] for i in rows), tuple(self.prompts[i] for i in rows))

    @staticmethod
    def concat(parts: Sequence["Forks | None"], sizes: Sequence[int]) -> "Forks":
        """Rows of several in order; a part without forks (None) holds `size` answers that never forked."""
        starts: list = []
        prompts: list = []
        for part, n in zip(parts, sizes):
            starts += part.starts if part is not None else [()] * n
            prompts += part.prompts if part is not None else [()] * n
        return Forks(tuple(starts), tuple(prompts))


@dataclass(frozen=True)
class Rollout:
    """G sampled completions per prompt; rows group by group (prompt b → rows b*G .. b*G+G-1)."""

    prompt_ids: Tensor  # [N, P] left-padded with pad_token_id
    prompt_mask: Tensor  # [N, P] 1 on real prompt tokens
    completion_ids: Tensor  # [N, T] right-padded with pad_token_id
    completion_mask: Tensor  # [N, T] 1 up to and including the EOS / stop token
    logprobs: Tensor  # [N, T] float32 log-probs under softmax(logits / T), 0 on padding
    truncated: Tensor  # [N] bool: no EOS / stop string within max_new_tokens
    tool_mask: Tensor | None = None  # [N, T] multi-turn only: 1 on tool-result tokens (context, not actions)
    turns: Turns | None = None  # multi-turn only: each token's turn, each turn's step reward and start state
    # [N] asynchronous rollout: the optimizer step of the weights that sampled each answer (its policy version)
    policy_version: Tensor | None = None
    # [N, T] long, in-flight weight updates and streaming groups: the policy version that sampled each completion
    # token (an answer may span versions: weights landed mid-answer, or it continued into a later step); -1 on
    # padding. `policy_version` is then each answer's oldest token's version (the lag bound holds for it)
    token_version: Tensor | None = None
    media: RowMedia | None = None  # [N] vision-language models: each answer's prompt images (models/media.py)
    forks: Forks | None = None  # tools.history = "split" only: where answers go on as new training rows

    @property
    def action_mask(self) -> Tensor:
        """[N, T] 1 on the tokens the policy sampled: the completion without tool results."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * (1 - self.tool_mask)

    @property
    def num_sequences(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def completion_lengths(self) -> Tensor:
        return self.completion_mask.sum(-1)  # [N]

    @property
    def sequence_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)  # [N, P+T]

    @property
    def sequence_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)  # [N, P+T]


def left_pad(prompts: list[list[int]], pad_token_id: int, device) -> tuple[Tensor, Tensor]:
    """Left-pad token lists into ids [B, P] and mask [B, P]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)  # [B, P]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, P]
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def rollout_from_tokens(prompt_ids: list[list[int]], completions: list[list[int]], logprobs: list[list[float]],
                        truncated: list[bool], *, group_size: int, pad_token_id: int,
                        device: torch.device | str = "cpu") -> Rollout:
    """A `Rollout` from B prompts and their N = B*G completions (lists of token ids, group by group)."""
    if len(completions) != len(prompt_ids) * group_size:
        raise ValueError(f"{len(prompt_ids)} prompts x {group_size} answers need {len(prompt_ids) * group_size} "
                         f"completions, got {len(completions)}")
    ids, mask = left_pad(prompt_ids, pad_token_id, device)  # [B, P]
    width = max(1, max(len(c) for c in completions))
    n = len(completions)
    comp = torch.full((n, width), pad_token_id, dtype=torch.long)  # [N, T]
    comp_mask = torch.zeros((n, width), dtype=torch.long)  # [N, T]
    logp = torch.zeros((n, width), dtype=torch.float32)  # [N, T]
    for i, (c, lp) in enumerate(zip(completions, logprobs)):
        comp[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        comp_mask[i, :len(c)] = 1
        logp[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return Rollout(prompt_ids=ids.repeat_interleave(group_size, 0), prompt_mask=mask.repeat_interleave(group_size, 0),
                   completion_ids=comp.to(device), completion_mask=comp_mask.to(device), logprobs=logp.to(device),
                   truncated=torch.tensor(truncated, dtype=torch.bool, device=device))


def concat_rollouts(rollouts: Sequence[Rollout], pad_token_id: int) -> Rollout:
    """Rows of several rollouts in order: prompts re-left-padded, completions re-right-padded."""
    P = max(r.prompt_ids.shape[1] for r in rollouts)
    T = max(r.completion_ids.shape[1] for r in rollouts)
    pad = torch.nn.functional.pad

    def cat(name: str, left: bool, width: int, fill) -> Tensor:
        parts = [getattr(r, name) if getattr(r, name) is not None else torch.zeros_like(r.completion_mask)
                 for r in rollouts]
        return torch.cat([pad(p, (width - p.shape[1], 0) if left else (0, width - p.shape[1]), value=fill)
                          for p in parts])

    return Rollout(prompt_ids=cat("prompt_ids", True, P, pad_token_id), prompt_mask=cat("prompt_mask", True, P, 0),
                   completion_ids=cat("completion_ids", False, T, pad_token_id),
                   completion_mask=cat("completion_mask", False, T, 0), logprobs=cat("logprobs", False, T, 0.0),
                   truncated=torch.cat([r.truncated for r in rollouts]),
                   tool_mask=None if all(r.tool_mask is None for r in rollouts) else
                   cat("tool_mask", False, T, 0),
                   turns=None if any(r.turns is None for r in rollouts) else
                   Turns.concat([r.turns for r in rollouts], T),
                   policy_version=None if any(r.policy_version is None for r in rollouts) else
                   torch.cat([r.policy_version for r in rollouts]),
                   token_version=None if any(r.token_version is None for r in rollouts) else
                   cat("token_version", False, T, -1),
                   media=RowMedia.concat([r.media for r in rollouts], [r.num_sequences for r in rollouts]),
                   forks=None if all(r.forks is None for r in rollouts) else
                   Forks.concat([r.forks for r in rollouts], [r.num_sequences for r in rollouts]))

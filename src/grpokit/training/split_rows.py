"""Training rows of answers whose conversation forked (`tools.history = "split"`, rollout/history.py).

    check_history_setup(config, toolbox, environments)          # start-up: what "split" cannot run with
    engine.history = conversation_history(...)                   # before sampling (rollout/history.py)
    batch, metrics = split_rows(batch, pad_token_id)             # after grading, advantages, per-turn credit
    batch = with_policy_version(batch, version)                  # async: a worker tags what it sends

Grading, advantages, dynamic sampling, per-turn credit and completions.jsonl all see *answers*: one
conversation each, its `Rollout` row holding its completion as one stream (every row's completion one after
another: the sampled tokens and the tool results appended within a row). Rewards are per conversation, so
the group structure is too. Only the update sees *training rows*; `split_rows` cuts each answer's stream at
its forks (`Rollout.forks`), once everything per answer is computed:

- row 1 of an answer: its prompt, and its completion up to and including the turn after which the chat
  template's rendering stopped continuing it;
- row k > 1: the prompt is the whole conversation as the template rendered it at the fork (the earlier turns
  rewritten, e.g. without their `<think>`, the last turn's tool results, the next assistant header), the
  completion the turns sampled from it (with the tool results appended while the template kept continuing).

So every sampled token is trained exactly once, in the row whose prompt is the context it was sampled from,
with its sampled log-prob (the update's recompute of that row gives the same numbers). Tool results rendered
into a later row's prompt are context there, as the prompt is. Each row carries its answer's advantage, or
with per-turn credit (`algorithm.turn_advantage`) each token its own turn's: both are sliced from the
answer's stream, so they land on the tokens they were computed for. The loss mask (tool results out, and
`mask_truncated_completions`: every row of a truncated answer) is sliced the same way.

Loss normalisation: rows are the update's samples, as TRL's AsyncGRPOTrainer (a forked row is one more
row), SkyRL and prime-rl (every turn its own sample) treat them. With the token-sum losses (`dapo`, the
default, and `cispo`: the sum over the batch's tokens divided by their count) a fork changes nothing: the
same tokens with the same advantages and the same count (TRL's argument for its forks). With the
per-sequence losses (`grpo`'s mean per sequence, `dr_grpo`'s division by the rows, GSPO's sequence ratio),
each row is a sequence, so an answer split in k rows weighs up to k times in that mean; `bnpo` sums over
each micro-batch, whose rows these are. Minibatches are drawn by answer (all the rows of an answer in the
same one), so the number of optimizer steps per batch stays what `train.minibatch_size` says.
"""

from __future__ import annotations

import dataclasses

import torch

from grpokit.config.schema import Config
from grpokit.errors import SetupError
from grpokit.models.parallel import world_size
from grpokit.rollout.batch import Rollout, Turns, left_pad


def check_history_setup(config: Config, toolbox, environments) -> None:
    """What `tools.history = "split"` cannot run with yet: one error line each, before any model loads."""
    if config.tools.history == "append":
        return
    where = 'tools.history = "split"'
    if toolbox is None and environments is None:
        raise SetupError(f"{where} renders multi-turn conversations, and this run has no tools or environment; give "
                         "it tools ([tools] functions / environment) or set tools.history = \"append\"")
    if world_size() > 1:
        raise SetupError(f"{where} runs in one process for now: with {world_size()} processes each would train a "
                         "different number of rows per step, and their collectives would fall out of step; run one "
                         "process or set tools.history = \"append\"")


def split_rows(batch, pad_token_id: int):
    """`batch` (a GenerationBatch) with the training rows of its answers when one forked ([R] rows: `rows`,
    `conversation`, and `loss_mask` / `token_advantages` per row), and the fork metrics. Unchanged (one row
    per answer) when none forked."""
    r = batch.draw.rollout
    if r.forks is None:
        return batch, {}
    metrics = _metrics(r)
    if not r.forks.any:
        return batch, metrics
    answers, starts, ends, prompts = _spans(r)
    device = r.completion_ids.device
    conv = torch.tensor(answers, dtype=torch.long, device=device)  # [R]
    start = torch.tensor(starts, dtype=torch.long, device=device)  # [R]
    length = torch.tensor(ends, dtype=torch.long, device=device) - start  # [R]
    T = max(1, int(length.max()))
    steps = torch.arange(T, device=device)[None, :]  # [1, T]
    valid = steps < length[:, None]  # [R, T]
    cols = (start[:, None] + steps).clamp(max=r.completion_ids.shape[1] - 1)  # [R, T] positions in the stream

    def take(t: torch.Tensor, fill) -> torch.Tensor:  # [N, Tc] per answer -> [R, T] per row
        return t[conv.to(t.device)].gather(1, cols.to(t.device)).masked_fill(~valid.to(t.device), fill)

    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, device)  # [R, P]
    turns = None if r.turns is None else Turns(take(r.turns.token_turn, -1), r.turns.rewards[conv],
                                               r.turns.states[conv], r.turns.counts[conv])
    rows = Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=take(r.completion_ids, pad_token_id),
                   completion_mask=take(r.completion_mask, 0), logprobs=take(r.logprobs, 0.0),
                   truncated=r.truncated[conv], tool_mask=None if r.tool_mask is None else take(r.tool_mask, 0),
                   turns=turns, policy_version=None if r.policy_version is None else r.policy_version[conv],
                   token_version=None if r.token_version is None else take(r.token_version, -1),
                   media=None if r.media is None else r.media[conv])
    token_advantages = None if batch.token_advantages is None else take(batch.token_advantages, 0.0)
    return dataclasses.replace(batch, rows=rows, conversation=conv, loss_mask=take(batch.loss_mask, 0),
                               token_advantages=token_advantages), metrics


def with_policy_version(batch, version: int | torch.Tensor):
    """`batch` (a GenerationBatch) tagged with the policy version that sampled it (asynchronous rollout: the
    worker, rollout_workers.py): every answer ([N], `draw.rollout`) and, when answers forked, every training row
    ([R], `rows`: its answer's). The trainer reads the lag from what it trains on (`batch.rollout`, the rows).
    `version`: one for the batch, or one per answer [N] (in-flight updates: each answer's oldest token's)."""
    answers = batch.draw.rollout
    versions = torch.as_tensor(version).expand(answers.num_sequences).clone()  # [N]
    batch = dataclasses.replace(batch, draw=dataclasses.replace(
        batch.draw, rollout=dataclasses.replace(answers, policy_version=versions)))
    if batch.rows is None:
        return batch
    return dataclasses.replace(batch, rows=dataclasses.replace(
        batch.rows, policy_version=versions[batch.conversation.cpu()]))  # [R]


def _spans(r: Rollout) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """Each training row's answer, start and end in that answer's completion, and prompt, answer by answer."""
    lengths = r.completion_mask.sum(-1).tolist()
    answers, starts, ends, prompts = [], [], [], []
    for i, (forks, fork_prompts) in enumerate(zip(r.forks.starts, r.forks.prompts)):
        bounds = [0, *forks, int(lengths[i])]
        row_prompts = [r.prompt_ids[i][r.prompt_mask[i].bool()].tolist(), *map(list, fork_prompts)]
        for k, prompt in enumerate(row_prompts):
            answers.append(i)
            starts.append(bounds[k])
            ends.append(bounds[k + 1])
            prompts.append(prompt)
    return answers, starts, ends, prompts


def _metrics(r: Rollout) -> dict:
    """`tools/rows_per_answer` (1 = no answer forked) and `tools/fork_frac` (the share of tool rounds, turns
    after the first, at which the template's rendering did not continue the row: TRL's rollout/fork_frac)."""
    forks = sum(len(s) for s in r.forks.starts)
    out = {"tools/rows_per_answer": (len(r.forks.starts) + forks) / max(1, len(r.forks.starts))}
    if r.turns is not None:
        rounds = int((r.turns.counts - 1).clamp(min=0).sum())
        out["tools/fork_frac"] = forks / rounds if rounds else 0.0
    return out

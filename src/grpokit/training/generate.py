"""One step's data: rollout -> grade (rollout/side.py) -> (dynamic sampling) -> group-relative advantages.

The result is a `GenerationBatch`: the graded answers, their advantages and the loss mask;
the update (update.py) adds the old / reference log-probs it needs as a new record. With
`tools.history = "split"` an answer whose conversation forked trains as several rows (split_rows.py):
everything here is per answer, the rows are cut last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpokit.algorithms.advantages import decoupled_advantages, group_advantages
from grpokit.config.schema import Config
from grpokit.models.parallel import all_ranks
from grpokit.observe.metrics import completion_metrics, reward_summary, tool_metrics
from grpokit.rewards.core import reward_metrics
from grpokit.rollout.batch import Rollout
from grpokit.rollout.grading import Draw
from grpokit.rollout.side import RolloutSide
from grpokit.training.split_rows import split_rows
from grpokit.training.turn_credit import turn_credit


@dataclass(frozen=True)
class GenerationBatch:
    """One step's sampled, graded answers, N = B * G, group by group; the update trains on `rollout`'s R rows:
    the answers themselves (R = N), or with answers that forked (tools.history = "split") their training rows."""

    draw: Draw  # rollout (ids, masks, sampling logprobs, truncation), rewards [N] and [N, F], texts
    advantages: torch.Tensor  # [N]
    loss_mask: torch.Tensor  # [N, T] completion mask, truncated answers zeroed if asked
    old_logp: torch.Tensor | None = None  # [N, T] only when μ > 1 or several minibatches
    ref_logp: torch.Tensor | None = None  # [N, T] only when β > 0
    is_weight: torch.Tensor | None = None  # [N, T] or [N, 1], only with algorithm.is_correction (sampler != trainer)
    token_advantages: torch.Tensor | None = None  # [N, T] only with algorithm.turn_advantage: each turn's own
    # tools.history = "split", when an answer forked: the training rows (loss_mask, token_advantages and the
    # log-probs the update adds are then [R, T], one per row) and the answer of each row [R] (split_rows.py)
    rows: Rollout | None = None
    conversation: torch.Tensor | None = None

    def loss_advantages(self, rows: torch.Tensor, T: int) -> torch.Tensor:
        """What the loss applies to `rows` (training rows): their answer's advantage [n], or per token [n, T]."""
        return self.row_advantages[rows] if self.token_advantages is None else self.token_advantages[rows, :T]

    @property
    def rollout(self) -> Rollout:
        """What the update trains on: the answers, or the training rows of answers that forked."""
        return self.draw.rollout if self.rows is None else self.rows

    @property
    def num_rows(self) -> int:
        return self.rollout.num_sequences

    @property
    def row_advantages(self) -> torch.Tensor:
        """[R] each training row's answer-level advantage."""
        return self.advantages if self.conversation is None else self.advantages[self.conversation]

    def rows_of(self, answers: torch.Tensor) -> torch.Tensor:
        """The training rows of `answers` (indices into `draw`), answer by answer: an update's minibatch of
        answers takes all their rows."""
        if self.conversation is None:
            return answers
        return (answers.cpu()[:, None] == self.conversation.cpu()[None, :]).nonzero()[:, 1]


def reward_trainer_state(config: Config, step: int, stream):
    """TRL's `trainer_state` keyword of the reward functions before step `step` (1-based) draws: a transformers
    `TrainerState` counted as TRL counts it, in optimizer steps (`num_iterations` x minibatches per generation
    batch; with grpokit's defaults one per step): `global_step` those done, `max_steps` the run's, `epoch` the
    prompts used so far / the rows (from the prompt stream's position)."""
    from transformers import TrainerState

    from grpokit.models.parallel import rank

    per_step = config.algorithm.num_iterations * (config.generation_batch_size // config.minibatch_size)
    position = stream.state_dict() if hasattr(stream, "state_dict") else {}
    rows = position.get("num_rows") or 0
    epoch = position.get("epoch", 0) + position.get("index", 0) / rows if rows else 0.0
    total_rows = config.train.steps * config.train.prompts_per_step
    return TrainerState(epoch=epoch, global_step=(step - 1) * per_step, max_steps=config.train.steps * per_step,
                        logging_steps=per_step, num_train_epochs=math.ceil(total_rows / rows) if rows else 0,
                        is_world_process_zero=rank() == 0)


def generate_and_grade(config: Config, side: RolloutSide, stream, sampling_generator: torch.Generator,
                       step: int | None = None) -> tuple[GenerationBatch, dict]:
    """Draw G graded answers for B prompts (`side`, rollout/side.py); with dynamic sampling, keep drawing
    prompt batches (up to `max_resample_rounds` more) until B groups carry signal. `step` (the loop's, 1-based)
    gives the reward functions TRL's `trainer_state` (None without it)."""
    G, B, algo, specs = config.rollout.group_size, config.train.prompts_per_step, config.algorithm, side.specs
    state = reward_trainer_state(config, step, stream) if step is not None else None
    draws: list[Draw] = []
    logged: dict[str, list[float]] = {}  # what reward functions report (TRL's log_metric): averaged over draws
    for _ in range(1 + (algo.max_resample_rounds if algo.dynamic_sampling else 0)):
        draws.append(side.draw(stream.next_batch(), generator=sampling_generator,  # B row indices
                               log_metric=lambda name, value: logged.setdefault(name, []).append(float(value)),
                               trainer_state=state))
        # several processes: every one draws as often as the one that needs most (streams stay in step)
        if not algo.dynamic_sampling or all_ranks(sum(d.with_signal(G).size for d in draws) >= B * G):
            break
    tool_stats = [d.tool_stats for d in draws if d.tool_stats is not None]  # multi-turn: what the tools did
    seen = reward_summary(torch.cat([d.total for d in draws]), G)  # before any filtering
    draw = draws[0] if not algo.dynamic_sampling else Draw.join([d.with_signal(G) for d in draws], B * G,
                                                                 side.sampling.pad_token_id, fallback=draws[-1])
    rollout = draw.rollout
    if config.rewards.aggregation == "normalize_then_sum":  # GDPO: each function normalized in its group first
        advantages = decoupled_advantages(draw.per_fn, [s.weight for s in specs], G, std=algo.std)
    else:  # from the weighted total [N], the reward that dynamic sampling and the metrics see
        advantages = group_advantages(draw.total, G, scale_rewards=algo.scale_rewards, std=algo.std,
                                      estimator=algo.advantage_estimator)
    loss_mask = rollout.action_mask.clone()  # tool results (multi-turn) are context: never in the loss
    if algo.mask_truncated_completions:  # truncated answers carry no gradient
        loss_mask[rollout.truncated] = 0
    metrics = {**reward_summary(draw.total, G), **reward_metrics(specs, draw.per_fn),
               **completion_metrics(rollout.action_mask, rollout.truncated),
               "time/rollout": sum(d.sample_s for d in draws), "time/reward": sum(d.grade_s for d in draws),
               **(tool_metrics(tool_stats) if tool_stats else {}),
               **{name: sum(values) / len(values) for name, values in logged.items()},
               **draws[-1].agent_metrics}  # an agent engine's: failed agents, model calls, rewrites
    if algo.dynamic_sampling:  # what the filter saw before it dropped groups
        metrics["frac_reward_zero_std"] = seen["frac_reward_zero_std"]
        metrics["dynamic_sampling/groups_kept"] = draw.size / G
        metrics["dynamic_sampling/draws"] = len(draws)
    token_advantages = None
    if algo.turn_advantage != "none":  # per-turn credit: each turn's tokens get that turn's advantage [N, T]
        token_advantages, turn_metrics = turn_credit(algo, rollout, draw.total, advantages, G)
        metrics.update(turn_metrics)
    batch, split_metrics = split_rows(GenerationBatch(draw, advantages, loss_mask, token_advantages=token_advantages),
                                      side.sampling.pad_token_id)  # answers that forked: their training rows, cut last
    return batch, {**metrics, **split_metrics}

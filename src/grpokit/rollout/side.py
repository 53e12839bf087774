"""The rollout side: one object that samples and grades groups of answers, for every part of grpokit.

    side = RolloutSide(prompts, specs, engine, tokenizer, sampling, group_size=G, environments=..., ...)
    draw = side.draw(indices, generator=g)     # B prompt indices -> N = B*G graded answers (a Draw)

The training step (training/generate.py), the evaluation during training and `grpokit eval`
(training/evaluation.py), the TRL drop-in's `evaluate()` (trl/evaluation.py) and the asynchronous rollout
workers (training/rollout_workers.py) all draw through it; what differs between them is what it is built
from (which prompts, which engine, which answer budget and temperature), never how it draws. For each batch:
the request carries the batch's rows (an agent engine runs each answer's agent on its row), each answer's
environment is reset with its row and its tools handed to the engine, `tools.history = "split"` renders each
answer's conversation, the prompts' images are selected, the engine samples, and every reward function
grades the answers (rollout/grading.py). The engine is reached through `RolloutEngine` only (engines.py).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from grpokit.config.schema import Config
from grpokit.rewards.core import RewardSpec
from grpokit.rollout.engine_protocol import RolloutEngine
from grpokit.rollout.environments import Environments
from grpokit.rollout.grading import Draw, grade
from grpokit.rollout.history import conversation_history
from grpokit.rollout.request import RolloutRequest, SamplingParams


@dataclass
class PromptTable:
    """The prompts a side draws from: rows and their tokenized prompts, checked against the context."""

    rows: list[dict]
    ids: list[list[int]]  # the tokenized prompt of each row
    eos_token_ids: list[int]
    media: object = None  # image rows: training.vision_setup.PromptMedia or models.media.RowMedia (`select`)


@dataclass(frozen=True)
class RolloutSide:
    """Draws and grades groups of `group_size` answers to `prompts`' rows (see the module docstring)."""

    prompts: PromptTable
    specs: Sequence[RewardSpec]  # every reward function, an environment's own included
    engine: RolloutEngine
    tokenizer: object
    sampling: SamplingParams
    group_size: int
    environments: Environments | None = None  # one instance per answer, reset with its row
    split_history: bool = False  # tools.history = "split": each turn sampled from the rendered conversation
    budget_field: str = "rollout.max_new_tokens"  # what an environment's too-long prompt names
    prompt_column: str = "prompt"  # the rows' column the reward functions receive as `prompts`

    @classmethod
    def for_training(cls, config: Config, prompts: PromptTable, specs: Sequence[RewardSpec], engine: RolloutEngine,
                     tokenizer, environments: Environments | None = None) -> "RolloutSide":
        """The training step's side: `rollout.*`'s sampling and group size, `tools.history`."""
        return cls(prompts, specs, engine, tokenizer,
                   SamplingParams.from_config(config, prompts.eos_token_ids, tokenizer.pad_token_id),
                   config.rollout.group_size, environments, config.tools.history == "split")

    def draw(self, indices: Sequence[int], *, generator: torch.Generator | None,
             log_metric: Callable[[str, float], None] | None = None, trainer_state=None) -> Draw:
        """Sample `group_size` answers to each of the rows `indices` (B of them) and grade them: N = B*G
        answers, group by group. What the reward functions report (TRL's `log_metric`) goes to `log_metric`;
        `trainer_state` is what they receive as TRL's `trainer_state`."""
        G, rows = self.group_size, [self.prompts.rows[i] for i in indices]
        ids, group, tools = [self.prompts.ids[i] for i in indices], G, self.engine.tools
        if self.environments is not None:  # each answer's own instance: the engine calls its methods
            ids, group, tools = self.environments.prompts(self.tokenizer, rows, ids, G, self.sampling.max_new_tokens,
                                                          self.budget_field)
        history = conversation_history(self.tokenizer, rows, G, tools, self.environments) \
            if self.split_history else None
        media = None if self.prompts.media is None else self.prompts.media.select(list(indices))
        request = RolloutRequest(ids, group, self.sampling, generator, rows, tools, history, media)
        t0 = time.perf_counter()
        result = self.engine.generate(request)
        t1 = time.perf_counter()
        stats = result.tool_stats
        draw = grade(result.rollout, rows, self.tokenizer, self.specs, G, prompt_column=self.prompt_column,
                     conversations=None if stats is None else stats.conversations,
                     environments=None if self.environments is None else self.environments.active,
                     log_metric=log_metric, trainer_state=trainer_state)
        return dataclasses.replace(draw, tool_stats=stats, agent_metrics=dict(result.agent_metrics),
                                   sample_s=t1 - t0, grade_s=time.perf_counter() - t1)

    def batches(self, batch_prompts: int) -> list[list[int]]:
        """Every row's index, in batches of at most `batch_prompts` rows (an evaluation's passes)."""
        n = len(self.prompts.rows)
        return [list(range(start, min(start + batch_prompts, n))) for start in range(0, n, batch_prompts)]

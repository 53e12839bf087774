"""What an engine is asked for and what it gives back: one request in, one result out.

    result = engine.generate(RolloutRequest(prompt_ids, group_size=G, sampling=SamplingParams(...), generator=g))
    result.rollout            # N = B*G answers, group by group, with the sampler's own log-probs of its tokens
    result.tool_stats         # multi-turn: what the tools (or an agent engine's agents) did; None without tools

The request carries everything about one batch (the prompts, the group size, the sampling settings as one
object, the batch's tools or environments' boxes, the split conversation history, the prompts' images, the
noise), so an engine keeps no per-batch state: two batches can be in one engine at once, and a new engine
needs nothing reset. The result carries everything that came back, the weight version that sampled it
included (tinker-cookbook's `Trajectory` is the model: a rollout returns values, never leaves them on the
engine). Both are plain frozen dataclasses, torch-only, so every layer may import them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from grpokit.rollout.batch import Rollout

if TYPE_CHECKING:  # imported for the annotations only: these modules import this one
    from grpokit.models.media import RowMedia
    from grpokit.rollout.history import ConversationHistory
    from grpokit.rollout.multiturn import ToolStats
    from grpokit.rollout.tools import ToolBox


@dataclass(frozen=True)
class SamplingParams:
    """How each answer is sampled (`rollout.*`, or an evaluation's own budget and temperature)."""

    max_new_tokens: int
    eos_token_ids: tuple = ()
    pad_token_id: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_strings: tuple = ()
    ignore_eos: bool = False

    @classmethod
    def from_config(cls, config, eos_token_ids: Sequence[int], pad_token_id: int) -> "SamplingParams":
        r = config.rollout
        return cls(r.max_new_tokens, tuple(eos_token_ids), pad_token_id, r.temperature, r.top_p, r.top_k,
                   tuple(r.stop_strings), r.ignore_eos)


@dataclass(frozen=True)
class RolloutRequest:
    """One batch to sample: `group_size` answers to each of the B prompts in `prompt_ids`."""

    prompt_ids: list[list[int]]  # [B] token ids of each prompt
    group_size: int  # G answers per prompt: N = B*G
    sampling: SamplingParams
    generator: torch.Generator | None = None  # the trainer's noise (a vLLM engine draws its seed from it)
    rows: list[dict] | None = None  # [B] the prompts' dataset rows (an agent engine runs each answer's agent on one)
    # multi-turn: the batch's tool box, or one per answer (N, group by group: environments' own methods)
    tools: "ToolBox | Sequence[ToolBox] | None" = None
    history: "ConversationHistory | None" = None  # tools.history = "split": each answer's rendered conversation
    media: "RowMedia | None" = None  # [B] a vision-language model's prompt images (models/media.py)

    @property
    def num_answers(self) -> int:
        return len(self.prompt_ids) * self.group_size

    @property
    def device(self) -> torch.device | str:
        """Where the rollout's tensors go when the engine has no device of its own: the generator's."""
        return self.generator.device if self.generator is not None else "cpu"

    def seed(self) -> int | None:
        """A seed drawn from the request's generator (engines that seed their own sampler: vLLM); None without."""
        if self.generator is None:
            return None
        return int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator, device=self.generator.device).item())


@dataclass(frozen=True)
class RolloutResult:
    """Everything one request gave back."""

    rollout: Rollout  # [N] answers with the sampler's per-token log-probs
    tool_stats: "ToolStats | None" = None  # multi-turn: what the tools did (an agent engine's: its agents)
    agent_metrics: dict[str, float] = field(default_factory=dict)  # an agent engine's: failed agents, calls, rewrites
    failures: list[str | None] | None = None  # [N] an agent engine's: why each answer's agent failed, None if not
    weight_version: int | None = None  # the trainer step whose weights sampled it, where the engine knows it

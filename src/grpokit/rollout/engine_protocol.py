"""The engine protocol: everything the rest of grpokit asks of a rollout engine, and its defaults.

    rollout = engine.generate(prompt_ids, group_size=G, sampling=SamplingParams(...), generator=g)
    engine.sync_weights(model)        # after every optimizer step: the sampler now holds the trainer's weights

The rollout side (side.py) sets the per-batch fields (`rows`, `tools` with environments, `history`) before
`generate` and reads what it left (`tool_stats`, `agent_metrics`); the loop syncs and stops the engine. Nothing
reaches an engine another way: every engine class (engines.py, vllm.py, vllm_server.py, agent_engine.py)
derives from `EngineBase`, and an engine handed to `train(engine=...)` with only the two documented methods is
wrapped in `PlainEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from grpokit.errors import SetupError
from grpokit.rollout.batch import Rollout
from grpokit.rollout.request import RolloutRequest, RolloutResult, SamplingParams  # noqa: F401 - re-exported
from grpokit.rollout.multiturn import ToolStats
from grpokit.rollout.tools import ToolBox


class RolloutEngine(Protocol):
    """Everything the rest of grpokit asks of an engine (the rollout side, rollout/side.py, sets and reads the
    per-batch fields; the loop syncs and stops it). `EngineBase` gives each a default; an engine handed to
    `train(engine=...)` that has only `generate` and `sync_weights` is wrapped in `PlainEngine`."""

    tools: ToolBox | None  # multi-turn rollouts: the tools (environments: each answer's box, set per batch)
    history: object  # tools.history = "split": this batch's ConversationHistory (rollout/history.py), else None
    rows: list[dict] | None  # this batch's rows (an agent engine runs each answer's agent on its row)
    tool_stats: ToolStats | None  # what the tools did in the last batch (None: no tools)
    agent_metrics: dict[str, float]  # an agent engine's: failed agents, model calls, rewrites
    adapter_prefix: str  # a vLLM server with LoRA: the names the trainer's engine loads adapters under

    @property
    def device(self) -> torch.device | str: ...  # where the rollouts' tensors live

    def generate(self, prompt_ids: list[list[int]], *, group_size: int, sampling: SamplingParams,
                 generator: torch.Generator | None = None, media=None) -> Rollout: ...

    def sync_weights(self, model) -> None: ...

    def stop_serving(self) -> None: ...  # the run ended: what the engine started stops (folders, endpoints)


class EngineBase:
    """The defaults of `RolloutEngine`'s fields: no tools, no per-batch state, nothing to stop."""

    tools: ToolBox | None = None
    history = None
    rows: list[dict] | None = None
    tool_stats: ToolStats | None = None
    agent_metrics: dict[str, float] = {}
    adapter_prefix: str = ""

    @property
    def device(self) -> torch.device | str:
        return "cpu"

    def sync_weights(self, model) -> None:
        """Nothing to do (an engine sampling on the training model itself)."""

    def stop_serving(self) -> None:
        """Nothing started, nothing to stop."""


class PlainEngine(EngineBase):
    """An engine handed to `train(engine=...)` with only the documented two methods (`generate`, `sync_weights`):
    the rest of the protocol at its defaults. It runs no tools and takes no images."""

    def __init__(self, inner):
        self.inner = inner

    def generate(self, prompt_ids, *, group_size, sampling, generator=None, media=None) -> Rollout:
        if media is not None:
            raise SetupError(f"train(engine=...): {type(self.inner).__name__} is given the prompts' images, and an "
                             "engine of the caller's takes none; subclass HFEngine, or drop the images")
        return self.inner.generate(prompt_ids, group_size=group_size, sampling=sampling, generator=generator)

    def sync_weights(self, model) -> None:
        self.inner.sync_weights(model)


def given_engine(engine, tools: ToolBox | None) -> RolloutEngine:
    """The engine `train(engine=...)` built: a grpokit engine (a subclass of HFEngine, VLLMEngine or EngineBase)
    as it is, with the run's `tools` if it has none of its own; anything else with `generate` and `sync_weights`
    wrapped (`PlainEngine`), which cannot run tools."""
    if not isinstance(engine, EngineBase):
        if tools is not None:
            raise SetupError(f"train(engine=...): {type(engine).__name__} is not a grpokit engine, so it cannot run "
                             "the run's tools (the prompts list them); subclass HFEngine (or EngineBase)")
        return PlainEngine(engine)
    if engine.tools is None:
        engine.tools = tools
    return engine

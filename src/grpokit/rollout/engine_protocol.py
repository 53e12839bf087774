"""The engine protocol: everything the rest of grpokit asks of a rollout engine, and its defaults.

    result = engine.generate(RolloutRequest(prompt_ids, group_size=G, sampling=SamplingParams(...), generator=g))
    engine.stop_serving()             # the run ended: what the engine started stops

An engine holds no per-batch state: the request (rollout/request.py) carries the batch's rows, tools or
environments' boxes, split history and images, and the result carries what came back (the rollout, the tools'
and agents' statistics, the weight version). How the trainer's weights reach an engine is not the engine's job:
one publisher per run (models/weight_sync.py `WeightPublisher.publish(model, step)`, chosen by
`rollout.weights.build_publisher`) moves them; the engine samples with whatever its sampler holds.

Every engine class (engines.py, vllm/, agent_engine.py) derives from `EngineBase`. An engine handed to
`train(engine=...)` that is not one is wrapped in `PlainEngine`: `generate(request)` and, for a sampler that
holds weights of its own, `sync_weights(model)` (the run's publisher calls it after every update).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Protocol

import torch

from grpokit.errors import SetupError
from grpokit.rollout.batch import Rollout
from grpokit.rollout.request import RolloutRequest, RolloutResult, SamplingParams  # noqa: F401 - re-exported
from grpokit.rollout.tools import ToolBox


class RolloutEngine(Protocol):
    """Everything the rest of grpokit asks of an engine: a request in, a result out; where its tensors live; and
    a stop for what it started. `EngineBase` gives the defaults."""

    @property
    def device(self) -> torch.device | str: ...  # where the rollouts' tensors live

    def generate(self, request: RolloutRequest) -> RolloutResult: ...

    def stop_serving(self) -> None: ...  # the run ended: what the engine started stops (endpoints)


class EngineBase:
    """The defaults of `RolloutEngine`: tensors on the CPU, no tools of its own, nothing to stop.

    `tools` is the engine's own tool box, when it was built with one (the run's tools); a request's own tools
    (environments: each answer's box) take its place for that batch."""

    tools: ToolBox | None = None

    @property
    def device(self) -> torch.device | str:
        return "cpu"

    def stop_serving(self) -> None:
        """Nothing started, nothing to stop."""


def accepts_earlier_spelling(generate):
    """`engine.generate(prompt_ids, *, group_size, sampling, generator=None, media=None) -> Rollout`, the spelling
    before the request, still works on grpokit's own engines: warned, built into a request, answered with the
    result's rollout (as it was). `inspect.signature` shows the new spelling."""

    @functools.wraps(generate)
    def call(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], RolloutRequest):
            return generate(self, args[0])
        warnings.warn(f"{type(self).__name__}.generate(prompt_ids, *, group_size, sampling, ...) is the old "
                      "spelling; pass one request: generate(RolloutRequest(prompt_ids, group_size, sampling, "
                      "generator)) (grpokit.rollout.request), which returns a RolloutResult", DeprecationWarning,
                      stacklevel=2)
        prompt_ids = args[0] if args else kwargs.pop("prompt_ids")
        media = kwargs.pop("media", None)
        return generate(self, RolloutRequest(prompt_ids, media=media, **kwargs)).rollout

    return call


def _takes_request(generate) -> bool:
    """Whether `generate` takes the request whole (one positional parameter) rather than the old spelling
    `generate(prompt_ids, *, group_size, sampling, generator=None)`."""
    try:
        parameters = inspect.signature(generate).parameters
    except (TypeError, ValueError):  # a builtin or C callable: assume the current spelling
        return True
    return "group_size" not in parameters and "sampling" not in parameters


class PlainEngine(EngineBase):
    """An engine handed to `train(engine=...)` that is not a grpokit engine: `generate(request)` returning a
    `RolloutResult` or a `Rollout` (its tools and images are not its business: it runs none), and
    `sync_weights(model)` if its sampler holds weights of its own. The spelling of earlier releases,
    `generate(prompt_ids, *, group_size, sampling, generator=None)`, still works, with a warning."""

    def __init__(self, inner):
        self.inner = inner
        self.old_spelling = callable(getattr(inner, "generate", None)) and not _takes_request(inner.generate)
        if self.old_spelling:
            warnings.warn(f"train(engine=...): {type(inner).__name__}.generate(prompt_ids, *, group_size, sampling, "
                          "generator) is the old spelling; take one grpokit.rollout.request.RolloutRequest and "
                          "return a RolloutResult (or a Rollout): generate(self, request)", DeprecationWarning,
                          stacklevel=3)

    def generate(self, request: RolloutRequest) -> RolloutResult:
        if request.media is not None:
            raise SetupError(f"train(engine=...): {type(self.inner).__name__} is given the prompts' images, and an "
                             "engine of the caller's takes none; subclass HFEngine, or drop the images")
        if self.old_spelling:
            out = self.inner.generate(request.prompt_ids, group_size=request.group_size, sampling=request.sampling,
                                      generator=request.generator)
        else:
            out = self.inner.generate(request)
        return RolloutResult(out) if isinstance(out, Rollout) else out


def given_engine(engine, tools: ToolBox | None) -> RolloutEngine:
    """The engine `train(engine=...)` built: a grpokit engine (a subclass of HFEngine, VLLMEngine or EngineBase)
    as it is, with the run's `tools` if it has none of its own; anything else with `generate` wrapped
    (`PlainEngine`), which cannot run tools."""
    if not isinstance(engine, EngineBase):
        if tools is not None:
            raise SetupError(f"train(engine=...): {type(engine).__name__} is not a grpokit engine, so it cannot run "
                             "the run's tools (the prompts list them); subclass HFEngine (or EngineBase)")
        return PlainEngine(engine)
    if not _takes_request(engine.generate):
        raise SetupError(f"train(engine=...): {type(engine).__name__}.generate takes (prompt_ids, *, group_size, "
                         "sampling, ...), the spelling of earlier releases; a grpokit engine now takes the batch as "
                         "one request and returns a result: def generate(self, request: RolloutRequest) -> "
                         "RolloutResult (grpokit.rollout.request), with the tools, history and rows in the request")
    if engine.tools is None:
        engine.tools = tools
    return engine

"""The run's weight publisher: how the trainer's weights reach the engine's sampler, chosen once per run.

    weights = build_publisher(config, engine)
    weights.publish(model, step)        # the start's push (step 0, or the resumed one), then after every update

The interface and the transports of grpokit's own are models/weight_sync.py; vLLM's are rollout/vllm/weights.py.
The rollout source (training/rollout_source.py) publishes through it, in sync and async mode alike.
"""

from __future__ import annotations

from grpokit.errors import SetupError
from grpokit.models.weight_sync import CallersEngine, SharedModel, WeightPublisher
from grpokit.rollout.agent_engine import AgentEngine
from grpokit.rollout.engine_protocol import PlainEngine, RolloutEngine
from grpokit.rollout.vllm.engine import VLLMEngine


def build_publisher(config, engine: RolloutEngine) -> WeightPublisher:
    """How the trainer's weights reach `engine`'s sampler, chosen once per run (models/weight_sync.py): nothing
    to move for the built-in sampler on the training model; one of vllm/weights.py's transports for a vLLM
    engine; the `sync_weights(model)` of an engine of the caller's (a subclass of HFEngine or EngineBase too). An
    agent engine's is that of the engine it samples with."""
    inner = engine.inner if isinstance(engine, AgentEngine) else engine  # an agent's calls: the run's own engine
    if isinstance(inner, PlainEngine):
        return CallersEngine(inner.inner)
    if callable(getattr(inner, "sync_weights", None)):  # a subclass of a grpokit engine that moves them itself
        if isinstance(inner, VLLMEngine):
            raise SetupError(f"train(engine=...): {type(inner).__name__}.sync_weights: a vLLM engine's weights move "
                             "through the run's publisher (grpokit.rollout.vllm.weights), chosen from rollout.vllm; "
                             "remove sync_weights, or wrap a VLLMEngine in an engine of your own that has it")
        return CallersEngine(inner)
    if isinstance(inner, VLLMEngine):  # (the vllm package imports vLLM only when an engine starts)
        from grpokit.rollout.vllm.weights import vllm_publisher

        return vllm_publisher(config, inner)
    return SharedModel()

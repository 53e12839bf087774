"""vLLM as grpokit's sampler (`rollout.engine = "vllm"`, extra `grpokit[vllm]`), in one package.

- `engine`: `VLLMEngine`, the sampling both backends share (a request in, a result out).
- `colocated`: `ColocatedLLM`, a `vllm.LLM` in the training process (its sleep mode, its LoRA requests).
- `server`: `ServerClient` / `ServerLLM`, a vLLM server over HTTP (`grpokit serve`), and the start's probe.
- `servers`: `ServerPool`, several servers as one backend (requests spread by load).
- `weights`: the transports of the trainer's weights (in-process reload, a folder, NCCL, LoRA adapter folders),
  chosen once by `vllm_publisher`, and the async rollout's locked publisher and subscriber.
- `checks`: what vLLM (its CPU build above all) cannot do here, said before the model loads.

Nothing here imports vLLM until an engine is started: the modules load anywhere.
"""

from __future__ import annotations

from grpokit.models.parallel import rank
from grpokit.rollout.tools import ToolBox
from grpokit.rollout.vllm.checks import INSTALL, check_vllm_can_run, on_cpu
from grpokit.rollout.vllm.engine import VLLMEngine

__all__ = ["INSTALL", "VLLMEngine", "check_vllm_can_run", "on_cpu", "vllm_engine"]

# names the module grpokit.rollout.vllm had before it became this package: found where they went, with a warning
_MOVED = {"head_size": "checks", "cpu_head_size_problem": "checks", "model_max_length": "checks",
          "transformers_fallback": "checks", "cpu_head_sizes": "checks", "CPU_HEAD_SIZES": "checks",
          "cpu_scheduler": "checks", "VLLM_LORA_RANKS": "colocated"}


def __getattr__(name):
    if name not in _MOVED:
        raise AttributeError(f"module 'grpokit.rollout.vllm' has no attribute {name!r}")
    import importlib
    import warnings

    home = f"grpokit.rollout.vllm.{_MOVED[name]}"
    warnings.warn(f"grpokit.rollout.vllm.{name} moved to {home}; import it from there", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module(home), name)


def vllm_engine(config, tokenizer, *, tools: ToolBox | None = None) -> VLLMEngine:
    """The vLLM engine `rollout.vllm` describes, for this process: a server's (`rollout.vllm.server`) or a
    colocated one on `model.path` (under torchrun each rank its own, seeded apart)."""
    options = config.rollout.vllm_options
    if options.server is not None:  # one server or several (vllm/servers.py spreads the requests)
        from grpokit.rollout.vllm.servers import connect_servers

        backend = connect_servers(options)
    else:
        from grpokit.rollout.vllm.colocated import ColocatedLLM

        backend = ColocatedLLM.start(config.model.path, options, dtype=config.model.dtype,
                                     seed=config.train.seed + rank(), lora=config.model.lora or None)
    return VLLMEngine(backend, tokenizer=tokenizer, tools=tools, max_tool_turns=config.tools.max_calls)

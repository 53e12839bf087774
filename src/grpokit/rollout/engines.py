"""Rollout engines: what samples the answers, behind one interface; and how the trainer's weights reach them.

    result = engine.generate(RolloutRequest(prompt_ids, group_size=G, sampling=SamplingParams(...), generator=g))
    weights = build_publisher(config, engine)      # rollout/weights.py, once per run: the transport to its sampler
    weights.publish(model, step)                    # after every optimizer step: the sampler holds step's weights

`generate` returns a `RolloutResult` whose `Rollout` has N = B*G rows, group by group, with the sampler's own
log-probs of the tokens it drew; the trainer never looks behind it. The interface (`RolloutEngine`, the
defaults `EngineBase`) is engine_protocol.py, the request and result request.py; the engines are here and in
the vllm/ package.

- `HFEngine` [`rollout.engine = "hf"`]: the built-in sampler (`rollout.sample_groups`) on the training
  model itself. Nothing to publish, and its log-probs are the trainer's (ratio exactly 1 on-policy).
- `VLLMEngine` [`rollout.engine = "vllm"`, extra `grpokit[vllm]`]: a colocated `vllm.LLM` in the training
  process (vllm/colocated.py), or a vLLM server over HTTP (vllm/server.py), behind one engine (vllm/engine.py).
  The weights move through one of vllm/weights.py's transports (an in-process reload, a folder the server
  reloads, NCCL to a server, LoRA adapter folders). Each `generate` passes a seed drawn from the trainer's
  generator, so `--resume` replays the same sampling seeds.
- The sampler and the trainer compute log-probs with different kernels (and vLLM often in bf16), so
  even on-policy their ratio is not exactly 1. `algorithm.is_correction` weights each token's (or
  answer's) loss by `exp(logp_trainer - logp_sampler)`, truncated or masked to [is_cap_min, is_cap_max]
  (TIS, Yao et al. 2025, and TRL's other modes; algorithms/mismatch.py), with `logp_trainer` the
  trainer's log-probs of the sampled tokens before the update (a no-grad pass, as TRL). vLLM runs with
  `logprobs_mode="processed_logprobs"` so that its log-probs include the temperature; with top-k/top-p
  they are those of the filtered distribution while the trainer's are unfiltered (as in TRL).
"""

from __future__ import annotations

import dataclasses

import torch

from grpokit.errors import keywords_moved_into
from grpokit.models.fsdp import full_params_for_generation
from grpokit.models.onednn import packed_linears
from grpokit.rollout.decode import DecodeSpeed, sample_groups
from grpokit.rollout.engine_protocol import EngineBase, RolloutEngine, accepts_earlier_spelling
from grpokit.rollout.multiturn import sample_conversations
from grpokit.rollout.request import RolloutRequest, RolloutResult
from grpokit.rollout.tools import ToolBox
from grpokit.rollout.vision import tool_images_for


class HFEngine(EngineBase):
    """The built-in sampler on the training model (shared prefill, KV cache, exact sampling).

    `speed` holds `sample_groups`' speed options (the sampler, the preallocated KV cache, the shared prefill, the
    layer loop; `rollout.*` in the config) and `packed_weights` the decode's oneDNN matmuls (models/onednn.py):
    they change the cost, not the distribution."""

    @keywords_moved_into("speed", DecodeSpeed, "grpokit.rollout.decode")
    def __init__(self, model, tokenizer=None, *, tools: ToolBox | None = None, max_tool_turns: int = 8,
                 packed_weights: bool = True, tool_images=None, speed: DecodeSpeed = DecodeSpeed()):
        self.model, self.tokenizer, self.speed, self.packed_weights = model, tokenizer, speed, packed_weights
        self.tools, self.max_tool_turns = tools, max_tool_turns
        self.tool_images = tool_images  # a vision-language model: rollout.vision.ToolImages renders image results

    @property
    def device(self) -> torch.device:
        return self.model.device

    @accepts_earlier_spelling
    def generate(self, request: RolloutRequest) -> RolloutResult:
        """Single-turn answers, or with tools (the request's, else the engine's own) multi-turn conversations whose
        tool results join the same KV cache; `request.media`: the prompts' images (rollout/vision.py)."""
        tools = request.tools if request.tools is not None else self.tools
        with full_params_for_generation(self.model), \
                packed_linears(self.model, request.num_answers, self.packed_weights):
            if tools:
                rollout, stats = sample_conversations(
                    self.model, dataclasses.replace(request, tools=tools), tokenizer=self.tokenizer,
                    max_tool_turns=self.max_tool_turns, speed=self.speed, render_results=self.tool_images)
                return RolloutResult(rollout, tool_stats=stats)
            return RolloutResult(sample_groups(self.model, request, tokenizer=self.tokenizer, speed=self.speed))


def check_engine_can_run(config, folder) -> None:
    """What the engine `rollout.engine` names cannot do with this model here, said before the model loads."""
    if config.rollout.engine == "vllm":
        from grpokit.rollout.vllm.checks import check_vllm_can_run  # imports vllm only when asked for

        check_vllm_can_run(config, folder)


def build_engine(config, model, tokenizer, *, tools: ToolBox | None = None) -> RolloutEngine:
    """The engine `rollout.engine` names, for this process (with `tools`: multi-turn rollouts)."""
    r = config.rollout
    if r.engine == "hf":
        return HFEngine(model, tokenizer, tools=tools, max_tool_turns=config.tools.max_calls,
                        packed_weights=r.packed_weights, speed=DecodeSpeed.from_config(config),
                        tool_images=tool_images_for(model, config.model.path) if tools else None)
    from grpokit.rollout.vllm import vllm_engine  # imports vllm only when asked for

    return vllm_engine(config, tokenizer, tools=tools)

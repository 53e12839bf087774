"""Rollout engines: what samples the answers, behind one interface.

    rollout = engine.generate(prompt_ids, group_size=G, sampling=SamplingParams(...), generator=g)
    engine.sync_weights(model)        # after every optimizer step: the sampler now holds the trainer's weights

`generate` returns a `Rollout` (N = B*G rows, group by group, with the sampler's own log-probs of the
tokens it drew); the trainer never looks behind it. The interface (`RolloutEngine`, `SamplingParams`, the
defaults `EngineBase`) is engine_protocol.py; the engines are here and in vllm.py.

- `HFEngine` [`rollout.engine = "hf"`]: the built-in sampler (`rollout.sample_groups`) on the training
  model itself. Nothing to sync, and its log-probs are the trainer's (ratio exactly 1 on-policy).
- `VLLMEngine` [`rollout.engine = "vllm"`, extra `grpokit[vllm]`, one GPU per process]: a `vllm.LLM`
  colocated in the training process, on the same GPU (`rollout.vllm.gpu_memory_utilization` of it;
  `enable_sleep_mode` frees its memory while the trainer runs). Under torchrun every rank owns one
  engine (`distributed_executor_backend="external_launcher"`) and samples its own prompts. After each
  update the weights are pushed in buckets of about `sync_bucket_mb` (one `load_weights` call per
  bucket, not per parameter; FSDP shards are gathered one bucket at a time); with LoRA only the
  adapter moves (saved to a temporary folder, loaded as a new `LoRARequest`). Each `generate` passes
  a seed drawn from the trainer's generator, so `--resume` replays the same sampling seeds.
- The sampler and the trainer compute log-probs with different kernels (and vLLM often in bf16), so
  even on-policy their ratio is not exactly 1. `algorithm.is_correction` weights each token's (or
  answer's) loss by `exp(logp_trainer - logp_sampler)`, truncated or masked to [is_cap_min, is_cap_max]
  (TIS, Yao et al. 2025, and TRL's other modes; algorithms/mismatch.py), with `logp_trainer` the
  trainer's log-probs of the sampled tokens before the update (a no-grad pass, as TRL). vLLM runs with
  `logprobs_mode="processed_logprobs"` so that its log-probs include the temperature; with top-k/top-p
  they are those of the filtered distribution while the trainer's are unfiltered (as in TRL).
"""

from __future__ import annotations

import torch

from grpokit.models.fsdp import full_params_for_generation
from grpokit.models.onednn import packed_linears
from grpokit.models.parallel import rank
from grpokit.rollout.batch import Rollout
from grpokit.rollout.decode import sample_groups
from grpokit.rollout.engine_protocol import EngineBase, RolloutEngine
from grpokit.rollout.multiturn import sample_conversations
from grpokit.rollout.tools import ToolBox
from grpokit.rollout.vision import tool_images_for


class HFEngine(EngineBase):
    """The built-in sampler on the training model (shared prefill, KV cache, exact sampling).

    `speed` holds `sample_groups`' speed options (the sampler, the preallocated KV cache, the
    shared prefill; `rollout.*` in the config) and `packed_weights` the decode's oneDNN matmuls
    (models/onednn.py): they change the cost, not the distribution."""

    def __init__(self, model, tokenizer=None, *, tools: ToolBox | None = None, max_tool_turns: int = 8,
                 packed_weights: bool = True, tool_images=None, **speed):
        self.model, self.tokenizer, self.speed, self.packed_weights = model, tokenizer, speed, packed_weights
        self.tools, self.max_tool_turns = tools, max_tool_turns
        self.tool_images = tool_images  # a vision-language model: rollout.vision.ToolImages renders image results

    @property
    def device(self) -> torch.device:
        return self.model.device

    def generate(self, prompt_ids, *, group_size, sampling, generator=None, media=None) -> Rollout:
        """`media` (`models.media.RowMedia`, one row per prompt): the prompts' images (rollout/vision.py)."""
        s = sampling
        rows = len(prompt_ids) * group_size
        with full_params_for_generation(self.model), packed_linears(self.model, rows, self.packed_weights):
            if self.tools:  # multi-turn: tool calls run and their results join the same KV cache
                rollout, self.tool_stats = sample_conversations(
                    self.model, prompt_ids, group_size=group_size, max_new_tokens=s.max_new_tokens,
                    eos_token_ids=list(s.eos_token_ids), pad_token_id=s.pad_token_id, tokenizer=self.tokenizer,
                    tools=self.tools, max_tool_turns=self.max_tool_turns, temperature=s.temperature, top_p=s.top_p,
                    top_k=s.top_k, generator=generator, sampler=self.speed.get("sampler", "inverse_cdf"),
                    layer_loop=self.speed.get("layer_loop", True),
                    history=self.history, media=media, render_results=self.tool_images)
                return rollout
            return sample_groups(
                self.model, prompt_ids, group_size=group_size, max_new_tokens=s.max_new_tokens,
                eos_token_ids=list(s.eos_token_ids), pad_token_id=s.pad_token_id, temperature=s.temperature,
                top_p=s.top_p, top_k=s.top_k, stop_strings=s.stop_strings, tokenizer=self.tokenizer,
                generator=generator, ignore_eos=s.ignore_eos, media=media, **self.speed)

def check_engine_can_run(config, folder) -> None:
    """What the engine `rollout.engine` names cannot do with this model here, said before the model loads."""
    if config.rollout.engine == "vllm":
        from grpokit.rollout.vllm import check_vllm_can_run  # imports vllm only when asked for

        check_vllm_can_run(config, folder)


def build_engine(config, model, tokenizer, *, tools: ToolBox | None = None) -> RolloutEngine:
    """The engine `rollout.engine` names, for this process (with `tools`: multi-turn rollouts)."""
    r = config.rollout
    if r.engine == "hf":
        return HFEngine(model, tokenizer, tools=tools, max_tool_turns=config.tools.max_calls, sampler=r.sampler,
                        preallocate_kv_cache=r.preallocated_kv_cache, share_prefill=r.shared_prefill,
                        layer_loop=r.layer_loop, packed_weights=r.packed_weights,
                        tool_images=tool_images_for(model, config.model.path) if tools else None)
    if "server" in r.vllm:  # vLLM on devices of its own, over HTTP (rollout/vllm_server.py)
        from grpokit.rollout.vllm_server import VLLMServerEngine

        options = {k: v for k, v in r.vllm.items() if k != "server"}
        return VLLMServerEngine(r.vllm["server"], seed=config.train.seed + rank(), lora=config.model.lora or None,
                                tokenizer=tokenizer, tools=tools, max_tool_turns=config.tools.max_calls, **options)
    from grpokit.rollout.vllm import VLLMEngine  # imports vllm only when asked for

    options = {"dtype": config.model.dtype, **r.vllm}
    return VLLMEngine(config.model.path, seed=config.train.seed + rank(), lora=config.model.lora or None,
                      tokenizer=tokenizer, tools=tools, max_tool_turns=config.tools.max_calls, **options)

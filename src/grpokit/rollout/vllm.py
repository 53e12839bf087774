"""The vLLM rollout engine (`rollout.engine = "vllm"`): a `vllm.LLM` colocated in the training process.

See `engines.py` for the interface, weight sync and truncated importance sampling; vLLM is
imported only when this engine is built.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Iterable

import torch
from torch import Tensor

from grpokit.models.lora import adapter_of
from grpokit.models.parallel import buckets, rank, world_size
from grpokit.rollout.batch import Rollout, rollout_from_tokens
from grpokit.rollout.multiturn import ToolStats, converse
from grpokit.rollout.tools import ToolBox

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _import_vllm():
    try:
        import vllm
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("rollout.engine = \"vllm\" needs vLLM on a CUDA machine: pip install 'grpokit[vllm]'") from e
    return vllm


def sync_tensors(model) -> Iterable[tuple[str, Tensor]]:
    """(Hugging Face name, tensor) of every parameter and buffer the sampler needs, ungathered (an FSDP
    shard's `shape` is the whole tensor's): tied weights once; rotary tables (the decoder's, a vision tower's
    rotary_pos_emb) are rebuilt by vLLM."""
    seen = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen or "rotary_emb" in name or name.endswith("inv_freq"):
            continue
        seen.add(id(t))
        yield name, t


def named_weights_for_sync(model) -> Iterable[tuple[str, Tensor]]:
    """`sync_tensors`, each whole, one at a time (FSDP shards are gathered here, one tensor at a time: every
    rank must iterate in step)."""
    for name, t in sync_tensors(model):
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        yield name, full.detach()


class VLLMEngine:
    """A colocated `vllm.LLM` behind the RolloutEngine interface (see the module docstring).

    `llm` and `vllm_module` may be given (tests pass fakes); otherwise vLLM is imported and the LLM
    built from `model_path`."""

    def __init__(self, model_path: str, *, dtype: str = "bfloat16", seed: int = 0, lora: dict | None = None,
                 gpu_memory_utilization: float = 0.3, enable_sleep_mode: bool = False, sync_bucket_mb: float = 512,
                 max_model_len: int | None = None, enforce_eager: bool = False, llm=None, vllm_module=None,
                 tokenizer=None, tools: ToolBox | None = None, max_tool_turns: int = 8):
        self.vllm = vllm_module or _import_vllm()
        # multi-turn (tools): turn by turn, the whole conversation as the next token-id prompt (vLLM's prefix
        # cache keeps the repeated part cheap); `tools` may be replaced per batch (environments)
        self.tokenizer, self.tools, self.max_tool_turns = tokenizer, tools, max_tool_turns
        self.tool_stats: ToolStats | None = None
        self.history = None  # tools.history = "split": this batch's ConversationHistory (rollout/history.py)
        self.bucket_bytes = int(sync_bucket_mb * 2**20)
        self.sleep_mode, self.lora = enable_sleep_mode, lora
        self.lora_request, self._lora_dir, self._lora_version = None, None, 0
        self.sync_calls: list[int] = []  # tensors per load_weights call of the last sync (for tests and logs)
        if llm is None:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: its model is reachable
            kwargs = dict(model=str(model_path), dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                          enable_sleep_mode=enable_sleep_mode, logprobs_mode="processed_logprobs",
                          enforce_eager=enforce_eager, max_model_len=max_model_len)
            if world_size() > 1:  # one engine per rank, inside torchrun's process group
                kwargs["distributed_executor_backend"] = "external_launcher"
            if lora:  # vLLM accepts only some ranks as its maximum: the smallest one that holds r
                rank = int(lora.get("r", 8))
                kwargs.update(enable_lora=True, max_loras=1,
                              max_lora_rank=next((k for k in VLLM_LORA_RANKS if k >= rank), rank))
            llm = self.vllm.LLM(**{k: v for k, v in kwargs.items() if v is not None})
        self.llm = llm
        self.asleep = self.weights_awake = False  # sleeps after each generate (enable_sleep_mode)

    # ---- sampling --------------------------------------------------------------------------

    def generate(self, prompt_ids, *, group_size, sampling, generator=None, media=None) -> Rollout:
        """`media` (`models.media.RowMedia`, one row per prompt): the prompts' images, sent as vLLM's multimodal
        inputs beside the token ids (`_request`); single-turn only."""
        s = sampling
        self._wake()
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device).item()) \
            if generator is not None else None
        if self.tools:
            if media is not None:
                raise ValueError("the vLLM engine does not take images in multi-turn rollouts yet")
            device = generator.device if generator is not None else "cpu"
            rollout = self._converse(prompt_ids, group_size, s, seed, device)
            if self.sleep_mode:
                self._sleep()
            return rollout
        params = self.vllm.SamplingParams(
            n=group_size, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_new_tokens,
            stop=list(s.stop_strings) or None, include_stop_str_in_output=True, ignore_eos=s.ignore_eos,
            stop_token_ids=None if s.ignore_eos else list(s.eos_token_ids), logprobs=0, seed=seed,
            skip_special_tokens=False)
        outputs = self.llm.generate([_request(p, None if media is None else media.rows[i])
                                     for i, p in enumerate(prompt_ids)], sampling_params=params, use_tqdm=False,
                                    lora_request=self.lora_request)
        completions, logprobs, truncated = [], [], []
        for request in outputs:
            if len(request.outputs) != group_size:
                raise RuntimeError(f"vLLM returned {len(request.outputs)} answers for a prompt, expected {group_size}")
            for out in request.outputs:
                ids = list(out.token_ids)[:s.max_new_tokens]
                placeholder = None if media is None else next(
                    (k for k, t in enumerate(ids) if t == media.image_token_id), None)
                if placeholder is not None:  # no image features behind a sampled placeholder: the answer ends there
                    ids = ids[:placeholder]
                completions.append(ids)
                logprobs.append(_sampled_logprobs(out.logprobs, ids))
                truncated.append(out.finish_reason == "length" or placeholder is not None)
        if self.sleep_mode:
            self._sleep()
        device = generator.device if generator is not None else "cpu"
        rollout = rollout_from_tokens(prompt_ids, completions, logprobs, truncated, group_size=group_size,
                                      pad_token_id=s.pad_token_id, device=device)
        return rollout if media is None else dataclasses.replace(rollout, media=media.repeat_interleave(group_size))

    def _converse(self, prompt_ids, group_size: int, s, seed: int | None, device) -> Rollout:
        """Multi-turn answers with tool calls (rollout/multiturn.converse): one vLLM request per answer and
        turn, ending at the end-of-turn token, each seeded from `seed` in order."""
        seeds = iter(range(seed or 0, 2**62))

        def generate_turns(contexts: list[list[int]], max_tokens: list[int]):
            params = [self.vllm.SamplingParams(
                n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=m,
                stop_token_ids=list(s.eos_token_ids), logprobs=0, seed=next(seeds) if seed is not None else None,
                skip_special_tokens=False) for m in max_tokens]
            outputs = self.llm.generate([{"prompt_token_ids": list(c)} for c in contexts], sampling_params=params,
                                        use_tqdm=False, lora_request=self.lora_request)
            turns = []
            for request, m in zip(outputs, max_tokens):
                ids = list(request.outputs[0].token_ids)[:m]
                turns.append((ids, _sampled_logprobs(request.outputs[0].logprobs, ids)))
            return turns

        rollout, self.tool_stats = converse(
            prompt_ids, group_size=group_size, max_new_tokens=s.max_new_tokens, eos_token_ids=s.eos_token_ids,
            pad_token_id=s.pad_token_id, tokenizer=self.tokenizer, tools=self.tools,
            max_tool_turns=self.max_tool_turns, generate_turns=generate_turns, device=device, history=self.history)
        return rollout

    # ---- weights ---------------------------------------------------------------------------

    def sync_weights(self, model) -> None:
        """Push the trainer's weights: the adapter alone with LoRA, else every tensor in buckets."""
        self._wake(weights_only=True)
        adapter = adapter_of(model)
        if adapter is not None:
            self._sync_adapter(adapter)
        else:
            self.sync_calls = []
            for bucket in buckets(named_weights_for_sync(model), self.bucket_bytes):
                self._load_weights(bucket)
                self.sync_calls.append(len(bucket))
        self.llm.reset_prefix_cache()  # cached KV of the old weights must not be reused

    def _load_weights(self, bucket: list[tuple[str, Tensor]]) -> None:
        target = _vllm_model(self.llm)
        if target is not None:
            target.load_weights(weights=bucket)
        else:  # the engine runs its workers elsewhere: send the bucket over its RPC
            self.llm.collective_rpc(_load_weights_on_worker, args=(bucket,))

    def _sync_adapter(self, adapter) -> None:
        if self._lora_dir is None:
            self._lora_dir = tempfile.mkdtemp(prefix=f"grpokit-lora-rank{rank()}-")
        previous = self.lora_request
        self._lora_version += 1
        folder = Path(self._lora_dir) / f"v{self._lora_version}"
        adapter.save_pretrained(str(folder))
        self.lora_request = _lora_request_class(self.vllm)(f"policy-v{self._lora_version}", self._lora_version,
                                                           str(folder))
        self.sync_calls = [0]
        if previous is not None:
            try:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)
            except Exception:  # an engine without remove_lora keeps at most max_loras adapters (LRU)
                pass
            old = Path(self._lora_dir) / f"v{self._lora_version - 1}"
            import shutil

            shutil.rmtree(old, ignore_errors=True)

    # ---- sleep mode: the engine's GPU memory is free while the trainer runs --------------------
    # After each generate the engine sleeps: level 2 drops its weights (the trainer pushes new ones
    # after the update anyway); with LoRA the base weights are never pushed, so level 1 keeps them
    # in host memory. sync_weights wakes the weights only; generate wakes the KV cache.

    def _sleep(self) -> None:
        self.llm.sleep(level=1 if self.lora else 2)
        self.asleep, self.weights_awake = True, False

    def _wake(self, weights_only: bool = False) -> None:
        if not self.asleep:
            return
        if weights_only:
            if not self.weights_awake:
                self.llm.wake_up(tags=["weights"])
                self.weights_awake = True
            return
        self.llm.wake_up(tags=["kv_cache"]) if self.weights_awake else self.llm.wake_up()
        self.asleep = self.weights_awake = False


def _request(prompt_ids, images) -> dict:
    """One vLLM prompt: its token ids, whose image placeholders the processor already expanded (vLLM detects the
    expanded placeholders and does not expand them again), and, for a prompt with images, the decoded images as
    its `multi_modal_data`, which vLLM's own processor encodes. vLLM may sample an image placeholder (nothing
    suppresses it there, unlike the built-in sampler): `generate` ends that answer before it, truncated."""
    request = {"prompt_token_ids": list(prompt_ids)}
    if images is not None and images.num_images:
        if not images.sources:  # (num_images counts Idefics3's crops, not images: not compared)
            raise ValueError("the prompt's decoded images are not kept (PromptImages.sources): vLLM cannot take them")
        request["multi_modal_data"] = {"image": [ref.image for ref in images.sources]}
    return request


def _lora_request_class(vllm):
    if hasattr(vllm, "LoRARequest"):
        return vllm.LoRARequest
    from vllm.lora.request import LoRARequest

    return LoRARequest


def _vllm_model(llm):
    """The nn.Module inside an in-process vLLM engine (V1 with VLLM_ENABLE_V1_MULTIPROCESSING=0), or None."""
    try:
        worker = llm.llm_engine.model_executor.driver_worker
    except AttributeError:
        return None
    for path in ("model_runner.model", "worker.model_runner.model"):
        obj = worker
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, "load_weights"):
            return obj
    return None


def _load_weights_on_worker(worker, bucket):  # runs inside a vLLM worker (collective_rpc)
    worker.model_runner.model.load_weights(weights=bucket)


def _sampled_logprobs(per_position, token_ids: list[int]) -> list[float]:
    """The sampled token's log-prob at each position, from vLLM's per-position {token_id: Logprob}."""
    if per_position is None:
        raise RuntimeError("vLLM returned no log-probs; the engine needs SamplingParams(logprobs=0)")
    out = []
    for tok, entry in zip(token_ids, per_position):
        item = entry.get(tok) if hasattr(entry, "get") else None
        if item is None:  # the sampled token is always present with logprobs=0; be lenient with formats
            item = next(iter(entry.values()))
        value = getattr(item, "logprob", item)
        out.append(float(value))
    return out

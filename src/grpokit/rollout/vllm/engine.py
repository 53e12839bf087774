"""The vLLM rollout engine (`rollout.engine = "vllm"`): one engine, colocated or over a server's HTTP.

    engine = VLLMEngine(ColocatedLLM.start(...))       # a vllm.LLM in this process (vllm/colocated.py)
    engine = VLLMEngine(ServerLLM.connect(options))     # a vLLM server (vllm/server.py)
    result = engine.generate(request)                   # rollout/request.py: a request in, a result out

What the two share is here: turning a request into vLLM requests (n = G per prompt, a seed drawn from the
trainer's generator so `--resume` replays it, the sampled token's log-prob with the temperature), the multi-turn
loop (rollout/multiturn.converse: one request per answer and turn, the whole conversation as its token-id
prompt; vLLM's prefix cache keeps the repeated part cheap), and the answers' bookkeeping. What differs is the
backend, which answers `complete(prompts, params, adapter)` with vLLM's `RequestOutput`s (`.outputs[k]` with
`token_ids`, `logprobs` and `finish_reason`) and opens a batch with `serving()`. The weights are not the engine's:
a publisher (vllm/weights.py) moves them and sets `served` (the step the sampler holds, the LoRA adapter to name),
which the engine reads when it samples.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Protocol

from grpokit.errors import SetupError
from grpokit.rollout.batch import rollout_from_tokens
from grpokit.rollout.engine_protocol import EngineBase, accepts_earlier_spelling
from grpokit.rollout.multiturn import converse
from grpokit.rollout.request import RolloutRequest, RolloutResult
from grpokit.rollout.tools import ToolBox


@dataclass
class ServedWeights:
    """What a vLLM engine's sampler holds, as its publisher (or, in an async worker, its subscriber) last set it:
    the trainer step whose weights it serves and, with LoRA, the adapter requests name (None: the base weights).
    The engine reads it when it samples; `adapter_prefix` names this run's adapters (a server outlives runs)."""

    step: int | None = None
    adapter: object = None  # a LoRARequest, or what a server's adapter is named by (lora_name, lora_int_id, lora_path)
    adapter_prefix: str = "policy"

    def use(self, step: int, adapter_prefix: str | None) -> None:
        """The sampler holds `step`'s weights, pushed by another process (a torchrun rank 0, an async trainer):
        with LoRA (`adapter_prefix`: the pushing process's adapter names), under that step's adapter name."""
        self.step = step
        if adapter_prefix is not None:
            self.adapter_prefix = adapter_prefix
            self.adapter = SimpleNamespace(lora_name=adapter_name(adapter_prefix, step), lora_int_id=step + 1,
                                           lora_path="")


def adapter_name(prefix: str, step: int) -> str:
    return f"{prefix}-v{step}"


@dataclass(frozen=True)
class CompletionParams:
    """One vLLM request's sampling settings, in vLLM's names (`vllm.SamplingParams`, the completions API)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int | None
    stop_token_ids: list[int] | None = None
    stop: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False


class Backend(Protocol):
    """Where the engine's requests go: a colocated `vllm.LLM` or a server (see the module docstring)."""

    def complete(self, prompts: list[dict], params: CompletionParams | list[CompletionParams], adapter=None) -> list:
        ...

    def serving(self): ...  # a context manager around one batch


class VLLMEngine(EngineBase):
    """A vLLM backend behind the RolloutEngine interface (see the module docstring)."""

    def __init__(self, backend: Backend, *, tokenizer=None, tools: ToolBox | None = None, max_tool_turns: int = 8,
                 served: ServedWeights | None = None, **earlier):
        if isinstance(backend, (str, os.PathLike)) or earlier:  # VLLMEngine(model_path, dtype=..., llm=...) before
            raise SetupError("VLLMEngine now takes its backend: VLLMEngine(ColocatedLLM.start(model_path, "
                             "VLLMOptions(...), dtype=..., seed=...)) from grpokit.rollout.vllm.colocated, or "
                             "VLLMEngine(ServerLLM.connect(VLLMOptions(server=url))) from grpokit.rollout.vllm.server; "
                             "grpokit.rollout.vllm.vllm_engine(config, tokenizer) builds the one a config names")
        self.backend, self.tokenizer, self.tools, self.max_tool_turns = backend, tokenizer, tools, max_tool_turns
        self.served = served or ServedWeights()  # what the sampler holds: the publisher's, read here

    @property
    def version(self) -> int | None:
        """The trainer step whose weights the sampler holds (None before the first push)."""
        return self.served.step

    @property
    def lora_request(self):
        """The adapter the next batch is sampled with (None: the base weights)."""
        return self.served.adapter

    @accepts_earlier_spelling
    def generate(self, request: RolloutRequest) -> RolloutResult:
        """Single-turn answers (with `request.media`: the prompts' images as vLLM's multimodal inputs), or with
        tools multi-turn conversations (text only)."""
        seed = request.seed()
        tools = request.tools if request.tools is not None else self.tools
        with self.backend.serving():
            if tools:
                if request.media is not None:
                    raise ValueError("the vLLM engine does not take images in multi-turn rollouts yet")
                rollout, stats = self._converse(dataclasses.replace(request, tools=tools), seed)
                return RolloutResult(rollout, tool_stats=stats, weight_version=self.served.step)
            rollout = self._single_turn(request, seed)
        return RolloutResult(rollout, weight_version=self.served.step)

    def _single_turn(self, request: RolloutRequest, seed: int | None):
        s, G, media = request.sampling, request.group_size, request.media
        params = CompletionParams(
            n=G, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_new_tokens, seed=seed,
            stop=list(s.stop_strings) or None, include_stop_str_in_output=True, ignore_eos=s.ignore_eos,
            stop_token_ids=None if s.ignore_eos else list(s.eos_token_ids))
        outputs = self.backend.complete([_request(p, None if media is None else media.rows[i])
                                         for i, p in enumerate(request.prompt_ids)], params, self.served.adapter)
        completions, logprobs, truncated = [], [], []
        for answers in outputs:
            if len(answers.outputs) != G:
                raise RuntimeError(f"vLLM returned {len(answers.outputs)} answers for a prompt, expected {G}")
            for out in answers.outputs:
                ids = list(out.token_ids)[:s.max_new_tokens]
                placeholder = None if media is None else next(
                    (k for k, t in enumerate(ids) if t == media.image_token_id), None)
                if placeholder is not None:  # no image features behind a sampled placeholder: the answer ends there
                    ids = ids[:placeholder]
                completions.append(ids)
                logprobs.append(sampled_logprobs(out.logprobs, ids))
                truncated.append(out.finish_reason == "length" or placeholder is not None)
        rollout = rollout_from_tokens(request.prompt_ids, completions, logprobs, truncated, group_size=G,
                                      pad_token_id=s.pad_token_id, device=request.device)
        return rollout if media is None else dataclasses.replace(rollout, media=media.repeat_interleave(G))

    def _converse(self, request: RolloutRequest, seed: int | None):
        """Multi-turn answers with tool calls (rollout/multiturn.converse): one vLLM request per answer and
        turn, ending at the end-of-turn token, each seeded from `seed` in order."""
        s, seeds = request.sampling, iter(range(seed or 0, 2**62))

        def generate_turns(contexts: list[list[int]], max_tokens: list[int]):
            params = [CompletionParams(n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=m,
                                       stop_token_ids=list(s.eos_token_ids),
                                       seed=next(seeds) if seed is not None else None) for m in max_tokens]
            outputs = self.backend.complete([{"prompt_token_ids": list(c)} for c in contexts], params,
                                            self.served.adapter)
            turns = []
            for answers, m in zip(outputs, max_tokens):
                ids = list(answers.outputs[0].token_ids)[:m]
                turns.append((ids, sampled_logprobs(answers.outputs[0].logprobs, ids)))
            return turns

        return converse(request, tokenizer=self.tokenizer, max_tool_turns=self.max_tool_turns,
                        generate_turns=generate_turns, device=request.device)


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


def sampled_logprobs(per_position, token_ids: list[int]) -> list[float]:
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

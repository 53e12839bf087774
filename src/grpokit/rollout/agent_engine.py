"""The rollout engine of black-box agents: one agent per answer, its calls sampled through the endpoint.

    grpokit.train(config, engine=agent_engine(my_agent))   # or [tools] agent = "agents.py:my_agent"

How the calls are served and recorded: rollout/agent_endpoint.py. This engine starts the N = B*G agents
of a batch (answer i runs on row i // G), samples every waiting call in one batch on the trainer's thread
with the run's own engine (`rollout.engine`, without tools) until each agent has returned or
`tools.agent_time_limit_s` has passed, and returns the recorded conversations as a `Rollout` (one prompt
per answer: the first call's rendering; `tool_mask` 1 on what the template inserted between calls) and,
for the reward functions, each conversation as messages (`tool_stats.conversations`).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import Counter
from typing import Callable

import torch

from grpokit.errors import SetupError
from grpokit.rollout.agent_endpoint import Agent, AgentEndpoint, AnswerRecord, PendingCall
from grpokit.rollout.batch import rollout_from_tokens
from grpokit.rollout.engine_protocol import EngineBase, given_engine
from grpokit.rollout.multiturn import ToolStats
from grpokit.rollout.request import RolloutRequest, RolloutResult


class AgentEngine(EngineBase):
    """A rollout engine whose answers are the agent's conversations, sampled by `inner` (the run's own
    engine, without tools; one that is not a grpokit engine is wrapped, engine_protocol.PlainEngine) through the
    endpoint. Each request carries its rows (the rollout side's, side.py): answer i runs on row i // G. The run's
    weights reach `inner` (rollout.weights.build_publisher publishes to it)."""

    def __init__(self, agent: Agent, inner, tokenizer, *, max_calls: int = 8, time_limit_s: float = 300.0,
                 port: int = 0, batch_wait_s: float = 0.02, max_positions: int | None = None):
        """`max_positions`: the model's context (default: that of `inner.model`, where the engine has one)."""
        self.agent, self.inner, self.tokenizer = agent, given_engine(inner, None), tokenizer
        max_positions = max_positions or context_length(getattr(inner, "model", None))
        self.endpoint = AgentEndpoint(tokenizer, port, max_positions)
        self.endpoint.max_calls, self.time_limit_s, self.batch_wait_s = max_calls, time_limit_s, batch_wait_s

    @property
    def device(self):
        return self.inner.device

    def close(self) -> None:
        self.endpoint.close()
        self.inner.stop_serving()  # a vLLM engine's weight folders

    stop_serving = close  # what train() calls when the run ends

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """Run one agent per answer (row b's G answers: b*G ... b*G+G-1) until all end or the time limit;
        the request's prompts (as grpokit renders them) stand in for an answer that made no call."""
        prompt_ids, group_size, sampling, generator = request.prompt_ids, request.group_size, request.sampling, \
            request.generator
        if request.rows is None or len(request.rows) != len(prompt_ids):
            raise SetupError("an agent engine needs each batch's rows (RolloutRequest.rows, as grpokit's rollout "
                             "side sends them); use it through train(engine=agent_engine(...)) or [tools] agent")
        N, endpoint = request.num_answers, self.endpoint
        endpoint.budget = sampling.max_new_tokens
        with endpoint.lock:
            endpoint.answers = [AnswerRecord() for _ in range(N)]
        returned: list = [None] * N
        threads = [threading.Thread(target=self._run_agent, args=(i, request.rows[i // group_size], returned),
                                    daemon=True, name=f"grpokit-agent-{i}") for i in range(N)]
        t0 = time.perf_counter()
        for thread in threads:
            thread.start()
        model_s = self._serve_until_done(threads, sampling, generator, t0 + self.time_limit_s)
        with endpoint.lock:
            for i, thread in enumerate(threads):
                answer = endpoint.answers[i]
                answer.closed = True
                if thread.is_alive():
                    answer.failed = f"still running after {self.time_limit_s:g} s"
        self._drain()
        return self._rollout(prompt_ids, group_size, sampling, returned, time.perf_counter() - t0 - model_s)

    def _run_agent(self, i: int, row: dict, returned: list) -> None:
        try:
            returned[i] = self.agent(self.endpoint.base_url(i), dict(row))
        except BaseException as e:  # noqa: BLE001 - the agent's own code: a failed answer, not the run's end
            self.endpoint.answers[i].failed = f"{type(e).__name__}: {e}"[:500]

    def _serve_until_done(self, threads, sampling, generator, deadline: float) -> float:
        """Sample waiting calls in batches (all live agents waiting, or `batch_wait_s` after the first) until
        every agent has ended or the deadline; the seconds spent sampling."""
        model_s = 0.0
        while any(t.is_alive() for t in threads) and time.perf_counter() < deadline:
            try:
                first = self.endpoint.requests.get(timeout=0.01)
            except queue.Empty:
                continue
            batch, until = [first], time.perf_counter() + self.batch_wait_s
            while len(batch) < sum(t.is_alive() for t in threads) and time.perf_counter() < until:
                try:
                    batch.append(self.endpoint.requests.get(timeout=max(0.0, until - time.perf_counter())))
                except queue.Empty:
                    break
            t0 = time.perf_counter()
            self._sample(batch, sampling, generator)
            model_s += time.perf_counter() - t0
        return model_s

    def _sample(self, batch: list[PendingCall], sampling, generator) -> None:
        """Sample the calls together, up to the longest answer any of them may have; the calls whose prompts
        would then pass the model's context are sampled after them, the same way (a call's own `max_tokens` fits
        its prompt in the context, so each round takes at least the call that may answer longest)."""
        longest, limit = max(job.max_tokens for job in batch), self.endpoint.max_positions
        later = [job for job in batch if limit is not None and len(job.prompt) + longest > limit]
        batch = [job for job in batch if not any(job is other for other in later)]
        rollout = self.inner.generate(RolloutRequest([job.prompt for job in batch], 1, dataclasses.replace(
            sampling, max_new_tokens=longest), generator)).rollout
        eos = set(sampling.eos_token_ids)
        for k, job in enumerate(batch):
            n = min(int(rollout.completion_mask[k].sum()), job.max_tokens)
            job.tokens = rollout.completion_ids[k, :n].tolist()
            job.logps = rollout.logprobs[k, :n].tolist()
            job.finished = bool(job.tokens) and job.tokens[-1] in eos
            job.done.set()
        if later:
            self._sample(later, sampling, generator)

    def _drain(self) -> None:
        """Calls still waiting when the time ran out: answered with an error."""
        while True:
            try:
                job = self.endpoint.requests.get_nowait()
            except queue.Empty:
                return
            job.tokens = None
            job.done.set()

    def _rollout(self, prompt_ids, G: int, sampling, returned: list, agent_s: float) -> RolloutResult:
        answers = self.endpoint.answers
        prompts = [a.prompt if a.prompt is not None else list(prompt_ids[i // G]) for i, a in enumerate(answers)]
        truncated = [a.truncated or a.failed is not None for a in answers]
        rollout = rollout_from_tokens(prompts, [a.tokens for a in answers], [a.logps for a in answers], truncated,
                                      group_size=1, pad_token_id=sampling.pad_token_id,
                                      device=self.inner.device)
        tool_mask = torch.zeros_like(rollout.completion_mask)  # [N, T] 1 on what the template inserted
        for i, a in enumerate(answers):
            tool_mask[i, :len(a.is_context)] = torch.tensor(a.is_context, dtype=tool_mask.dtype)
        conversations = [_with_final(a.conversation, r) for a, r in zip(answers, returned)]
        stats = ToolStats([sum(a.tool_calls.values()) for a in answers], [int(a.failed is not None) for a in answers],
                          [max(1, a.calls) for a in answers], conversations, seconds=agent_s,
                          per_tool=sum((a.tool_calls for a in answers), Counter()))
        metrics = {"agent/failed": sum(a.failed is not None for a in answers) / len(answers),
                   "agent/model_calls": sum(a.calls for a in answers) / len(answers),
                   "agent/rewritten_calls": sum(a.rewritten for a in answers) / len(answers)}
        return RolloutResult(dataclasses.replace(rollout, tool_mask=tool_mask), tool_stats=stats,
                             agent_metrics=metrics, failures=[a.failed for a in answers])


def _with_final(conversation: list[dict], final) -> list[dict]:
    """The conversation as the reward functions see it: the agent's returned string as the last answer."""
    messages = list(conversation)
    if isinstance(final, str) and not (messages and messages[-1]["role"] == "assistant"
                                       and messages[-1]["content"] == final):
        messages.append({"role": "assistant", "content": final})
    return messages or [{"role": "assistant", "content": ""}]


def context_length(model) -> int | None:
    """The model's context (max_position_embeddings; a vision-language config keeps it in its text config)."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "max_position_embeddings", None)


def agent_engine(agent: Agent, *, time_limit_s: float = 300.0, port: int = 0) -> Callable:
    """`train(engine=agent_engine(my_agent))`: the run's own engine (rollout.engine, without tools) serving
    `my_agent(base_url, row)` through the endpoint; `tools.max_calls` bounds its tool rounds."""
    if not callable(agent):
        raise SetupError(f"agent_engine: {agent!r} is not callable; give a function agent(base_url, row)")
    if port:  # taken now: before the model loads, not after
        AgentEndpoint.probe(port)

    def build(config, model, tokenizer):
        from grpokit.rollout.engines import build_engine

        return AgentEngine(agent, build_engine(config, model, tokenizer, tools=None), tokenizer,
                           max_calls=config.tools.max_calls, time_limit_s=time_limit_s, port=port,
                           max_positions=context_length(model))

    return build


def agent_engine_from_config(config) -> Callable:
    """`[tools] agent = "file.py:function"`: loaded now, before anything else is (a bad reference fails first)."""
    from grpokit.rewards.registry import load_reward

    t = config.tools
    if config.rollout.mode == "async":
        raise SetupError("tools.agent: the agents' endpoint samples in the trainer's process, and rollout.mode = "
                         "\"async\" samples in worker processes; set rollout.mode = \"sync\"")
    if t.functions or t.environment:
        field = "functions" if t.functions else "environment"
        raise SetupError(f"tools.agent: an agent runs its own tools, and tools.{field} gives grpokit's too; remove "
                         "one of them")
    return agent_engine(load_reward(t.agent, kind="agent"), time_limit_s=t.agent_time_limit_s, port=t.agent_port)

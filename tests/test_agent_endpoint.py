"""The OpenAI-compatible endpoint for black-box agents (rollout/agent_endpoint.py), driven by the real
`openai` client: each call is sampled by grpokit's own engine and recorded, so the training row is the
conversation's tokens (sampled log-probs equal a recompute), the final answer is graded, and the bounds
(port in use, an agent that never ends, too many calls) are clear errors or failed answers."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading

import pytest
import torch

from conftest import make_config
from grpokit.config.schema import ToolsConfig
from grpokit.errors import RewardLoadError, SetupError
from grpokit.observe.tracking import read_metrics
from grpokit.rollout.agent_engine import AgentEngine, agent_engine
from grpokit.rollout.engine_protocol import SamplingParams
from grpokit.rollout.engines import HFEngine
from grpokit.training.loop import train

openai = pytest.importorskip("openai", reason="the agent endpoint's tests need the openai client: pip install "
                                              "'grpokit[agents]'")


@pytest.fixture(scope="module")
def model_and_tokenizer(tool_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tool_model_dir).eval(), AutoTokenizer.from_pretrained(tool_model_dir)


def two_call_agent(base_url: str, row: dict) -> str:
    """Asks, sends a tool result back, asks again; returns its own final answer."""
    client = openai.OpenAI(base_url=base_url, api_key="grpokit", max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "tool", "name": "add", "content": "42"}]
    second = client.chat.completions.create(model="policy", messages=messages)
    return "final:" + second.choices[0].message.content


def digits_sampling(tokenizer, max_new_tokens=300):
    """Turns end at a digit or "=": several turns on a random model."""
    eos = tuple(tokenizer.convert_tokens_to_ids(d) for d in "0123456789=")
    return SamplingParams(max_new_tokens, eos, tokenizer.pad_token_id)


def test_every_call_is_recorded_and_the_row_recomputes_to_the_sampled_logprobs(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = AgentEngine(two_call_agent, HFEngine(model, tokenizer), tokenizer, max_calls=4, time_limit_s=60)
    try:
        rows = [{"prompt": "12+3="}, {"prompt": "40+1="}]
        engine.rows = rows
        rollout = engine.generate([[0]] * 2, group_size=2, sampling=digits_sampling(tokenizer),
                                  generator=torch.Generator().manual_seed(0))
    finally:
        engine.close()
    assert rollout.num_sequences == 4 and engine.failures == [None] * 4
    assert engine.agent_metrics["agent/model_calls"] == 2.0
    for i in range(4):
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()
        tokens = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
        # the prompt is the first call's rendering of the row's question
        assert prompt == tokenizer.apply_chat_template([{"role": "user", "content": rows[i // 2]["prompt"]}],
                                                       add_generation_prompt=True, tokenize=True, return_dict=False)
        inserted = rollout.tool_mask[i, :len(tokens)].bool()
        text = tokenizer.decode([t for t, m in zip(tokens, inserted) if m])
        assert "42" in text  # the tool result sits in the row as context, not as sampled tokens
        sequence = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = model(sequence).logits[0, len(prompt) - 1:-1].float()  # [T, V]
        recomputed = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        sampled = rollout.logprobs[i, :len(tokens)]
        assert torch.allclose(recomputed[~inserted], sampled[~inserted], atol=1e-4)
        assert (sampled[inserted] == 0).all()
        conversation = engine.tool_stats.conversations[i]
        assert [m["role"] for m in conversation] == ["assistant", "tool", "assistant", "assistant"]
        assert conversation[-1]["content"].startswith("final:")


def test_the_openai_reply_carries_the_parsed_tool_calls(model_and_tokenizer):
    from grpokit.rollout.agent_endpoint import AgentEndpoint

    _, tokenizer = model_and_tokenizer
    endpoint = AgentEndpoint(tokenizer)
    seen = []

    class Fake:  # what the trainer's thread would sample: a call, then the end of the turn
        def serve(self):
            job = endpoint.requests.get(timeout=10)
            call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            job.tokens, job.logps, job.finished = tokenizer.encode(call) + [tokenizer.eos_token_id], [], True
            job.done.set()

    try:
        from grpokit.rollout.agent_endpoint import AnswerRecord

        endpoint.answers, endpoint.budget = [AnswerRecord()], 200
        threading.Thread(target=Fake().serve, daemon=True).start()
        client = openai.OpenAI(base_url=endpoint.base_url(0), api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1+2"}],
                                               tools=[{"type": "function", "function": {
                                                   "name": "add", "parameters": {"type": "object"}}}])
        seen.append(reply)
    finally:
        endpoint.close()
    call = seen[0].choices[0].message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert seen[0].choices[0].finish_reason == "tool_calls"


def test_an_agent_that_never_ends_is_a_failed_answer_and_the_batch_goes_on(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    stop = threading.Event()

    def stuck(base_url, row):
        if row["prompt"] == "hang":
            stop.wait(120)
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="p", messages=[{"role": "user", "content": row["prompt"]}],
                                               max_tokens=4)
        return reply.choices[0].message.content

    engine = AgentEngine(stuck, HFEngine(model, tokenizer), tokenizer, time_limit_s=10.0)
    try:
        engine.rows = [{"prompt": "hang"}, {"prompt": "1+1="}]
        rollout = engine.generate([[0]] * 2, group_size=1, sampling=digits_sampling(tokenizer))
    finally:
        stop.set()
        engine.close()
    assert engine.failures[0].startswith("still running after 10 s"), engine.failures
    assert engine.failures[1] is None, [(a.calls, len(a.tokens)) for a in engine.endpoint.answers]
    assert rollout.truncated[0] and 0 < rollout.completion_mask[1].sum() <= 4
    assert rollout.completion_mask[0].sum() == 0  # nothing recorded: nothing to train on


def test_calls_past_tools_max_calls_are_refused_with_the_reason(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    errors = []

    def chatty(base_url, row):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        try:
            for _ in range(5):
                client.chat.completions.create(model="p", messages=[{"role": "user", "content": row["prompt"]}])
        except openai.BadRequestError as e:
            errors.append(str(e))
            raise

    engine = AgentEngine(chatty, HFEngine(model, tokenizer), tokenizer, max_calls=1, time_limit_s=60)
    try:
        engine.rows = [{"prompt": "1+1="}]
        engine.generate([[0]], group_size=1, sampling=digits_sampling(tokenizer))
    finally:
        engine.close()
    assert "made its 2 model calls (tools.max_calls = 1" in errors[0]
    assert engine.failures[0].startswith("BadRequestError")
    assert engine.agent_metrics["agent/rewritten_calls"] == 1.0  # the same question again: not the conversation


def test_a_port_in_use_is_one_error_naming_the_fix(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SetupError, match=rf"tools.agent_port: port {port} on 127.0.0.1 is not available .*"
                                             r"tools.agent_port = 0"):
            AgentEngine(two_call_agent, None, tokenizer, port=port)
        with pytest.raises(SetupError, match=rf"port {port} .*not available"):  # at once, before the model loads
            agent_engine(two_call_agent, port=port)


def test_train_with_an_agent_grades_its_final_answers_and_logs_agent_metrics(tool_model_dir, tmp_path):
    config = make_config(tool_model_dir, tmp_path / "run", steps=2, prompts_per_step=2, max_new_tokens=8)
    graded = []

    def final_answer(completions, **kwargs):
        graded.extend(c[-1]["content"] for c in completions)
        return [float(c[-1]["content"].startswith("final:")) * (len(c[-1]["content"]) % 3) for c in completions]

    def one_call_agent(base_url, row):
        client = openai.OpenAI(base_url=base_url, api_key="grpokit", max_retries=0)
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        return "final:" + reply.choices[0].message.content

    run = train(config, engine=agent_engine(one_call_agent, time_limit_s=60), reward_functions=[final_answer])
    metrics = read_metrics(run)
    assert len(metrics) == 2 and all("agent/model_calls" in m and m["agent/failed"] == 0.0 for m in metrics)
    assert len(graded) == 2 * 2 * 4 and all(g.startswith("final:") for g in graded)


AGENT_SOURCE = """
import openai

def agent(base_url, row):
    client = openai.OpenAI(base_url=base_url, api_key="grpokit", max_retries=0)
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return "final:" + reply.choices[0].message.content
"""


def test_an_agent_from_the_config_trains_and_its_endpoint_stops_with_the_run(tool_model_dir, tmp_path):
    (tmp_path / "agents.py").write_text(AGENT_SOURCE)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    config = make_config(tool_model_dir, tmp_path / "run", steps=1, prompts_per_step=1, max_new_tokens=4)
    config = dataclasses.replace(config, tools=ToolsConfig(agent=f"{tmp_path / 'agents.py'}:agent", agent_port=port))
    run = train(config, reward_functions=[lambda completions, **_: [float(len(c[-1]["content"])) for c in completions]])
    assert read_metrics(run)[0]["agent/failed"] == 0.0
    with socket.socket() as again, pytest.raises(ConnectionRefusedError):
        again.connect(("127.0.0.1", port))  # the endpoint is gone with the run


def test_a_bad_agent_reference_fails_before_the_model_loads(tiny_model_dir, tmp_path):
    config = make_config(tmp_path / "no-model-here", tmp_path / "run")
    config = dataclasses.replace(config, tools=ToolsConfig(agent=f"{tmp_path / 'missing.py'}:agent"))
    with pytest.raises(RewardLoadError, match="agent"):
        train(config)


class ScriptedInner:
    """An inner engine that answers each call with the next scripted text (and the end-of-turn token)."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.prompts = tokenizer, list(texts), []

    def generate(self, prompt_ids, *, group_size, sampling, generator=None):
        from grpokit.rollout.batch import rollout_from_tokens

        self.prompts += prompt_ids
        tokens = [self.tokenizer.encode(self.texts.pop(0)) + [self.tokenizer.eos_token_id] for _ in prompt_ids]
        return rollout_from_tokens(prompt_ids, tokens, [[-0.5] * len(t) for t in tokens], [False] * len(tokens),
                                   group_size=1, pad_token_id=sampling.pad_token_id)

    def sync_weights(self, model):
        pass


def test_an_agent_that_echoes_the_tool_calls_back_continues_the_recorded_row(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    tools = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]

    def tool_agent(base_url, row):  # the usual OpenAI tool loop: the reply message itself goes back
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": row["prompt"]}]
        reply = client.chat.completions.create(model="p", messages=messages, tools=tools).choices[0].message
        call = reply.tool_calls[0]
        result = sum(json.loads(call.function.arguments).values())
        messages += [reply.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "name": "add", "content": str(result)}]
        return client.chat.completions.create(model="p", messages=messages, tools=tools).choices[0].message.content

    call = '<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>'
    inner = ScriptedInner(tokenizer, [call, "42"])
    engine = AgentEngine(tool_agent, inner, tokenizer, time_limit_s=60)
    try:
        engine.rows = [{"prompt": "20+22="}]
        rollout = engine.generate([[0]], group_size=1, sampling=SamplingParams(200, (tokenizer.eos_token_id,),
                                                                                tokenizer.pad_token_id))
    finally:
        engine.close()
    assert engine.failures == [None] and engine.agent_metrics["agent/rewritten_calls"] == 0
    tokens = rollout.completion_ids[0][rollout.completion_mask[0].bool()].tolist()
    sampled = [t for t, m in zip(tokens, rollout.tool_mask[0].tolist()) if not m]
    eos = tokenizer.eos_token_id
    assert sampled == tokenizer.encode(call) + [eos] + tokenizer.encode("42") + [eos]  # both turns, as sampled
    assert (rollout.logprobs[0][rollout.completion_mask[0].bool()] != 0).tolist() == [not m for m in
                                                                                       rollout.tool_mask[0].tolist()]
    # the second call's context is the first one's tokens and the template's tool turn: one row, in order
    prompt = rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist()
    assert inner.prompts[1] == prompt + tokens[:-3]
    assert "42" in tokenizer.decode([t for t, m in zip(tokens, rollout.tool_mask[0].tolist()) if m])
    assert engine.tool_stats.calls == [1] and engine.tool_stats.per_tool == {"add": 1}


def test_an_agent_with_tools_or_async_rollout_is_refused_naming_the_fields(tiny_model_dir, tmp_path):
    (tmp_path / "agents.py").write_text(AGENT_SOURCE)
    config = make_config(tiny_model_dir, tmp_path / "run")
    agent = f"{tmp_path / 'agents.py'}:agent"
    with_tools = dataclasses.replace(config, tools=ToolsConfig(agent=agent, functions=("tools.py:add",)))
    with pytest.raises(SetupError, match="tools.agent: an agent runs its own tools, and tools.functions"):
        train(with_tools)
    in_async = dataclasses.replace(config, tools=ToolsConfig(agent=agent),
                                   rollout=dataclasses.replace(config.rollout, mode="async"))
    with pytest.raises(SetupError, match='tools.agent: .*set rollout.mode = "sync"'):
        train(in_async)

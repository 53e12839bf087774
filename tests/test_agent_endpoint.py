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
from grpokit.rollout.engines import HFEngine
from grpokit.rollout.request import RolloutRequest, RolloutResult, SamplingParams
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
        result = engine.generate(RolloutRequest([[0]] * 2, 2, digits_sampling(tokenizer),
                                                torch.Generator().manual_seed(0), rows=rows))
        rollout = result.rollout
    finally:
        engine.close()
    assert rollout.num_sequences == 4 and result.failures == [None] * 4
    assert result.agent_metrics["agent/model_calls"] == 2.0
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
        conversation = result.tool_stats.conversations[i]
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
        result = engine.generate(RolloutRequest([[0]] * 2, 1, digits_sampling(tokenizer),
                                                rows=[{"prompt": "hang"}, {"prompt": "1+1="}]))
        rollout = result.rollout
    finally:
        stop.set()
        engine.close()
    assert result.failures[0].startswith("still running after 10 s"), result.failures
    assert result.failures[1] is None, [(a.calls, len(a.tokens)) for a in engine.endpoint.answers]
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
        result = engine.generate(RolloutRequest([[0]], 1, digits_sampling(tokenizer), rows=[{"prompt": "1+1="}]))
    finally:
        engine.close()
    assert "made its 2 model calls (tools.max_calls = 1" in errors[0]
    assert result.failures[0].startswith("BadRequestError")
    assert result.agent_metrics["agent/rewritten_calls"] == 1.0  # the same question again: not the conversation


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

    def generate(self, request):
        from grpokit.rollout.batch import rollout_from_tokens

        self.prompts += request.prompt_ids
        tokens = [self.tokenizer.encode(self.texts.pop(0)) + [self.tokenizer.eos_token_id]
                  for _ in request.prompt_ids]
        return RolloutResult(rollout_from_tokens(request.prompt_ids, tokens, [[-0.5] * len(t) for t in tokens],
                                                 [False] * len(tokens), group_size=1,
                                                 pad_token_id=request.sampling.pad_token_id))


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
        result = engine.generate(RolloutRequest([[0]], 1, SamplingParams(200, (tokenizer.eos_token_id,),
                                                                          tokenizer.pad_token_id),
                                                rows=[{"prompt": "20+22="}]))
        rollout = result.rollout
    finally:
        engine.close()
    assert result.failures == [None] and result.agent_metrics["agent/rewritten_calls"] == 0
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
    assert result.tool_stats.calls == [1] and result.tool_stats.per_tool == {"add": 1}


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


def _endpoint_with_one_answer(tokenizer):
    from grpokit.rollout.agent_endpoint import AgentEndpoint, AnswerRecord

    endpoint = AgentEndpoint(tokenizer)
    endpoint.answers, endpoint.budget = [AnswerRecord()], 200
    return endpoint


def _post(port: int, path: str, body: bytes, method: str = "POST") -> tuple[int, dict]:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        connection.close()


@pytest.mark.parametrize("body, words", [
    (b"[1, 2]", "the request body must be a JSON object, got a JSON list"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role is 'wizard'; it must be one of"),
    (b'{"messages": [{"content": "hi"}]}', "messages[0].role is None"),
    (b'{"messages": [{"role": "user", "content": 7}]}', "messages[0].content must be a string or a list of content "
                                                         "parts"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 3}', "n = 3 is not served: one choice per call"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -2}', "max_tokens must be a positive integer"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}', "stream = true is not served"),
    (b'{"messages": "hi"}', "messages must be a non-empty list"),
])
def test_a_request_the_endpoint_cannot_serve_is_a_400_in_openais_error_shape(model_and_tokenizer, body, words):
    _, tokenizer = model_and_tokenizer
    endpoint = _endpoint_with_one_answer(tokenizer)
    try:
        status, reply = _post(endpoint.port, "/answers/0/v1/chat/completions", body)
    finally:
        endpoint.close()
    assert status == 400 and words in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error" and set(reply["error"]) == {"message", "type", "param",
                                                                                         "code"}
    assert endpoint.requests.empty()  # nothing reached the sampler


def test_get_models_lists_the_policy_as_openai_does(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    endpoint = _endpoint_with_one_answer(tokenizer)
    try:
        models = openai.OpenAI(base_url=endpoint.base_url(0), api_key="x", max_retries=0).models.list()
        status, unknown = _post(endpoint.port, "/answers/0/v1/engines", b"", method="GET")
    finally:
        endpoint.close()
    assert [m.id for m in models.data] == ["grpokit"]
    assert status == 400 and "unknown path '/answers/0/v1/engines'" in unknown["error"]["message"]


def test_a_client_that_leaves_before_its_reply_prints_no_traceback(model_and_tokenizer, capfd):
    import struct
    import time

    _, tokenizer = model_and_tokenizer
    endpoint = _endpoint_with_one_answer(tokenizer)
    try:
        body = json.dumps({"model": "p", "messages": [{"role": "user", "content": "1+1"}]}).encode()
        client = socket.create_connection(("127.0.0.1", endpoint.port))
        client.sendall(b"POST /answers/0/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                       % (len(body), body))
        job = endpoint.requests.get(timeout=30)  # the call waits for the sampler ...
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # ... and its client goes away (a reset, as a killed agent's connection)
        time.sleep(0.3)
        job.tokens, job.logps, job.finished = tokenizer.encode("2") + [tokenizer.eos_token_id], [0.0, 0.0], True
        job.done.set()
        deadline = time.monotonic() + 30
        while not endpoint.answers[0].messages and time.monotonic() < deadline:  # recorded, then the reply fails
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        endpoint.close()
    assert endpoint.answers[0].messages, "the call was never answered"
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "ConnectionResetError" not in err, err


def _long_prompt_agent(errors_file) -> str:
    return f"""
import openai

def agent(base_url, row):
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    answer = int(base_url.rstrip("/").split("/")[-2])
    long = "7" * 600  # more tokens than the tiny model's 512 positions
    messages = [{{"role": "user", "content": long if answer % 2 == 0 else row["prompt"]}}]
    try:
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
        messages += [{{"role": "assistant", "content": reply.choices[0].message.content}},
                     {{"role": "user", "content": long}}]
        client.chat.completions.create(model="policy", messages=messages)  # a later turn past the context
    except openai.BadRequestError as e:
        with open({str(errors_file)!r}, "a") as f:
            f.write(f"{{answer}} {{e.status_code}} {{e.body['message']}}\\n")
        raise
    return "unreachable"
"""


def test_an_agent_prompt_past_the_context_is_a_400_and_a_failed_answer_not_the_runs_end(tool_model_dir, tmp_path):
    """Issue 43 point 2: `prompt 0 has 618 tokens ... max_position_embeddings=512` from the sampler ended the run
    (exit 1), on the first call or a later turn. Now the call is refused with HTTP 400, the answer fails."""
    errors = tmp_path / "errors.txt"
    (tmp_path / "agents.py").write_text(_long_prompt_agent(errors))
    config = make_config(tool_model_dir, tmp_path / "run", steps=1, prompts_per_step=1, max_new_tokens=8)
    config = dataclasses.replace(config, tools=ToolsConfig(agent=f"{tmp_path / 'agents.py'}:agent"))
    run = train(config, reward_functions=[lambda completions, **_: [float(len(c[-1]["content"])) for c in completions]])
    assert read_metrics(run)[0]["agent/failed"] == 1.0
    lines = errors.read_text().splitlines()
    assert {int(line.split()[0]) % 2 for line in lines} == {0, 1}  # the first call, and a later turn
    for line in lines:
        assert " 400 grpokit: the conversation is " in line and "the model's context (max_position_embeddings) is " \
               "512 positions" in line and "shorten the messages" in line, line


def test_calls_batched_together_are_each_sampled_within_the_context(model_and_tokenizer):
    """A call near the context's end sampled beside one that may answer at length: the batch's longest answer
    would pass the context for the first (a ValueError from the sampler, the run's end); each fits instead."""
    model, tokenizer = model_and_tokenizer
    render = lambda text: tokenizer.apply_chat_template([{"role": "user", "content": text}],  # noqa: E731
                                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    long = "1" * (500 - len(render("")))
    assert 490 <= len(render(long)) <= 505

    def agent(base_url, row):
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="p", messages=[{"role": "user", "content": row["prompt"]}])
        return reply.choices[0].message.content

    engine = AgentEngine(agent, HFEngine(model, tokenizer), tokenizer, time_limit_s=60, batch_wait_s=10.0)
    try:
        sampling = SamplingParams(100, (tokenizer.eos_token_id,), tokenizer.pad_token_id, ignore_eos=True)
        result = engine.generate(RolloutRequest([[0]] * 2, 1, sampling, rows=[{"prompt": long}, {"prompt": "1+1="}]))
        rollout = result.rollout
    finally:
        engine.close()
    assert result.failures == [None, None]
    lengths = rollout.completion_mask.sum(1).tolist()
    assert lengths[0] == 512 - len(render(long)) and lengths[1] == 100  # each up to its own bound

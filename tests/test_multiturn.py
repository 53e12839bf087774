"""Multi-turn rollouts with tool calls: the KV-cache continuation, the log-probs the trainer sees,
tool faults, and the tool-result tokens kept out of the loss.

A random tiny model emits no tool-call syntax, so the format hooks of `sample_conversations` are
scripted here: a turn ends at any digit or "=" (frequent under a random character model), every turn
"calls" `add`, and results are rendered as their characters. What is tested is the loop itself.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from grpokit.algorithms.objectives import Accumulation, LossSpec, policy_loss
from grpokit.config.variants import LOSS_TYPES
from grpokit.models.forward import completion_logprobs
from grpokit.models.loading import load_model, load_tokenizer
from grpokit.rollout.multiturn import sample_conversations
from grpokit.rollout.request import RolloutRequest, SamplingParams
from grpokit.rollout.tools import ToolBox, ToolCall, parse_tool_calls, run_calls


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, device="cpu").eval(), load_tokenizer(tiny_model_dir)


def _setup(tok):
    digits = [tok.convert_tokens_to_ids(d) for d in "0123456789="]
    hooks = dict(parse_calls=lambda text, **_: [ToolCall("add", {"a": len(text), "b": 1})],
                 render_results=lambda results: tok.encode("<" + ",".join(r.content for r in results) + ">",
                                                           add_special_tokens=False))
    return digits, hooks


def _sample(tiny, prompts, *, temperature=1.0, seed=0, max_tool_turns=2, budget=24, group_size=3):
    model, tok = tiny
    digits, hooks = _setup(tok)
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    sampling = SamplingParams(budget, tuple(digits), tok.pad_token_id, temperature)
    request = RolloutRequest(ids, group_size, sampling, torch.Generator().manual_seed(seed), tools=ToolBox([add]))
    return sample_conversations(model, request, tokenizer=tok, max_tool_turns=max_tool_turns, **hooks)


PROMPTS = ["12+7=", "3+45=", "100+1="]


def test_tool_results_are_appended_and_marked(tiny):
    rollout, stats = _sample(tiny, PROMPTS)
    assert rollout.tool_mask is not None and rollout.tool_mask.sum() > 0
    assert max(stats.turns) > 1 and sum(stats.calls) >= sum(t - 1 for t in stats.turns)  # a result may not fit
    assert (rollout.logprobs[rollout.tool_mask.bool()] == 0).all()  # context, not sampled
    assert not (rollout.tool_mask.bool() & ~rollout.completion_mask.bool()).any()
    assert stats.per_tool["add"] == sum(stats.calls) and sum(stats.failures) == 0
    assert max(stats.turns) <= 3  # max_tool_turns = 2: at most two tool rounds
    assert (rollout.completion_mask.sum(-1) <= 24).all()


def test_sampled_log_probs_equal_a_full_recompute_of_the_compacted_sequence(tiny):
    model, _ = tiny
    rollout, _ = _sample(tiny, PROMPTS)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                      rollout.completion_mask)
    action = rollout.action_mask.bool()
    torch.testing.assert_close(logp[action], rollout.logprobs[action], atol=1e-4, rtol=0)


def _reprefill_reference(tiny, prompt: str, *, max_tool_turns=2, budget=24) -> list[int]:
    """Greedy multi-turn decoding by brute force: the whole conversation runs again for every token."""
    model, tok = tiny
    digits, hooks = _setup(tok)
    prompt_ids, out, turn_start, turns = tok.encode(prompt, add_special_tokens=False), [], 0, 1
    while True:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt_ids + out])).logits[0, -1]
        t = int(logits.argmax())
        out.append(t)
        if t in digits:
            text = tok.decode(out[turn_start:])  # special tokens kept, as the sampler passes it
            calls = hooks["parse_calls"](text)
            if not calls or turns > max_tool_turns:
                return out
            results = ToolBox([add]).run(calls)
            suffix = hooks["render_results"](results)
            if len(out) + len(suffix) >= budget:
                return out
            out += suffix
            turn_start, turns = len(out), turns + 1
        elif len(out) >= budget:
            return out


def test_the_kv_cache_continuation_gives_the_tokens_of_a_full_reprefill(tiny):
    rollout, stats = _sample(tiny, PROMPTS, temperature=0.0, group_size=1)
    assert max(stats.turns) > 1
    for i, prompt in enumerate(PROMPTS):
        got = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
        assert got == _reprefill_reference(tiny, prompt)


def test_batched_rows_equal_rows_sampled_alone(tiny):
    together, _ = _sample(tiny, PROMPTS, temperature=0.0, group_size=1)
    for i, prompt in enumerate(PROMPTS):
        alone, _ = _sample(tiny, [prompt], temperature=0.0, group_size=1)
        row = together.completion_ids[i][together.completion_mask[i].bool()]
        assert torch.equal(row, alone.completion_ids[0][alone.completion_mask[0].bool()])


def test_an_answer_capped_by_the_budget_is_truncated_and_within_it(tiny):
    rollout, _ = _sample(tiny, PROMPTS, budget=6, max_tool_turns=8)
    lengths = rollout.completion_mask.sum(-1)
    assert (lengths <= 6).all()
    assert rollout.truncated.any()


# ---- tools: parsing and faults --------------------------------------------------------------------


def test_tool_calls_are_read_in_the_hermes_format():
    text = ('I will add. <tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 3, "b": 4}), ToolCall("add", {"a": 1, "b": 2})]
    assert parse_tool_calls("no call here") == []


@pytest.mark.parametrize("text, message", [
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>["add"]</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', '"arguments" must be a JSON object'),
])
def test_malformed_calls_are_failed_calls_not_crashes(text, message):
    (call,) = parse_tool_calls(text)
    (result,) = ToolBox([add]).run([call])
    assert result.failed and message in json.loads(result.content)["error"]


def test_tool_faults_become_error_results():
    def boom(x: int) -> int:
        """Fail.

        Args:
            x: Anything.
        """
        raise ValueError("no")

    def hang(x: int) -> int:
        """Never answer in time.

        Args:
            x: Anything.
        """
        time.sleep(3)
        return x

    async def twice(x: int) -> int:
        """Double, asynchronously.

        Args:
            x: The number.
        """
        return 2 * x

    box = ToolBox([add, boom, hang, twice], timeout_s=0.3)
    t0 = time.perf_counter()
    results = box.run([ToolCall("boom", {"x": 1}), ToolCall("hang", {"x": 1}), ToolCall("nope", {}),
                       ToolCall("add", {"a": 1}), ToolCall("twice", {"x": 21}), ToolCall("add", {"a": 1, "b": 2})])
    assert time.perf_counter() - t0 < 2.5  # the hanging call does not hold the rollout
    assert [r.failed for r in results] == [True, True, True, True, False, False]
    assert "ValueError: no" in results[0].content
    assert "did not answer within 0.3 s" in results[1].content
    assert "unknown tool 'nope'" in results[2].content and "add" in results[2].content
    assert "wrong arguments ['a']" in results[3].content
    assert results[4].content == "42" and results[5].content == "3"


def test_a_tool_without_a_docstring_is_refused_naming_it():
    def bare(x):
        return x

    with pytest.raises(ValueError, match="tool 'bare'.*docstring"):
        ToolBox([bare])


# ---- the loss ignores tool-result tokens ---------------------------------------------------------


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_tool_tokens_carry_no_gradient_and_do_not_change_the_loss(loss_type, beta):
    g = torch.Generator().manual_seed(0)
    N, T = 6, 10
    completion = torch.ones(N, T)
    completion[:, 8:] = 0
    tool = torch.zeros(N, T)
    tool[:, 3:5] = 1  # a tool result in the middle of every answer
    action = completion * (1 - tool)
    old, ref = torch.randn(N, T, generator=g) * 0.3, torch.randn(N, T, generator=g) * 0.3
    adv = torch.randn(N, generator=g)

    def loss_with(noise: float):
        logp = (old + 0.1 * torch.randn(N, T, generator=torch.Generator().manual_seed(1))).clone()
        logp = logp + noise * tool  # anything at the tool positions
        logp.requires_grad_(True)
        loss, _ = policy_loss(logp, old + noise * tool, adv, action,
                              LossSpec(beta=beta, loss_type=loss_type, max_completion_length=T),
                              ref_logp=ref - noise * tool, accumulation=Accumulation(action.sum()))
        loss.backward()
        return loss.item(), logp.grad

    base, grad = loss_with(0.0)
    moved, grad_moved = loss_with(5.0)
    assert moved == pytest.approx(base, rel=1e-6, abs=1e-7)
    assert (grad[tool.bool()] == 0).all() and (grad_moved[tool.bool()] == 0).all()
    torch.testing.assert_close(grad, grad_moved)


def _slow(x: int) -> int:
    """Never answer in time.

    Args:
        x: Anything.
    """
    time.sleep(3)
    return x


def test_hanging_calls_of_many_answers_cost_one_timeout_and_later_calls_still_work():
    box = ToolBox([_slow, add], timeout_s=0.3)
    t0 = time.perf_counter()
    results = run_calls([[(box, ToolCall("_slow", {"x": i}))] for i in range(20)])
    assert time.perf_counter() - t0 < 1.5  # answers wait at the same time, not one after another
    assert all(r[0].failed and "within 0.3 s" in r[0].content for r in results)
    t0 = time.perf_counter()
    assert box.run([ToolCall("add", {"a": 1, "b": 2})])[0].content == "3"  # no worker pool to run out of
    assert time.perf_counter() - t0 < 0.25


def test_one_answers_calls_run_in_the_order_written():
    log = []

    def step(n: int) -> int:
        """Record a step.

        Args:
            n: The step.
        """
        time.sleep(0.01 * (5 - n))  # later calls are faster: run at once, they would finish first
        log.append(n)
        return n

    box = ToolBox([step])
    run_calls([[(box, ToolCall("step", {"n": n})) for n in range(5)]])
    assert log == [0, 1, 2, 3, 4]


def test_a_tool_raising_system_exit_is_a_failed_call():
    def leave(x: int) -> int:
        """Exit.

        Args:
            x: Anything.
        """
        raise SystemExit(3)

    (result,) = ToolBox([leave]).run([ToolCall("leave", {"x": 1})])
    assert result.failed and "SystemExit" in result.content


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compacting_the_cache_changes_neither_tokens_nor_log_probs(tiny, monkeypatch, temperature):
    """Holes dropped from the cache at every step (slack 0.5): the same samples, and log-probs that a
    full recompute of the compacted sequence reproduces."""
    import functools

    import grpokit.rollout.multiturn as multiturn
    from grpokit.rollout.decode import Decoder

    loose, _ = _sample(tiny, PROMPTS, temperature=temperature)
    calls = []
    real_keep = Decoder.keep_columns
    monkeypatch.setattr(Decoder, "keep_columns", lambda self, c: calls.append(c.shape) or real_keep(self, c))
    monkeypatch.setattr(multiturn, "_compact", functools.partial(multiturn._compact, slack=0.5))
    tight, _ = _sample(tiny, PROMPTS, temperature=temperature)
    assert calls  # the cache was compacted
    assert torch.equal(loose.completion_ids, tight.completion_ids)
    torch.testing.assert_close(loose.logprobs, tight.logprobs, atol=1e-5, rtol=0)
    model, _ = tiny
    with torch.no_grad():
        logp, _ = completion_logprobs(model, tight.prompt_ids, tight.prompt_mask, tight.completion_ids,
                                      tight.completion_mask)
    action = tight.action_mask.bool()
    torch.testing.assert_close(logp[action], tight.logprobs[action], atol=1e-4, rtol=0)


def test_turn_by_turn_sampling_gives_the_answers_of_the_kv_cache_sampler(tiny):
    """`converse` (for engines that cannot append to their cache: a whole-context prefill per turn)
    and `sample_conversations` (one KV cache) follow the same rules: greedy, the same answers."""
    from grpokit.rollout.decode import sample_groups
    from grpokit.rollout.multiturn import converse

    model, tok = tiny
    digits, hooks = _setup(tok)

    def generate_turns(contexts, max_tokens):
        turns = []
        for context, m in zip(contexts, max_tokens):
            r = sample_groups(model, RolloutRequest([context], 1, SamplingParams(m, tuple(digits), tok.pad_token_id,
                                                                                 temperature=0.0)))
            n = int(r.completion_mask[0].sum())
            turns.append((r.completion_ids[0, :n].tolist(), r.logprobs[0, :n].tolist()))
        return turns

    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    request = RolloutRequest(ids, 1, SamplingParams(24, tuple(digits), tok.pad_token_id), tools=ToolBox([add]))
    by_turn, stats = converse(request, tokenizer=tok, max_tool_turns=2, generate_turns=generate_turns, device="cpu",
                              **hooks)
    cached, cached_stats = _sample(tiny, PROMPTS, temperature=0.0, group_size=1)
    assert max(stats.turns) > 1
    assert torch.equal(by_turn.completion_ids, cached.completion_ids)
    assert torch.equal(by_turn.tool_mask, cached.tool_mask) and torch.equal(by_turn.truncated, cached.truncated)
    torch.testing.assert_close(by_turn.logprobs, cached.logprobs, atol=1e-5, rtol=0)
    assert stats.conversations == cached_stats.conversations and stats.calls == cached_stats.calls


def test_the_vllm_engine_runs_tool_calls_turn_by_turn(tiny_model_dir, tiny, monkeypatch):
    """VLLMEngine with tools (against the CPU stand-in for vLLM in tests/fake_vllm): one request per
    answer and turn, the conversation so far as token ids; tool results marked as in the HF engine."""
    import functools
    import importlib.util
    from pathlib import Path

    import grpokit.rollout.vllm.engine as vllm_engine
    from grpokit.rollout.multiturn import converse
    from grpokit.rollout.request import RolloutRequest, SamplingParams
    from grpokit.rollout.vllm.colocated import ColocatedLLM

    path = Path(__file__).parent / "fake_vllm" / "vllm" / "__init__.py"
    spec = importlib.util.spec_from_file_location("grpokit_test_fake_vllm", path)
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)  # under its own name: `vllm` stays uninstalled for the other tests
    _, tok = tiny
    digits, hooks = _setup(tok)
    monkeypatch.setattr(vllm_engine, "converse", functools.partial(converse, **hooks))
    engine = vllm_engine.VLLMEngine(ColocatedLLM(fake.LLM(str(tiny_model_dir), "float32"), fake), tokenizer=tok,
                                    tools=ToolBox([add]), max_tool_turns=2)
    sampling = SamplingParams(max_new_tokens=24, eos_token_ids=tuple(digits), pad_token_id=tok.pad_token_id)
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    result = engine.generate(RolloutRequest(ids, 2, sampling, torch.Generator().manual_seed(0)))
    rollout, stats = result.rollout, result.tool_stats
    assert rollout.completion_ids.shape[0] == 6 and max(stats.turns) > 1 and sum(stats.calls) > 0
    assert rollout.tool_mask.sum() > 0 and (rollout.logprobs[rollout.tool_mask.bool()] == 0).all()
    assert (rollout.completion_mask.sum(-1) <= 24).all()
    model, _ = tiny
    with torch.no_grad():  # the sampler's log-probs are the trainer's, over the whole conversation
        logp, _ = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                      rollout.completion_mask)
    action = rollout.action_mask.bool()
    torch.testing.assert_close(logp[action], rollout.logprobs[action], atol=1e-4, rtol=0)

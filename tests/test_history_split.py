"""`tools.history = "split"`: conversations whose chat template rewrites earlier turns train as several rows.

The template here is Qwen3-style on the tiny tokenizer: the assistant header opens `<think>` and an earlier
assistant turn is rendered without its reasoning (only what follows its `</think>`; a turn that never
closed its `<think>` keeps its text, but loses the opening `<think>` the header gave it), so every tool
round rewrites the conversation. The random model writes no call syntax, so turns end at a digit or "="
and every turn "calls" `add` (scripted, as in test_multiturn.py); the rendering, the forks, the rows and
the training are the real path.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import make_config
from grpokit.config.schema import ToolsConfig
from grpokit.errors import ConfigError, SetupError
from grpokit.models.forward import completion_logprobs
from grpokit.models.loading import load_model, load_tokenizer
from grpokit.models.tiny import TOOL_WORDS, build_char_tokenizer, build_tiny_model
from grpokit.observe.tracking import read_jsonl, read_metrics
from grpokit.rollout.engines import HFEngine
from grpokit.rollout.grading import Draw
from grpokit.rollout.history import ConversationHistory
from grpokit.rollout.multiturn import converse, sample_conversations
from grpokit.rollout.request import RolloutRequest, RolloutResult, SamplingParams
from grpokit.rollout.tools import ToolBox, ToolCall, check_tool_template
from grpokit.training.generate import GenerationBatch
from grpokit.training.loop import train
from grpokit.training.split_rows import check_history_setup, split_rows


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


_TOOLS = ("{% if tools %}tools: {% for t in tools %}{{ t['function']['name'] }}{% if not loop.last %}, {% endif %}"
          "{% endfor %}{{ '\\n' }}{% endif %}")
_CALLS = "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
# A template that rewrites nothing: each message after the first on a line of its own, the next header last.
PLAIN_TEMPLATE = (_TOOLS + "{% for m in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
                  "{{ m['role'] }}: {{ m['content'] }}" + _CALLS + "{% endfor %}"
                  "{% if add_generation_prompt %}{{ '\\n' }}assistant: {% endif %}")
# Qwen3-style: the header opens <think>; only the last message keeps its reasoning.
THINK_TEMPLATE = (_TOOLS + "{% for m in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
                  "{% if m['role'] == 'assistant' %}"
                  "{% if loop.last %}assistant: <think>{{ m['content'] }}"
                  "{% else %}assistant: {{ m['content'].split('</think>')[-1] }}{% endif %}" + _CALLS +
                  "{% else %}{{ m['role'] }}: {{ m['content'] }}{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '\\n' }}assistant: <think>{% endif %}")
PROMPTS = ["12+7=", "3+45=", "100+1="]


def _model_dir(path, template):
    tokenizer = build_char_tokenizer(words=("<think>", "</think>", *TOOL_WORDS))
    tokenizer.chat_template = template
    build_tiny_model(path, tokenizer=tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seed=0)
    return path


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("think-model"), THINK_TEMPLATE)


@pytest.fixture(scope="module")
def tiny(think_dir):
    return load_model(think_dir, device="cpu").eval(), load_tokenizer(think_dir)


def _digits(tok):
    return [tok.convert_tokens_to_ids(d) for d in "0123456789="]


def _scripted(text, **_):
    return [ToolCall("add", {"a": len(text), "b": 1})]


def _prompt_ids(tok, prompts=PROMPTS):
    box = ToolBox([add])
    return [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                        tools=box.schemas), add_special_tokens=False)["input_ids"] for p in prompts]


def _sample(tiny, *, template=None, history=True, G=2, temperature=1.0, budget=40, seed=0, history_cls=None):
    model, tok = tiny
    if template is not None:
        tok.chat_template = template
    box = ToolBox([add])
    renderer = (history_cls or ConversationHistory)(tok, PROMPTS, [box.schemas] * len(PROMPTS)).repeat(G) \
        if history else None
    sampling = SamplingParams(budget, tuple(_digits(tok)), tok.pad_token_id, temperature)
    request = RolloutRequest(_prompt_ids(tok), G, sampling, torch.Generator().manual_seed(seed), tools=box,
                             history=renderer)
    return sample_conversations(model, request, tokenizer=tok, max_tool_turns=2, parse_calls=_scripted)


def _batch(rollout, advantages=None, token_advantages=None):
    N = rollout.num_sequences
    draw = Draw(rollout, torch.zeros(N, 1), torch.zeros(N), ["p"] * N, ["t"] * N)
    adv = torch.arange(N, dtype=torch.float32) if advantages is None else advantages
    return GenerationBatch(draw, adv, rollout.action_mask.clone(), token_advantages=token_advantages)


def _recompute(model, rows):
    with torch.no_grad():
        logp, _ = completion_logprobs(model, rows.prompt_ids, rows.prompt_mask, rows.completion_ids,
                                      rows.completion_mask)
    return logp


@pytest.fixture()
def think(tiny):
    tiny[1].chat_template = THINK_TEMPLATE
    return tiny


def test_a_template_that_drops_earlier_think_forks_and_each_rows_log_probs_equal_a_full_recompute(think):
    model, tok = think
    rollout, stats = _sample(think)
    assert rollout.forks is not None and rollout.forks.any
    assert max(stats.turns) > 1
    # every tool round rewrote the conversation: one row per turn, none appended
    assert [len(s) for s in rollout.forks.starts] == [t - 1 for t in stats.turns]
    assert rollout.tool_mask.sum() == 0
    batch, metrics = split_rows(_batch(rollout), tok.pad_token_id)
    rows = batch.rollout
    assert rows.num_sequences == sum(stats.turns) and metrics["tools/rows_per_answer"] == sum(stats.turns) / 6
    assert metrics["tools/fork_frac"] == 1.0
    action = rows.action_mask.bool()
    torch.testing.assert_close(_recompute(model, rows)[action], rows.logprobs[action], atol=1e-4, rtol=0)
    # every sampled token is trained once: the rows' completions, one after another, are the answer's stream
    for i in range(rollout.num_sequences):
        mine = (batch.conversation == i).nonzero().flatten()
        joined = torch.cat([rows.completion_ids[k][rows.completion_mask[k].bool()] for k in mine])
        assert torch.equal(joined, rollout.completion_ids[i][rollout.completion_mask[i].bool()])
        assert (batch.row_advantages[mine] == i).all()  # each row carries its answer's advantage
        think = tok.convert_tokens_to_ids("<think>")
        for k, start in zip(mine[1:], rollout.forks.starts[i]):  # a later row's prompt: the earlier turns without
            prompt = rows.prompt_ids[k][rows.prompt_mask[k].bool()]  # the <think> each header opened
            written = int((rollout.completion_ids[i, :start] == think).sum())  # the model's own <think>s stay
            assert int((prompt == think).sum()) == written + 1  # and the new header's
            assert tok.decode(prompt).endswith("\nassistant: <think>") and "\ntool: " in tok.decode(prompt)


def test_a_template_that_rewrites_nothing_stays_one_row_token_for_token_as_append(tiny):
    split, split_stats = _sample(tiny, template=PLAIN_TEMPLATE)
    appended, stats = _sample(tiny, template=PLAIN_TEMPLATE, history=False)
    assert max(stats.turns) > 1 and appended.tool_mask.sum() > 0
    assert not split.forks.any and appended.forks is None
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "truncated"):
        assert torch.equal(getattr(split, name), getattr(appended, name)), name
    assert torch.equal(split.logprobs, appended.logprobs)
    assert split_stats.conversations == stats.conversations
    batch = _batch(split)
    same, metrics = split_rows(batch, tiny[1].pad_token_id)
    assert same is batch and same.rows is None and metrics == {"tools/rows_per_answer": 1.0, "tools/fork_frac": 0.0}


class _SummarisesAtTheSecondRound(ConversationHistory):
    """A summarising agent's context: from the second tool round on, the first assistant turn is replaced by a
    note. Round one continues the row, round two forks: a row then holds two turns and a tool result."""

    def render(self, i, messages):
        if sum(m["role"] == "assistant" for m in messages) >= 2:
            messages = [{"role": "assistant", "content": "(summary)"}, *messages[1:]]
        return super().render(i, messages)


def test_rows_that_hold_several_turns_keep_their_tool_results_and_per_turn_advantages(tiny):
    model, tok = tiny
    rollout, stats = _sample(tiny, template=PLAIN_TEMPLATE, history_cls=_SummarisesAtTheSecondRound, budget=60)
    assert any(t == 3 for t in stats.turns)
    token_adv = rollout.turns.token_turn.float() * 10 + torch.arange(rollout.num_sequences)[:, None]  # [N, T]
    batch, _ = split_rows(_batch(rollout, token_advantages=token_adv), tok.pad_token_id)
    rows = batch.rollout
    action = rows.action_mask.bool()
    torch.testing.assert_close(_recompute(model, rows)[action], rows.logprobs[action], atol=1e-4, rtol=0)
    for i, turns in enumerate(stats.turns):
        mine = (batch.conversation == i).nonzero().flatten().tolist()
        assert len(mine) == (2 if turns == 3 else 1)
        if turns == 3:
            first, second = mine
            assert rows.tool_mask[first].sum() > 0 and rows.tool_mask[second].sum() == 0  # round one appended
            assert set(rows.turns.token_turn[first][action[first]].tolist()) == {0, 1}
            assert set(rows.turns.token_turn[second][action[second]].tolist()) == {2}
            assert "(summary)" in tok.decode(rows.prompt_ids[second])
        for k in mine:  # each token's advantage is its own turn's: 10 * turn + answer
            turn = rows.turns.token_turn[k][action[k]]
            assert torch.equal(batch.token_advantages[k][action[k]], turn.float() * 10 + i)
            assert (batch.loss_mask[k] == rows.action_mask[k]).all()


def test_turn_by_turn_sampling_forks_and_its_rows_recompute_exactly(think):
    """`converse` (vLLM's path: the next turn's context as token ids, a whole-context prefill per turn) with the
    same history: a forked answer's next turn is sampled from the rendering, and each row recomputes exactly."""
    from grpokit.rollout.decode import sample_groups

    model, tok = think
    digits, generator = _digits(tok), torch.Generator().manual_seed(0)

    def generate_turns(contexts, max_tokens):
        turns = []
        for context, m in zip(contexts, max_tokens):
            r = sample_groups(model, RolloutRequest([context], 1, SamplingParams(m, tuple(digits), tok.pad_token_id),
                                                    generator))
            n = int(r.completion_mask[0].sum())
            turns.append((r.completion_ids[0, :n].tolist(), r.logprobs[0, :n].tolist()))
        return turns

    box = ToolBox([add])
    history = ConversationHistory(tok, PROMPTS, [box.schemas] * 3).repeat(2)
    request = RolloutRequest(_prompt_ids(tok), 2, SamplingParams(40, tuple(digits), tok.pad_token_id), tools=box,
                             history=history)
    rollout, stats = converse(request, tokenizer=tok, max_tool_turns=2, generate_turns=generate_turns, device="cpu",
                              parse_calls=_scripted)
    assert [len(s) for s in rollout.forks.starts] == [t - 1 for t in stats.turns] and rollout.forks.any
    batch, _ = split_rows(_batch(rollout), tok.pad_token_id)
    rows = batch.rollout
    assert rows.num_sequences == sum(stats.turns)
    action = rows.action_mask.bool()
    torch.testing.assert_close(_recompute(model, rows)[action], rows.logprobs[action], atol=1e-4, rtol=0)


def test_the_append_check_refuses_a_rewriting_template_and_names_split(think):
    _, tok = think
    with pytest.raises(ValueError, match='tools.history = "split"'):
        check_tool_template(tok, ToolBox([add]))
    check_tool_template(tok, ToolBox([add]), history="split")  # the whole probe conversation renders


def test_settings_split_cannot_serve_are_refused_at_start(think_dir, tmp_path):
    with pytest.raises(ConfigError, match="tools.history"):
        ToolsConfig(history="rewrite")
    config = dataclasses.replace(make_config(think_dir, tmp_path / "run"), tools=ToolsConfig(history="split"))
    with pytest.raises(SetupError, match='tools.history = "split" renders multi-turn conversations'):
        check_history_setup(config, None, None)
    box = ToolBox([add])
    check_history_setup(config, box, None)
    asynchronous = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, mode="async"))
    check_history_setup(asynchronous, box, None)  # async is served (tests/test_async_split.py)
    with pytest.raises(SetupError, match="tools.history"):  # through train(): before any model loads
        train(dataclasses.replace(config, tools=ToolsConfig(history="split")), reward_functions=[lambda **k: []])
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def _engine():
    class Scripted(HFEngine):  # turns end at a digit or "=" and always call `add`; the history is the real one
        def generate(self, request):
            s = request.sampling
            s = SamplingParams(s.max_new_tokens, tuple(_digits(self.tokenizer)), s.pad_token_id, s.temperature)
            rollout, stats = sample_conversations(self.model, dataclasses.replace(request, sampling=s),
                                                  tokenizer=self.tokenizer, max_tool_turns=2, parse_calls=_scripted)
            return RolloutResult(rollout, tool_stats=stats)

    return lambda config, model, tokenizer: Scripted(model, tokenizer, tools=ToolBox([add]))


def final_parity(completions, **kwargs):
    text = [c[-1]["content"] for c in completions]
    return [sum(ord(ch) % 2 == 0 for ch in t) / max(1, len(t)) for t in text]


@pytest.mark.parametrize("algorithm, train_options", [
    ({"is_correction": "token_truncate"}, {}),  # the trainer's log-probs of each row against the sampler's
    ({"num_iterations": 2, "turn_advantage": "mt_grpo"}, {"minibatch_size": 4, "micro_batch_size": 2}),
])
def test_a_run_with_a_rewriting_template_trains_on_the_rows(think_dir, tmp_path, algorithm, train_options):
    config = make_config(think_dir, tmp_path / "run", steps=3, max_new_tokens=40, prompts_per_step=2,
                         algorithm=algorithm, train=train_options, output={"completions_every": 1})
    config = dataclasses.replace(config, tools=ToolsConfig(history="split", max_calls=2))
    run = train(config, reward_functions=[final_parity], tools=[add], engine=_engine())
    metrics = read_metrics(run)
    assert len(metrics) == 3
    assert all(m["tools/rows_per_answer"] > 1 and m["tools/fork_frac"] == 1.0 for m in metrics)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    if "is_correction" in algorithm:  # a row trained from the wrong context would show here
        assert max(m["sampling/logprob_gap_max"] for m in metrics) < 1e-4
    rows = read_jsonl(run / "completions.jsonl")
    assert len(rows) == 3 * 8  # one per answer, not per training row
    assert all(json.dumps(r["conversation"]) and isinstance(r["advantage"], float) for r in rows)


def test_held_out_evaluation_samples_from_the_rendered_conversation(think, monkeypatch):
    """`[eval]` with tools.history = "split" samples as training does; append cannot run this template at all."""
    import grpokit.rollout.multiturn as multiturn
    from grpokit.rewards.core import RewardSpec
    from grpokit.training.evaluation import EvalSettings, ToolUse, evaluate

    model, tok = think
    monkeypatch.setattr(multiturn, "call_parser", lambda tokenizer: _scripted)
    rows = [{"prompt": p} for p in PROMPTS]
    specs = [RewardSpec("final_parity", final_parity, 1.0)]
    settings = EvalSettings(SamplingParams(40, tuple(_digits(tok)), tok.pad_token_id), samples_per_prompt=2,
                            greedy=False)
    tool_use = ToolUse(ToolBox([add]), max_tool_turns=2)
    result = evaluate(model, tok, rows, _prompt_ids(tok), specs, settings,
                      tool_use=dataclasses.replace(tool_use, history="split"))
    assert result["tool_call_share"] == 1.0 and 0 <= result["mean_reward"] <= 1
    with pytest.raises(ValueError, match='tools.history = "split"'):
        evaluate(model, tok, rows, _prompt_ids(tok), specs, settings, tool_use=tool_use)


def test_forks_travel_with_their_answers_through_dynamic_samplings_filter_and_join(think):
    model, tok = think
    rollout, _ = _sample(think)
    total = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.5, 0.5])  # group 0 and group 2 have no signal
    draw = Draw(rollout, total[:, None], total, ["p"] * 6, ["t"] * 6)
    kept = draw.with_signal(2)
    assert kept.size == 2 and kept.rollout.forks == rollout.forks[torch.tensor([2, 3])]
    plain, _ = _sample(think, history=False, template=PLAIN_TEMPLATE, G=1)  # another draw, no forks recorded
    tok.chat_template = THINK_TEMPLATE
    plain_draw = Draw(plain, torch.ones(3, 1), torch.ones(3), ["p"] * 3, ["t"] * 3)
    joined = Draw.join([kept, plain_draw], 4, tok.pad_token_id, fallback=kept)
    assert joined.rollout.forks.starts == (*rollout.forks.starts[2:4], (), ())
    batch, _ = split_rows(GenerationBatch(joined, torch.zeros(4), joined.rollout.action_mask.clone()), tok.pad_token_id)
    rows = batch.rollout
    action = rows.action_mask.bool()
    torch.testing.assert_close(_recompute(model, rows)[action], rows.logprobs[action], atol=1e-4, rtol=0)

"""The built-in task that needs a tool (multiplication + calculator), its warm-start traces, evaluation
with tools (`evaluate(tool_use=...)`, `grpokit eval`), and the tool demo end to end (`--quick`)."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys

import pytest
import torch

from conftest import make_config
from grpokit.cli import main
from grpokit.config.schema import DataConfig, ToolsConfig
from grpokit.data.prompts import render_prompt
from grpokit.demo_tools import trace_sampler
from grpokit.evaluate import EvalSettings, SamplingParams, ToolUse, evaluate
from grpokit.models.loading import load_model_and_tokenizer, load_tokenizer
from grpokit.models.tiny import TOOL_CHAT_TEMPLATE, TOOL_WORDS, build_char_tokenizer, build_tiny_model
from grpokit.observe.tracking import read_metrics
from grpokit.rollout.engines import HFEngine
from grpokit.rollout.multiturn import sample_conversations
from grpokit.rollout.request import RolloutRequest
from grpokit.rollout.tools import ToolBox, ToolCall
from grpokit.sft import collate
from grpokit.tasks import calculator, get_task
from grpokit.training.loop import train
from grpokit.training.setup import resolve_tools


@pytest.fixture(scope="module")
def calc_model_dir(tmp_path_factory):
    """A random tiny model whose tokenizer has the tool template and the tool-call tags as words."""
    path = tmp_path_factory.mktemp("calc-model")
    tokenizer = build_char_tokenizer(words=TOOL_WORDS)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    build_tiny_model(path, tokenizer=tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seed=0)
    return path


def test_calculator_is_exact_and_never_runs_code():
    assert calculator("47*86") == "4042" and calculator("(2+3)*4 - 6/3") == "18" and calculator("7/2") == "3.5"
    assert calculator("-3*(4+5)/2") == "-13.5" and calculator("10000001/2") == "5000000.5"
    assert calculator("1/3") == "1/3" and calculator("1/1024") == "0.0009765625"  # exact, never rounded
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        calculator("__import__('os').system('true')")
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        calculator("9**9**9")
    with pytest.raises(ZeroDivisionError):
        calculator("1/0")
    schema = ToolBox([calculator]).schemas[0]["function"]  # a TRL-style tool: type hints + Google docstring
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]
    # through the tool box: an exception is a failed call whose result is an error for the model
    ok, bad = ToolBox([calculator]).run([ToolCall("calculator", {"expression": "12*3"}),
                                          ToolCall("calculator", {"expression": "12*"})])
    assert (ok.content, ok.failed) == ("36", False) and bad.failed and "not an arithmetic expression" in bad.content


def test_multiplication_rows_splits_and_verifier():
    task = get_task("multiplication", digits=2)
    train, held = task.generate(300, seed=0, split="train"), task.generate(50, seed=0, split="eval")
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    for r in train[:20]:
        a, b = task.operands(r)
        assert 10 <= a <= 99 and 10 <= b <= 99 and r["answer"] == str(a * b) and r["prompt"] == f"{a}*{b}="
    (score,) = task.reward_functions()
    assert score.name == "multiplication"
    conversation = [{"role": "assistant", "content": "<tool_call>...</tool_call>"},
                    {"role": "tool", "name": "calculator", "content": "4042"},
                    {"role": "assistant", "content": " 4042\n"}]
    assert score.fn([conversation, conversation[:1] + [{"role": "assistant", "content": "4041"}]],
                    answer=["4042", "4042"]) == [1.0, 0.0]
    assert [f.__name__ for f in task.tools()] == ["calculator"]
    with pytest.raises(Exception, match="digits must be an integer from 1 to 9"):
        get_task("multiplication", digits=0)


def test_one_digit_traces_stay_valid_operands_and_guesses_are_never_right():
    task, rng = get_task("multiplication", digits=1), random.Random(0)
    for _ in range(500):
        row = task.generate(1, seed=rng.randrange(10**6))[0]
        messages, answer = task.tool_trace(row, rng, no_call=0.5, wrong_argument=0.5)
        if not messages:
            assert answer != row["answer"] and int(answer) >= 0
        else:
            a, b = map(int, messages[0]["tool_calls"][0]["function"]["arguments"]["expression"].split("*"))
            assert 0 <= a <= 9 and 0 <= b <= 9


def test_tool_traces_use_the_tool_imperfectly_as_asked():
    task = get_task("multiplication")
    row = {"prompt": "47*86=", "answer": "4042"}
    rng = random.Random(0)
    messages, answer = task.tool_trace(row, rng)
    assert messages[0]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "47*86"}}
    assert messages[1] == {"role": "tool", "name": "calculator", "content": "4042"} and answer == "4042"
    for _ in range(20):
        messages, answer = task.tool_trace(row, rng, no_call=1.0)
        assert messages == [] and answer != "4042"  # a guess near the product, without the tool
        messages, answer = task.tool_trace(row, rng, wrong_argument=1.0)
        expression = messages[0]["tool_calls"][0]["function"]["arguments"]["expression"]
        a, b = map(int, expression.split("*"))
        assert abs(a - 47) + abs(b - 86) == 1 and answer == str(a * b) == messages[1]["content"]


def test_warm_start_traces_train_the_model_turns_and_mask_the_tool_result(calc_model_dir):
    _, tokenizer = load_model_and_tokenizer(calc_model_dir, device="cpu")
    task, tools = get_task("multiplication"), ToolBox([calculator])
    sample = trace_sampler(task, [{"prompt": "47*86=", "answer": "4042"}], tokenizer, tools, no_call=0.0,
                           wrong_argument=0.0)
    prompt, segments = sample(random.Random(0))
    assert prompt == render_prompt(tokenizer, "47*86=", tools=tools.schemas)
    batch = collate(tokenizer, [(prompt, segments)])
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    text = lambda keep: tokenizer.decode([t for t, lab in zip(ids, labels) if (lab != -100) == keep])  # noqa: E731
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "47*86"}}</tool_call>'
    assert text(True) == call + "<eos>4042<eos>"  # the call turn and the answer: trained
    assert text(False) == prompt + "\ntool: 4042\nassistant: "  # the prompt and the tool's result: context only
    # the untrained segment is exactly what the rollout appends after the call
    (tail,) = [s for s, train in segments if not train]
    from grpokit.rollout.tools import ToolResult, tool_suffix_ids
    assert tail == tool_suffix_ids(tokenizer, [ToolResult("calculator", "4042", False)])


def test_char_tokenizer_keeps_blanks_and_newlines_when_loaded_next_to_a_qwen2_model(calc_model_dir):
    # transformers rebuilds a qwen2 folder's tokenizer with Qwen's own pre-tokenizer, which dropped every
    # blank and newline of the character tokenizer; grpokit loads the declared generic tokenizer as is
    tokenizer = load_tokenizer(calc_model_dir)
    ids = tokenizer("a b\nc <tool_call>", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["a", " ", "b", "\n", "c", " ", "<tool_call>"]
    assert tokenizer.decode(ids) == "a b\nc <tool_call>"


def test_a_task_with_a_tool_brings_it_unless_the_run_names_its_own(calc_model_dir, tmp_path, monkeypatch):
    config = make_config(calc_model_dir, tmp_path / "run", steps=1, max_new_tokens=24)
    config = dataclasses.replace(config, data=DataConfig(task="multiplication", num_prompts=16))
    task = get_task("multiplication")
    box, environments = resolve_tools(config, task=task)
    assert list(box.functions) == ["calculator"] and environments is None

    def other(x: str) -> str:
        """Echo.

        Args:
            x: Text.
        """
        return x

    assert list(resolve_tools(config, [other], task=task)[0].functions) == ["other"]
    assert resolve_tools(config, task=get_task("addition")) == (None, None)
    assert resolve_tools(config, [], task=task) == (None, None)  # train(tools=[]): none
    no_task_tools = dataclasses.replace(config, tools=ToolsConfig(task_tools=False))
    assert resolve_tools(no_task_tools, task=task) == (None, None)
    # end to end: the run renders its prompts with the calculator and logs the tool metrics
    seen = []
    real = HFEngine.generate

    def spy(self, request):
        seen.append(self.tokenizer.decode(request.prompt_ids[0]))
        return real(self, request)

    monkeypatch.setattr(HFEngine, "generate", spy)
    run = train(config)
    assert seen[0].startswith("tools: calculator\nuser: ") and seen[0].endswith("=\nassistant: ")
    assert "tools/call_frequency" in read_metrics(run)[0]


def test_evaluate_with_tools_counts_calls_and_failures_of_the_sampled_answers(calc_model_dir, monkeypatch):
    model, tokenizer = load_model_and_tokenizer(calc_model_dir, device="cpu")
    task = get_task("multiplication")
    rows = task.generate(6, seed=0, split="eval")
    tools = ToolBox([calculator])
    ids = [tokenizer(render_prompt(tokenizer, r["prompt"], tools=tools.schemas), add_special_tokens=False)["input_ids"]
           for r in rows]
    # a random model never writes a call: script the parser so every turn "calls" the tool, half with a
    # broken expression (failed calls), and the second turn's text is the answer
    calls = iter(range(10_000))

    def scripted(text, **_):
        k = next(calls)
        return [ToolCall("calculator", {"expression": "6*7" if k % 2 else "6*"})]

    import grpokit.rollout.engines
    monkeypatch.setattr(grpokit.rollout.engines, "sample_conversations",
                        lambda *args, **kwargs: sample_conversations(*args, parse_calls=scripted, **kwargs))
    settings = EvalSettings(SamplingParams(40, pad_token_id=tokenizer.pad_token_id, temperature=1.0),
                            samples_per_prompt=2, greedy=False, seed=3)
    result = evaluate(model, tokenizer, rows, ids, task.reward_functions(), settings,
                      tool_use=ToolUse(tools, max_tool_turns=1))
    # recompute the same draw independently
    calls = iter(range(10_000))
    request = RolloutRequest(ids, 2, SamplingParams(40, (tokenizer.eos_token_id,), tokenizer.pad_token_id),
                             torch.Generator().manual_seed(3), tools=tools)
    _, stats = sample_conversations(model, request, tokenizer=tokenizer, max_tool_turns=1, parse_calls=scripted)
    assert sum(stats.calls) > 0
    assert result["tool_call_share"] == pytest.approx(sum(c > 0 for c in stats.calls) / len(stats.calls))
    assert result["tool_failure_rate"] == pytest.approx(sum(stats.failures) / sum(stats.calls))
    assert 0.0 < result["tool_failure_rate"] < 1.0
    # without tools the keys are absent (a single-turn evaluation)
    plain = evaluate(model, tokenizer, rows, ids, task.reward_functions(), EvalSettings(samples_per_prompt=1,
                                                                                       greedy=False))
    assert "tool_call_share" not in plain


def test_evaluates_old_keyword_spelling_warns_and_gives_the_same_metrics(calc_model_dir, monkeypatch):
    """`evaluate(..., samples_per_prompt=..., max_new_tokens=..., tools=..., max_tool_turns=...)` (before
    `EvalSettings` and `ToolUse`) still works, warning, and scores as the new spelling does."""
    model, tokenizer = load_model_and_tokenizer(calc_model_dir, device="cpu")
    task = get_task("multiplication")
    rows = task.generate(3, seed=0, split="eval")
    tools = ToolBox([calculator])
    ids = [tokenizer(render_prompt(tokenizer, r["prompt"], tools=tools.schemas), add_special_tokens=False)["input_ids"]
           for r in rows]
    import grpokit.rollout.engines
    monkeypatch.setattr(grpokit.rollout.engines, "sample_conversations", lambda *args, **kwargs: sample_conversations(
        *args, parse_calls=lambda text, **_: [ToolCall("calculator", {"expression": "6*7"})], **kwargs))
    with pytest.warns(DeprecationWarning, match="EvalSettings"):
        old = evaluate(model, tokenizer, rows, ids, task.reward_functions(), samples_per_prompt=2, temperature=0.9,
                       max_new_tokens=24, tools=tools, max_tool_turns=1, seed=3)
    settings = EvalSettings(SamplingParams(24, pad_token_id=tokenizer.pad_token_id, temperature=0.9),
                            samples_per_prompt=2, seed=3)
    new = evaluate(model, tokenizer, rows, ids, task.reward_functions(), settings,
                   tool_use=ToolUse(tools, max_tool_turns=1))
    assert old == new and "tool_call_share" in new


def test_eval_cli_with_a_tool_task_and_its_errors(calc_model_dir, tiny_model_dir, tmp_path, capsys):
    code = main(["eval", "--model", str(calc_model_dir), "--task", "multiplication", "--num-prompts", "3",
                 "--samples", "2", "--no-greedy", "--json", "--device", "cpu"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and {"tool_call_share", "tool_failure_rate", "accuracy"} <= set(result)
    # a model whose chat template cannot show tools: one error line naming the flag and the fix
    code = main(["eval", "--model", str(tiny_model_dir), "--task", "multiplication", "--num-prompts", "2",
                 "--device", "cpu"])
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("error: --model:") and "chat template" in err and "Traceback" not in err
    assert "--no-tools" in err  # the error says where the tool came from and how to leave it out
    bad = tmp_path / "t.py"
    bad.write_text("def f(x):\n    return x\n")
    code = main(["eval", "--model", str(calc_model_dir), "--task", "multiplication", "--tool", f"{bad}:f",
                 "--device", "cpu"])
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("error: --tool:") and "type hints" in err
    code = main(["eval", "--model", str(calc_model_dir), "--task", "multiplication", "--max-tool-calls", "0"])
    assert code != 0 and "--max-tool-calls must be >= 1" in capsys.readouterr().err
    # the task's own tool can be left out: a model without a tool template evaluates on the bare answers
    code = main(["eval", "--model", str(tiny_model_dir), "--task", "multiplication", "--num-prompts", "2",
                 "--samples", "1", "--no-greedy", "--no-tools", "--json", "--device", "cpu"])
    assert code == 0 and "tool_call_share" not in json.loads(capsys.readouterr().out)
    code = main(["eval", "--model", str(calc_model_dir), "--task", "multiplication", "--no-tools", "--tool", "x.py:f"])
    assert code != 0 and "contradict" in capsys.readouterr().err


def test_tool_demo_quick_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "grpokit.cli", "demo", "--task", "tools", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for stage in ("before", "after"):
        for key in ("accuracy", "tool_call_share", "tool_failure_rate", "greedy_accuracy"):
            assert 0.0 <= summary[stage][key] <= 1.0
    metrics = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == summary["grpo_steps"] and "tools/call_frequency" in metrics[0]
    assert "answers that call the tool" in r.stdout and "tool calls that fail" in r.stdout


@pytest.mark.slow
def test_tool_demo_learns_to_use_the_tool(tmp_path):
    """The full demo (about 9 minutes on 2 cores): held-out sampled accuracy at least 1.5x the warm
    start's, and more answers calling the tool."""
    from grpokit.demo_tools import run_tool_demo

    summary = run_tool_demo(tmp_path / "demo")
    before, after = summary["before"], summary["after"]
    assert after["accuracy"] >= 1.5 * before["accuracy"] and after["tool_call_share"] > before["tool_call_share"]

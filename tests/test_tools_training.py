"""Training with tools end to end: `train(tools=...)` and `[tools]` in TOML, the chat-template check,
metrics and the conversations kept in completions.jsonl.

The random tiny model never writes tool-call syntax by itself, so the run that must make calls uses
an engine (train's `engine=` hook) whose turn end and call parser are scripted, as in
test_multiturn.py; everything else (prompt rendering with the tools, grading, masking, metrics,
logs) is the real path.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from conftest import make_config, parity
from grpokit.config.schema import ToolsConfig
from grpokit.errors import DataError, EnvironmentFault, SetupError
from grpokit.models.tiny import TOOL_CHAT_TEMPLATE
from grpokit.observe.report import build_report
from grpokit.observe.tracking import read_jsonl, read_metrics
from grpokit.rewards.graders import completion_text
from grpokit.rollout.engines import HFEngine
from grpokit.rollout.multiturn import sample_conversations
from grpokit.rollout.request import RolloutResult, SamplingParams
from grpokit.rollout.tools import ToolBox, ToolCall
from grpokit.training.loop import train

TOOL_SOURCE = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b
'''
namespace: dict = {}
exec(TOOL_SOURCE, namespace)
add = namespace["add"]


def final_parity(completions, **kwargs):
    """With tools, prompts are conversations and completions are messages (as in TRL): score the last turn."""
    return parity([completion_text(c) for c in completions])


def scripted_engine(box: ToolBox | None, call: ToolCall | None = None, seen: list | None = None):
    """HFEngine whose turns end at a digit or "=" and always make one call (`add` unless `call` says
    otherwise): tool rounds on a random model. With environments the engine's per-answer boxes are used."""

    class Scripted(HFEngine):
        def generate(self, request):
            if seen is not None:  # the prompts as rendered, blanks dropped
                seen.extend(self.tokenizer.decode(p).replace(" ", "") for p in request.prompt_ids)
            digits = [self.tokenizer.convert_tokens_to_ids(d) for d in "0123456789="]
            s = request.sampling
            s = SamplingParams(s.max_new_tokens, tuple(digits), s.pad_token_id, s.temperature)
            rollout, stats = sample_conversations(
                self.model, dataclasses.replace(request, sampling=s, tools=request.tools or box),
                tokenizer=self.tokenizer, max_tool_turns=2,
                parse_calls=lambda text, **_: [call or ToolCall("add", {"a": len(text), "b": 1})])
            return RolloutResult(rollout, tool_stats=stats)

    return lambda config, model, tokenizer: Scripted(model, tokenizer)


def test_a_run_with_tool_calls_trains_logs_them_and_keeps_the_conversations(tool_model_dir, tmp_path):
    config = make_config(tool_model_dir, tmp_path / "run", steps=2, max_new_tokens=64,
                         output={"completions_every": 1})
    run = train(config, reward_functions=[final_parity], tools=[add], engine=scripted_engine(ToolBox([add])))
    metrics = read_metrics(run)
    assert len(metrics) == 2
    for m in metrics:
        assert m["tools/call_frequency"] > 0 and m["tools/failure_frequency"] == 0
        assert m["tools/turns_per_answer"] > 1 and m["tools/calls/add"] == m["tools/call_frequency"]
        assert m["time/tools"] >= 0 and torch.isfinite(torch.tensor(m["loss"]))
        assert m["completions/mean_length"] < 64  # sampled tokens only: the tool results fill the rest
    page = build_report(run).read_text()
    assert page.count('class="turn tool"') > 0 and 'class="turn assistant"' in page  # tool results set apart
    rows = read_jsonl(run / "completions.jsonl")
    conversation = rows[0]["conversation"]
    assert conversation[0]["role"] == "assistant"
    assert any(msg["role"] == "tool" and msg["name"] == "add" for row in rows for msg in row["conversation"])


def test_tools_from_toml_render_into_the_prompts(tool_model_dir, tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(TOOL_SOURCE)
    monkeypatch.chdir(tmp_path)
    config = dataclasses.replace(make_config(tool_model_dir, tmp_path / "run", steps=1, max_new_tokens=8),
                                 tools=ToolsConfig(functions=("my_tools.py:add",), max_calls=2, timeout_s=5))
    seen = []
    real = HFEngine.generate

    def spy(self, request):
        seen.append(self.tokenizer.decode(request.prompt_ids[0]))
        return real(self, request)

    monkeypatch.setattr(HFEngine, "generate", spy)
    run = train(config, reward_functions=[final_parity])
    assert seen[0].startswith("tools: add\n")
    assert "tools/call_frequency" in read_metrics(run)[0]


def test_a_chat_template_without_tools_is_refused_before_the_model_loads(tiny_model_dir, tmp_path):
    config = make_config(tiny_model_dir, tmp_path / "run", steps=1)
    with pytest.raises(SetupError, match="tools: .*ignores the tools.*chat_template"):
        train(config, reward_functions=[final_parity], tools=[add])
    assert not (tmp_path / "run").exists()


def test_a_tool_without_a_docstring_is_refused_naming_the_field(tool_model_dir, tmp_path):
    def bare(x):
        return x

    config = make_config(tool_model_dir, tmp_path / "run", steps=1)
    with pytest.raises(SetupError, match="tools.functions: tool 'bare'"):
        train(config, reward_functions=[final_parity], tools=[bare])


def test_the_loss_mask_of_a_multi_turn_batch_leaves_out_the_tool_results(tool_model_dir, tmp_path):
    from grpokit.models.loading import load_model, load_tokenizer
    from grpokit.rewards.core import RewardSpec
    from grpokit.rollout.side import PromptTable, RolloutSide
    from grpokit.training.generate import generate_and_grade

    model, tok = load_model(tool_model_dir, device="cpu"), load_tokenizer(tool_model_dir)
    config = make_config(tool_model_dir, tmp_path / "run", max_new_tokens=64, prompts_per_step=2)
    rows = [{"prompt": p} for p in ("12+7=", "3+45=")]
    prompts = PromptTable(rows, [tok.encode(r["prompt"], add_special_tokens=False) for r in rows], [tok.eos_token_id])

    class Stream:
        def next_batch(self):
            return [0, 1]

    engine = scripted_engine(ToolBox([add]))(config, model, tok)
    side = RolloutSide.for_training(config, prompts, [RewardSpec("p", final_parity)], engine, tok)
    batch, metrics = generate_and_grade(config, side, Stream(), torch.Generator().manual_seed(0))
    r = batch.rollout
    assert r.tool_mask.sum() > 0 and metrics["tools/call_frequency"] > 0
    assert torch.equal(batch.loss_mask, r.completion_mask * (1 - r.tool_mask))
    assert batch.loss_mask[r.tool_mask.bool()].sum() == 0


# ---- environments (TRL's environment_factory) -----------------------------------------------------

ENV_SOURCE = '''
class Counter:
    """A TRL-style environment: reset with the row, one tool method, its own reward."""

    def reset(self, **row):
        self.count = 0
        return OBSERVATION

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count)
'''


def counter_class(observation=None):
    namespace = {"OBSERVATION": observation}
    exec(ENV_SOURCE, namespace)
    return namespace["Counter"]


def test_an_environment_gives_each_answer_its_own_instance_tools_and_reward(tool_model_dir, tmp_path):
    seen, pairs = [], []

    def own_counts(completions, environments, **kwargs):
        seen.append(environments)
        shown = [sum(m["role"] == "tool" for m in c) for c in completions]  # results the answer saw
        pairs.extend(zip(shown, [env.count for env in environments]))
        return [float(env.count) for env in environments]

    config = make_config(tool_model_dir, tmp_path / "run", steps=2, max_new_tokens=64)
    run = train(config, reward_functions=[own_counts], environment_factory=counter_class(),
                engine=scripted_engine(None, ToolCall("increment", {"step": 1})))
    metrics = read_metrics(run)
    for m in metrics:
        assert m["tools/call_frequency"] > 0 and m["tools/failure_frequency"] == 0
        # every successful call added 1 to the answer's own counter: its reward is its own call count
        assert m["rewards/Counter/mean"] == pytest.approx(m["tools/call_frequency"])
        assert m["rewards/own_counts/mean"] == pytest.approx(m["rewards/Counter/mean"])
    # each answer's own instance counted its own calls: those it saw, plus one whose result did not fit
    assert all(shown <= count <= shown + 1 for shown, count in pairs) and any(count for _, count in pairs)
    batch = seen[0]
    assert len(batch) == 4 * 4 and len({id(env) for env in batch}) == len(batch)  # one instance per answer
    assert seen[1][0] is seen[0][0]  # pooled: the next batch resets the same instances


def test_what_reset_returns_is_appended_to_each_answers_prompt(tool_model_dir, tmp_path, monkeypatch):
    seen = []
    real = HFEngine.generate

    def spy(self, request):
        seen.append((len(request.prompt_ids), request.group_size, self.tokenizer.decode(request.prompt_ids[0])))
        return real(self, request)

    monkeypatch.setattr(HFEngine, "generate", spy)
    config = make_config(tool_model_dir, tmp_path / "run", steps=1, max_new_tokens=8)
    train(config, environment_factory=counter_class(observation="(start at zero)"))
    n_prompts, group, text = seen[0]
    assert (n_prompts, group) == (16, 1)  # each answer its own prompt
    assert "(startatzero)" in text.replace(" ", "") and text.replace(" ", "").startswith("tools:increment")


def test_an_environment_from_toml_and_one_without_reset(tool_model_dir, tmp_path, monkeypatch):
    (tmp_path / "envs.py").write_text(ENV_SOURCE.replace("OBSERVATION", "None"))
    (tmp_path / "bad.py").write_text("class NoReset:\n    def step(self, x: int) -> int:\n        return x\n")
    monkeypatch.chdir(tmp_path)
    base = make_config(tool_model_dir, tmp_path / "run", steps=1, max_new_tokens=8)
    run = train(dataclasses.replace(base, tools=ToolsConfig(environment="envs.py:Counter")))
    assert "rewards/Counter/mean" in read_metrics(run)[0]  # beside the task's verifier
    bad = dataclasses.replace(base, tools=ToolsConfig(environment="bad.py:NoReset"),
                              output=dataclasses.replace(base.output, dir=str(tmp_path / "bad-run")))
    with pytest.raises(SetupError, match="tools.environment: environment NoReset: it needs a reset"):
        train(bad)


def test_tools_with_dynamic_sampling_keep_conversations_aligned_with_the_kept_answers(tool_model_dir, tmp_path):
    config = make_config(tool_model_dir, tmp_path / "run", steps=2, max_new_tokens=48,
                         algorithm={"dynamic_sampling": True, "max_resample_rounds": 2},
                         output={"completions_every": 1})
    run = train(config, reward_functions=[final_parity], tools=[add], engine=scripted_engine(ToolBox([add])))
    metrics = read_metrics(run)
    assert all(m["dynamic_sampling/draws"] >= 1 and m["tools/call_frequency"] > 0 for m in metrics)
    for row in read_jsonl(run / "completions.jsonl"):  # each kept answer logged with its own conversation
        assistant = [m["content"] for m in row["conversation"] if m["role"] == "assistant"]
        assert row["completion"].replace(" ", "").startswith(assistant[0].replace(" ", "")[:5])


def test_a_run_with_tools_resumes_to_the_same_result(tool_model_dir, tmp_path):
    def run_to(steps, out, resume=False):
        config = make_config(tool_model_dir, out, steps=steps, max_new_tokens=48, output={"save_every": 1})
        return train(config, reward_functions=[final_parity], tools=[add], resume=resume,
                     engine=scripted_engine(ToolBox([add])))

    straight = read_metrics(run_to(3, tmp_path / "a"))
    run_to(2, tmp_path / "b")
    resumed = read_metrics(run_to(3, tmp_path / "b", resume=True))
    keys = ("reward", "loss", "tools/call_frequency", "tools/turns_per_answer", "completions/mean_length")
    assert [[m[k] for k in keys] for m in straight] == [[m[k] for k in keys] for m in resumed]


def test_named_environments_each_show_and_run_their_own_tools(tool_model_dir, tmp_path):
    class Doubler:
        def reset(self, **row):
            assert "environment" not in row  # the selecting column is not passed to reset (TRL)

        def double(self, x: int) -> int:
            """Double a number.

            Args:
                x: The number.
            """
            return 2 * x

    seen = []
    rows = [{"prompt": f"{i}+1=", "environment": "count" if i % 2 else "double"} for i in range(8)]
    config = make_config(tool_model_dir, tmp_path / "run", steps=1, max_new_tokens=48, prompts_per_step=4)
    run = train(config, rows=rows, reward_functions=[final_parity],
                environment_factory={"count": counter_class(), "double": Doubler},
                engine=scripted_engine(None, ToolCall("increment", {"step": 1}), seen))
    (m,) = read_metrics(run)
    tools_line = {text.split("user:")[1].split("assistant:")[0].strip(): text.split("user:")[0].strip()
                  for text in seen}
    assert all(line == ("tools:increment" if int(p.split("+")[0]) % 2 else "tools:double")
               for p, line in tools_line.items()) and len(tools_line) == 4  # each prompt: its own tools
    # "increment" exists only in the Counter rows' tool boxes: the Doubler rows' calls fail
    assert 0 < m["tools/failure_frequency"] < 1
    assert "rewards/Counter/mean" in m and "rewards/Doubler/mean" not in m

    config = make_config(tool_model_dir, tmp_path / "bad", steps=1)
    with pytest.raises(DataError, match="row 1: environment 'nope' is not among the environments given"):
        train(config, rows=[{"prompt": "1+1=", "environment": "nope"}], reward_functions=[final_parity],
              environment_factory={"count": counter_class()})


def test_tool_metrics_reduce_over_ranks_that_called_different_tools(monkeypatch):
    """A tool called on one rank only is 0 on the others (no KeyError while the others wait), and
    failures per call are pooled by each rank's calls."""
    from types import SimpleNamespace

    import grpokit.observe.metrics as metrics_mod
    from grpokit.rollout.batch import Rollout

    def rank_part(metrics):
        n = 4
        mask = torch.ones(n, 3, dtype=torch.long)
        ids = torch.zeros(n, 3, dtype=torch.long)
        rollout = Rollout(ids[:, :2], mask[:, :2], ids, mask, torch.zeros(n, 3), torch.zeros(n, dtype=torch.bool))
        batch = SimpleNamespace(rollout=rollout, loss_mask=mask.float(), advantages=torch.ones(n),
                                draw=SimpleNamespace(total=torch.zeros(n), per_fn=torch.zeros(n, 0)))
        return metrics, batch

    mine, batch = rank_part({"tools/call_frequency": 1.0, "tools/failure_frequency": 0.5, "tools/calls/add": 1.0})
    other, _ = rank_part({"tools/call_frequency": 3.0, "tools/failure_frequency": 0.0, "tools/calls/mul": 3.0})

    def all_gather_object(parts, obj):
        parts[0] = obj
        parts[1] = (other, obj[1], obj[2])

    monkeypatch.setattr(metrics_mod, "is_distributed", lambda: True)
    monkeypatch.setattr(metrics_mod.tdist, "get_world_size", lambda: 2)
    monkeypatch.setattr(metrics_mod.tdist, "all_gather_object", all_gather_object)
    config = make_config("unused", "unused")
    out = metrics_mod.reduce_metrics(mine, batch, [], config)
    assert out["tools/calls/add"] == 0.5 and out["tools/calls/mul"] == 1.5 and out["tools/call_frequency"] == 2.0
    assert out["tools/failure_frequency"] == pytest.approx(2 / 16)  # 2 failed of 4 calls, 0 of 12


def test_environment_faults_are_one_error_naming_the_environment(tool_model_dir, tmp_path):
    class Broken:
        def __init__(self):
            raise RuntimeError("no database")

    class BadReset:
        def reset(self, **row):
            if row["prompt"].startswith("1"):
                raise KeyError("level")

    class AsyncScore:
        def reset(self, **row):
            pass

        async def get_reward(self) -> float:
            return 0.25

    config = make_config(tool_model_dir, tmp_path / "a", steps=1, max_new_tokens=8)
    with pytest.raises(SetupError, match="tools.environment: environment factory 'Broken' raised RuntimeError"):
        train(config, environment_factory=Broken)
    rows = [{"prompt": "1+1="}, {"prompt": "2+2="}]
    with pytest.raises(EnvironmentFault, match=r"environment BadReset: reset raised KeyError: 'level' \(row"):
        train(make_config(tool_model_dir, tmp_path / "b", steps=1, max_new_tokens=8, prompts_per_step=2),
              rows=rows, reward_functions=[final_parity], environment_factory=BadReset)
    run = train(make_config(tool_model_dir, tmp_path / "c", steps=1, max_new_tokens=8), rows=rows * 2,
                reward_functions=[final_parity], environment_factory=AsyncScore)
    assert read_metrics(run)[0]["rewards/AsyncScore/mean"] == 0.25  # an async get_reward is awaited, as in TRL


def test_templates_grpokit_cannot_use_with_tools_are_refused_at_start(tool_model_dir, tiny_model_dir, tmp_path):
    other_format = tmp_path / "other-format"
    shutil.copytree(tool_model_dir, other_format)
    config_file = other_format / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text())
    tok_config["chat_template"] = TOOL_CHAT_TEMPLATE.replace("<tool_call>", "[CALL]").replace("</tool_call>", "")
    config_file.write_text(json.dumps(tok_config))
    with pytest.raises(SetupError, match="writes tool calls in a format grpokit does not read yet"):
        train(make_config(other_format, tmp_path / "a", steps=1), reward_functions=[final_parity], tools=[add])
    windowed = tmp_path / "windowed"
    shutil.copytree(tool_model_dir, windowed)
    model_config = json.loads((windowed / "config.json").read_text())
    model_config.update(use_sliding_window=True, sliding_window=4, max_window_layers=0,
                        layer_types=["sliding_attention"] * model_config["num_hidden_layers"])
    (windowed / "config.json").write_text(json.dumps(model_config))
    with pytest.raises(SetupError, match="multi-turn rollouts need plain full attention"):
        train(make_config(windowed, tmp_path / "b", steps=1), reward_functions=[final_parity], tools=[add])

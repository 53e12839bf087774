"""Environments from OpenEnv and verifiers train unchanged (rollout/adapters.py): built here with those
libraries' own base classes; OpenEnv's HTTP server started and stopped by grpokit on 127.0.0.1; several
environments in one run, each scoring its own answers; a missing library names the extra to install."""

from __future__ import annotations

import dataclasses
import json
import socket
import sys

import pytest

from conftest import make_config
from grpokit.config.schema import ToolsConfig
from grpokit.errors import SetupError
from grpokit.observe.tracking import read_metrics
from grpokit.rollout.adapters import adapt_environment, openenv_environment, verifiers_environment
from grpokit.rollout.engines import HFEngine
from grpokit.rollout.environments import Environments
from grpokit.rollout.multiturn import sample_conversations
from grpokit.rollout.request import RolloutResult, SamplingParams
from grpokit.rollout.tools import ToolCall
from grpokit.training.loop import train
from grpokit.training.tool_setup import resolve_tools

pytest.importorskip("openenv", reason="pip install 'grpokit[agents]'")
vf = pytest.importorskip("verifiers", reason="pip install 'grpokit[agents]'")

ENV_SOURCE = '''
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    """Guess the hidden number."""

    guess: int


class GuessObservation(Observation):
    message: str = ""


class Guess(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.target = 0

    def reset(self, seed=None, episode_id=None, target: int = 3, **kwargs) -> GuessObservation:
        self.target = target
        return GuessObservation(message=" Guess a number.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        right = action.guess == self.target
        return GuessObservation(message="right" if right else "wrong", done=right, reward=1.0 if right else -0.1)

    @property
    def state(self):
        return State()
'''
namespace: dict = {"__name__": "guess_env"}
exec(ENV_SOURCE, namespace)
Guess, GuessAction = namespace["Guess"], namespace["GuessAction"]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def correct(completion, answer) -> float:
    """verifiers' convention: the completion as messages, the row's answer."""
    return float(str(answer) in json.dumps(completion))


async def short(completion, parser) -> float:
    return 1.0 / (1 + len(json.dumps(completion))) + 0.0 * len(parser.__class__.__name__)


def math_env():
    from datasets import Dataset

    dataset = Dataset.from_list([{"question": "1+2", "answer": "3"}])
    return vf.ToolEnv(dataset=dataset, tools=[add], rubric=vf.Rubric(funcs=[correct, short], weights=[1.0, 0.5]))


def play(environments: Environments, rows, calls):
    """Reset one instance per row and run `calls` as that answer's first turn."""
    boxes, observations = environments.start(rows)
    return observations, [box.run(c) for box, c in zip(boxes, calls)], boxes


def test_an_openenv_environment_is_one_step_tool_with_its_rewards_and_states():
    environments = Environments(adapt_environment(Guess))
    schema = environments.toolbox.schemas[0]["function"]
    assert schema["name"] == "step" and schema["parameters"]["properties"]["guess"]["type"] == "integer"
    assert schema["parameters"]["required"] == ["guess"] and "Guess the hidden number" in schema["description"]
    observations, results, boxes = play(environments, [{"prompt": "p", "target": 5}] * 2,
                                        [[ToolCall("step", {"guess": 4})], [ToolCall("step", {"guess": 5})]])
    assert observations == [" Guess a number."] * 2  # appended to the prompt, as TRL's reset text
    assert [r[0].content for r in results] == ["wrong", "right"]  # each answer its own instance
    wrong, right = environments.active
    assert wrong.get_turn_reward() == -0.1 and right.get_turn_reward() == 1.0 and right.get_turn_reward() is None
    assert (wrong.get_reward(), right.get_reward()) == (-0.1, 1.0) and right.get_state() == "right"
    after = boxes[1].run([ToolCall("step", {"guess": 5})])[0]
    assert after.failed and "the episode is over" in after.content


def test_openenvs_own_http_server_is_started_and_stopped_on_127_0_0_1():
    adapter = openenv_environment(Guess, serve=True)
    environments = Environments(adapter)  # the probe instance starts the server
    try:
        _, results, _ = play(environments, [{"prompt": "p", "target": 2}], [[ToolCall("step", {"guess": 2})]])
        assert results[0][0].content == "right" and environments.active[0].get_reward() == 1.0
        url = environments.active[0]._env.async_client.base_url
        assert url.startswith("http://127.0.0.1:")
        remote = Environments(openenv_environment(url=url, action=GuessAction, reset_columns=("target",)))
        _, results, _ = play(remote, [{"prompt": "p", "target": 7}], [[ToolCall("step", {"guess": 7})]])
        assert results[0][0].content == "right"  # a server someone else runs, by its url
    finally:
        adapter.close()
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))


def test_a_verifiers_tool_env_gives_its_tools_and_its_rubric_as_reward_columns():
    cls = verifiers_environment(math_env())
    environments = Environments({"math": cls, "guess": adapt_environment(Guess)})
    assert [s["function"]["name"] for s in environments.schemas_for({"environment": "math"})] == ["add"]
    specs = {s.name: s for s in environments.reward_specs()}
    assert set(specs) == {"Guess", "ToolEnv/correct", "ToolEnv/short"}
    assert (specs["ToolEnv/correct"].weight, specs["ToolEnv/short"].weight) == (1.0, 0.5)
    rows = [{"prompt": "1+2", "environment": "math", "answer": "3"}, {"prompt": "g", "environment": "guess"}]
    environments.start(rows)
    completions = [[{"role": "assistant", "content": "it is 3"}], [{"role": "assistant", "content": "x"}]]
    score = specs["ToolEnv/correct"].fn(["1+2", "g"], completions, environments=environments.active,
                                       answer=["3", None])
    assert score == [1.0, None]  # the guess answer is not the rubric's to grade
    assert specs["ToolEnv/short"].fn(["1+2", "g"], completions, environments=environments.active,
                                     answer=["3", None])[0] == pytest.approx(1 / (1 + len(json.dumps(completions[0]))))


def test_unsupported_verifiers_environments_and_missing_libraries_are_one_error(monkeypatch):
    class Custom(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return []

    with pytest.raises(SetupError, match="env_response, which grpokit does not run; ToolEnv"):
        verifiers_environment(Custom(dataset=math_env().dataset, rubric=vf.Rubric()))
    with pytest.raises(SetupError, match="url 'localhost:1' must start with http"):
        openenv_environment(url="localhost:1")
    monkeypatch.setitem(sys.modules, "openenv.core.generic_client", None)
    with pytest.raises(SetupError, match=r"needs the `openenv` package.*pip install 'grpokit\[agents\]'"):
        openenv_environment(url="http://127.0.0.1:1", action=GuessAction)
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(SetupError, match=r"verifiers_environment needs the `verifiers` package.*grpokit\[agents\]"):
        verifiers_environment(object())


def scripted(config, model, tokenizer):
    """Turns end at a digit or "="; each makes its environment's one call (a random model writes none)."""
    arguments = {"step": {"guess": 5}, "add": {"a": 1, "b": 2}}

    class Scripted(HFEngine):
        def generate(self, request):
            digits = [self.tokenizer.convert_tokens_to_ids(d) for d in "0123456789="]
            s = SamplingParams(request.sampling.max_new_tokens, tuple(digits), request.sampling.pad_token_id)
            rollout, stats = sample_conversations(
                self.model, dataclasses.replace(request, sampling=s), tokenizer=self.tokenizer, max_tool_turns=1,
                parse_calls=lambda text, tools, **_: [ToolCall(tools[0]["function"]["name"],
                                                               arguments[tools[0]["function"]["name"]])])
            return RolloutResult(rollout, tool_stats=stats)

    return Scripted(model, tokenizer)


def test_an_openenv_and_a_verifiers_environment_train_together_each_with_its_own_rewards(tool_model_dir, tmp_path):
    rows = [{"prompt": "guess", "environment": "guess", "target": 5, "answer": ""},
            {"prompt": "1+2", "environment": "math", "target": 0, "answer": "3"}] * 8
    config = make_config(tool_model_dir, tmp_path / "run", steps=2, prompts_per_step=2, max_new_tokens=64)
    run = train(config, rows=rows, reward_functions=[], engine=scripted,
                environment_factory={"guess": Guess, "math": math_env()})
    metrics = read_metrics(run)
    for m in metrics:
        assert m["tools/call_frequency"] > 0 and m["tools/failure_frequency"] == 0
        assert m["rewards/Guess/mean"] == pytest.approx(1.0)  # every guess answer guessed 5 = its target
        assert "rewards/ToolEnv/correct/mean" in m and "rewards/ToolEnv/short/mean" in m


def test_an_openenv_class_from_toml_is_adapted(tmp_path, monkeypatch):
    (tmp_path / "envs.py").write_text(ENV_SOURCE)
    monkeypatch.chdir(tmp_path)
    config = make_config(tmp_path, tmp_path / "run")
    box, environments = resolve_tools(dataclasses.replace(config, tools=ToolsConfig(environment="envs.py:Guess")))
    assert list(box.functions) == ["step"] and [s.name for s in environments.reward_specs()] == ["Guess"]


def test_the_server_grpokit_started_for_a_run_stops_when_the_run_ends(tool_model_dir, tmp_path, monkeypatch):
    adapter = openenv_environment(Guess, serve=True)
    urls = []
    real = adapter.reset

    def reset(self, **row):
        urls.append(self._env.async_client.base_url)
        return real(self, **row)

    monkeypatch.setattr(adapter, "reset", reset)
    config = make_config(tool_model_dir, tmp_path / "run", steps=1, prompts_per_step=1, max_new_tokens=16)
    train(config, rows=[{"prompt": "guess", "target": 5, "answer": ""}] * 2, reward_functions=[], engine=scripted,
          environment_factory=adapter)
    port = int(urls[0].rsplit(":", 1)[1])
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))


def test_adapted_environments_in_worker_processes_are_refused_naming_the_field(tmp_path):
    config = make_config(tmp_path, tmp_path / "run")
    config = dataclasses.replace(config, tools=ToolsConfig(isolation="process"))
    with pytest.raises(SetupError, match='tools.isolation = "process": environments from OpenEnv or verifiers'):
        resolve_tools(config, environment_factory={"guess": Guess})


def test_a_verifiers_environment_trains_on_its_own_dataset(tool_model_dir, tmp_path):
    env = math_env()
    config = make_config(tool_model_dir, tmp_path / "run", steps=1, prompts_per_step=1, max_new_tokens=32)
    run = train(config, rows=env.get_dataset(), reward_functions=[], engine=scripted, environment_factory=env)
    m = read_metrics(run)[0]
    assert m["tools/call_frequency"] > 0 and m["tools/failure_frequency"] == 0
    # the rubric graded the conversations: those whose add(1, 2) result fitted hold the answer 3
    assert 0 < m["rewards/ToolEnv/correct/mean"] <= m["tools/call_frequency"]


def test_an_openenv_step_that_never_returns_is_a_failed_call_within_tools_timeout_s():
    import threading

    release = threading.Event()

    class Stuck(Guess):
        def step(self, action: GuessAction, timeout_s=None, **kwargs):  # a string hint (future annotations)
            release.wait(30)
            return super().step(action)

    try:
        environments = Environments(adapt_environment(Stuck), timeout_s=0.5)
        _, results, _ = play(environments, [{"prompt": "p"}], [[ToolCall("step", {"guess": 1})]])
    finally:
        release.set()
    assert results[0][0].failed and "did not answer within 0.5 s" in results[0][0].content


def test_a_verifiers_factory_not_named_load_environment_is_told_the_fix_or_its_kinds_refusal(tmp_path, monkeypatch):
    """Issue 43 point 12: a function returning a verifiers environment under another name was told "it needs a
    reset(**row) method", also for a MultiTurnEnv, whose documented refusal is another."""
    (tmp_path / "vf_envs.py").write_text('''
import verifiers as vf
from datasets import Dataset


class Custom(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return []


def data():
    return Dataset.from_list([{"question": "1+2", "answer": "3"}])


def make_tools():
    return vf.ToolEnv(dataset=data(), tools=[], rubric=vf.Rubric())


def make_custom():
    return Custom(dataset=data(), rubric=vf.Rubric())
''')
    monkeypatch.chdir(tmp_path)
    config = make_config(tmp_path, tmp_path / "run")
    for factory, words in (("make_tools", "environment factory 'make_tools' returns a verifiers ToolEnv, which "
                                          "grpokit adapts from a function named load_environment"),
                           ("make_custom", "a Custom answers with its own env_response, which grpokit does not "
                                           "run; ToolEnv, StatefulToolEnv and SingleTurnEnv are supported")):
        tools = ToolsConfig(environment=f"vf_envs.py:{factory}")
        with pytest.raises(SetupError) as err:
            resolve_tools(dataclasses.replace(config, tools=tools))
        assert words in str(err.value) and "reset(**row)" not in str(err.value), str(err.value)

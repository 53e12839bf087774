"""The sandboxed code-execution reward and reward timeouts: bad answers score 0.0, never crash the caller."""

from __future__ import annotations

import time

import pytest

from grpokit.errors import RewardError, RewardLoadError, RewardTimeoutError
from grpokit.rewards.core import RewardSpec, compute_rewards
from grpokit.rewards.registry import get_reward, reward_specs
from grpokit.rewards.sandbox import code_execution_reward, extract_code, run_tests

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
LIMIT = 0.5  # seconds: the tests' time limit (the default is 5)


@pytest.fixture(scope="module")
def reward():
    return code_execution_reward(time_limit=LIMIT, memory_mb=256)


def test_extract_code_takes_the_last_python_block_else_any_block_else_all():
    assert extract_code("x\n```python\na = 1\n```\nmore\n```python\nb = 2\n```") == "b = 2\n"
    assert extract_code("```\nc = 3\n```") == "c = 3\n"
    assert extract_code("d = 4") == "d = 4"


def test_correct_wrong_partial_and_skipped_answers(reward):
    answers = ["```python\ndef add(a, b):\n    return a + b\n```",
               "def add(a, b):\n    return a - b",
               "def add(a, b):\n    return 3",  # passes the first test only
               "def add(a, b): return a + b"]
    tests = [ADD_TESTS, ADD_TESTS, ADD_TESTS, None]
    assert reward(answers, tests) == [1.0, 0.0, 0.5, None]


def test_a_string_of_test_code_is_all_or_nothing_and_chat_completions_work(reward):
    chat = [[{"role": "assistant", "content": "def sq(x): return x * x"}]]
    assert reward(chat, ["assert sq(3) == 9\nassert sq(2) == 4"]) == [1.0]
    assert reward(chat, ["assert sq(3) == 9\nassert sq(2) == 5"]) == [0.0]


BAD_ANSWERS = {
    "cpu-bound hang (RLIMIT_CPU / wall clock)": "while True:\n    pass",
    "sleeping hang (wall clock)": "import time\ntime.sleep(60)",
    "10 GB allocation (RLIMIT_AS -> MemoryError)": "x = bytearray(10**10)",
    "hard exit before the tests": "import os\nos._exit(3)",
    "clean-looking early exit": "import sys\nsys.exit(0)",
    "syntax error": "def add(a, b) return a + b",
    "interpreter crash": "import signal, os\nos.kill(os.getpid(), signal.SIGSEGV)",
}


def test_bad_answers_get_zero_within_the_limit():
    reward = code_execution_reward(time_limit=LIMIT, memory_mb=256, workers=len(BAD_ANSWERS))
    t0 = time.monotonic()
    out = reward([code + "\ndef add(a, b): return a + b" for code in BAD_ANSWERS.values()],
                 [ADD_TESTS] * len(BAD_ANSWERS))
    assert dict(zip(BAD_ANSWERS, out)) == dict.fromkeys(BAD_ANSWERS, 0.0)
    assert time.monotonic() - t0 < LIMIT + 4  # limit + start-up grace + a loaded machine, all side by side


def test_a_hang_inside_a_test_scores_zero(reward):
    assert reward(["def add(a, b):\n    while True: pass"], [["assert True", "assert add(1, 1) == 2"]]) == [0.0]


def test_memory_limit_is_the_one_configured():
    grow = "x = bytearray(96 * 2**20)\ndef f(): return 1"
    assert run_tests(grow, ["assert f() == 1"], time_limit=LIMIT, memory_mb=64) == 0.0
    assert run_tests(grow, ["assert f() == 1"], time_limit=LIMIT, memory_mb=256) == 1.0


def test_answers_run_in_parallel_in_an_empty_folder_without_the_parents_environment(reward, monkeypatch):
    monkeypatch.setenv("GRPOKIT_SECRET", "s3cret")
    probe = "import os\nfiles = os.listdir('.')\nsecret = os.environ.get('GRPOKIT_SECRET')"
    tests = [["assert secret is None", "assert [f for f in files if not f.startswith('.grpokit')] == []"]]
    t0 = time.monotonic()
    out = reward([probe, "import time\ntime.sleep(60)", "import time\ntime.sleep(60)"], tests * 3)
    assert out == [1.0, 0.0, 0.0]  # the module's reward has 4 workers
    assert time.monotonic() - t0 < 2 * (LIMIT + 1.0)  # the two hangs (LIMIT + 1 s grace each) ran side by side


def test_registered_with_options_and_bad_options_are_named():
    fn = get_reward("code_execution", time_limit=2.0, memory_mb=128, workers=2)
    assert fn(["def f(): return 1"], tests=[["assert f() == 1"]]) == [1.0]
    with pytest.raises(RewardLoadError, match="time_limit must be > 0"):
        get_reward("code_execution", time_limit=0)


def test_inside_compute_rewards_a_crashing_answer_is_a_zero_not_an_error(reward):
    spec = RewardSpec("code", reward)
    per_fn, total = compute_rewards([spec], ["p", "p"], ["import os\nos._exit(1)", "def add(a, b): return a + b"],
                                    [[1], [1]], {"tests": [ADD_TESTS, ADD_TESTS]})
    assert total.tolist() == [0.0, 1.0]


# ------------------------------------------------------------------ reward timeouts (RewardSpec.timeout)


def slow(completions, **kwargs):
    time.sleep(30)  # abandoned in a daemon thread when the timeout fires
    return [1.0] * len(completions)


def test_a_reward_past_its_timeout_stops_with_the_name_and_the_limit():
    t0 = time.monotonic()
    with pytest.raises(RewardTimeoutError, match=r"reward function 'slow' took longer than 0\.5 s") as e:
        compute_rewards([RewardSpec("slow", slow, timeout=0.5)], ["p"], ["c"], [[1]])
    assert time.monotonic() - t0 < 3
    assert isinstance(e.value, RewardError)  # the CLI's user-error path
    assert "code_execution" in str(e.value)  # points at the sandbox for untrusted code


def test_timeouts_pass_results_and_errors_through():
    def fine(completions, **kwargs):
        return [0.5] * len(completions)

    def boom(completions, **kwargs):
        raise KeyError("nope")

    _, total = compute_rewards([RewardSpec("fine", fine, timeout=5)], ["p"], ["c"], [[1]])
    assert total.tolist() == [0.5]
    with pytest.raises(RewardError, match=r"reward function 'boom' at sample 0.*raised KeyError"):
        compute_rewards([RewardSpec("boom", boom, timeout=5)], ["p"], ["c"], [[1]])


def test_timeout_is_set_from_the_config_args(tmp_path):
    ref = tmp_path / "r.py"
    ref.write_text("import time\ndef sleepy(completions, **kw):\n    time.sleep(30)\n    return [0.0]\n")
    specs = reward_specs([f"{ref}:sleepy", "numeric_match"], args={"sleepy": {"timeout": 1.0},
                                                                  "numeric_match": {"timeout": 1}})
    assert [s.timeout for s in specs] == [1.0, 1.0]
    with pytest.raises(RewardTimeoutError, match="took longer than 1.0 s"):
        compute_rewards(specs[:1], ["p"], ["c"], [[1]])
    with pytest.raises(RewardLoadError, match="timeout must be a number of seconds >= 0"):
        reward_specs(["numeric_match"], args={"numeric_match": {"timeout": "2s"}})


def test_your_own_reward_functions_have_a_default_timeout_and_built_ins_bound_themselves(tmp_path):
    """rewards.timeout_s (600 s unless set) bounds references and Python callables; a function's own
    `timeout` overrides it, 0 meaning no limit; built-in rewards keep running in the calling thread
    (math-verify's own parse timeouts need the main thread)."""
    from grpokit.config.schema import Config, DataConfig, ModelConfig, RewardConfig
    from grpokit.training.rollout_setup import resolve_reward_specs

    ref = tmp_path / "r.py"
    ref.write_text("def mine(completions, **kw):\n    return [0.0] * len(completions)\n")
    specs = reward_specs([f"{ref}:mine", "numeric_match"], default_timeout=600.0)
    assert [s.timeout for s in specs] == [600.0, None]
    assert reward_specs([f"{ref}:mine"], args={"mine": {"timeout": 0}}, default_timeout=600.0)[0].timeout is None

    def config(**rewards):
        return Config(model=ModelConfig(path="m"), data=DataConfig(task="addition"), rewards=RewardConfig(**rewards))

    assert RewardConfig().timeout_s == 600.0
    assert resolve_reward_specs(config(), None, [lambda completions, **kw: [0.0]])[0].timeout == 600.0
    assert resolve_reward_specs(config(timeout_s=0), None, [lambda completions, **kw: [0.0]])[0].timeout is None
    assert [s.timeout for s in resolve_reward_specs(config(functions=(f"{ref}:mine",), timeout_s=2), None)] == [2.0]

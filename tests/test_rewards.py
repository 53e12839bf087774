"""Rewards: the TRL calling convention, combination, error paths, graders' golden values, registry."""

from __future__ import annotations

import math
import pickle
import sys
import threading

import pytest
import torch

from grpokit.data.prompts import columns_of
from grpokit.errors import RewardError, RewardLoadError
from grpokit.rewards.core import RewardSpec, compute_rewards, reward_metrics
from grpokit.rewards.graders import format_reward, math_equivalence, numeric_match, soft_overlong_penalty
from grpokit.rewards.registry import get_reward, load_reward, resolve_reward, reward_specs

nan = math.nan


def _call(fns, completions, prompts=None, ids=None, **columns):
    specs = [f if isinstance(f, RewardSpec) else RewardSpec(f"f{i}", f) for i, f in enumerate(fns)]
    n = len(completions)
    prompts = prompts if prompts is not None else [f"p{i}" for i in range(n)]
    ids = ids if ids is not None else [[1] * (i + 1) for i in range(n)]
    return compute_rewards(specs, prompts, completions, ids, columns)


# ------------------------------------------------------------------ combination


def test_weighted_nansum_and_none_handling():
    def a(completions, **kw):
        return [1.0, None, 0.5, None]

    def b(completions, **kw):
        return [2.0, 3.0, None, None]

    specs = [RewardSpec("a", a, weight=2.0), RewardSpec("b", b, weight=-0.5)]
    per_fn, total = compute_rewards(specs, ["p"] * 4, ["c"] * 4, [[1]] * 4, {})
    assert per_fn.dtype == torch.float32 and per_fn.shape == (4, 2)
    torch.testing.assert_close(per_fn, torch.tensor([[1.0, 2.0], [nan, 3.0], [0.5, nan], [nan, nan]]),
                               equal_nan=True)
    # 2*1 - 0.5*2 = 1 ; only b: -1.5 ; only a: 1.0 ; nobody graded: NaN
    torch.testing.assert_close(total, torch.tensor([1.0, -1.5, 1.0, nan]), equal_nan=True)


def test_reward_metrics_nan_aware():
    specs = [RewardSpec("acc", numeric_match), RewardSpec("fmt", numeric_match), RewardSpec("none", numeric_match)]
    per_fn = torch.tensor([[1.0, 0.0, nan], [0.0, nan, nan], [1.0, nan, nan], [nan, nan, nan]])
    m = reward_metrics(specs, per_fn)
    assert m["rewards/acc/mean"] == pytest.approx(2 / 3)
    assert m["rewards/acc/std"] == pytest.approx(math.sqrt(1 / 3))  # sample std of 1, 0, 1
    assert m["rewards/fmt/mean"] == 0.0 and m["rewards/fmt/std"] == 0.0  # one graded sample
    assert math.isnan(m["rewards/none/mean"]) and math.isnan(m["rewards/none/std"])


def test_trl_style_function_gets_columns_repeated_per_sample_and_trl_extras():
    rows = [{"prompt": "1+1=", "answer": "2", "level": 1}, {"prompt": "2+2=", "answer": "4", "level": 3}]
    G = 3
    seen = {}

    def trl_fn(prompts, completions, completion_ids, **kwargs):
        seen.update(kwargs, prompts=prompts, completions=completions, completion_ids=completion_ids)
        kwargs["log_metric"]("custom", 1.0)
        kwargs["log_extra"]("note", ["x"] * len(completions))
        return [float(c == a) for c, a in zip(completions, kwargs["answer"])]

    prompts = [r["prompt"] for r in rows for _ in range(G)]
    completions = ["2", "3", "2", "4", "4", "5"]
    ids = [[5], [6], [5], [7], [7], [8]]
    logged = []
    per_fn, total = compute_rewards([RewardSpec("acc", trl_fn)], prompts, completions, ids,
                                    columns_of(rows, repeat=G), trainer_state="STATE",
                                    log_metric=lambda k, v: logged.append((k, v)))
    assert seen["answer"] == ["2", "2", "2", "4", "4", "4"]
    assert seen["level"] == [1, 1, 1, 3, 3, 3]
    assert seen["prompts"] == prompts and seen["completion_ids"] == ids
    assert seen["trainer_state"] == "STATE" and callable(seen["log_extra"])
    assert "prompt" not in seen
    assert logged == [("custom", 1.0)]
    assert total.tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]


def test_function_without_kwargs_gets_only_what_it_names():
    def strict(completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    per_fn, _ = _call([strict], ["1", "2"], answer=["1", "3"], other=[0, 0])
    assert per_fn[:, 0].tolist() == [1.0, 0.0]


def test_function_naming_a_missing_column_is_reported_before_the_call():
    def needs_solution(completions, solution):
        raise AssertionError("must not be called")

    with pytest.raises(RewardError, match=r"'f0' needs argument\(s\) \['solution'\].*columns: \['answer'\]"):
        _call([needs_solution], ["1"], answer=["1"])


def test_conversational_prompts_get_trl_message_completions():
    got = []

    def fn(completions, **kw):
        got.extend(completions)
        return [1.0] * len(completions)

    prompts = [[{"role": "user", "content": "hi"}]] * 2
    _call([fn], ["a", "b"], prompts=prompts)
    assert got == [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]]
    assert numeric_match(got, ["1", "2"]) == [0.0, 0.0]


def test_async_reward_function_is_awaited():
    async def fn(completions, **kw):
        return [0.25] * len(completions)

    per_fn, _ = _call([fn], ["a", "b"])
    assert per_fn[:, 0].tolist() == [0.25, 0.25]


def test_trl_builtin_functions_work_unchanged():
    from trl.rewards import get_soft_overlong_punishment, think_format_reward

    prompts = [[{"role": "user", "content": "q"}]] * 2
    completions = ["<think>\nhm\n</think>\n<answer>4</answer>", "4"]
    specs = [RewardSpec("think", think_format_reward),
             RewardSpec("len", get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2))]
    per_fn, _ = compute_rewards(specs, prompts, completions, [[1] * 3, [1] * 5], {})
    assert per_fn.tolist() == [[1.0, -0.5], [0.0, -1.0]]


# ------------------------------------------------------------------ error paths


def test_raising_function_names_function_and_first_failing_sample():
    def fragile(completions, **kw):
        return [1.0 / len(c) for c in completions]  # ZeroDivisionError on the empty completion

    with pytest.raises(RewardError, match=r"'fragile' at sample 2 \(prompt 'p2', completion ''\) raised "
                                          r"ZeroDivisionError") as info:
        _call([RewardSpec("fragile", fragile)], ["ab", "c", "", "d"])
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_batch_only_raise_is_reported_without_a_false_index():
    def batchy(completions, **kw):
        if len(completions) > 1:
            raise RuntimeError("boom")
        return [0.0]

    with pytest.raises(RewardError, match=r"'f0' on a batch of 2 samples .* raised RuntimeError: boom"):
        _call([batchy], ["a", "b"])


@pytest.mark.parametrize("returned, pattern", [
    (0.5, r"'f0' returned float 0\.5; it must return a list"),
    ("1.0", r"'f0' returned str '1\.0'; it must return a list"),
    ([1.0], r"'f0' returned 1 values for 3 completions"),
    ([1.0, 1.0, 1.0, 1.0], r"'f0' returned 4 values for 3 completions"),
    ([1.0, nan, 0.0], r"'f0' at sample 1 \(prompt 'p1', completion 'c1'\) returned nan; rewards must be finite"),
    ([1.0, 0.0, math.inf], r"'f0' at sample 2 .* returned inf"),
    ([1.0, 1e39, 0.0], r"'f0' at sample 1 .* returned 1e\+39, beyond float32's range .*scale the reward down"),
    ([1.0, "0.5", 0.0], r"'f0' at sample 1 .* returned '0\.5' \(str\); return a float, or None"),
    ([1.0, 0.0, [1.0]], r"'f0' at sample 2 .* returned \[1\.0\] \(list\)"),
])
def test_bad_return_values_are_named(returned, pattern):
    with pytest.raises(RewardError, match=pattern):
        _call([lambda completions, **kw: returned], ["c0", "c1", "c2"])


def test_a_weighted_total_past_float32_is_named_not_left_inf():
    big = lambda completions, **kw: [3e38, 0.0]  # noqa: E731
    with pytest.raises(RewardError, match=r"weighted total of the rewards at sample 0 is beyond float32's range"):
        _call([big, big], ["a", "b"])


def test_numpy_and_bool_returns_are_accepted():
    import numpy as np

    per_fn, _ = _call([lambda completions, **kw: np.array([1.0, 0.0]), lambda completions, **kw: [True, False]],
                      ["a", "b"])
    assert per_fn.tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_long_previews_are_truncated():
    with pytest.raises(RewardError) as info:
        _call([lambda completions, **kw: [None, "x"]], ["short", "y" * 500])
    assert "..." in str(info.value) and len(str(info.value)) < 400


def test_caller_mistakes_are_value_errors():
    with pytest.raises(ValueError, match=r"column 'answer'.*columns_of\(rows, repeat=G\)"):
        _call([numeric_match], ["1", "2"], answer=["1"])
    with pytest.raises(ValueError, match="unique"):
        compute_rewards([RewardSpec("a", numeric_match), RewardSpec("a", numeric_match)], ["p"], ["1"], [[1]],
                        {"answer": ["1"]})
    with pytest.raises(ValueError, match="at least one"):
        compute_rewards([], ["p"], ["1"], [[1]], {})


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(name="", fn=numeric_match), "name must be a non-empty string"),
    (dict(name="x", fn=3), "'x': fn must be callable"),
    (dict(name="x", fn=numeric_match, weight=nan), "'x': weight must be a finite number"),
    (dict(name="x", fn=numeric_match, timeout=0), "'x': timeout must be > 0"),
])
def test_reward_spec_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        RewardSpec(**kwargs)


# ------------------------------------------------------------------ graders


@pytest.mark.parametrize("completion, answer, expected", [
    ("46", "46", 1.0),
    ("The total is 1,000.", "1000", 1.0),
    ("so 1000.0", 1000, 1.0),
    ("1000", "1,000", 1.0),
    ("0.5", 0.5, 1.0),
    ("-7", "-7", 1.0),
    ("10-3", "3", 1.0),  # a binary minus is not a sign
    ("10-3", "-3", 0.0),
    ("<answer>42</answer> and later 7", "42", 1.0),
    ("first 42 then 43", "42", 0.0),
    ("no number here", "42", 0.0),
    ("", "42", 0.0),
    ("72", "Natalia sold 48/2 = 24 clips ... #### 72", 1.0),
    ("anything", "no number", None),
    ("1", None, None),
])
def test_numeric_match_golden(completion, answer, expected):
    assert numeric_match([completion], [answer]) == [expected]


@pytest.mark.parametrize("completion, answer, expected", [
    ("0.5", "\\frac{1}{2}", 1.0),
    ("The answer is $\\frac{1}{2}$", "0.5", 1.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("<answer>1/3</answer>", "\\frac{1}{3}", 1.0),
    ("0.6", "\\frac{1}{2}", 0.0),
    ("no math", "\\frac{1}{2}", 0.0),
])
def test_math_equivalence_golden(completion, answer, expected):
    assert math_equivalence([completion], [answer]) == [expected]


def test_math_equivalence_works_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(math_equivalence(["0.5", "2"], ["\\frac{1}{2}", "3"])))
    t.start()
    t.join()
    assert out == [[1.0, 0.0]]


def test_math_equivalence_without_math_verify_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install 'grpokit\[math\]'"):
        math_equivalence(["1"], ["1"])


@pytest.mark.parametrize("completion, expected", [
    ("<think>a\nb</think>\n<answer>3</answer>", 1.0),
    ("  <think>a</think><answer>3</answer>\n", 1.0),
    ("<think>a</think> <answer>3</answer> trailing", 0.0),
    ("<answer>3</answer>", 0.0),
    ("<think>a</think>", 0.0),
])
def test_format_reward_default(completion, expected):
    assert format_reward()([completion]) == [expected]
    assert get_reward("format")([[{"role": "assistant", "content": completion}]]) == [expected]


def test_format_reward_custom_pattern_and_bad_regex():
    assert format_reward(r"\d+")(["123", "12a"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"invalid regular expression '\('"):
        format_reward("(")


def test_soft_overlong_penalty_golden_and_trl_parity():
    # max 20, buffer 4: ramp starts after 16 tokens; (16 - L) / 4 on (16, 20]; -1 beyond 20.
    expected = {0: 0.0, 10: 0.0, 16: 0.0, 17: -0.25, 18: -0.5, 19: -0.75, 20: -1.0, 21: -1.0, 100: -1.0}
    fn = soft_overlong_penalty(max_completion_length=20, overlong_buffer=4)
    ids = [[0] * L for L in expected]
    assert fn(completion_ids=ids) == list(expected.values())
    from trl.rewards import get_soft_overlong_punishment

    for mx, buf in [(20, 4), (7, 7), (5, 0)]:
        ids = [[0] * L for L in range(0, mx + 3)]
        ours = soft_overlong_penalty(mx, buf)(completion_ids=ids)
        assert ours == get_soft_overlong_punishment(mx, buf)(completion_ids=ids)
    assert pickle.loads(pickle.dumps(fn))(completion_ids=[[0] * 18]) == [-0.5]


@pytest.mark.parametrize("args, pattern", [
    ((0, 0), "max_completion_length must be an integer >= 1"),
    ((10, -1), "overlong_buffer must be an integer >= 0"),
    ((10, 11), r"overlong_buffer \(11\) must be <= max_completion_length \(10\)"),
    ((10.0, 2), "max_completion_length must be an integer"),
])
def test_soft_overlong_penalty_validation(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        soft_overlong_penalty(*args)


# ------------------------------------------------------------------ registry and loading


def test_registry_builtins_and_task_verifiers():
    assert get_reward("numeric_match") is numeric_match
    assert get_reward("math_equivalence") is math_equivalence
    assert get_reward("soft_overlong_penalty", max_completion_length=8, overlong_buffer=2)(
        completion_ids=[[0] * 7]) == [-0.5]
    assert get_reward("addition")(["46", "45"], answer=["46", "46"]) == [1.0, 0.0]
    assert get_reward("countdown", format_score=0.1)(["3*25", "3+25", "hi"], numbers=[[3, 7, 25]] * 3,
                                                    target=[75] * 3) == [1.0, 0.1, 0.0]


def test_registry_errors_name_the_reward_and_the_choices():
    with pytest.raises(RewardLoadError, match=r"unknown reward 'numeric'.*known rewards: addition, code_execution, "
                                              r"countdown, format, math_equivalence, multiplication, numeric_match, "
                                              r"shapes, soft_overlong_penalty"):
        get_reward("numeric")
    with pytest.raises(RewardLoadError, match=r"'rewards\.py'.*needs ':function'"):
        get_reward("rewards.py")
    with pytest.raises(RewardLoadError, match=r"reward 'numeric_match' got arguments \['digits'\].*accepts: none"):
        get_reward("numeric_match", digits=2)
    with pytest.raises(RewardLoadError, match=r"'soft_overlong_penalty'.*accepts: max_completion_length, "
                                              r"overlong_buffer"):
        get_reward("soft_overlong_penalty", max_len=3)


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("SCALE = 2.0\n\ndef short(completions, **kwargs):\n"
                    "    return [SCALE * (len(c) < 3) for c in completions]\n\n"
                    "def _private(completions, **kwargs):\n    return []\n")
    return path


def test_load_reward_from_file_and_module(reward_file, monkeypatch, tmp_path):
    fn = load_reward(f"{reward_file}:short")
    assert fn(["ab", "abcd"]) == [2.0, 0.0]
    monkeypatch.chdir(tmp_path)
    assert load_reward("my_rewards.py:short")(["a"]) == [2.0]
    assert load_reward("grpokit.rewards:numeric_match") is numeric_match
    assert resolve_reward("numeric_match") is numeric_match
    specs = reward_specs(["my_rewards.py:short", "format"], weights=[1.0, 0.5], args={"format": {"pattern": "a"}})
    assert [(s.name, s.weight) for s in specs] == [("short", 1.0), ("format", 0.5)]
    assert specs[1].fn(["a", "b"]) == [1.0, 0.0]


def test_load_reward_errors_name_the_ref_and_the_fix(reward_file, tmp_path):
    with pytest.raises(RewardLoadError, match=r"reward 'nowhere/x\.py:f': file 'nowhere/x\.py' not found"):
        load_reward("nowhere/x.py:f")
    with pytest.raises(RewardLoadError, match=r"has no attribute 'long'; functions defined there: \['short'\]"):
        load_reward(f"{reward_file}:long")
    with pytest.raises(RewardLoadError, match=r"'SCALE' is a float, not a function"):
        load_reward(f"{reward_file}:SCALE")
    with pytest.raises(RewardLoadError, match=r"module 'no_such_pkg_xyz' not found.*'path/to/no_such_pkg_xyz\.py"):
        load_reward("no_such_pkg_xyz:f")
    with pytest.raises(RewardLoadError, match=r"must look like 'path/to/file\.py:function'"):
        load_reward("my_rewards.py")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_module_qq\n")
    with pytest.raises(RewardLoadError, match=r"importing '.*broken\.py' raised ModuleNotFoundError") as info:
        load_reward(f"{broken}:f")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    with pytest.raises(RewardLoadError, match=r"arguments \['x'\] only apply to built-in rewards"):
        resolve_reward(f"{reward_file}:short", x=1)
    with pytest.raises(ValueError, match=r"reward arguments given for \['nope'\]"):
        reward_specs(["format"], args={"nope": {}})

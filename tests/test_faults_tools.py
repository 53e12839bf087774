"""Hostile tools and environments through `grpokit train` (issue 26): each case a run on a tiny model
that calls the tool `t` in every turn (fault_harness.build_calling_model), then a resume.

Each case asserts the harness's contract: the run finishes (exit 0, the fault a failed call counted in
`tools/failure_frequency`) or ends in one `error:` line with exit 2 and no traceback; it never runs
past its deadline; and the folder resumes (`--resume` to two steps; after an error, once the fault
is switched off through its mode file, the newest checkpoint stays and the run continues from it).
The cases run in-process through `grpokit.cli.main` (about a second each); the exits that would end
pytest's own process run in subprocesses.
"""

from __future__ import annotations

import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fault_harness import CliResult, assert_clean_exit, assert_user_error, build_calling_model, run_cli
from grpokit import cli
from grpokit.observe.tracking import read_jsonl, read_metrics
from grpokit.training.checkpoint import list_checkpoints

pytestmark = pytest.mark.faults

TIMEOUT_S = 1.0  # tools.timeout_s of every case: a hang costs this, not the run


@dataclass(frozen=True)
class Case:
    name: str
    body: str  # of the tool `t()` (tools cases) or of the environment class (environment cases)
    shown: str | None = None  # text the model must see as the tool's result (finishing cases)
    failed: bool = True  # the call counts as failed
    error: tuple[str, ...] = ()  # an error line naming these (error cases); empty: the run finishes
    environment: bool = False
    extra: str = ""  # more TOML
    subprocess: bool = False  # would end pytest's process if the guard failed


# The hostile bodies run only while the mode file says "on" (the fix, for the resume, is to switch it off).
TOOL_CASES = [
    Case("raise", 'raise ValueError("no")', "ValueError: no"),
    Case("hang", "time.sleep(30)", f"did not answer within {TIMEOUT_S:g} s"),
    Case("huge_result", 'return "x" * 20_000_000', "more than tools.max_result_chars = 100000"),
    Case("lone_surrogate", 'return "bad \\udcff text"', "bad \ufffd text", failed=False),
    Case("nul_bytes", 'return "a\\x00b"', "a\ufffdb", failed=False),
    Case("not_a_string", 'return {"k": [1, b"\\xff"]}', "{'k': [1, b'\\xff']}", failed=False),
    Case("str_raises", "class Odd:\n    def __str__(self):\n        raise RuntimeError('odd')\nreturn Odd()",
         "the result could not be shown as text (RuntimeError: odd)"),
    Case("surrogate_in_error", 'raise ValueError("\\udcff")', "ValueError: \\ufffd"),
    Case("chdir", 'os.chdir("/")\nreturn "moved"', "moved", failed=False),
    Case("sys_exit", "sys.exit(3)", "SystemExit: 3"),
    Case("os_exit", "os._exit(7)", "os._exit(7)", subprocess=True),
    Case("self_kill", "os.kill(os.getpid(), signal.SIGKILL)", "SIGKILL", subprocess=True),
]

ENV = '''
class Env:
    def reset(self, **row):
        {reset}

    def t(self) -> str:
        """A tool."""
        return "ok"

    def get_reward(self) -> float:
        {get_reward}
'''


def env_case(name: str, reset: str = "return None", get_reward: str = "return 1.0", **kw) -> Case:
    return Case(name, ENV.format(reset=reset, get_reward=get_reward), environment=True, **kw)


ENV_CASES = [
    env_case("reset_int", "return 3 if on() else None", error=("environment Env: reset returned 3 (int)",)),
    env_case("reset_list", "return [1, 2] if on() else None", error=("environment Env: reset returned [1, 2]",)),
    env_case("reset_text_parts", 'return [{"type": "text", "text": " go"}] if on() else None', failed=False),
    env_case("reset_surrogate", 'return " \\udcff" if on() else None', failed=False),
    env_case("reset_hangs", "time.sleep(30) if on() else None",
             error=("environment Env: reset did not return within 1 s (tools.timeout_s",)),
    env_case("reset_huge", 'return "y" * 10**8 if on() else None', error=("tools.max_result_chars",)),
    env_case("reset_past_context", 'return "y" * 600 if on() else None',
             error=("environment Env", "exceeds the model's context of 512")),
    env_case("reset_exits", "os._exit(3) if on() else None", error=("environment Env: reset raised ToolExit",)),
    env_case("get_reward_hangs", get_reward="time.sleep(30) if on() else None\n        return 1.0",
             error=("environment Env: get_reward did not return within 1 s",)),
    env_case("get_reward_exits", get_reward="os._exit(3) if on() else None\n        return 1.0",
             error=("environment Env: get_reward raised ToolExit: the tool called os._exit(3)",)),
    env_case("with_eval", failed=False,
             extra='[eval]\nevery = 1\nnum_prompts = 2\nsamples_per_prompt = 2\ngreedy = false\n'),
]
ASYNC_RESET = env_case("async_reset", "pass").body.replace("def reset", "async def reset")


def write_case(folder: Path, model: Path, case: Case) -> Path:
    """The case's tool or environment file, its mode file ("on") and run.toml, in `folder`; output.dir is
    relative ("run"), so a tool that changes the working directory would lose it."""
    folder.mkdir(parents=True)
    mode = folder / "mode"
    mode.write_text("on")
    head = (f"import os, signal, sys, time\n\ndef on():\n    return open({str(mode)!r}).read() == 'on'\n\n")
    name = f"hostile_{case.name}"
    if case.environment:
        source = head + (ASYNC_RESET if case.name == "async_reset" else case.body)
        tools = f'environment = "{folder / name}.py:Env"'
    else:
        body = textwrap.indent(f"if not on():\n    return 'ok'\n{case.body}", "    ")
        source = head + f'def t() -> str:\n    """A tool."""\n{body}\n'
        tools = f'functions = ["{folder / name}.py:t"]'
    (folder / f"{name}.py").write_text(source)
    (folder / "score.py").write_text("def score(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    rewards = "" if case.environment else f'functions = ["{folder / "score.py"}:score"]'
    (folder / "run.toml").write_text(textwrap.dedent(f"""\
        [model]
        path = "{model}"
        [data]
        task = "addition"
        num_prompts = 8
        [rewards]
        {{rewards}}
        [rollout]
        group_size = 2
        max_new_tokens = 256
        [train]
        steps = 1
        prompts_per_step = 1
        num_threads = 1
        [tools]
        {{tools}}
        max_calls = 1
        timeout_s = {TIMEOUT_S}
        [output]
        dir = "run"
        console = false
        completions_every = 1
        """).replace("{rewards}", rewards).replace("{tools}", tools) + case.extra)
    return folder / "run.toml"


@pytest.fixture(scope="module")
def calling_model(tmp_path_factory) -> Path:
    return build_calling_model(tmp_path_factory.mktemp("calling-model"))


def train_in_process(folder: Path, *args: str, monkeypatch, capsys) -> tuple[CliResult, float]:
    monkeypatch.chdir(folder)
    args = ["train", str(folder / "run.toml"), *args]
    start, threads = time.monotonic(), torch.get_num_threads()
    try:
        code = cli.main(args)
    finally:
        torch.set_num_threads(threads)  # train.num_threads = 1 would stay for the tests after
    seconds = time.monotonic() - start
    out = capsys.readouterr()
    return CliResult(args, code, out.out, out.err), seconds


def tool_messages(run: Path) -> list[str]:
    rows = read_jsonl(run / "completions.jsonl")
    return [m["content"] for r in rows for m in r["conversation"] if m["role"] == "tool"]


def check_finished(case: Case, run: Path, steps: int) -> None:
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), case.name
    if not case.environment:
        assert all(r["tools/call_frequency"] == 1.0 for r in rows), rows
        assert all(r["tools/failure_frequency"] == (1.0 if case.failed else 0.0) for r in rows), (case.name, rows)
        shown = tool_messages(run)
        assert shown and all(case.shown in m for m in shown), (case.name, shown[:1])
    assert [c.name for c in list_checkpoints(run)][-1] == f"checkpoint-{steps}"


def run_case(case: Case, folder: Path, model: Path, monkeypatch, capsys) -> None:
    config = write_case(folder, model, case)
    first, seconds = train_in_process(folder, monkeypatch=monkeypatch, capsys=capsys)
    assert seconds < 60, f"{case.name}: {seconds:.0f} s"  # a hang costs tools.timeout_s, never the run
    run = folder / "run"
    if case.error:
        assert_user_error(first, *case.error)
        assert not list_checkpoints(run)
        (folder / "mode").write_text("off")  # the fix; the same command now runs
        again, _ = train_in_process(folder, monkeypatch=monkeypatch, capsys=capsys)
        assert_clean_exit(again)
    else:
        assert_clean_exit(first)
        check_finished(case, run, 1)
        if case.name == "with_eval":
            assert "eval/accuracy" in read_metrics(run)[-1]
    resumed, _ = train_in_process(folder, "--resume", "--set", "train.steps=2", monkeypatch=monkeypatch,
                                  capsys=capsys)
    assert_clean_exit(resumed)
    if not case.error:
        check_finished(case, run, 2)
    assert config.exists()


@pytest.mark.parametrize("case", [c for c in TOOL_CASES + ENV_CASES if not c.subprocess], ids=lambda c: c.name)
def test_a_hostile_tool_or_environment_fails_a_call_or_stops_in_one_line(case, calling_model, tmp_path,
                                                                          monkeypatch, capsys):
    run_case(case, tmp_path / case.name, calling_model, monkeypatch, capsys)


def test_an_async_reset_is_refused_at_start_up_naming_the_class(calling_model, tmp_path, monkeypatch, capsys):
    case = env_case("async_reset")
    write_case(tmp_path / "async", calling_model, case)
    result, _ = train_in_process(tmp_path / "async", monkeypatch=monkeypatch, capsys=capsys)
    assert_user_error(result, "tools.environment", "environment Env: reset is `async def`")
    assert not (tmp_path / "async" / "run").exists()


def test_hung_calls_leave_a_bounded_number_of_threads(calling_model, tmp_path, monkeypatch, capsys):
    from grpokit.rollout import tools

    monkeypatch.setattr(tools, "MAX_ABANDONED", 3)
    monkeypatch.setattr(tools, "_abandoned", [])  # other tests' hung calls may still run
    case = Case("hang", "time.sleep(5)", "did not answer")
    write_case(tmp_path / "bounded", calling_model, case)
    before = threading.active_count()
    result, _ = train_in_process(tmp_path / "bounded", "--set", "train.steps=3", "--set", "train.prompts_per_step=2",
                                 monkeypatch=monkeypatch, capsys=capsys)
    assert_clean_exit(result)
    assert threading.active_count() - before <= 3 + 4  # the bound, and one step's 4 calls that started together
    shown = tool_messages(tmp_path / "bounded" / "run")
    assert any("earlier calls are still running past tools.timeout_s" in m for m in shown), shown


CTYPES_EXIT = Case("ctypes_exit", "import ctypes\nctypes.CDLL(None)._exit(7)", "the tool's worker process died "
                   "(exit code 7)", subprocess=True)  # past the guard: only a worker process survives it


@pytest.mark.parametrize("isolation", ["none", "process"])
def test_exits_of_a_tool_never_end_the_trainer(isolation, calling_model, tmp_path):
    """os._exit and a SIGKILL of the tool's own process: a failed call, in-process (the guard) and in a worker;
    an exit through ctypes, which no guard sees, in a worker."""
    cases = [c for c in TOOL_CASES if c.subprocess] + ([CTYPES_EXIT] if isolation == "process" else [])

    def one(case):
        folder = tmp_path / case.name
        write_case(folder, calling_model, case)
        start = time.monotonic()
        result = run_cli("train", folder / "run.toml", "--set", f"tools.isolation={isolation}", cwd=folder,
                         timeout=300)
        return case, result, time.monotonic() - start

    with ThreadPoolExecutor(2) as pool:
        for case, result, seconds in pool.map(one, cases):
            assert_clean_exit(result)
            check_finished(case, tmp_path / case.name / "run", 1)
            print(f"{case.name} ({isolation}): {seconds:.1f} s")


def test_the_table_covers_every_kind_of_fault():
    names = {c.name for c in TOOL_CASES + ENV_CASES}
    assert {"raise", "hang", "huge_result", "lone_surrogate", "nul_bytes", "chdir", "os_exit", "self_kill",
            "not_a_string", "reset_int", "reset_list", "reset_hangs", "get_reward_hangs", "with_eval"} <= names


@pytest.mark.parametrize("exits", [False, True], ids=["runs", "tool_exits"])
def test_environments_in_worker_processes(exits, calling_model, tmp_path, monkeypatch, capsys):
    """tools.isolation = "process" with an environment: reset, its tool and get_reward run in the workers; a tool
    that ends its worker fails the call, and the lost instance's get_reward stops the run in one line."""
    tool = "import ctypes\n        ctypes.CDLL(None)._exit(7)" if exits else 'return "ok"'
    case = Case("env_process", ENV.format(reset='return " go"', get_reward="return 1.0").replace(
        'return "ok"', tool), environment=True, extra="", failed=exits)
    config = write_case(tmp_path / "env", calling_model, case)
    config.write_text(config.read_text().replace("max_calls = 1", "max_calls = 1\nisolation = \"process\""))
    result, _ = train_in_process(tmp_path / "env", monkeypatch=monkeypatch, capsys=capsys)
    if exits:
        assert_user_error(result, "environment Env: get_reward has no instance: its worker process died")
    else:
        assert_clean_exit(result)
        assert read_metrics(tmp_path / "env" / "run")[-1]["rewards/Env/mean"] == 1.0
        assert all(m == "ok" for m in tool_messages(tmp_path / "env" / "run"))


def test_an_exit_in_a_tool_worker_names_what_it_would_end_not_the_isolation_already_set(calling_model, tmp_path,
                                                                                          monkeypatch, capsys):
    """Issue 43 point 11: with tools.isolation = "process" set, an environment's os._exit in its worker was told to
    set tools.isolation = "process"."""
    case = next(c for c in ENV_CASES if c.name == "reset_exits")
    write_case(tmp_path / "worker", calling_model, case)
    result, _ = train_in_process(tmp_path / "worker", "--set", "tools.isolation=process", monkeypatch=monkeypatch,
                                 capsys=capsys)
    line = assert_user_error(result, "environment Env: reset raised ToolExit: the tool called os._exit(3), which would "
                                     "end its tool worker process (tools.isolation = \"process\")")
    assert "runs tools where that ends a worker" not in line, line

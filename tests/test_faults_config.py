"""Fault injection, config part: every field of every section gets bad values by its annotated type.

Cases are generated from the dataclasses (dataclasses.fields + typing.get_type_hints), so a new
field is covered the day it is added. Each bad value goes through the real CLI,
`grpokit train CFG --set section.key=VALUE` (or, for a string field, where `--set` keeps any text,
as `key = VALUE` in the TOML file), and must end in the contract of tests/fault_harness.py: exit
code 2, exactly one `error:` line naming "section.key", no traceback, no output folder.

All cases run in-process through `grpokit.cli.main` (~10 ms each), one test per field; a
representative subset (the first case of each annotated type and route, and the faults reported
by users) also runs in subprocesses, 2 at a time (~0.4 s each here).
At the time of writing: 550 cases over 65 fields, 18 of them also in subprocesses.
"""

from __future__ import annotations

import dataclasses
import json
import time
import typing
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fault_harness import CliResult, assert_user_error, run_cli, snapshot
from grpokit import cli
from grpokit.config.loading import load_config
from grpokit.config.schema import SECTIONS

pytestmark = pytest.mark.faults

# A valid run, small enough that accepting it by mistake would still end quickly.
BASE = {
    "model": {"path": None},  # the tiny_model_dir fixture
    "data": {"task": "addition", "num_prompts": 16},
    "rollout": {"group_size": 2, "max_new_tokens": 2},
    "train": {"steps": 1, "prompts_per_step": 2},
    "output": {"dir": "run", "console": False},  # relative: inside the case's working folder
}

# Bad values (TOML text) by annotated type. `--set` reads a value as TOML, else as its text.
WRONG = {
    int: ["abc", "2.5", "true", "[1]", "{a = 1}", '"3"', "nan", "inf", "-1"],
    float: ["abc", "true", "[1.0]", "{a = 1}", '"0.5"', "nan", "inf", "-inf", "-1.0"],
    bool: ['"false"', '"true"', "1", "0", "yes", "False", "[true]", "{a = 1}"],
    tuple[str, ...]: ["abc", "5", "[1]", '[""]', '["a", 2]', "{a = 1}", "true"],
    tuple[float, ...]: ["abc", "5", '["a"]', "[nan]", "[inf]", "[true]", "{a = 1}"],
    tuple[float, float]: ["abc", "0.9", "[0.9]", "[0.9, nan]", "[0.9, inf]", '[0.9, "a"]', "[2.0, 3.0]",
                          "[-0.1, 0.9]", "[0.9, 0.99, 0.999]", "{a = 1}"],
    dict: ["5", "abc", "[1]", "true", '"{}"'],
    dict[str, dict]: ["5", "abc", "[1]", "true", "{a = 1}", '{a = "x"}'],
}
STR_IN_FILE = ["2024", "1.5", "true", "[1]", '["runs"]', "{a = 1}"]  # `--set` would keep these as text
NEGATIVE_OK = {"data.seed", "eval.correct_threshold"}  # fields where -1 is a valid value (rewards may be negative)
FREE_TEXT = {"model.path", "data.path", "data.prompt_column", "output.dir"}  # any non-empty text is valid
# Options inside a table field (known keys with their own types and ranges)
NESTED = {
    "model.lora": ["{r = 0}", "{r = 2.5}", "{r = true}", '{r = "8"}', "{alpha = nan}", "{alpha = -1}",
                   "{alpha = true}", "{target_modules = [1]}", "{target_modules = 5}", "{rank = 8}"],
    "rollout.vllm": ["{gpu_memory_utilization = 2.0}", '{gpu_memory_utilization = "a"}',
                     "{gpu_memory_utilization = nan}", "{max_model_len = 1.5}", "{max_model_len = 0}",
                     '{enforce_eager = "yes"}', "{enable_sleep_mode = 1}", "{sync_bucket_mb = -1}", "{dtype = 16}",
                     '{dtype = "fp8"}', "{bogus = 1}"],
    "rewards.args": ["{a = [1]}", "{a = true}"],
}


@dataclasses.dataclass(frozen=True)
class Case:
    key: str  # section.key: the error line must name it
    value: str  # TOML text
    in_file: bool = False  # written into the TOML file instead of --set

    @property
    def id(self) -> str:
        return f"{self.key}{' = ' if self.in_file else '='}{self.value}"


def generate_cases() -> list[Case]:
    cases = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key, kind = f"{section}.{f.name}", hints[f.name]
            if kind is str:
                cases += [Case(key, v, in_file=True) for v in STR_IN_FILE]
                required = f.default != "" or key == "model.path"
                cases += [Case(key, "")] if required else []  # `--set key=`: the empty string
                cases += [Case(key, '"no-such-value"')] if required and key not in FREE_TEXT else []
                continue
            values = [v for v in WRONG[kind] if not (v in ("-1", "-1.0") and key in NEGATIVE_OK)]
            cases += [Case(key, v) for v in values + NESTED.get(key, [])]
    return cases


CASES = generate_cases()
KINDS_SEEN: set = set()
SUBPROCESS_CASES = []  # the first case of each (annotated type, route), plus a few by hand
for case in CASES:
    section, name = case.key.split(".")
    kind = (typing.get_type_hints(SECTIONS[section])[name], case.in_file, case.value == "")
    if kind not in KINDS_SEEN:
        KINDS_SEEN.add(kind)
        SUBPROCESS_CASES.append(case)
SUBPROCESS_CASES += [c for c in CASES if c.id in {
    'algorithm.dynamic_sampling="false"', "train.learning_rate=inf", "rollout.group_size=2.5",
    "train.adam_betas=[2.0, 3.0]", "rollout.vllm={gpu_memory_utilization = 2.0}", "model.lora={r = 0}",
    "output.dir = 2024"}]


def toml_text(base: dict, model_path: Path, case: Case | None = None) -> str:
    lines = []
    for section, values in base.items():
        values = {**values, "path": str(model_path)} if section == "model" else dict(values)
        values = {k: json.dumps(v) for k, v in values.items()}  # str, int and bool: JSON writes them as TOML does
        if case is not None and case.in_file and case.key.startswith(section + "."):
            values[case.key.split(".")[1]] = case.value
        lines += [f"[{section}]"] + [f"{k} = {v}" for k, v in values.items()] + [""]
    if case is not None and case.in_file and case.key.split(".")[0] not in base:
        lines += [f"[{case.key.split('.')[0]}]", f"{case.key.split('.')[1]} = {case.value}"]
    return "\n".join(lines)


def cli_args(config: Path, case: Case) -> list[str]:
    return ["train", str(config)] + ([] if case.in_file else ["--set", f"{case.key}={case.value}"])


@pytest.fixture(scope="module")
def base_config(tiny_model_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fault-config") / "base.toml"
    path.write_text(toml_text(BASE, tiny_model_dir))
    return path


def write_case_config(base_config: Path, tiny_model_dir, case: Case, folder: Path) -> Path:
    if not case.in_file:
        return base_config
    path = folder / "case.toml"
    path.write_text(toml_text(BASE, tiny_model_dir, case))
    return path


def test_base_config_is_valid(base_config, tiny_model_dir):
    config = load_config(base_config)
    assert config.model.path == str(tiny_model_dir) and config.data.task == "addition" and config.train.steps == 1
    assert config.output.dir == "run" and config.generation_batch_size == 4


def test_every_field_has_cases():
    covered = {c.key for c in CASES}
    every = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert covered == every, every - covered


@pytest.mark.parametrize("key", sorted({c.key for c in CASES}))
def test_bad_values_are_one_error_line_naming_the_field(key, base_config, tiny_model_dir, tmp_path, monkeypatch,
                                                        capsys):
    # one test per field (a test per case would cost ~10x the cases themselves in pytest overhead)
    for i, case in enumerate(c for c in CASES if c.key == key):
        folder = tmp_path / f"case-{i}"
        work = folder / "work"  # the working folder: output.dir = "run" would land here
        work.mkdir(parents=True)
        config = write_case_config(base_config, tiny_model_dir, case, folder)
        monkeypatch.chdir(work)
        before = snapshot(folder)
        args = cli_args(config, case)
        code = cli.main(args)
        out = capsys.readouterr()
        assert_user_error(CliResult(args, code, out.out, out.err), case.key)
        assert snapshot(folder) == before and not any(work.iterdir()), case.id


def test_bad_values_through_the_cli_in_subprocesses(base_config, tiny_model_dir, tmp_path):
    start = time.perf_counter()

    def run(i_case):
        i, case = i_case
        folder = tmp_path / f"case-{i}"
        folder.mkdir()
        work = folder / "work"
        work.mkdir()
        config = write_case_config(base_config, tiny_model_dir, case, folder)
        before = snapshot(folder)
        return case, run_cli(*cli_args(config, case), cwd=work, timeout=120), folder, before

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, enumerate(SUBPROCESS_CASES)))
    for case, result, folder, before in results:
        assert_user_error(result, case.key)
        assert snapshot(folder) == before and not any((folder / "work").iterdir()), case.id
    print(f"\nconfig faults: {len(CASES)} cases in-process, {len(SUBPROCESS_CASES)} also in subprocesses "
          f"({time.perf_counter() - start:.1f} s)")


def test_a_config_error_under_torchrun_is_printed_once(base_config, tmp_path):
    """Every torchrun process loads the config; the error used to be printed once per process. Each still
    exits 2 (torchrun's own process then adds its ChildFailedError traceback, which no process it started
    can silence: `grpokit train --nproc-per-node`, the next test, is the launch without it)."""
    import os
    import subprocess
    import sys

    from fault_harness import ROOT

    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([str(torchrun), "--nproc-per-node", "2", "-m", "grpokit.cli", "train", str(base_config),
                        "--set", "train.steps=abc"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: train.steps: must be an integer, got 'abc' (a string); e.g. train.steps = 100"], r.stderr
    assert r.returncode != 0 and "exitcode  : 2" in r.stderr  # both processes exited 2
    # one process of a machine alone (LOCAL_RANK 1) says nothing; a fault during a run is printed on any process
    quiet = run_cli("train", base_config, "--set", "train.steps=abc", env={"LOCAL_RANK": "1", "RANK": "1"})
    assert quiet.returncode == 2 and quiet.stderr == "", quiet.describe()


KILLED_ON_RANK_1 = """
import os, signal
def boom(completions, **kwargs):
    if os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(completions)
"""


def test_grpokit_train_nproc_per_node_shows_the_processes_error_line_not_torchruns_traceback(base_config, tmp_path):
    """`grpokit train --nproc-per-node 2` runs torchrun's launcher in grpokit's process: a config error is found
    before any process starts (once, exit 2); a start-up error in the processes is their one line and exit 2; a
    process killed by a signal is one line naming it, the last; no torchrun traceback or agent log line in any
    case; and a good run trains on 2 processes and exits 0."""
    run = f"output.dir={json.dumps(str(tmp_path / 'run'))}"
    before = time.monotonic()
    assert_user_error(run_cli("train", base_config, "--nproc-per-node", "2", "--set", "train.steps=abc"),
                      "train.steps: must be an integer, got 'abc'")
    assert time.monotonic() - before < 30  # no process was started for it
    startup = run_cli("train", base_config, "--nproc-per-node", "2", "--set", run, "--set", "model.path=/no/model")
    assert_user_error(startup, "model.path '/no/model' is not a folder")
    assert "ChildFailedError" not in startup.stderr and "torch.distributed" not in startup.stderr, startup.describe()
    (tmp_path / "r.py").write_text(KILLED_ON_RANK_1)
    killed = run_cli("train", base_config, "--nproc-per-node", "2", "--set", run, "--set", "output.overwrite=true",
                     "--set", f"rewards.functions=[{json.dumps(str(tmp_path / 'r.py') + ':boom')}]")
    assert killed.returncode == 2 and "ChildFailedError" not in killed.stderr, killed.describe()
    assert "Traceback" not in killed.stderr, killed.describe()  # process 0's failed collective is said by this line
    assert killed.error_lines == ["error: training process 1 was ended by SIGKILL (killed from outside, or out of "
                                  "memory: dmesg names the OOM killer's victims), and the other processes were "
                                  "stopped; the run stopped before its first checkpoint: start it again with the "
                                  "same command"]
    assert killed.stderr.rstrip().endswith("start it again with the same command"), killed.describe()
    good = run_cli("train", base_config, "--nproc-per-node", "2", "--set", run, "--set", "output.overwrite=true")
    assert good.returncode == 0 and "Traceback" not in good.stderr, good.describe()
    assert good.stdout.count("run folder:") == 1 and (tmp_path / "run" / "checkpoint-1").is_dir(), good.describe()
    with pytest.raises(Exception, match="--nproc-per-node must be >= 1, got 0"):
        from grpokit.models.parallel import launch

        launch(0, ["train", str(base_config)])

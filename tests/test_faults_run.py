"""Fault injection on the run folder through the real CLI, in subprocesses: failed first attempts,
disk full, two runs on one folder, overwrite, resume with a changed config, Ctrl-C, SIGKILL anywhere.

Each case asserts the contract of tests/fault_harness.py (exit 2 and one `error:` line naming the file
or field, or exit 0 for a clean stop; never a traceback) and that the folder is either untouched or
resumable, with metrics and weights equal to an uninterrupted run where the case resumes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import comparable
from fault_harness import ROOT, assert_clean_exit, assert_user_error, run_cli, snapshot, write_train_config
from grpokit.observe.tracking import read_history, read_metrics
from grpokit.training.checkpoint import list_checkpoints

pytestmark = pytest.mark.faults


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def fault_env(tmp_path: Path, **hooks) -> dict:
    """Environment for the `parity` reward's hooks: a call counter file plus e.g. FAULT_RAISE_AT=1."""
    counter = tmp_path / f"calls-{random.randrange(10**9)}"
    return {"FAULT_COUNTER": str(counter), **{f"FAULT_{k.upper()}": str(v) for k, v in hooks.items()}}


class Started:
    """`grpokit ARGS` running in the background, its output going to files that a test can watch."""

    def __init__(self, *args, env: dict | None = None):
        import tempfile

        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "grpokit.cli", *map(str, args)], cwd=ROOT, env=full_env,
                                     stdout=self.out, stderr=self.err, text=True)
        self.pid = self.proc.pid

    def poll(self):
        return self.proc.poll()

    def stderr_now(self) -> str:
        self.err.seek(0)
        return self.err.read()

    def communicate(self, timeout: float = 300) -> tuple[str, str]:
        self.proc.wait(timeout)
        self.out.seek(0)
        return self.out.read(), self.stderr_now()

    @property
    def returncode(self):
        return self.proc.returncode

    def send_signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


start = Started


def wait_for(condition, proc: Started, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def logged_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """An uninterrupted 3-step run: what every resumed run below must equal."""
    folder = tmp_path_factory.mktemp("reference")
    run = folder / "run"
    assert_clean_exit(run_cli("train", write_train_config(folder, tiny_model_dir, run)))
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    return run


def assert_equals_reference(run: Path, reference: Path) -> None:
    assert comparable(read_metrics(run)) == comparable(read_metrics(reference))
    assert same_weights(run / "checkpoint-3", reference / "checkpoint-3")


# ---------------------------------------------------------------- 1. a failed first attempt does not lock the folder


def test_a_run_that_fails_before_its_first_checkpoint_can_simply_be_run_again(tiny_model_dir, tmp_path, reference):
    run = tmp_path / "run"
    cfg = write_train_config(tmp_path, tiny_model_dir, run)
    failed = run_cli("train", cfg, env=fault_env(tmp_path, raise_at=1))
    assert_user_error(failed, "reward function 'parity'", "boom")
    assert (run / "config.toml").is_file() and not list_checkpoints(run)
    again = run_cli("train", cfg)  # the same command, once the reward is fixed
    assert_clean_exit(again)
    assert "stopped before its first checkpoint" in again.stdout and "earlier-attempts" in again.stdout
    assert_equals_reference(run, reference)
    (aside,) = (run / "earlier-attempts").iterdir()  # the failed attempt's logs are kept, not deleted
    assert (aside / "config.toml").is_file() and (aside / "metrics.jsonl").read_text() == ""
    # --resume still needs a checkpoint, and says so
    assert_user_error(run_cli("train", cfg, "--resume", "--set", f"output.dir={json.dumps(str(tmp_path / 'new'))}"),
                      "has no checkpoint to resume from", "run without --resume")


# ---------------------------------------------------------------- 3. disk full: real ENOSPC on a small tmpfs


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs: real ENOSPC, not an injected one. Needs root and mount rights (skipped otherwise)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'mount failed'}); real disk-full cases need it")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("fill_at, leave, mentions", [
    (1, 0, ("metrics.jsonl", "No space left on device", "no checkpoint was written yet")),
    (2, 48 * 1024, ("could not write checkpoint-2", "the earlier checkpoints are intact (checkpoint-1)")),
])
def test_disk_full_mid_run_is_one_error_line_and_the_run_resumes_exactly(tiny_model_dir, tmp_path, small_disk,
                                                                         reference, fill_at, leave, mentions):
    """The reward fills the disk during step `fill_at`, leaving `leave` bytes. At step 1 nothing is left
    for the first metrics line; at step 2 the metrics line fits but the checkpoint does not (a real
    failure inside safetensors / torch.save, not an injected OSError). Either way: exit 2, one line, no
    half line, no partial checkpoint; once space is freed, the same command (with --resume when a
    checkpoint exists) gives exactly the uninterrupted run."""
    run, filler = small_disk / "run", small_disk / "filler"
    cfg = write_train_config(tmp_path, tiny_model_dir, run)
    result = run_cli("train", cfg, env=fault_env(tmp_path, fill_at=fill_at, fill_path=filler, fill_leave=leave))
    assert_user_error(result, *mentions)
    text = (run / "metrics.jsonl").read_text()
    assert text == "" or text.endswith("\n")  # never half a line
    assert not list(run.glob(".tmp-checkpoint-*"))
    assert list_checkpoints(run) == [run / f"checkpoint-{s}" for s in range(1, fill_at)]
    filler.unlink()
    assert_clean_exit(run_cli("train", cfg, *(["--resume"] if fill_at > 1 else [])))
    assert_equals_reference(run, reference)


def test_a_metrics_line_cut_by_a_crash_is_dropped_on_resume(tiny_model_dir, tmp_path, reference):
    run = tmp_path / "run"
    cfg = write_train_config(tmp_path, tiny_model_dir, run)
    assert_clean_exit(run_cli("train", cfg, "--set", "train.steps=2"))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')  # what a kill inside a write leaves (older versions wrote in pieces)
    assert read_metrics(run)[-1]["step"] == 2  # readers (report, demo) skip it too
    assert_clean_exit(run_cli("train", cfg, "--resume"))
    assert_equals_reference(run, reference)


# ---------------------------------------------------------------- 4. two runs on one folder


def test_a_second_run_on_a_busy_folder_is_refused_naming_the_first(tiny_model_dir, tmp_path, reference):
    run = tmp_path / "run"
    cfg = write_train_config(tmp_path, tiny_model_dir, run)
    first = start("train", cfg, env=fault_env(tmp_path, hang_at=2))  # holds the folder, hangs in step 2
    try:
        wait_for(lambda: list_checkpoints(run), first, "checkpoint-1")
        time.sleep(0.5)  # now inside step 2's hanging reward: nothing changes in the folder
        before = snapshot(run)
        for args in (["train", cfg], ["train", cfg, "--resume"], ["train", cfg, "--set", "output.overwrite=true"]):
            line = assert_user_error(run_cli(*args), "output.dir", "in use by another grpokit run",
                                     f"pid {first.pid}", "choose another output.dir")
            assert "run.toml" in line  # the other run's command
        assert snapshot(run) == before
    finally:
        first.kill()  # SIGKILL: the OS drops the lock; nothing stale is left behind
    assert_clean_exit(run_cli("train", cfg, "--resume"))
    assert_equals_reference(run, reference)


def test_two_runs_started_together_on_a_new_folder_one_runs_one_is_refused(tiny_model_dir, tmp_path, reference):
    run = tmp_path / "run"
    cfg = write_train_config(tmp_path, tiny_model_dir, run)
    procs = [start("train", cfg), start("train", cfg)]
    results = [p.communicate() + (p.returncode,) for p in procs]
    codes = sorted(rc for _, _, rc in results)
    assert codes == [0, 2], results
    (out, err, _), = [r for r in results if r[2] == 2]
    # refused by the lock (still running) or, if the first finished already, by "already holds a run"
    assert "in use by another grpokit run" in err or "already holds a run" in err, err
    assert "Traceback" not in err
    assert_equals_reference(run, reference)


# ---------------------------------------------------------------- 5. overwrite starts clean


def test_overwrite_removes_the_earlier_run_and_says_what_it_removed(tiny_model_dir, tmp_path, reference):
    run = tmp_path / "run"
    cfg = write_train_config(tmp_path, tiny_model_dir, run)
    assert_clean_exit(run_cli("train", cfg))  # checkpoints 1-3
    (run / "notes.txt").write_text("mine")  # not grpokit's: left alone
    again = run_cli("train", cfg, "--set", "train.steps=1", "--set", "output.overwrite=true")
    assert_clean_exit(again)
    assert "output.overwrite: removed the earlier run" in again.stdout and "checkpoint-3" in again.stdout
    assert list_checkpoints(run) == [run / "checkpoint-1"] and (run / "notes.txt").read_text() == "mine"
    assert [r["step"] for r in read_metrics(run)] == [1]
    assert_clean_exit(run_cli("train", cfg, "--resume"))  # continues the new run, not the old checkpoint-3
    assert_equals_reference(run, reference)
    assert len(read_history(run)) == 2


# ---------------------------------------------------------------- 10. resume with a changed config


REFUSED_CHANGES = {
    "train.seed": "1", "rollout.group_size": "2", "algorithm.beta": "0.1", "train.prompts_per_step": "1",
    "train.learning_rate": "0.5", "rollout.temperature": "0.7", "data.num_prompts": "20",
}


def test_resume_refuses_changed_fields_listing_each_and_touches_nothing(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    cfg = write_train_config(tmp_path, tiny_model_dir, run, steps=1)
    assert_clean_exit(run_cli("train", cfg))
    before = snapshot(run)
    other_model = tmp_path / "other-model"
    import shutil

    shutil.copytree(tiny_model_dir, other_model)
    sets = [w for k, v in REFUSED_CHANGES.items() for w in ("--set", f"{k}={v}")]
    line = assert_user_error(run_cli("train", cfg, "--resume", "--set", "train.steps=2", *sets, "--set",
                                     f"model.path={json.dumps(str(other_model))}"),
                             "differs from the one that wrote", "checkpoint-1", "model.path", "restore them")
    for key in REFUSED_CHANGES:
        assert key in line, (key, line)
    assert "train.steps:" not in line  # allowed to change
    assert snapshot(run) == before
    below = assert_user_error(run_cli("train", cfg, "--resume", "--set", "train.steps=0"), "train.steps")
    assert snapshot(run) == before, below


def test_resume_accepts_steps_and_logging_changes_and_keeps_each_segments_config(tiny_model_dir, tmp_path,
                                                                                 reference):
    run = tmp_path / "run"
    cfg = write_train_config(tmp_path, tiny_model_dir, run, steps=1)
    assert_clean_exit(run_cli("train", cfg))
    done = run_cli("train", cfg, "--resume")  # train.steps equals the checkpoint's step: nothing to do
    assert_clean_exit(done)
    assert "already complete at step 1" in done.stdout
    assert_clean_exit(run_cli("train", cfg, "--resume", "--set", "train.steps=3", "--set", "output.keep_last=5",
                              "--set", "output.completions_every=1"))
    assert_equals_reference(run, reference)
    history = read_history(run)
    assert [h["start_step"] for h in history] == [0, 1]
    assert history[1]["changes"] == {"output.completions_every": [0, 1], "output.keep_last": [10, 5],
                                     "train.steps": [1, 3]}
    assert "--resume" in history[1]["command"]
    assert (run / "checkpoint-3" / "grpokit_config.toml").is_file()
    below = assert_user_error(run_cli("train", cfg, "--resume", "--set", "train.steps=2"),
                              "train.steps = 2 is below", "checkpoint-3")
    assert "--set train.steps=" in below


# ---------------------------------------------------------------- 6 + 12. Ctrl-C and the exact command to continue


def test_first_ctrl_c_answers_at_once_a_second_stops_cleanly_and_the_printed_command_continues(
        tiny_model_dir, tmp_path, reference):
    """A reward hangs in step 2: the first SIGINT prints at once what will happen; the second stops the
    run with one `stopped:` line (exit 130), no traceback; the printed command (with the user's --set
    overrides, output.dir included) continues the run to exactly the uninterrupted result."""
    run = tmp_path / "elsewhere"
    cfg = write_train_config(tmp_path, tiny_model_dir, tmp_path / "ignored")
    args = ["train", cfg, "--set", f"output.dir={json.dumps(str(run))}", "--set", "train.max_consecutive_skips=4"]
    proc = start(*args, env=fault_env(tmp_path, hang_at=2))
    try:
        wait_for(lambda: logged_steps(run) >= 1 and list_checkpoints(run), proc, "checkpoint-1")
        time.sleep(0.5)  # inside step 2's hanging reward
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: "again to stop at once" in proc.stderr_now(), proc, "the first Ctrl-C's message", 5)
        assert "SIGINT: stopping after the current step" in proc.stderr_now()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in out + err
    (line,) = [x for x in err.splitlines() if x.startswith("stopped:")]
    assert f"the newest checkpoint is {run / 'checkpoint-1'}" in line.lower()
    command = line.split("continue with: ", 1)[1]
    assert "--resume" in command and "output.dir=" in command and "max_consecutive_skips=4" in command
    import shlex

    words = shlex.split(command)
    assert words[1] == "train"
    assert_clean_exit(run_cli(*words[1:]))  # exactly what it said
    assert_equals_reference(run, reference)


def test_sigterm_message_gives_the_exact_command(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    cfg = write_train_config(tmp_path, tiny_model_dir, tmp_path / "ignored", steps=10_000)
    proc = start("train", cfg, "--set", f"output.dir={json.dumps(str(run))}")
    try:
        wait_for(lambda: logged_steps(run) >= 1, proc, "step 1")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    import shlex

    command = out.split("Continue with: ", 1)[1].splitlines()[0]
    assert shlex.split(command)[2:] == [str(cfg), "--set", f"output.dir={json.dumps(str(run))}", "--resume"]


# ---------------------------------------------------------------- SIGKILL at random points, then --resume


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigkill_at_a_random_moment_then_resume_equals_the_uninterrupted_run(tiny_model_dir, tmp_path, reference,
                                                                            seed):
    """Kill -9 the run at a random moment between its first log line and its end (inside a step, a save
    or a log write), then --resume (or start again if no checkpoint was written) until it is done."""
    run = tmp_path / "run"
    cfg = write_train_config(tmp_path, tiny_model_dir, run)
    proc = start("train", cfg)
    try:
        wait_for(lambda: (run / "metrics.jsonl").exists(), proc, "the run to start")
        time.sleep(random.Random(seed).uniform(0.0, 1.5))
    finally:
        proc.kill()
    again = run_cli("train", cfg, *(["--resume"] if list_checkpoints(run) else []))
    assert_clean_exit(again)
    assert_equals_reference(run, reference)


def test_a_hanging_reward_stops_the_run_at_its_timeout_and_the_run_resumes(tiny_model_dir, tmp_path, reference):
    """Your own reward functions are bounded by rewards.timeout_s (600 s by default; 2 s here)."""
    run = tmp_path / "run"
    cfg = write_train_config(tmp_path, tiny_model_dir, run)
    t0 = time.monotonic()
    hung = run_cli("train", cfg, "--set", "rewards.timeout_s=2", env=fault_env(tmp_path, hang_at=2))
    assert_user_error(hung, "reward function 'parity' took longer than 2.0 s", "rewards.timeout_s")
    assert time.monotonic() - t0 < 60
    assert list_checkpoints(run) == [run / "checkpoint-1"]
    assert_clean_exit(run_cli("train", cfg, "--resume", "--set", "rewards.timeout_s=2"))  # a resumable change
    assert_equals_reference(run, reference)


# ---------------------------------------------------------------- third round 13. a damaged newest checkpoint


@pytest.mark.parametrize("damage, why", [
    ("missing_state", "trainer_state.pt is missing"),
    ("cut_weights", "model.safetensors is"),
    ("cut_state", "trainer_state.pt is damaged"),
])
def test_resume_from_a_damaged_newest_checkpoint_continues_from_the_one_before(tmp_path, reference, damage, why):
    """checkpoint-3 without its trainer state, with model.safetensors cut to 1000 bytes, or with a cut
    trainer_state.pt: --resume says which checkpoint is damaged and why, moves it aside (kept), trains
    step 3 again from checkpoint-2, and ends where the uninterrupted run ended."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    newest = run / "checkpoint-3"
    if damage == "missing_state":
        (newest / "trainer_state.pt").unlink()
    else:
        name = "model.safetensors" if damage == "cut_weights" else "trainer_state.pt"
        data = (newest / name).read_bytes()
        (newest / name).write_bytes(data[:1000] if damage == "cut_weights" else data[: len(data) // 2])
    resumed = run_cli("train", reference.parent / "run.toml", "--set", f"output.dir={json.dumps(str(run))}",
                      "--resume")
    assert_clean_exit(resumed)
    assert why in resumed.stdout and "resuming from checkpoint-2" in resumed.stdout, resumed.describe()
    assert (run / "damaged-checkpoints" / "checkpoint-3").is_dir()
    assert_equals_reference(run, reference)
    for step in (1, 2, 3):  # every checkpoint intact and the run done: nothing more to do
        (run / f"checkpoint-{step}" / "trainer_state.pt").unlink()
    line = assert_user_error(run_cli("train", reference.parent / "run.toml", "--set",
                                     f"output.dir={json.dumps(str(run))}", "--resume"),
                             "checkpoint-3 is damaged (trainer_state.pt is missing)", "no earlier checkpoint")
    assert "Traceback" not in line


def test_resume_from_the_only_checkpoint_with_damaged_tensor_data_says_to_start_again(tiny_model_dir, tmp_path):
    """NaN bytes in the weights of the only checkpoint (the header intact, so the start-up check passes):
    found as the tensors are read at resume, one error line naming the file and that there is nothing earlier."""
    run = tmp_path / "run"
    assert_clean_exit(run_cli("train", write_train_config(tmp_path, tiny_model_dir, run, steps=1)))
    weights = run / "checkpoint-1" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = b"\xff" * 64
    weights.write_bytes(bytes(data))
    assert_user_error(run_cli("train", write_train_config(tmp_path, tiny_model_dir, run, steps=2), "--resume"),
                      f"--resume: {run / 'checkpoint-1'} cannot be read (model.safetensors: tensor",
                      "holds NaN values", "it is the only checkpoint, so start again without --resume")

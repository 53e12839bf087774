"""Faults injected on purpose: kills, signals, NaN updates, bad input. Nothing is lost, every stop is explained.

Each test makes the fault happen deterministically (a monkeypatched function, a signal sent from a
known point), never with fault hooks in production code. The runs are tiny: 2 prompts x 4 answers
of at most 4 tokens on the session's 2-layer model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import grpokit.training.checkpoint as checkpoint_mod
import grpokit.training.run_folder as run_folder_mod
import grpokit.training.setup as setup_mod
import grpokit.training.update as update_mod
from conftest import PARITY_SOURCE, comparable, make_config, parity
from fault_harness import snapshot, write_train_config
from grpokit.cli import main as cli_main
from grpokit.errors import CheckpointError, TrainingDiverged
from grpokit.observe.tracking import read_metrics
from grpokit.training.loop import train

ROOT = Path(__file__).resolve().parents[1]


def weights(ckpt: Path) -> dict:
    return load_file(str(ckpt / "model.safetensors"))


# This file's runs: 16 prompts taken 2 a step, answers of at most 4 tokens (as `cli_config` writes them).
run_config = partial(make_config, num_prompts=16, prompts_per_step=2, max_new_tokens=4)
# `grpokit train` configs for the same runs, graded by the plain `parity`, checkpoints left to the defaults.
cli_config = partial(write_train_config, reward_source=PARITY_SOURCE, save_every=None, keep_last=None)


def grpokit_process(*args, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "grpokit.cli", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


# ---------------------------------------------------- 1. exact resume through the CLI


def test_cli_resume_in_a_fresh_process_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """6 steps straight == 3 steps, then `grpokit train CFG --resume --set train.steps=6` in a new process:
    the same metrics (wall-clock ones aside) and bit-identical final weights."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    cfg = cli_config(tmp_path, tiny_model_dir, straight, steps=6)
    assert cli_main(["train", str(cfg)]) == 0
    assert cli_main(["train", str(cfg), "--set", f"output.dir={json.dumps(str(split))}", "--set", "train.steps=3"]) == 0
    assert [c.name for c in checkpoint_mod.list_checkpoints(split)] == ["checkpoint-3"]
    resumed = grpokit_process("train", cfg, "--resume", "--set", f"output.dir={json.dumps(str(split))}")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    a, b = read_metrics(straight), read_metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert comparable(a) == comparable(b)
    assert any(r["grad_norm"] > 0 for r in a)  # the weights did move: the comparison means something
    wa, wb = weights(straight / "checkpoint-6"), weights(split / "checkpoint-6")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# ---------------------------------------------------- 2. SIGKILL in the middle of a save

KILLER = '''
import os, signal, sys
import grpokit.training.checkpoint as ck
from grpokit.config import Config, DataConfig, ModelConfig, OutputConfig, RolloutConfig, TrainConfig
from grpokit.training.loop import train
{parity}
real_save, saves = ck.torch.save, []

def save_then_die(obj, f, *args, **kwargs):
    # trainer_state.pt is written last: the model weights and tokenizer are already in the temp folder.
    saves.append(str(f))
    if len(saves) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *args, **kwargs)

ck.torch.save = save_then_die
config = Config(model=ModelConfig(path=sys.argv[1]), data=DataConfig(task="addition", num_prompts=16),
                rollout=RolloutConfig(group_size=4, max_new_tokens=4),
                train=TrainConfig(steps=3, prompts_per_step=2, learning_rate=1e-3),
                output=OutputConfig(dir=sys.argv[2], console=False, save_every=1, keep_last=5))
train(config, reward_functions=[parity])
'''


def test_sigkill_during_a_save_keeps_the_previous_checkpoint_and_resume_completes(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    script = tmp_path / "killer.py"
    script.write_text(KILLER.format(parity=PARITY_SOURCE))
    r = subprocess.run([sys.executable, str(script), str(tiny_model_dir), str(run)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == -signal.SIGKILL, r.stderr
    # The save was cut off after the weights, before trainer_state.pt: only the hidden temp folder has it.
    tmp = run / ".tmp-checkpoint-2"
    assert (tmp / "model.safetensors").is_file() and not (tmp / "trainer_state.pt").exists()
    assert not (run / "checkpoint-2").exists()
    assert checkpoint_mod.list_checkpoints(run) == [run / "checkpoint-1"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "checkpoint-1")  # the previous checkpoint loads
    assert checkpoint_mod.load_trainer_state(run / "checkpoint-1")["step"] == 1

    train(run_config(tiny_model_dir, run, steps=3, output={"save_every": 1, "keep_last": 5}), reward_functions=[parity],
          resume=True)
    assert [c.name for c in checkpoint_mod.list_checkpoints(run)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert checkpoint_mod.load_trainer_state(run / "checkpoint-3")["step"] == 3
    assert not tmp.exists()  # the stale temp folder was replaced by the completed save
    steps = [r["step"] for r in read_metrics(run)]
    assert set(steps) == {1, 2, 3} and steps[-1] == 3


def test_resume_after_a_crash_does_not_duplicate_metrics_rows(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    train(run_config(tiny_model_dir, run, steps=2, output={"save_every": 1}), reward_functions=[parity])
    # A crash after step 2's metrics row but before its checkpoint: drop checkpoint-2 as if never written.
    import shutil

    shutil.rmtree(run / "checkpoint-2")
    train(run_config(tiny_model_dir, run, steps=3, output={"save_every": 1}), reward_functions=[parity], resume=True)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    """ENOSPC while writing checkpoint-2: the error propagates, checkpoint-1 stays complete and loadable."""
    run = tmp_path / "run"
    real_save, saves = torch.save, []

    def save_or_fail(obj, f, *args, **kwargs):
        saves.append(f)
        if len(saves) == 2:
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint_mod.torch, "save", save_or_fail)
    message = (f"{run}: could not write checkpoint-2 (No space left on device); the earlier checkpoints are "
               f"intact (checkpoint-1); free space and continue with: train(config, resume=True)")
    with pytest.raises(CheckpointError) as caught:
        train(run_config(tiny_model_dir, run, steps=3, output={"save_every": 1}), reward_functions=[parity])
    assert str(caught.value) == message
    assert checkpoint_mod.list_checkpoints(run) == [run / "checkpoint-1"]
    assert checkpoint_mod.load_trainer_state(run / "checkpoint-1")["step"] == 1
    assert not list(run.glob(".tmp-checkpoint-*"))  # the partial copy is gone (it only takes space)


def test_a_failed_first_save_is_an_error_line_saying_no_checkpoint_exists(tiny_model_dir, tmp_path, monkeypatch,
                                                                           capsys):
    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_mod.torch, "save", no_space)
    run = tmp_path / "run"
    assert cli_main(["train", str(cli_config(tmp_path, tiny_model_dir, run, steps=1))]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run}: could not write checkpoint-1 (No space left on device); no earlier "
                          "checkpoint exists; free space (or choose another output.dir) and start again"), err
    assert "Traceback" not in err and not list(run.glob("*checkpoint-*"))


# ---------------------------------------------------- 3. SIGTERM / SIGINT: finish the step, save, say how to resume


def test_sigterm_saves_a_checkpoint_at_the_step_reached_and_says_how_to_resume(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    cfg = cli_config(tmp_path, tiny_model_dir, run, steps=10_000)
    proc = grpokit_process("train", cfg)
    try:
        deadline = time.monotonic() + 240
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 1):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no step finished in time"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    reached = read_metrics(run)[-1]["step"]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, reached + 1))
    assert checkpoint_mod.list_checkpoints(run)[-1] == run / f"checkpoint-{reached}"
    assert checkpoint_mod.load_trainer_state(run / f"checkpoint-{reached}")["step"] == reached
    assert "SIGTERM" in out and "--resume" in out, out
    # ... and the run continues from there (a fresh 1-step extension).
    assert cli_main(["train", str(cfg), "--resume", "--set", f"train.steps={reached + 1}"]) == 0
    assert [r["step"] for r in read_metrics(run)] == list(range(1, reached + 2))


def test_sigint_finishes_the_step_and_saves_a_second_one_stops_at_once(tiny_model_dir, tmp_path, capsys):
    calls = []

    def interrupting(completions, **kwargs):  # graded once per step; Ctrl-C arrives during step 2
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return parity(completions)

    before = signal.getsignal(signal.SIGINT)
    run = train(run_config(tiny_model_dir, tmp_path / "run", steps=50), reward_functions=[interrupting])
    assert signal.getsignal(signal.SIGINT) is before  # the handler is restored
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert checkpoint_mod.list_checkpoints(run) == [run / "checkpoint-2"]
    assert "SIGINT: stopped after step 2" in capsys.readouterr().out

    calls.clear()

    def impatient(completions, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # reward functions run in a worker thread (rewards.timeout_s): the main thread
            os.kill(os.getpid(), signal.SIGINT)  # handles each signal, so give it time between the two
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C: stop now, no save
            time.sleep(5)
        return parity(completions)

    with pytest.raises(KeyboardInterrupt):
        train(run_config(tiny_model_dir, tmp_path / "run2", steps=50, output={"save_every": 1}),
              reward_functions=[impatient])
    assert checkpoint_mod.list_checkpoints(tmp_path / "run2") == [tmp_path / "run2" / "checkpoint-1"]


# ---------------------------------------------------- 4. numerical guard: NaN updates


def nan_on_calls(monkeypatch, bad_calls):
    """Make `policy_loss` return a NaN loss on the given calls (1-based). The runs below use the plain
    autograd path (`fused_logprobs = false`), which calls policy_loss once per step and takes the
    gradient from that loss; the fused path derives it from a separate call."""
    real, calls = update_mod.policy_loss, []

    def policy_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan"), stats) if bad_calls(len(calls)) else (loss, stats)

    monkeypatch.setattr(update_mod, "policy_loss", policy_loss)


def test_a_nan_update_is_skipped_and_counted_and_leaves_the_weights(tiny_model_dir, tmp_path, monkeypatch):
    nan_on_calls(monkeypatch, lambda call: call == 2)
    run = train(run_config(tiny_model_dir, tmp_path / "run", steps=3, output={"save_every": 1, "keep_last": 3},
                           train={"max_consecutive_skips": 2, "fused_logprobs": False}), reward_functions=[parity])
    rows = read_metrics(run)
    assert [r["skipped_updates"] for r in rows] == [0, 1, 0]
    assert rows[1]["grad_norm"] is None and rows[1]["loss"] is None  # NaN is written as null
    w1, w2, w3 = (weights(run / f"checkpoint-{s}") for s in (1, 2, 3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # step 2 changed nothing
    assert any(not torch.equal(w2[k], w3[k]) for k in w2)  # step 3 trained again
    assert all(torch.isfinite(w).all() for w in w3.values())


def test_consecutive_nan_updates_stop_the_run_naming_the_count_and_the_last_checkpoint(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    nan_on_calls(monkeypatch, lambda call: call >= 2)
    run = tmp_path / "run"
    with pytest.raises(TrainingDiverged) as e:
        train(run_config(tiny_model_dir, run, steps=10, output={"save_every": 1, "keep_last": 5},
                         train={"max_consecutive_skips": 2, "fused_logprobs": False}),
              reward_functions=[parity])
    message = str(e.value)
    assert "2 steps in a row had a NaN/inf loss or gradient" in message
    assert f"the last good checkpoint is {run / 'checkpoint-2'}" in message and "max_consecutive_skips" in message
    assert [r["skipped_updates"] for r in read_metrics(run)] == [0, 1, 1]
    assert checkpoint_mod.list_checkpoints(run)[-1] == run / "checkpoint-2"
    w1, w2 = weights(run / "checkpoint-1"), weights(run / "checkpoint-2")
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # the skipped step saved the last good weights unchanged


# ---------------------------------------------------- 5. start-up checks: message, and nothing on disk touched


@pytest.fixture
def previous_run(tmp_path):
    """An output folder that already holds a run; every failing start below must leave it byte for byte."""
    run = tmp_path / "run"
    (run / "checkpoint-1").mkdir(parents=True)
    (run / "checkpoint-1" / "model.safetensors").write_bytes(b"weights")
    (run / "checkpoint-1" / "trainer_state.pt").write_bytes(b"state")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


def data_file(tmp_path, content: bytes) -> str:
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    return f"data.path={json.dumps(str(path))}"


GOOD_ROW = b'{"prompt": "1+1=", "answer": "2"}\n'
FILE_DATA = ["--set", "data.task=''", "--set", 'rewards.functions=["numeric_match"]']
START_UP_FAULTS = {
    "group size < 2": (lambda t: ["--set", "rollout.group_size=1"], ["rollout.group_size: must be >= 2"]),
    "epsilon out of range": (lambda t: ["--set", "algorithm.epsilon=1.5"], ["algorithm.epsilon: must be in (0, 1)"]),
    "epsilon zero": (lambda t: ["--set", "algorithm.epsilon=0"], ["algorithm.epsilon: must be in (0, 1)"]),
    "beta < 0": (lambda t: ["--set", "algorithm.beta=-0.1"], ["algorithm.beta: must be >= 0"]),
    "minibatch does not divide the batch": (lambda t: ["--set", "train.minibatch_size=3"],
                                            ["train.minibatch_size: 3 must divide the generation batch of 8"]),
    "micro-batch does not divide the minibatch": (lambda t: ["--set", "train.micro_batch_size=3"],
                                                  ["train.micro_batch_size: 3 must divide train.minibatch_size (8)"]),
    "unknown key": (lambda t: ["--set", "rollout.group_sise=4"], ["unknown key rollout.group_sise",
                                                                  "did you mean 'group_size'"]),
    "unknown section": (lambda t: ["--set", "trian.steps=4"], ["unknown section [trian]", "did you mean 'train'"]),
    "missing model folder": (lambda t: ["--set", f"model.path={json.dumps(str(t / 'nope'))}"],
                             ["model.path", "is not a folder"]),
    "model folder without config.json": (lambda t: ["--set", f"model.path={json.dumps(str(t))}"],
                                         ["has no config.json"]),
    "dataset without a prompt column": (lambda t: [*FILE_DATA, "--set", data_file(t, b'{"question": "1+1="}\n')],
                                        ["no column 'prompt'", "question"]),
    "empty prompt": (lambda t: [*FILE_DATA, "--set", data_file(t, GOOD_ROW + b'{"prompt": "  "}\n')],
                     ["line 2: empty 'prompt'"]),
    "prompt longer than the context": (lambda t: [*FILE_DATA, "--set", data_file(
        t, GOOD_ROW + json.dumps({"prompt": "9" * 600}).encode() + b"\n")], ["prompt row 2 has 600 tokens",
                                                                            "context of 512"]),
    "malformed JSON line": (lambda t: [*FILE_DATA, "--set", data_file(t, GOOD_ROW + b'{"prompt": "x",}\n')],
                            ["line 2 is not valid JSON"]),
    "non-UTF-8 text": (lambda t: [*FILE_DATA, "--set", data_file(t, GOOD_ROW + b'{"prompt": "caf\xe9"}\n')],
                       ["line 2 is not valid UTF-8 (byte 0xe9"]),
    "unknown reward": (lambda t: ["--set", 'rewards.functions=["numeric_mach"]'], ["unknown reward 'numeric_mach'"]),
    "bad reward timeout": (lambda t: ["--set", 'rewards.functions=["numeric_match"]', "--set",
                                      "rewards.args={numeric_match = {timeout = -1}}"],
                           ["timeout must be a number of seconds >= 0"]),
}


@pytest.mark.parametrize("fault", list(START_UP_FAULTS))
def test_start_up_faults_are_explained_and_touch_nothing(tiny_model_dir, tmp_path, previous_run, capsys, fault):
    make_args, needles = START_UP_FAULTS[fault]
    cfg = cli_config(tmp_path, tiny_model_dir, previous_run, steps=2)
    before, files_before = snapshot(previous_run), set(os.listdir(tmp_path))
    (tmp_path / "empty-model").mkdir()
    rc = cli_main(["train", str(cfg), "--resume", *make_args(tmp_path / "empty-model" if "config.json" in fault
                                                             else tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    assert snapshot(previous_run) == before  # resume was asked for, yet nothing was written or removed
    assert set(os.listdir(tmp_path)) - files_before <= {"empty-model", "d.jsonl"}


def test_unwritable_output_folder_is_explained(tiny_model_dir, tmp_path, capsys):
    # A path under a regular file cannot be created even by root (who ignores permission bits).
    blocker = tmp_path / "afile"
    blocker.write_text("keep me")
    cfg = cli_config(tmp_path, tiny_model_dir, blocker / "run", steps=2)
    assert cli_main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "is not writable (Not a directory); choose another folder" in err, err
    assert blocker.read_text() == "keep me"


def test_too_little_free_disk_is_explained_before_the_model_loads(tiny_model_dir, tmp_path, previous_run, capsys,
                                                                  monkeypatch):
    import shutil

    monkeypatch.setattr(run_folder_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12, 0))
    monkeypatch.setattr(setup_mod, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setattr(run_folder_mod, "checkpoint_damage", lambda c: None)  # previous_run's stand-in checkpoint
    cfg = cli_config(tmp_path, tiny_model_dir, previous_run, steps=2)
    before = snapshot(previous_run)
    assert cli_main(["train", str(cfg), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "has 0 MiB free" in err and "choose another output.dir" in err, err
    assert snapshot(previous_run) == before

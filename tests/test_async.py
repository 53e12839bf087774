"""Asynchronous rollout (rollout.mode = "async", training/rollout_source.py): workers sample while the trainer
updates. Each run spawns a worker process (a few seconds: it imports torch and loads the model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import comparable, make_config, parity
from grpokit.config.schema import RolloutConfig
from grpokit.errors import ConfigError, ModelLoadError, RolloutWorkerError, SetupError
from grpokit.observe.report import build_report
from grpokit.observe.timeline import timeline_svg
from grpokit.training.loop import train

_calls = {"n": 0}


def exits_on_second_batch(completions, **kwargs):
    _calls["n"] += 1
    if _calls["n"] == 2:
        os._exit(3)
    return parity(completions)


def killed_on_second_batch(completions, **kwargs):
    _calls["n"] += 1
    if _calls["n"] == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: no heartbeat, no batch
    return parity(completions)


def hangs_on_second_batch(completions, **kwargs):
    _calls["n"] += 1
    if _calls["n"] == 2:
        time.sleep(3600)  # alive and beating, but no batch comes
    return parity(completions)


def raises_on_second_batch(completions, **kwargs):
    _calls["n"] += 1
    if _calls["n"] == 2:
        raise ValueError("the grader's database is gone")
    return parity(completions)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def config(model_dir, out, *, steps=3, rollout=None, **kw):
    return make_config(model_dir, out, steps=steps, rollout={"mode": "async", **(rollout or {})},
                       train={"num_threads": 1, **kw.pop("train", {})}, **kw)


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / f"checkpoint-{step}" / "model.safetensors")


def test_async_with_max_staleness_0_is_the_sync_loop(tiny_model_dir, tmp_path):
    """Orders wait for the newest weights: the same prompts, noise, answers and updates as sync, in two processes."""
    sync = train(make_config(tiny_model_dir, tmp_path / "sync", steps=3, train={"num_threads": 1}),
                 reward_functions=[parity])
    run = train(config(tiny_model_dir, tmp_path / "async", rollout={"max_staleness": 0}), reward_functions=[parity])
    a, b = comparable(rows(sync / "metrics.jsonl")), comparable(rows(run / "metrics.jsonl"))
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert y["async/staleness_max"] == 0
        for key in x:  # the async rows add their own keys (async/*, sampling/*)
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), key
    w_sync, w_async = weights(sync, 3), weights(run, 3)
    assert w_sync.keys() == w_async.keys()
    for name in w_sync:
        torch.testing.assert_close(w_async[name], w_sync[name], rtol=1e-4, atol=1e-6)
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(w_async[n], initial[n]) for n in w_async if n in initial)  # it trained


def test_versions_lag_as_ordered_and_the_lag_is_corrected(tiny_model_dir, tmp_path):
    """weight_sync_every = 3, max_staleness = 2: the workers hold versions 0, 3, ... only, so steps 1-3 are
    sampled by version 0 (lag 0, 1, 2) and steps 4-6 by version 3 (lag 0, 1, 2): deterministic. The
    sampler-trainer gap is 0 where the lag is 0 and the correction weights move where it is not."""
    run = train(config(tiny_model_dir, tmp_path / "run", steps=6, learning_rate=1e-2,
                       rollout={"max_staleness": 2, "weight_sync_every": 3}), reward_functions=[parity])
    got = rows(run / "metrics.jsonl")
    assert [r["async/staleness_max"] for r in got] == [0, 1, 2, 0, 1, 2]
    assert [r["async/staleness_mean"] for r in got] == [0, 1, 2, 0, 1, 2]
    assert all(r["async/dropped"] == 0 for r in got)
    for r in got:  # is_correction "auto" = token_truncate in async
        lagging = r["async/staleness_max"] > 0
        assert (r["sampling/logprob_gap_max"] > 1e-4) == lagging, r
        assert "time/trainer_idle" in r and "time/sampler_idle" in r
    timeline = rows(run / "timeline.jsonl")
    assert {t["process"] for t in timeline} == {"trainer", "worker 0"}
    assert {t["phase"] for t in timeline} == {"sample", "wait", "train", "weight sync"}
    assert all(t["end"] >= t["start"] for t in timeline)
    # the trainer's spans follow each other; worker 0 sampled step 2's batch while the trainer trained step 1
    span = {(t["process"], t["phase"], t["step"]): t for t in timeline}
    assert span[("worker 0", "sample", 2)]["start"] < span[("trainer", "train", 1)]["end"]
    page = build_report(run).read_text()
    assert "<h2>Timeline</h2>" in page


def test_the_timeline_chart_draws_each_process_in_its_lane_and_skips_damaged_rows():
    spans = [{"step": 1, "process": "worker 0", "phase": "sample", "start": 0.0, "end": 1.0},
             {"step": 1, "process": "trainer", "phase": "train", "start": 1.0, "end": 2.0},
             {"step": 2, "process": "worker 0", "phase": "sample", "start": 1.0, "end": 2.0},
             {"step": 2, "process": "trainer", "phase": "wait", "start": 2.0, "end": float("nan")},
             "not a span", {"process": "trainer"}]
    svg = timeline_svg(spans)
    assert svg.count("<title>") == 3 and svg.index(">trainer<") < svg.index(">worker 0<")
    assert "steps 1-2 (2.00 s)" in svg
    assert timeline_svg([]) is None and timeline_svg(["x"]) is None


def test_old_logprobs_sampler_clips_around_the_stale_sampler_as_trls_async_trainer(tiny_model_dir, tmp_path):
    """old_logprobs = "sampler", is_correction = "none": the ratio is taken against the sampler's own log-probs
    (TRL's AsyncGRPOTrainer), so a stale batch starts away from ratio 1 and is clipped; a fresh one is not."""
    run = train(config(tiny_model_dir, tmp_path / "run", steps=6, learning_rate=5e-2,
                       rollout={"max_staleness": 2, "weight_sync_every": 3},
                       algorithm={"old_logprobs": "sampler", "is_correction": "none"}), reward_functions=[parity])
    got = rows(run / "metrics.jsonl")
    assert [r["async/staleness_max"] for r in got] == [0, 1, 2, 0, 1, 2]
    assert all("sampling/is_ratio_mean" not in r for r in got)  # no correction weights
    clipped = [r["clip_ratio/region_mean"] for r in got]
    assert clipped[0] == clipped[3] == 0  # lag 0, one pass: the ratio is exactly 1
    assert clipped[2] > 0 and clipped[5] > 0  # two updates behind at lr 5e-2: tokens outside [0.8, 1.2]


def test_two_workers_take_turns_and_resume(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    cfg = config(tiny_model_dir, out, steps=4, rollout={"workers": 2, "max_staleness": 1},
                 output={"save_every": 2})
    train(cfg, reward_functions=[parity])
    longer = config(tiny_model_dir, out, steps=6, rollout={"workers": 2, "max_staleness": 1},
                    output={"save_every": 2})
    train(longer, reward_functions=[parity], resume=True)
    got = rows(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert all(0 <= r["async/staleness_max"] <= 1 for r in got)
    assert {t["process"] for t in rows(out / "timeline.jsonl")} >= {"worker 0", "worker 1"}


def test_a_resume_after_a_lost_step_keeps_one_timeline_row_per_span(tiny_model_dir, tmp_path):
    """Issue 43 point 6: a kill after step 2's logs and before its checkpoint, then --resume: metrics.jsonl was
    cut back to step 1, timeline.jsonl kept step 2's spans and the redone step 2 added them again."""
    import shutil

    out = tmp_path / "run"
    cfg = config(tiny_model_dir, out, steps=2, rollout={"max_staleness": 0}, output={"save_every": 1})
    train(cfg, reward_functions=[parity])
    assert any(t["step"] == 2 for t in rows(out / "timeline.jsonl"))
    shutil.rmtree(out / "checkpoint-2")  # what a SIGKILL between step 2's logs and its checkpoint leaves
    train(cfg, reward_functions=[parity], resume=True)
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == [1, 2]
    spans = [(t["process"], t["phase"], t["step"]) for t in rows(out / "timeline.jsonl") if t["step"] > 1]
    assert spans and len(spans) == len(set(spans)), spans


@pytest.mark.parametrize("reward, words", [
    (exits_on_second_batch, "rollout worker 0 exited with code 3"),
    (killed_on_second_batch, "rollout worker 0 is hung: no heartbeat"),
    (hangs_on_second_batch, "rollout worker 0: no batch for step 2 within rollout.worker_timeout_s = 4 s"),
    (raises_on_second_batch, "rollout worker 0: reward function 'raises_on_second_batch'"),
])
def test_a_failing_worker_ends_the_run_with_one_error_and_a_resumable_folder(tiny_model_dir, tmp_path, reward,
                                                                            words):
    out = tmp_path / "run"
    t0 = time.monotonic()
    with pytest.raises(RolloutWorkerError) as err:
        train(config(tiny_model_dir, out, steps=4, rollout={"max_staleness": 0, "worker_timeout_s": 4}),
              reward_functions=[reward])
    assert words in str(err.value)
    assert "\n" not in str(err.value)
    go_on = "Once that is fixed, continue with" if reward in (raises_on_second_batch, exits_on_second_batch) \
        else "Continue with"  # 43.14; a reward that exits the worker is named (issue 52)
    assert "step 1 is saved" in str(err.value) and f"{go_on}: train(config, resume=True)" in str(err.value)
    assert time.monotonic() - t0 < 60
    assert (out / "checkpoint-1").is_dir()
    run = train(config(tiny_model_dir, out, steps=2), reward_functions=[parity], resume=True)
    assert [r["step"] for r in rows(run / "metrics.jsonl")] == [1, 2]


def always_raises(completions, **kwargs):
    raise ValueError("the grader's database is gone")


def test_a_reward_that_always_raises_names_it_and_the_fix_before_the_command_to_start_again(tiny_model_dir,
                                                                                          tmp_path):
    """Issue 43.14: the user's own code stops the worker before any checkpoint: the error names the function,
    and the command to start again comes after the fix (it said only "start again with the same command",
    which fails the same way)."""
    with pytest.raises(RolloutWorkerError) as err:
        train(config(tiny_model_dir, tmp_path / "run", steps=2), reward_functions=[always_raises])
    said = str(err.value)
    assert said.startswith("rollout worker 0: reward function 'always_raises'") and "database is gone" in said, said
    assert said.endswith("no checkpoint was written yet: once that is fixed, start again with the same command")


def test_a_worker_frozen_with_batches_queued_is_hung_within_its_timeout(tiny_model_dir, tmp_path, monkeypatch):
    """Issue 43: `kill -STOP` of a worker whose batches wait, unread, for the trainer (their tensors stay in
    the worker's memory, fetched over a local socket the frozen worker no longer serves) ends the run within
    rollout.worker_timeout_s with the heartbeat's error, not a trainer blocked on that socket."""
    from grpokit.training import rollout_source

    original, frozen = rollout_source.AsyncRollouts.next, {}

    def next_batch(self, step):
        if step == 2 and not frozen:
            time.sleep(2.0)  # ordered 3 steps ahead, the worker has queued the batches of steps 2 to 4
            frozen.update(pid=self.procs[0].pid, at=time.monotonic())
            os.kill(frozen["pid"], signal.SIGSTOP)
            frozen["rescue"] = threading.Timer(60, os.kill, (frozen["pid"], signal.SIGKILL))  # else a hang
            frozen["rescue"].start()
        return original(self, step)

    monkeypatch.setattr(rollout_source.AsyncRollouts, "next", next_batch)
    try:
        with pytest.raises(RolloutWorkerError) as err:
            train(config(tiny_model_dir, tmp_path / "run", steps=8,
                         rollout={"max_staleness": 3, "weight_sync_every": 4, "worker_timeout_s": 5}),
                  reward_functions=[parity])
    finally:
        if "rescue" in frozen:
            frozen["rescue"].cancel()
    assert "rollout worker 0 is hung: no heartbeat" in str(err.value)
    assert time.monotonic() - frozen["at"] < 5 + 15


def test_what_async_cannot_do_is_refused_before_the_model_loads(tiny_model_dir, tmp_path):
    with pytest.raises(SetupError, match="train\\(reward_functions=...\\) cannot be sent"):
        train(config(tiny_model_dir, tmp_path / "a"), reward_functions=[lambda completions, **kw: [0.0] * len(
            completions)])
    with pytest.raises(SetupError, match="train\\(engine=...\\)"):
        train(config(tiny_model_dir, tmp_path / "b"), reward_functions=[parity], engine=lambda *a: None)
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        RolloutConfig(mode="async", max_staleness=0, weight_sync_every=2)
    with pytest.raises(ConfigError, match="rollout.mode"):
        RolloutConfig(mode="asynch")
    with pytest.raises(ConfigError, match="rollout.engine"):
        RolloutConfig(mode="async", engine="vllm")
    with pytest.raises(ConfigError, match="rollout.worker_devices"):
        RolloutConfig(mode="async", workers=2, worker_devices=("cpu",))
    with pytest.raises(ModelLoadError, match="rollout.worker_devices 'cuda:7'"):
        train(config(tiny_model_dir, tmp_path / "c", rollout={"worker_devices": ("cuda:7",)}),
              reward_functions=[parity])
    for field, value in (("workers", 0), ("max_staleness", -1), ("worker_timeout_s", 0), ("weight_sync_every", 0)):
        with pytest.raises(ConfigError, match=f"rollout.{field}"):
            RolloutConfig(mode="async", **{field: value})


SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from conftest import make_config, parity
from grpokit.training.loop import train
train(make_config({model!r}, {out!r}, steps=1000, rollout={{"mode": "async"}}, train={{"num_threads": 1}}),
      reward_functions=[parity])
"""


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_no_worker_outlives_the_trainer(tiny_model_dir, tmp_path, sig):
    """A script with no __main__ guard (the workers do not run it again); SIGKILL of the trainer takes its
    workers with it (parent-death signal), SIGTERM stops after the step, saves, and stops them."""
    script = tmp_path / "run.py"
    out = tmp_path / "run"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), model=str(tiny_model_dir), out=str(out)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        assert _wait_for(lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size,
                         120), "the run never logged a step"
        workers = [p for p in _children(proc.pid) if "grpokit" in Path(f"/proc/{p}/cmdline").read_text()
                   or "multiprocessing" in Path(f"/proc/{p}/cmdline").read_text()]
        assert workers
        proc.send_signal(sig)
        proc.wait(60)
        assert _wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in workers), 10), "orphan worker"
        if sig == signal.SIGTERM:
            output = proc.stdout.read()
            assert proc.returncode == 0, output
            assert "SIGTERM: stopped after step" in output and "Traceback" not in output
            assert list(out.glob("checkpoint-*"))
    finally:
        proc.kill()


@pytest.mark.parametrize("layout", ["no guard", "an empty guard", "guarded", "reward inside the guard"])
def test_a_script_without_guard_whose_reward_lives_in_it_is_refused(tiny_model_dir, tmp_path, layout):
    """Issue 43.7: a guard line with the training code outside it (`if __name__ == "__main__": pass`) was taken
    for a guarded script, and each worker re-ran the script (a second run in the same folder), the trainer
    saying only "exited with code 1 while the trainer waited for start-up". The line that starts the run must
    be inside the guard."""
    body = textwrap.dedent(f"""
        cfg = schema.Config(model=schema.ModelConfig(path={str(tiny_model_dir)!r}),
                            data=schema.DataConfig(task="addition", num_prompts=8),
                            rollout=schema.RolloutConfig(group_size=2, max_new_tokens=3, mode="async"),
                            train=schema.TrainConfig(steps=1, prompts_per_step=2),
                            output=schema.OutputConfig(dir={str(tmp_path / 'out')!r}, console=False))
        train(cfg, reward_functions=[my_reward])
    """)
    head = textwrap.dedent("""
        from grpokit.config import schema
        from grpokit.training.loop import train
        def my_reward(completions, **kwargs):
            return [0.0] * len(completions)
    """)
    script = tmp_path / "run.py"
    script.write_text({"no guard": head + body,
                       "an empty guard": head + body + 'if __name__ == "__main__":\n    pass\n',
                       "guarded": head + 'if __name__ == "__main__":\n' + textwrap.indent(body, "    "),
                       "reward inside the guard": 'if __name__ == "__main__":\n' + textwrap.indent(head + body, "    ")
                       }[layout])
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    if layout == "guarded":
        assert done.returncode == 0, done.stderr[-2000:]
        return
    assert done.returncode != 0
    assert "uses my_reward, defined in" in done.stderr and "__main__" in done.stderr
    where = "inside `if __name__" if layout == "reward inside the guard" else "whose line 12 starts the run outside"
    assert where in done.stderr, done.stderr[-1500:]


class Counter:
    """A TRL-style environment (module level: it travels to the worker by pickle)."""

    def reset(self, **row):
        self.count = 0

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


def last_turn_parity(completions, **kwargs):
    return parity([c[-1]["content"] for c in completions])


def test_environments_rewards_evaluation_and_dynamic_sampling_work_in_async(tool_model_dir, tmp_path):
    """Environments and their rewards live in the worker beside the sampler; [eval] runs in the trainer."""
    model = tool_model_dir
    cfg = config(model, tmp_path / "run", steps=2, max_new_tokens=24, rollout={"max_staleness": 1},
                 algorithm={"dynamic_sampling": True, "max_resample_rounds": 1},
                 eval={"every": 2, "num_prompts": 4, "samples_per_prompt": 2})
    run = train(cfg, reward_functions=[last_turn_parity], environment_factory=Counter)
    got = rows(run / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2]
    assert all("tools/call_frequency" in r and "rewards/Counter/mean" in r for r in got)
    assert "dynamic_sampling/draws" in got[0] and "eval/mean_reward" in got[1]


TOML = """
[model]
path = {model!r}
device = "cpu"
[data]
task = "addition"
num_prompts = 64
[rollout]
group_size = 4
max_new_tokens = 5
mode = {mode!r}
max_staleness = 0
[train]
steps = 2
prompts_per_step = 4
learning_rate = 1e-2
num_threads = 1
[rewards]
functions = ["{tests}/conftest.py:parity"]
[output]
dir = {out!r}
console = false
"""


def test_torchrun_data_parallel_trainer_with_its_own_workers_equals_sync(tiny_model_dir, tmp_path):
    """Two trainer processes (torchrun, gloo), each with its own worker and its own weight group: the same
    steps as two processes sampling themselves."""
    got = {}
    for mode in ("sync", "async"):
        toml = tmp_path / f"{mode}.toml"
        toml.write_text(TOML.format(model=str(tiny_model_dir), mode=mode, out=str(tmp_path / mode),
                                    tests=str(Path(__file__).parent)))
        done = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(toml), "--nproc-per-node", "2"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        got[mode] = comparable(rows(tmp_path / mode / "metrics.jsonl"))
    assert len(got["sync"]) == len(got["async"]) == 2
    for x, y in zip(got["sync"], got["async"]):
        for key in x:
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), key

"""A process of a torchrun run lost mid-training (issue 52): SIGKILL of rank 1, or of a whole "node" of two.

Each test starts real processes on this machine (gloo on the CPU, the tiny model): `grpokit train --nproc-per-node 2`
(grpokit's own launcher), and two `torchrun --nnodes 2` invocations, one a node, with a static rendezvous on
127.0.0.1. Rank 1 ends itself with SIGKILL inside its reward function at its second call (step 2), a deterministic
stand-in for `kill -9` or the OOM killer; a marker file keeps a resumed run from doing it again. The survivor must
say so in one `error:` line naming the lost process and `--resume` (exit 2), with no gloo traceback, and leave the
checkpoints intact. Also: rank 0 still in its own step when torchrun's SIGTERM comes; rank 1 stopping on an error of
its own (its line alone, no hang); and, in-process, which process is named and who says it on 2 machines of 2.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fault_harness import ROOT, CliResult, run_cli
from grpokit.models import parallel
from grpokit.training.checkpoint import checkpoint_damage, list_checkpoints

REWARD = """
import os, signal, time
calls = [0]
def kills(completions, **kwargs):
    calls[0] += 1
    marker = {marker!r}
    if calls[0] == 2 and not os.path.exists(marker):
        if os.environ.get("RANK") == "1":
            open(marker, "w").close()  # once: a resumed run goes on
            {rank_1}
        time.sleep({rank_0_sleeps})
    return [float(len(c) % 2) for c in completions]
"""
KILL = "os.kill(os.getpid(), signal.SIGKILL)"


def _config(tmp_path: Path, model_dir: Path, rank_1: str = KILL, rank_0_sleeps: float = 0.0) -> Path:
    (tmp_path / "r.py").write_text(REWARD.format(marker=str(tmp_path / "killed-once"), rank_1=rank_1,
                                                 rank_0_sleeps=rank_0_sleeps))
    toml = tmp_path / "run.toml"
    toml.write_text(f"""
[model]
path = {json.dumps(str(model_dir))}
[data]
task = "addition"
num_prompts = 16
[rollout]
group_size = 2
max_new_tokens = 2
[train]
steps = 3
prompts_per_step = 2
num_threads = 1
[output]
dir = {json.dumps(str(tmp_path / "run"))}
console = false
save_every = 1
[rewards]
functions = [{json.dumps(str(tmp_path / "r.py") + ":kills")}]
""")
    return toml


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _intact(run: Path) -> None:
    """Step 1 was saved before rank 1 died in step 2; that checkpoint is whole, nothing half-written is listed."""
    checkpoints = list_checkpoints(run)
    assert [c.name for c in checkpoints] == ["checkpoint-1"], checkpoints
    assert checkpoint_damage(checkpoints[0]) is None


def test_a_rank_killed_under_nproc_per_node_is_one_error_line_and_resume_continues(tiny_model_dir, tmp_path):
    """`grpokit train --nproc-per-node 2`, rank 1 SIGKILLed in step 2: it printed rank 0's gloo tracebacks
    ("Connection reset by peer", from the step's collective and again from DistributedContext.close), then the
    launcher's line, exit 137. Now: one line naming process 1 and the command that continues, exit 2; the resume
    it names trains the rest."""
    toml = _config(tmp_path, tiny_model_dir)
    lost = run_cli("train", toml, "--nproc-per-node", "2", timeout=240)
    assert lost.returncode == 2, lost.describe()
    assert "Traceback" not in lost.stderr + lost.stdout and "[rank" not in lost.stderr, lost.describe()
    assert len(lost.error_lines) == 1, lost.describe()
    line = lost.error_lines[0]
    for words in ("training process 1", "SIGKILL", "checkpoint-1", f"grpokit train {toml} --nproc-per-node 2 "
                                                                    "--resume"):
        assert words in line, lost.describe()
    assert lost.stderr.rstrip().endswith(line), lost.describe()  # the last word: nothing after it
    _intact(tmp_path / "run")
    resumed = run_cli("train", toml, "--nproc-per-node", "2", "--resume", timeout=240)
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.describe()
    assert _steps(tmp_path / "run") == [1, 2, 3]


def test_a_rank_killed_while_the_other_computes_is_the_launchers_line_alone(tiny_model_dir, tmp_path):
    """Rank 0 is in its own reward function (a long generation or grading) when rank 1 is killed: torchrun's
    agent sends it SIGTERM before its next collective. It printed the graceful stop's "SIGTERM: stopping after the
    current step, which is then saved", then gloo's traceback. Now that SIGTERM, with a process of this machine
    gone, ends it at once without a word, and the launcher's line is the only one."""
    toml = _config(tmp_path, tiny_model_dir, rank_0_sleeps=4.0)
    lost = run_cli("train", toml, "--nproc-per-node", "2", timeout=240)
    assert lost.returncode == 2, lost.describe()
    assert "Traceback" not in lost.stderr and "SIGTERM" not in lost.stderr + lost.stdout, lost.describe()
    assert len(lost.error_lines) == 1 and "training process 1 was ended by SIGKILL" in lost.error_lines[0], \
        lost.describe()
    _intact(tmp_path / "run")


def test_an_error_of_one_rank_alone_is_its_own_line_and_ends_the_run(tiny_model_dir, tmp_path):
    """Rank 1's reward function raises on its share (rank 0's does not): rank 1 says why, exit 2. It hung: rank 1
    left through DistributedContext.close's barrier while rank 0 waited in the step's all-reduce, each for the
    other, for the group's 30-minute timeout. Now a process leaving on its error waits for no one, says so in the
    group's store, and rank 0, whose connection to it then closes, leaves without a word."""
    toml = _config(tmp_path, tiny_model_dir, rank_1="raise ValueError('the grader of rank 1 is down')")
    failed = run_cli("train", toml, "--nproc-per-node", "2", timeout=180)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.describe()
    assert len(failed.error_lines) == 1, failed.describe()
    assert "reward function 'kills'" in failed.error_lines[0] and "the grader of rank 1 is down" in \
        failed.error_lines[0], failed.describe()
    _intact(tmp_path / "run")


def _node(toml: Path, node: int, port: int) -> subprocess.Popen:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                             "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "grpokit.cli", "train",
                             str(toml)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_node_killed_under_torchrun_nnodes_2_is_one_error_line_on_the_survivor(tiny_model_dir, tmp_path):
    """Two `torchrun --nnodes 2` nodes of one process each; node 1's process SIGKILLed in step 2. The survivor
    (node 0) printed gloo's tracebacks from its collective and from DistributedContext.close, and no `error:` line
    at all. Now its process prints one line naming the lost process and node and `--resume`, exits 2, and prints
    no traceback of its own; what follows is torchrun's own report of that exit (its ChildFailedError traceback,
    printed by torchrun's process, which no process it starts can silence; `grpokit train --nproc-per-node` is
    the launch without it)."""
    toml = _config(tmp_path, tiny_model_dir)
    port = _free_port()
    nodes = [_node(toml, n, port) for n in (0, 1)]
    try:
        outs = [p.communicate(timeout=240) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    survivor = CliResult(["torchrun node 0"], nodes[0].returncode, *outs[0])
    assert "[rank" not in survivor.stderr, survivor.describe()  # no traceback of the training process
    ours = survivor.stderr.split("Traceback (most recent call last):")  # what precedes torchrun's own report
    assert len(ours) == 2 and "torch/distributed/run.py" in ours[1] and "exitcode  : 2" in ours[1], survivor.describe()
    assert len(survivor.error_lines) == 1, survivor.describe()
    line = survivor.error_lines[0]
    for words in ("training process 1", "node 1", "checkpoint-1", f"grpokit train {toml} --resume"):
        assert words in line, survivor.describe()
    _intact(tmp_path / "run")


# ---- which process is named, and who says it, on 4 processes over 2 machines (in-process, no group) ----------

A, B = "host-a", "host-b"
ROSTER = [parallel.Member(0, 0, A, 100), parallel.Member(1, 0, A, 101), parallel.Member(2, 1, B, 102),
          parallel.Member(3, 1, B, 103)]
RESET = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:4711: Connection reset by peer")


@pytest.mark.parametrize("me, dead, marks, launched, what, says", [
    # a process of this machine, gone by its pid: named; the lowest left here says it, unless the launcher does
    (0, {101}, {}, False, "training process 1 (node 0) was lost", True),
    (0, {101}, {}, True, "training process 1 (node 0) was lost", False),
    (1, {100}, {}, False, "training process 0 (node 0) was lost", True),
    # none here gone: the one elsewhere not known to have left; rank 0, alive here, says it for this machine
    (0, set(), {3: "quiet"}, False, "training process 2 (node 1, host host-b) was lost", True),
    (1, set(), {3: "quiet"}, False, "training process 2 (node 1, host host-b) was lost", False),
    (0, set(), {}, False, "a training process (node 1, host host-b) was lost", True),
    # one that stopped on its own error printed it where it ran: said here once, by another machine only
    (0, set(), {2: "error"}, False, "training process 2 (node 1, host host-b) stopped on an error of its own", True),
    (0, {101}, {1: "error"}, False, "training process 1 (node 0) stopped on an error of its own", False),
    # this machine's loss already reported by the lower rank, which then left
    (1, set(), {0: "reported"}, False, "a training process (node 1, host host-b) was lost", False),
])
def test_the_lost_process_is_named_and_one_process_a_machine_says_it(monkeypatch, me, dead, marks, launched, what,
                                                                      says):
    monkeypatch.setattr(parallel, "_roster", ROSTER)
    monkeypatch.setattr(parallel, "rank", lambda: me)
    monkeypatch.setattr(parallel, "_gone", lambda pid: pid in dead)
    monkeypatch.setattr(parallel, "_marks", lambda members: marks)
    monkeypatch.setattr(parallel.socket, "gethostname", lambda: ROSTER[me].host)
    monkeypatch.setenv(parallel.LAUNCHED, "1") if launched else monkeypatch.delenv(parallel.LAUNCHED, raising=False)
    loss = parallel.peer_loss(RESET, wait_s=0.0)
    assert what in loss.what and loss.says is says, loss
    assert parallel.peer_loss(RuntimeError("CUDA out of memory"), wait_s=0.0) is None  # not a lost process
    on_sigterm = parallel.peer_loss(None)  # torchrun's stop: a loss only when a process of this machine is gone
    assert (on_sigterm is None) if not dead else (on_sigterm == loss)

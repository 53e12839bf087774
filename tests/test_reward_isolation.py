"""Isolated reward functions (rewards/worker_pool.py): worker processes that a timeout really stops.

Two module-scoped pools keep the file fast (a worker costs ~0.1 s to start, ~3 s more when it imports
torch): `pool` runs functions that need grpokit's registry (and so torch, until registry.py stops importing
core at the top); `fault_pool` runs the hanging and crashing functions of a small module written to a
temporary folder, torch-free, so that the workers they cost are cheap to replace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from grpokit.errors import RewardError, RewardLoadError, RewardTimeoutError
from grpokit.rewards.core import RewardSpec, compute_rewards
from grpokit.rewards.pooled_reward import isolate
from grpokit.rewards.registry import get_reward, load_reward
from grpokit.rewards.worker_pool import RewardPool, RewardWorkerError, check_isolatable

FAULTS = '''
import ctypes, os, subprocess, sys, time
from pathlib import Path

def ok(completions, **kwargs):
    return [float(len(c)) for c in completions]

def sleeps(completions):  # no **kwargs, no log_metric: still counted when skipped
    time.sleep(1000)

def spins(completions, **kwargs):
    while True:
        pass

def segfaults(completions, **kwargs):
    ctypes.string_at(0)

def exits(completions, **kwargs):
    os._exit(3)

def hangs_on_marker(completions, **kwargs):
    if "hang" in completions:
        time.sleep(1000)
    return [1.0] * len(completions)

def starts_child_and_hangs(completions, pidfile, **kwargs):
    child = subprocess.Popen(["sleep", "1000"])
    Path(pidfile[0]).write_text(str(child.pid))
    time.sleep(1000)

def imports_torch(completions, **kwargs):
    return [float("torch" in sys.modules)] * len(completions)

def forks_and_returns(completions, **kwargs):
    os.fork()  # the child returns out of the function too, into the worker's loop
    return [0.5] * len(completions)

def forks_a_child_that_outlives_it(completions, pidfile, **kwargs):
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    Path(pidfile[0]).write_text(str(pid))
    return [0.25] * len(completions)
'''


def exact(completions, answer, **kwargs):
    """A module-level function of this file: it reaches a worker by reference."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def worker_pid(completions, **kwargs):
    return [float(os.getpid())] * len(completions)


def echo_idx(completions, idx, **kwargs):
    return [float(i) for i in idx]


def fails_on_bad(completions, **kwargs):
    if "bad" in completions:
        raise ValueError("bad answer")
    return [1.0] * len(completions)


def logs(completions, log_metric, log_extra):
    log_metric("my/size", float(len(completions)))
    log_extra("seen", list(completions))
    return [0.5] * len(completions)


def what_arrives(completions, environments, trainer_state):
    return [float(environments is None) + 2 * float(trainer_state is None)] * len(completions)


def main_score(completions, **kwargs):
    return [2.0] * len(completions)


def always_one(completions, **kwargs):
    return [0.0]


@pytest.fixture(scope="module")
def pool():
    with RewardPool(workers=2) as p:
        yield p


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    folder = tmp_path_factory.mktemp("faults")
    (folder / "isolation_faults.py").write_text(FAULTS)
    sys.path.insert(0, str(folder))
    import isolation_faults
    yield isolation_faults
    sys.path.remove(str(folder))
    sys.modules.pop("isolation_faults", None)


@pytest.fixture(scope="module")
def fault_pool(faults):  # started after `faults` is on sys.path: workers copy it
    with RewardPool(workers=2) as p:
        yield p


def batch(completions, **columns):
    n = len(completions)
    return dict(prompts=["p"] * n, completions=list(completions), completion_ids=[[1, 2]] * n, columns=columns)


def run(specs, data, **kwargs):
    return compute_rewards(specs, data["prompts"], data["completions"], data["completion_ids"], data["columns"],
                           **kwargs)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def gone_within(pids, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


# ---- the same answers as in-process ---------------------------------------------------------------------


def test_references_builtins_and_module_functions_give_in_process_values(pool, tmp_path):
    (tmp_path / "r.py").write_text("def score(completions, **kwargs):\n    return [len(c) / 10 for c in completions]\n")
    ref = f"{tmp_path / 'r.py'}:score"
    specs = [RewardSpec("exact", exact), RewardSpec("countdown", get_reward("countdown", format_score=0.1), 0.5),
             RewardSpec("score", load_reward(ref), 2.0)]
    sources = [None, ("countdown", {"format_score": 0.1}), ref]
    G = 4
    comps = ["3+4", "7", "3*4", "junk", "12", "2+10", "x", "10+2"] * 2
    data = batch(comps, answer=["7", "12"] * 8, numbers=[[3, 4]] * 8 + [[2, 10]] * 8, target=[7] * 8 + [12] * 8)
    want_per_fn, want_total = run(specs, data)
    isolated = [isolate(s, pool, source=src, group_size=G) for s, src in zip(specs, sources)]
    assert all(s.timeout is None and s.weight == w.weight for s, w in zip(isolated, specs))
    per_fn, total = run(isolated, data)
    assert per_fn.tolist() == want_per_fn.tolist() and total.tolist() == want_total.tolist()
    assert len(pool.pids) == 2  # two chunks of two groups ran in parallel


def test_groups_are_never_split_and_columns_line_up(pool):
    specs = [isolate(RewardSpec("pid", worker_pid), pool, group_size=3),
             isolate(RewardSpec("idx", echo_idx), pool, group_size=3)]
    per_fn, _ = run(specs, batch(["a"] * 15, idx=list(range(15))))  # 5 groups of 3 over 2 workers
    pids = per_fn[:, 0].view(5, 3)
    assert (pids == pids[:, :1]).all() and len(set(per_fn[:, 0].tolist())) == 2
    assert per_fn[:, 1].tolist() == list(range(15))
    per_fn, _ = run(specs, batch(["a"] * 14, idx=list(range(14))))  # not whole groups: one chunk
    assert len(set(per_fn[:, 0].tolist())) == 1 and per_fn[:, 1].tolist() == list(range(14))


def test_a_raise_keeps_its_type_and_cores_sample_location(pool):
    spec = isolate(RewardSpec("picky", fails_on_bad), pool, group_size=4)
    comps = ["ok"] * 5 + ["bad"] + ["ok"] * 2
    with pytest.raises(RewardError, match=r"'picky' at sample 5 .*'bad'.* raised ValueError: bad answer"):
        run([spec], batch(comps))
    with pytest.raises(ValueError, match="bad answer") as info:
        spec.fn(completions=comps)
    assert "traceback in the reward worker process" in info.value.__notes__[0]


def test_a_wrong_count_is_that_calls_count_against_that_calls_completions(pool):
    """Each worker's call is checked on its own: one value for 8 completions, not the chunks' 2 values
    summed against the batch's 16 (in-process: one value for all 16)."""
    split = isolate(RewardSpec("one", always_one), pool, group_size=4)  # 4 groups over 2 workers
    with pytest.raises(RewardError, match=r"^reward function 'one' returned 1 values for 8 completions "
                                          r"\(samples 0-7 of 16, one worker's share\); return exactly one value"):
        run([split], batch(["a"] * 16))
    whole = isolate(RewardSpec("one", always_one), pool)  # one chunk: the same line as in-process
    with pytest.raises(RewardError) as isolated:
        run([whole], batch(["a"] * 16))
    with pytest.raises(RewardError) as in_process:
        run([RewardSpec("one", always_one)], batch(["a"] * 16))
    assert str(isolated.value) == str(in_process.value)
    assert "returned 1 values for 16 completions;" in str(in_process.value)


def test_live_objects_stay_home(pool):
    import threading

    spec = isolate(RewardSpec("arrives", what_arrives), pool, group_size=1)
    per_fn, _ = run([spec], batch(["a", "b"], environments=[object(), object()]), trainer_state={"step": 3})
    assert per_fn[:, 0].tolist() == [1.0, 1.0]  # environments are not sent, a picklable trainer_state is
    per_fn, _ = run([spec], batch(["a", "b"], environments=[object(), object()]), trainer_state=threading.Lock())
    assert per_fn[:, 0].tolist() == [3.0, 3.0]  # what does not pickle arrives as None


def test_log_metric_and_log_extra_are_replayed(pool):
    metrics, extras = [], []
    spec = isolate(RewardSpec("logs", logs), pool, group_size=2)
    comps = ["a", "b", "c", "d", "e", "f", "g", "h"]
    per_fn, _ = run([spec], batch(comps), log_metric=lambda *a: metrics.append(a),
                    log_extra=lambda *a: extras.append(a))
    assert per_fn[:, 0].tolist() == [0.5] * 8
    assert metrics == [("my/size", 4.0), ("my/size", 4.0)]  # one per chunk, as TRL averages them
    assert [v for _, values in extras for v in values] == comps and {c for c, _ in extras} == {"seen"}


def test_script_functions_need_a_main_guard(pool, tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    fn = types.FunctionType(main_score.__code__, {}, "main_score")
    fn.__module__, fn.__qualname__ = "__main__", "main_score"
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "main_score", fn, raising=False)
    monkeypatch.setattr(main, "__file__", str(script), raising=False)
    monkeypatch.setattr(main, "__spec__", None, raising=False)
    script.write_text("def main_score(completions, **kwargs):\n    return [2.0] * len(completions)\n"
                      "raise SystemExit('a worker ran the script')\n")
    with pytest.raises(RewardLoadError, match=r"'main_score'.*train.py has no `if __name__ == \"__main__\":` guard"):
        check_isolatable(RewardSpec("main_score", fn))
    script.write_text(script.read_text().replace("raise", "if __name__ == '__main__':\n    raise"))
    per_fn, _ = run([isolate(RewardSpec("main_score", fn), pool)], batch(["a", "b"]))
    assert per_fn[:, 0].tolist() == [2.0, 2.0]  # the worker loaded the script without running its main code


def test_what_cannot_run_in_a_worker_is_refused_at_start_up(tmp_path):
    def local(completions, **kwargs):
        return [0.0] * len(completions)

    (tmp_path / "r.py").write_text("def score(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    for fn, words in [(lambda completions, **kw: [0.0], "does not pickle"), (local, "does not pickle"),
                      (load_reward(f"{tmp_path / 'r.py'}:score"), "a file loaded by reference")]:
        with pytest.raises(RewardLoadError, match=f"reward function 'f'.*cannot run in a worker process: .*{words}"):
            check_isolatable(RewardSpec("f", fn))
    with pytest.raises(RewardLoadError, match="file 'nope.py' not found"):
        check_isolatable(RewardSpec("f", exact), ("nope.py:score", {}))
    check_isolatable(RewardSpec("f", exact))
    check_isolatable(RewardSpec("f", exact), (f"{tmp_path / 'r.py'}:score", {}))
    check_isolatable(RewardSpec("f", exact), ("countdown", {"format_score": 0.1}))


# ---- hangs and crashes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sleeps", "spins"])
def test_a_hung_function_is_stopped_at_its_timeout_and_replaced(fault_pool, faults, name):
    spec = isolate(RewardSpec(name, getattr(faults, name), timeout=0.5), fault_pool, group_size=2)
    run([isolate(RewardSpec("ok", faults.ok), fault_pool, group_size=2)], batch(["a"] * 4))  # warm, built
    before = fault_pool.pids
    start = time.monotonic()
    with pytest.raises(RewardTimeoutError, match=rf"'{name}' took longer than 0.5 s \(its timeout\) on samples "
                                                 r"[02]-[13] of 4 in worker process \d+; .*rewards.on_error"):
        run([spec], batch(["a"] * 4))
    assert time.monotonic() - start < 0.5 + 3.0  # the build of the function is not counted, the call is
    assert gone_within(before, 2.0)
    per_fn, _ = run([isolate(RewardSpec("ok", faults.ok), fault_pool, group_size=2)], batch(["ab"] * 4))
    assert per_fn[:, 0].tolist() == [2.0] * 4 and not set(fault_pool.pids) & set(before)


@pytest.mark.parametrize("name, how", [("segfaults", "SIGSEGV"), ("exits", "exit code 3")])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_crash_costs_a_worker_not_the_trainer(fault_pool, faults, name, how, on_error):
    spec = isolate(RewardSpec(name, getattr(faults, name)), fault_pool, on_error=on_error, group_size=2)
    metrics = []
    if on_error == "raise":
        with pytest.raises(RewardWorkerError, match=rf"'{name}' crashed its worker \({how}\) on samples 0-1 of 2"):
            run([spec], batch(["a", "b"]))
    else:
        per_fn, total = run([spec], batch(["a", "b"]), log_metric=lambda *a: metrics.append(a))
        assert per_fn.isnan().all() and total.isnan().all() and spec.fn.ungraded == 2
        assert metrics == [(f"rewards/{name}/ungraded", 2)]
    per_fn, _ = run([isolate(RewardSpec("ok", faults.ok), fault_pool)], batch(["abc"]))
    assert per_fn.tolist() == [[3.0]]


def test_a_crash_prints_no_stack_dump(faults, capfd):
    """A segfault printed faulthandler's "Fatal Python error" and a stack per crashed call; now nothing (the
    error, or the ungraded count, names the function). The pool starts here, so its workers write to capfd."""
    with RewardPool(workers=1) as p:
        skip = isolate(RewardSpec("segfaults", faults.segfaults), p, on_error="skip")
        for _ in range(2):
            assert run([skip], batch(["a"]))[0].isnan().all()
        with pytest.raises(RewardWorkerError, match=r"^reward function 'segfaults' crashed its worker \(SIGSEGV\)"):
            run([isolate(RewardSpec("segfaults", faults.segfaults), p)], batch(["a"]))
    err = capfd.readouterr().err
    assert "Fatal Python error" not in err and "Segmentation fault" not in err, err


def test_a_function_that_forks_prints_no_traceback_and_its_child_never_answers(faults, capfd, tmp_path):
    """A forked child that returned out of the function ran the worker's loop: at close it printed a
    ProcessLookupError / ChildProcessError traceback (killing and reaping the worker's guard, not its own).
    A child that outlives the call is stopped with the worker's process group."""
    pidfile = tmp_path / "child.pid"
    with RewardPool(workers=1) as p:
        returns = isolate(RewardSpec("forks_and_returns", faults.forks_and_returns), p)
        outlives = isolate(RewardSpec("outlives", faults.forks_a_child_that_outlives_it), p)
        for _ in range(3):  # the worker answers each call once: a child's answer would be read by the next
            assert run([returns], batch(["a", "b"]))[0].tolist() == [[0.5], [0.5]]
        assert run([outlives], batch(["a"], pidfile=[str(pidfile)]))[0].tolist() == [[0.25]]
        child = int(pidfile.read_text())
        assert alive(child)
    assert gone_within([child], 5)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error" not in err, err


def test_skip_scores_only_the_chunk_that_timed_out(fault_pool, faults):
    spec = isolate(RewardSpec("sleeps", faults.sleeps, timeout=0.5), fault_pool, on_error="skip", group_size=2)
    metrics = []
    per_fn, _ = run([spec], batch(["a"] * 4), log_metric=lambda *a: metrics.append(a))
    assert per_fn.isnan().all() and spec.fn.ungraded == 4 and metrics == [("rewards/sleeps/ungraded", 4)]
    spec = isolate(RewardSpec("marker", faults.hangs_on_marker, timeout=0.5), fault_pool, on_error="skip",
                   group_size=2)
    per_fn, _ = run([spec], batch(["a", "b", "hang", "c"]))
    assert per_fn[:2, 0].tolist() == [1.0, 1.0] and per_fn[2:].isnan().all() and spec.fn.ungraded == 2


def test_a_timeout_kills_what_the_function_started(fault_pool, faults, tmp_path):
    pidfile = tmp_path / "child.pid"
    spec = isolate(RewardSpec("tree", faults.starts_child_and_hangs, timeout=1.0), fault_pool)
    with pytest.raises(RewardTimeoutError):
        run([spec], batch(["a"], pidfile=[str(pidfile)]))
    assert gone_within([int(pidfile.read_text())], 2.0)


def test_workers_do_not_import_torch_for_a_torch_free_function(fault_pool, faults):
    from grpokit.rewards.verifiers import addition_reward  # grpokit.rewards, whose __init__ imports torch

    per_fn, _ = run([isolate(RewardSpec("add", addition_reward), fault_pool),
                     isolate(RewardSpec("torch", faults.imports_torch), fault_pool)], batch(["7"], answer=["7"]))
    assert per_fn.tolist() == [[1.0, 0.0]]


# ---- clean-up ---------------------------------------------------------------------------------------------


def test_close_reaps_every_worker():
    p = RewardPool(workers=2).start()
    pids = p.pids
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    p.close()
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # reaped: not even zombies
    with pytest.raises(RuntimeError, match="closed"):
        p.start()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_a_sigkilled_trainer(tmp_path):
    """Workers, and what their functions started (a `sleep` that a reward function left running), die with a
    SIGKILLed trainer: nothing is left re-parented to PID 1."""
    import grpokit.rewards.worker_pool as isolation

    (tmp_path / "tree.py").write_text(textwrap.dedent("""
        import subprocess, time
        from pathlib import Path

        def starts_child_and_hangs(completions, pidfile, **kwargs):
            child = subprocess.Popen(["sleep", "1000"])
            Path(pidfile[0]).write_text(str(child.pid))
            time.sleep(1000)
    """))
    pidfile = tmp_path / "child.pid"
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(f"""
        import importlib.util, sys, threading, time
        from pathlib import Path
        sys.path.insert(0, {str(tmp_path)!r})
        import tree
        spec = importlib.util.spec_from_file_location("isolation", {isolation.__file__!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # without grpokit.rewards' __init__: no torch, a quick start
        pool = module.RewardPool(workers=2).start()  # (a pool nothing refers to closes itself)
        job = {{"completions": ["a"], "pidfile": [{str(pidfile)!r}]}}
        source = module.sendable("tree", tree.starts_child_and_hangs)
        threading.Thread(target=pool.run, args=(source, [job], (), None), daemon=True).start()
        while not Path({str(pidfile)!r}).is_file() or not Path({str(pidfile)!r}).read_text():
            time.sleep(0.02)
        print(*pool.pids, Path({str(pidfile)!r}).read_text(), flush=True)
        time.sleep(60)
    """))
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 3 and all(alive(pid) for pid in pids)  # two workers, one grandchild
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert gone_within(pids, 5.0)


def test_isolate_checks_its_arguments(pool):
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'skip'"):
        isolate(RewardSpec("f", exact), pool, on_error="ignore")
    with pytest.raises(ValueError, match="group_size must be an integer >= 1"):
        isolate(RewardSpec("f", exact), pool, group_size=0)
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        RewardPool(workers=0)
    assert run([isolate(RewardSpec("f", exact), pool)], batch([], answer=[]))[0].shape == (0, 1)

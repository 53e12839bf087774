"""Where each step's graded batch comes from: the loop's own rollout (sync) or worker processes (async).

    batch, metrics = rollouts.next(step)        # rollout -> grade -> advantages
    metrics = rollouts.publish(model, step)     # after the update: the samplers get step's weights

Both publish through one `WeightPublisher` (models/weight_sync.py), chosen once: the run's own (`run.weights`,
rollout.weights.build_publisher: nothing for the built-in sampler, a vLLM transport, an engine of the caller's)
in sync mode and, against a vLLM server, in async mode under the worker's lock; gloo to the built-in workers.

`SyncRollouts` is the loop as it always was: sample on the training model, then train. `AsyncRollouts`
(`rollout.mode = "async"`, docs/ASYNC.md) keeps `max_staleness + 1` steps' batches ordered from
`rollout.workers` processes (training/rollout_workers.py), so sampling and grading run while the trainer
updates. The order for step s says which weights it needs at least: version s - 1 - max_staleness, where
version v is the weights after optimizer step v. A worker waits for them before it samples, so no answer
the trainer takes lags it by more than `max_staleness` steps, and none has to be thrown away; with
`max_staleness = 0` each order waits for the newest weights, which is the sync loop in two processes.
A batch that would still be too old (a worker that fell behind a resume) is dropped, counted, and ordered
again. Batches are taken in step order, round robin over the workers; a worker samples with the newest
weights it holds, so above max_staleness = 0 the version each step meets depends on the workers' speed.

The lag is corrected in the loss: `algorithm.is_correction` ("auto" = "token_truncate" here) weights each
token by the trainer's / the sampler's probability, truncated, and the clipped ratio is taken against the
trainer's own log-probs before the update (decoupled PPO). Every wait has a deadline
(`rollout.worker_timeout_s`): a worker that exits, stops beating, or delivers nothing in time ends the
run with one error naming it; the loop saves the finished steps first.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import pickle
import queue
import sys
import time
import types
from pathlib import Path

import torch.multiprocessing as mp

from grpokit import processes
from grpokit.errors import RolloutWorkerError, SetupError
from grpokit.models.loading import resolve_device
from grpokit.models.parallel import rank
from grpokit.models.threads import usable_cores
from grpokit.models.weight_sync import GlooPublisher
from grpokit.observe.metrics import version_metrics
from grpokit.rollout.vllm.ranks import every_ranks
from grpokit.rollout.vllm.weights import LockedPublisher
from grpokit.training.generate import generate_and_grade
from grpokit.training.rollout_workers import WorkerSpec, parameter_shapes, running_reward, worker_main
from grpokit.training.streaming_rollouts import StreamingRollouts
from grpokit.training.worker_budget import available_memory, check_memory, crowded_cores


class SyncRollouts:
    """Sample on the training model itself, then train on it: nothing overlaps."""

    def __init__(self, config, run):
        self.config, self.run = config, run
        self.failed: RolloutWorkerError | None = None  # a vLLM server that took no weights: said at the next batch

    def next(self, step: int):
        if self.failed is not None:  # the loop saves the step whose weights did not travel, then says it
            raise self.failed
        return generate_and_grade(self.run.inputs.local, self.run.side, self.run.stream, self.run.sampling_generator,
                                  step)

    def publish(self, model, step: int) -> dict:
        try:
            self.run.weights.publish(model, step)  # vLLM: push the new weights; HF: the sampler is the model
        except RolloutWorkerError as e:  # a server that went away: this step's update is done, its row comes first
            self.failed = e
        return {}

    def close(self) -> None:
        pass


def split_threads(config) -> tuple[int, int]:
    """(trainer threads, each worker's threads): `rollout.worker_threads` and `train.num_threads` where set,
    else the usable cores shared out, one at least each."""
    cores, workers = len(usable_cores()), config.rollout.workers
    each = config.rollout.worker_threads or max(1, cores // (workers + 1))
    return config.train.num_threads or max(1, cores - workers * each), each


def check_async_can_run(config, engine) -> None:
    """What asynchronous rollout (and a vLLM server) cannot do yet, and workers this machine cannot hold
    (training/worker_budget.py), refused before the model loads; workers past the cores, said in one line."""
    if config.rollout.mode != "async":
        return
    if engine is not None:
        raise SetupError("rollout.mode = \"async\": train(engine=...) samples in the trainer's process; the "
                         "workers run the built-in sampler. Leave engine out, or use rollout.mode = \"sync\"")
    for device in config.rollout.worker_devices:  # a device this machine lacks: now, not after the model loads
        resolve_device(device, field="rollout.worker_devices")
    check_memory(config, available_memory())  # workers the memory cannot hold: refused before any starts
    warning = crowded_cores(config, split_threads(config)[1])
    if warning and rank() == 0:
        print(warning, flush=True)


class _MainFinder(pickle.Pickler):
    """Pickles to nowhere, noting the first object that lives in `__main__` (the user's script)."""

    def __init__(self):
        super().__init__(io.BytesIO())
        self.from_main = None

    def persistent_id(self, obj):
        if self.from_main is None and isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            self.from_main = obj.__qualname__
        return None


def worker_devices(config, model) -> list[str]:
    """Each worker's device: `rollout.worker_devices`, else the trainer's (its own GPU under torchrun)."""
    r = config.rollout
    if r.vllm_options.server is not None:  # the worker only sends requests: no model, no device of its own
        return ["cpu"]
    named = r.worker_devices or [str(next(model.parameters()).device)] * r.workers
    return [str(resolve_device(d, field="rollout.worker_devices")) for d in named]


def _sendable(what: str, value) -> str | None:
    """A start-up error when `value` cannot travel to a worker process (a lambda, a local function, a
    function of a script the worker cannot load without running it); the name of what it takes from
    `__main__`, if anything."""
    finder = _MainFinder()
    try:
        finder.dump(value)
    except Exception as e:  # noqa: BLE001 - pickle raises many kinds
        raise SetupError(f"rollout.mode = \"async\": {what} cannot be sent to the rollout worker processes "
                         f"({type(e).__name__}: {e}); define it at module level in an importable file, or use "
                         f"rollout.mode = \"sync\"") from None
    if finder.from_main is None:
        return None
    path = getattr(sys.modules["__main__"], "__file__", None)  # a worker imports the script to find it
    line = _unguarded_line(path) if path else 0
    if line is None and not _defined_outside_the_guard(path, finder.from_main.split(".")[0]):
        raise SetupError(f"rollout.mode = \"async\": {what} uses {finder.from_main}, defined in {path} inside `if "
                         "__name__ == \"__main__\":`, which a rollout worker process does not run when it imports "
                         "the script; define it above that block, or in its own .py file")
    if line is not None:
        where = f"{path}, whose line {line} starts the run outside" if line else "the interactive session, outside"
        raise SetupError(f"rollout.mode = \"async\": {what} uses {finder.from_main}, defined in {where} `if "
                         "__name__ == \"__main__\":`; a rollout worker process imports the script to find it, "
                         "and would start the run again. Put the code that starts the run under `if __name__ == "
                         "\"__main__\":`, or move the function into its own .py file")
    return finder.from_main


def _defined_outside_the_guard(path: str, name: str) -> bool:
    """Whether the script binds `name` at its top level (a def, class, assignment or import), where a worker
    importing it finds it; True when the script cannot be read (its own error comes later)."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return True
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and name in {(a.asname or a.name).split(".")[0]
                                                                         for a in node.names}:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in {n.id for n in ast.walk(node)
                                                                       if isinstance(n, ast.Name)}:
            return True
    return False


def _unguarded_line(path: str) -> int | None:
    """The line of the script `path` (run as `__main__`) whose module-level code is starting this run, when it
    is not inside a top-level `if __name__ == "__main__":` block; None when it is. The guard's mere presence is
    not enough: `if __name__ == "__main__": pass` with the training code above it re-runs in every worker."""
    main = sys.modules["__main__"].__dict__
    frame = sys._getframe()
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is main):
        frame = frame.f_back
    if frame is None:  # not started from the script's top level (a function the user's tooling calls)
        return None
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    guarded = [(node.lineno, node.end_lineno) for node in tree.body if isinstance(node, ast.If)
               and ast.unparse(node.test).replace("'", '"') in ('__name__ == "__main__"', '"__main__" == __name__')]
    return None if any(a <= frame.f_lineno <= b for a, b in guarded) else frame.f_lineno


@contextlib.contextmanager
def _main_hidden(hide: bool):
    """Spawned workers re-import the user's script to find what it defines; when they need nothing from it,
    they are started without it (a script with no `__main__` guard would run its training again)."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    if hide:
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
    try:
        yield
    finally:
        if hide:
            main.__dict__.update(saved)
            if "__spec__" not in saved:
                del main.__spec__


class AsyncRollouts:
    """The trainer's side of asynchronous rollout: W worker processes, their orders, their batches."""

    def __init__(self, config, run, run_dir: Path):
        r, given = config.rollout, run.inputs.rollout
        if r.in_flight_updates and (run.side.engine.tools or run.side.environments is not None):
            raise SetupError("rollout.in_flight_updates: multi-turn rollouts (tools or an environment) sample through "
                             "their own decode loop, which does not take weights between its steps yet; set "
                             "rollout.in_flight_updates = false (weights then land between batches)")
        self.config, self.run, self.K, self.W, self.timeout_s = config, run, r.max_staleness, r.workers, \
            r.worker_timeout_s
        self.start = self.published = run.start_step
        self.next_order = run.start_step + 1  # the step whose batch is ordered next
        self.arrived: dict[int, tuple[int, object]] = {}  # step -> (worker, WorkerBatch)
        self.dropped = 0
        self.failed: RolloutWorkerError | None = None  # a weight transfer's fault, said at the next batch
        self.started = False  # every worker has said "ready"
        self.took = time.time()  # when the trainer last took a batch
        self.timeline = run_dir / "timeline.jsonl" if run.inputs.folder is not None else None
        ctx = mp.get_context("spawn")  # a fresh interpreter: no copy of the trainer's threads or locks
        self.announced = ctx.Value("q", -1)
        self.beats = ctx.Array("d", [time.monotonic()] * self.W)
        self.results, self.orders = ctx.Queue(), [ctx.Queue() for _ in range(self.W)]
        self.server_lock = ctx.Lock()  # a vLLM server: held by the worker while it samples, by the trainer to push
        # the reward function each worker is running in its own process (rewards.isolation = "none"), named when the
        # worker's process ends in it; no lock, which a worker killed in the middle of a write would keep
        self.running = [ctx.Array("c", 256, lock=False) if config.rewards.isolation == "none" else None
                        for _ in range(self.W)]
        server = r.vllm_options.server is not None  # the run's publisher pushes to it, under the worker's lock
        self.channel = LockedPublisher(run.weights, self.timeout_s, every_ranks(self.server_lock), self.announced,
                                       holds=run.start_step, in_flight=r.in_flight_updates) if server \
            else GlooPublisher(self.W, self.timeout_s, self.announced)
        spec = WorkerSpec(given, [n for n, p in run.policy.model.named_parameters() if p.requires_grad],
                          parameter_shapes(run.policy.model), run.stream, run.sampling_generator.get_state(),
                          run.start_step + 1, self.W, split_threads(config)[1], self.channel.port, self.timeout_s,
                          run.side.engine.served.adapter_prefix if server else "")
        from_main = [_sendable(what, value) for what, value in (
            ("train(reward_functions=...)", given.reward_functions), ("train(tools=...)", given.tools),
            ("train(environment_factory=...)", given.environment_factory),
            ("the run's rows, prompts or config", spec))]
        self.devices = worker_devices(config, run.policy.model)
        self.procs = [ctx.Process(target=worker_main, name=f"grpokit-rollout-{i}", daemon=True,
                                  args=(spec, i, self.devices[i], self.orders[i], self.results, self.beats,
                                        self.announced, os.getpid(), self.server_lock, self.running[i]))
                      for i in range(self.W)]
        self.inbox = None
        try:  # a start that fails half-way stops the workers already started
            with _main_hidden(not any(from_main)), processes.stop_signals_held():
                for p in self.procs:
                    p.start()
                # batches are fetched on the inbox's thread (signals held there for good): one whose tensors a
                # frozen worker holds blocks that thread, never the trainer
                self.inbox = processes.Inbox(lambda timeout: self.results.get(timeout=timeout), "rollout-results")
            ready: set[int] = set()
            while len(ready) < self.W:  # each builds its model, rewards and tools (imports may starve its beat)
                kind, index, _, _ = self._get(waiting_for=min(set(range(self.W)) - ready), what="start-up (loading "
                                              "the model, rewards and tools)", within_s=max(self.timeout_s, 600))
                ready.add(index)
            self.started = True
            self.channel.connect()
            self._publish(run.policy.model, self.start)
        except BaseException:
            self.close()
            raise

    # ---- taking batches --------------------------------------------------------------------------------

    def next(self, step: int):
        if self.failed is not None:  # the loop saves the step whose weights failed to travel, then says it
            raise self.failed
        last = self.config.train.steps  # nothing past it: a worker would wait for weights never sent
        while self.next_order <= min(step + self.K, last):  # keep max_staleness + 1 steps ordered ahead
            self._order(self.next_order)
            self.next_order += 1
        t0 = time.perf_counter()
        while True:
            while step not in self.arrived:
                kind, index, s, payload = self._get(waiting_for=self._worker_of(step), what=f"batch for step {step}")
                self.arrived[s] = (index, payload)
            index, got = self.arrived.pop(step)
            if step - 1 - got.version <= self.K:
                break
            self.dropped += len(got.batch.advantages)  # too old (e.g. ordered before a resume): again
            self._order(step)
        idle = time.perf_counter() - t0
        self.run.stream.load_state_dict(got.stream_state)  # the checkpoint's: after the last batch taken
        if index == 0:  # ... and worker 0's noise, where it continues from (the batches in flight are redone)
            generator = self.run.sampling_generator
            if got.generator_state.numel() == generator.get_state().numel():  # a generator of its kind
                generator.set_state(got.generator_state)
        lag = step - 1 - got.batch.rollout.policy_version.double()  # [R]: per training row (forked answers: several)
        answers = got.batch.draw.rollout  # each token's version (rollout_workers.tag_versions): one per answer
        # unless in-flight updates landed inside it
        metrics = {**got.metrics, **version_metrics(answers.token_version, answers.action_mask, step - 1),
                   "async/staleness_mean": float(lag.mean()), "async/staleness_max": float(lag.max()),
                   "async/dropped": self.dropped, "time/trainer_idle": idle, "time/sampler_idle": got.waited_s,
                   "async/sampler_tokens_per_sec": got.tokens / max(got.ended - got.started, 1e-9)}
        self._record(step, [(f"worker {index}", "sample", got.started, got.ended),
                            ("trainer", "wait", time.time() - idle, time.time())])
        self.took = time.time()  # the update of this batch starts
        return got.batch, metrics

    def _worker_of(self, step: int) -> int:
        return (step - 1) % self.W

    def _order(self, step: int) -> None:
        self.orders[self._worker_of(step)].put((step, max(self.start, step - 1 - self.K)))

    def _get(self, *, waiting_for: int, what: str, within_s: float | None = None):
        """The next message of any worker; a worker's error, exit, silence or slowness is one error."""
        deadline = time.monotonic() + (within_s or self.timeout_s)
        while True:
            try:
                message = self.inbox.get(timeout=0.2)
            except queue.Empty:
                self._check(waiting_for, what, deadline)
                continue
            except (OSError, EOFError):  # its sender exited before its tensors were fetched: that worker's fault
                self._check(waiting_for, what, time.monotonic() + 2)
                continue
            if message[0] == "error":
                raise RolloutWorkerError(f"rollout worker {message[1]}: {message[3]}", users_code=message[4])
            return message

    def _reported_error(self, *, within_s: float) -> RolloutWorkerError | None:
        """A worker's own error message, if one is queued (a worker sends it, then exits): it says more than the
        exit code or the closed connection the trainer sees. Batches read meanwhile are kept."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                message = self.inbox.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return None
            except (OSError, EOFError):  # a batch whose tensors' sender has exited: unreadable, and not needed
                continue
            if message[0] == "error":
                return RolloutWorkerError(f"rollout worker {message[1]}: {message[3]}", users_code=message[4])
            if message[0] == "batch":
                self.arrived[message[2]] = (message[1], message[3])

    def _check(self, waiting_for: int, what: str, deadline: float) -> None:
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                if (said := self._reported_error(within_s=0.5)) is not None:  # it said why before it exited
                    raise said
                how = f"was killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exited with code {p.exitcode}"
                oom = " (SIGKILL: often the kernel's out-of-memory killer)" if p.exitcode == -9 else ""
                if reward := running_reward(self.running[i]):  # the user's code: the fix before the command
                    raise RolloutWorkerError(
                        f"rollout worker {i} {how} in reward function '{reward}'{oom}, which runs in the worker's "
                        "process (rewards.isolation = \"none\"); rewards.isolation = \"process\" runs it in a worker "
                        "process of its own, where that ends that process, not the rollout worker", users_code=True)
                raise RolloutWorkerError(f"rollout worker {i} {how}{oom} while the trainer waited for {what}")
        now = time.monotonic()
        for i in range(self.W if self.started else 0):
            # at the deadline, a worker silent for 4 beats is frozen (SIGSTOP, a debugger), not slow: it froze after
            # the trainer began to wait, so its beat is younger than the timeout, but "alive" would be wrong
            silent = now > deadline and i == waiting_for and processes.is_hung(self.beats, i, 0.0)
            if silent or processes.is_hung(self.beats, i, self.timeout_s):
                raise RolloutWorkerError(f"rollout worker {i} is hung: no heartbeat for "
                                         f"{processes.beat_age(self.beats, i):.0f} s "
                                         f"(rollout.worker_timeout_s = {self.timeout_s:g}); it is stopped")
        if now > deadline:
            within = f"rollout.worker_timeout_s = {self.timeout_s:g} s" if self.started else \
                f"{max(self.timeout_s, 600):g} s"
            raise RolloutWorkerError(
                f"rollout worker {waiting_for}: no {what} within {within} (it is alive: slow, or waiting on a tool, "
                "reward or grader that does not return); raise rollout.worker_timeout_s, or bound what it waits on "
                "(tools.timeout_s, rewards.timeout_s)")

    # ---- weights ---------------------------------------------------------------------------------------

    def publish(self, model, step: int) -> dict:
        """After optimizer step `step`: the workers get its weights every `weight_sync_every` steps (not after
        the last step: no batch is sampled after it)."""
        r = self.config.rollout
        self._record(step, [("trainer", "train", self.took, time.time())])
        if step % r.weight_sync_every or step >= self.config.train.steps:
            return {}
        try:
            return {"time/weight_sync": self._publish(model, step)}
        except RolloutWorkerError as e:  # this step's update is done: its row and checkpoint come first
            self.failed = e
            return {}

    def _publish(self, model, version: int) -> float:
        started = time.time()
        try:
            seconds = self.channel.publish(model, version)
        except RolloutWorkerError:  # the vLLM server's own error (the worker has no part in a push to it)
            raise
        except RuntimeError as e:  # gloo's timeout, or a closed connection: a worker did not take part
            if (said := self._reported_error(within_s=2)) is not None:  # a reward or tool failed: its words
                raise said from None
            for i, p in enumerate(self.procs):
                self._check(i, "a weight transfer", time.monotonic() + 1)
            raise RolloutWorkerError(f"the weight transfer of step {version} to the rollout workers failed within "
                                     f"rollout.worker_timeout_s = {self.timeout_s:g} s ({e})") from None
        self.published = version
        self._record(version, [("trainer", "weight sync", started, time.time())])
        return seconds

    # ---- the timeline and the end ----------------------------------------------------------------------

    def _record(self, step: int, spans: list[tuple[str, str, float, float]]) -> None:
        """What each process did when (timeline.jsonl; the HTML report draws it)."""
        if self.timeline is None or not self.run.inputs.folder or os.environ.get("RANK", "0") != "0":
            return
        with open(self.timeline, "a") as f:
            for process, phase, start, end in spans:
                f.write(json.dumps({"step": step, "process": process, "phase": phase, "start": start,
                                    "end": end}) + "\n")

    def close(self) -> None:
        """Stop every worker: a None order, 5 s to finish, then its process group killed."""
        for q in self.orders:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        processes.stop(self.procs, grace=5.0)
        if self.inbox is not None:
            self.inbox.close()  # its receive, if a frozen worker held it, ended with that worker
        for q in [self.results, *self.orders]:
            q.cancel_join_thread()
            q.close()


def build_rollouts(config, run, run_dir: Path):
    """The source the loop takes batches from (`rollout.mode`)."""
    if config.rollout.mode != "async":
        sync = SyncRollouts(config, run)
        return StreamingRollouts(config, run, sync) if config.rollout.partial_rollouts else sync
    return AsyncRollouts(config, run, run_dir)


"""Data parallel over `torchrun` processes: the process group, collectives, gradient all-reduce.

Launch with the engine users already have: `torchrun --nproc_per_node W -m grpokit.cli train run.toml`
(gloo on CPU, NCCL on GPU; `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and the rendezvous come from torchrun), or,
on one machine, `grpokit train run.toml --nproc-per-node W` (`launch`: the same launcher, in grpokit's
process, so that a failure reads as the process's own `error:` line rather than torchrun's traceback).
Every process runs the same `train()`; this module makes them one run. With one process (no
`WORLD_SIZE`, or 1) every function here is a no-op and `train()` is exactly the single-process loop.

What rank r of W does, and why the result equals one process on the same global batch:

- **Prompts.** Every rank draws the same global batch of B prompts from an identically seeded stream
  and keeps prompts [r*B/W, (r+1)*B/W): whole groups, so group statistics (advantages, the dynamic
  sampling filter) never cross a rank and no reward is gathered before normalising. B % W == 0 is
  checked before any model loads. Dynamic sampling draws the same number of extra batches on every
  rank (the loop continues while any rank still lacks groups), so the streams stay in step.
- **Sampling.** The rank's generator is seeded `train.seed + r`: ranks draw different answers.
- **Update.** Gradients are all-reduced (SUM, in flat buckets) once per optimizer step, after the
  micro-batches' backward passes and before clipping, so every rank applies the same clipped update.
  `dapo`/`cispo` divide by the *global* token count of the minibatch (all-reduced before the loss), so
  the sum of the ranks' gradients is exactly one process's. `grpo` and `dr_grpo` average over answers,
  and every rank holds the same number of answers, so the SUM is scaled by 1/W: exactly one process.
  `bnpo` averages each micro-batch's tokens (as TRL, under DDP too): W ranks equal one process whose
  minibatch is split into W× more micro-batches (equal to it when the token counts are equal).
  Manual all-reduce rather than DDP: one all-reduce per optimizer step whatever the gradient
  accumulation, ranks may skip the forward of zero-advantage answers (no backward at all on a rank is
  fine), and the custom normalisers stay visible here instead of inside DDP's averaging.
- **FSDP2** (`model.fsdp = true`, fsdp.py): gradients are reduce-scattered as sums and scaled as
  above, and every rank runs the forward of every answer (the zero-advantage skip is turned off).
- **Metrics** are reduced across ranks by what they mean: reward and completion statistics are
  recomputed from the gathered per-answer values, token means (kl, clip ratios, entropy) are weighted
  by each rank's token counts, times are maxima, `tokens_per_sec` a sum (`observe/metrics.py`).
- **Files.** Only rank 0 writes checkpoints, metrics, completions and the console; the checkpoint holds
  every rank's sampling-generator state, so `--resume` with the same W continues exactly.
- **A process lost** (killed, out of memory, its machine down): the others' next collective fails with gloo's
  "Connection reset by peer" (`peer_loss` reads it). Which process is gone is found from the roster every process
  joins with (its node, host and pid: a pid on this host is looked at, a process elsewhere is the one whose
  connection closed) and from what the others said in the group's store as they left (`mark_left`: one that
  stopped on its own error printed it). One process per machine says it, one `error:` line with the command that
  continues (training/safekeeping.py); under `launch` the launcher names a process it started itself.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as tdist

from grpokit import processes
from grpokit.errors import ConfigError, SetupError, UserError
from grpokit.models.gloo_exit import die_with_launcher, drain_at_exit, silenced_once_said, stderr_silenced

BUCKET_BYTES = 32 * 2**20


def _destroy() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def exit_rank(code: int | None) -> None:
    """How `python -m grpokit.cli` ends in a torchrun process: the group left and the output flushed, then out
    without the interpreter's teardown, which has nothing left to do (the loop has closed its writers, workers
    and pools) and is where gloo's worker threads could abort a finished process (models/gloo_exit.py says how;
    processes that do finalize, a user's own script calling train(), are covered by its drain at exit)."""
    _destroy()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


def is_distributed() -> bool:
    """Several torchrun processes share this run (a process group of more than one)."""
    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def world_size() -> int:
    return tdist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return tdist.get_rank() if is_distributed() else 0


@dataclasses.dataclass
class DistributedContext:
    """This process's place in the run; `from_env()` joins torchrun's process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # created by from_env(), so close() destroys it
    failed: bool = False  # the run is leaving on an error (training/safekeeping.py): close() waits for no one

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "DistributedContext":
        """Read torchrun's environment; with WORLD_SIZE > 1 join (or reuse) the default process group."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1 and not is_distributed():
            return cls()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        die_with_launcher()
        owns = False
        if not tdist.is_initialized():
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(local_rank)  # "cuda" now means this rank's GPU
            tdist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=30))
            # Kept for the process's life: a second train() in the same process joins it again (destroying
            # and re-creating a group under torchrun's store can hang).
            atexit.register(_destroy)
            owns = True
        drain_at_exit()
        _join_roster()
        return cls(tdist.get_rank(), tdist.get_world_size(), local_rank, owns)

    def close(self) -> None:
        """Wait for every process (the group itself lives until the process exits); not after an error (`failed`),
        when the others may never come. A process lost after the last step changes nothing: its work is saved."""
        if is_distributed() and not self.failed:
            try:
                tdist.barrier()
            except RuntimeError as e:
                if not _peer_gone(e):
                    raise

    # ---- configuration ---------------------------------------------------------------------

    def local_config(self, config):
        """This rank's share of the run: B/W prompts per step, minibatch/W answers per optimizer step.
        Raises ConfigError (before any model loads) when the global batch does not split evenly."""
        W, t, algo = self.world_size, config.train, config.algorithm
        fsdp = config.model.fsdp
        if W == 1:
            if fsdp:
                raise ConfigError("model.fsdp: sharding needs several processes; launch with torchrun "
                                  "--nproc_per_node N "
                                  "(or set model.fsdp = false)")
            return config
        if t.prompts_per_step % W:
            raise ConfigError(f"train.prompts_per_step: {t.prompts_per_step} prompts cannot be split over {W} "
                              f"processes (whole groups per rank); use a multiple of {W}, e.g. "
                              f"{W * (t.prompts_per_step // W + 1)}")
        if config.minibatch_size % W:
            raise ConfigError(f"train.minibatch_size: {config.minibatch_size} answers cannot be split over {W} "
                              f"processes; use a multiple of {W}")
        local_mb = config.minibatch_size // W
        if t.micro_batch_size and local_mb % t.micro_batch_size:
            raise ConfigError(f"train.micro_batch_size: {t.micro_batch_size} (answers per forward on one process) must "
                              f"divide the per-process minibatch of {local_mb} answers (minibatch / {W} processes)")
        if fsdp and config.model.lora:
            raise ConfigError("model.fsdp with model.lora is not supported yet: the adapters are small, so plain data "
                              "parallel (model.fsdp = false) replicates them cheaply")
        several = config.minibatch_size < config.generation_batch_size
        if algo.dynamic_sampling and W > 1 and (several or fsdp):
            raise ConfigError("algorithm.dynamic_sampling with several processes needs one minibatch per step "
                              "(train.minibatch_size = 0) and no model.fsdp: a rank may end a step with fewer groups, "
                              "and every rank must take the same number of optimizer steps")
        every_answer = {"skip_zero_advantage": False} if fsdp else {}
        train = dataclasses.replace(t, prompts_per_step=t.prompts_per_step // W,
                                    minibatch_size=local_mb if t.minibatch_size else 0, **every_answer)
        return dataclasses.replace(config, train=train)

    def shard_stream(self, stream) -> "ShardedStream":
        return stream if self.world_size == 1 else ShardedStream(stream, self.rank, self.world_size)

    # ---- running something once ---------------------------------------------------------------

    def main_only(self, factory: Callable[[], Any]) -> Any:
        """`factory()` on rank 0; elsewhere an object whose every method does nothing."""
        return factory() if self.is_main else _Null()

    def run_on_main(self, fn: Callable, *args, **kwargs) -> Any:
        """`fn` on rank 0 only; every rank gets its result, or raises its exception (no rank hangs)."""
        if self.world_size == 1:
            return fn(*args, **kwargs)
        box: list = [None]
        if self.is_main:
            try:
                box[0] = ("ok", fn(*args, **kwargs))
            except Exception as e:  # re-raised on every rank below
                box[0] = ("error", e)
        tdist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "error":
            raise value
        return value

    def any(self, flag: bool) -> bool:
        return any_rank(flag)

    # ---- gathering for rank 0's files ---------------------------------------------------------

    def gather_draw(self, draw, advantages):
        """The whole batch's answers (prompts, texts, rewards, advantages) for completions.jsonl."""
        if self.world_size == 1:
            return draw, advantages
        from types import SimpleNamespace

        parts: list = [None] * self.world_size
        mine = (draw.prompts, draw.texts, draw.per_fn.cpu(), draw.total.cpu(), advantages.cpu(), draw.conversations)
        tdist.all_gather_object(parts, mine)
        prompts = [p for part in parts for p in part[0]]
        joined = SimpleNamespace(prompts=prompts, texts=[t for part in parts for t in part[1]],
                                 per_fn=torch.cat([p[2] for p in parts]), total=torch.cat([p[3] for p in parts]),
                                 size=len(prompts),
                                 conversations=None if parts[0][5] is None else [c for p in parts for c in p[5]])
        return joined, torch.cat([p[4] for p in parts])



class ShardedStream:
    """This rank's contiguous share of every global batch of a prompt stream (state: the global stream's)."""

    def __init__(self, stream, rank: int, world: int):
        self.stream, self.rank, self.world = stream, rank, world

    def next_batch(self) -> list:
        batch = self.stream.next_batch()
        share = len(batch) // self.world
        return batch[self.rank * share:(self.rank + 1) * share]

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)


class _Null:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def gather_states(state):
    """Every rank's `state` (its sampling generator's) as a list for the checkpoint; on one process the state."""
    if not is_distributed():
        return state
    out: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, state)
    return out


def local_state(saved):
    """This rank's entry of a `gather_states` list (resume); a plain state is a one-process run's."""
    n, W = (len(saved) if isinstance(saved, list) else 1), world_size()
    if n != W:
        raise SetupError(f"--resume: the checkpoint was written by {n} process(es), this run has {W}; resume with "
                           f"the same number of processes (torchrun --nproc_per_node {n})")
    return saved[rank()] if isinstance(saved, list) else saved


def any_rank(flag: bool) -> bool:
    if not is_distributed():
        return bool(flag)
    t = torch.tensor([1 if flag else 0], device=_comm_device())
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return bool(t.item())


def all_ranks(flag: bool) -> bool:
    return not any_rank(not flag)


def global_sum(value: torch.Tensor) -> torch.Tensor:
    """A count summed over ranks (e.g. dapo's token count of the minibatch)."""
    if not is_distributed():
        return value
    out = value.detach().clone().to(_comm_device())
    tdist.all_reduce(out)
    return out.to(value.device)


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else torch.device("cpu")


def reduce_gradients(model, sums_over_global_tokens: bool, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Make every rank's gradients the whole batch's: SUM over ranks, scaled by 1/W for the loss types
    that average over answers (module docstring; `AlgorithmConfig.sums_over_global_tokens`). Call after
    backward, before clipping."""
    if not is_distributed():
        return
    W = tdist.get_world_size()
    scale = 1.0 if sums_over_global_tokens else 1.0 / W
    params = [p for p in model.parameters() if p.requires_grad]
    if is_fsdp(model):  # FSDP2 already reduce-scattered the sums during backward
        for p in params:
            if p.grad is not None and scale != 1.0:
                p.grad.mul_(scale)
        return
    device = params[0].device if params else _comm_device()
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    tdist.all_reduce(has)  # a parameter with a gradient on any rank gets one everywhere (zeros where missing)
    live = [p for p, h in zip(params, has.tolist()) if h]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in buckets([(None, p) for p in live], bucket_bytes, key=lambda p: p.grad):
        grads = [p.grad for _, p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        tdist.all_reduce(flat)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def buckets(named, bucket_bytes: int, key: Callable = lambda t: t):
    """Group (name, tensor) pairs into lists of about `bucket_bytes` each, one dtype per list, in order."""
    bucket, size, dtype = [], 0, None
    for name, item in named:
        t = key(item)
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or t.dtype != dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, item))
        size, dtype = size + nbytes, t.dtype
    if bucket:
        yield bucket


def is_fsdp(model) -> bool:
    """Whether `model` is sharded by FSDP2 (fsdp.py)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


# ---- a process of the run lost ------------------------------------------------------------------------

# Set by `launch` for the processes it starts (it names one of them that dies itself): a file where a process that
# printed why the run stopped says so (`mark_left`), so that the launcher adds nothing when its rendezvous fails too
LAUNCHED = "GRPOKIT_LAUNCHED"
# What a collective raises when the process at the other end of a connection is gone (gloo; NCCL's remote error)
_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "ncclRemoteError",
         "remote process exited")


class LostProcessError(UserError, RuntimeError):
    """Another process of this run is gone, so this one stops; the message names it and how to continue.
    `quiet`: another process (or grpokit's launcher) says it, so the CLI prints nothing here."""

    def __init__(self, message: str, *, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


@dataclasses.dataclass(frozen=True)
class Member:
    """One process of the run, as the others know it from the start."""

    rank: int
    node: int  # torchrun's GROUP_RANK: which machine (launch) of the run
    host: str
    pid: int


@dataclasses.dataclass(frozen=True)
class PeerLoss:
    """What `peer_loss` found: `what` happened (a sentence naming the process), and whether this process `says`
    it (else the lost one said why itself, the launcher that started it names it, or a lower rank here says it)."""

    what: str
    says: bool


_roster: list[Member] = []
_joined = [0]  # how many times this process joined (a second train() in one process): the store keys' prefix


def _join_roster() -> None:
    """Every process's node, host and pid, gathered once as the run joins the group."""
    me = Member(tdist.get_rank(), int(os.environ.get("GROUP_RANK", "0")), socket.gethostname(), os.getpid())
    members: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(members, me)
    _roster[:] = members
    _joined[0] += 1


def _peer_gone(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and not isinstance(error, UserError) and any(
        words in str(error) for words in _GONE)


def _store():
    try:
        return tdist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _key(rank_: int) -> str:
    """Where process `rank_` says it left; rank 0's pid and the join count keep a restarted run's keys apart."""
    return f"grpokit/{_roster[0].pid}.{_joined[0]}/left/{rank_}"


def mark_left(how: str) -> None:
    """Tell the others, in the group's store, that this process leaves the run, and why: "error", its own (which it
    prints: an error line, a traceback); "reported" or "quiet", another process lost (said here, or left to another
    process or the launcher). A process whose connection to it then closes does not call it lost. Bounded: a store
    on a machine that is gone answers nothing."""
    if how in ("error", "reported") and os.path.isfile(said := os.environ.get(LAUNCHED, "")):
        with contextlib.suppress(OSError), open(said, "a") as f:
            f.write(f"{rank()} {how}\n")
    store = _store()
    if store is None or not _roster:
        return
    with contextlib.suppress(Exception), stderr_silenced():
        processes.receive(lambda: store.set(_key(rank()), how), 2.0)


def _marks(members: list[Member]) -> dict[int, str]:
    """What each of `members` said as it left (`mark_left`); {} when the store cannot be read."""
    store = _store()
    if store is None:
        return {}

    def read() -> dict[int, str]:
        return {m.rank: store.get(_key(m.rank)).decode() for m in members if store.check([_key(m.rank)])}

    try:
        with stderr_silenced():
            return processes.receive(read, 3.0)
    except Exception:  # noqa: BLE001 - its host is gone too, or slow: nobody said anything we can read
        return {}


def _gone(pid: int) -> bool:
    """Whether process `pid` of this host has exited (a zombie not yet reaped by its launcher included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def _names(members: list[Member]) -> str:
    """"training process 1 (node 1)", "training processes 2, 3 (host b)": the node where the run has several, the
    host where it is not this one."""
    ranks = ", ".join(str(m.rank) for m in members)
    return f"training process{'es' if len(members) > 1 else ''} {ranks}{_where(members)}"


def _where(members: list[Member]) -> str:
    nodes = sorted({m.node for m in members})
    hosts = sorted({m.host for m in members} - {socket.gethostname()})
    where = [f"node {', '.join(map(str, nodes))}"] if len({m.node for m in _roster}) > 1 else []
    where += [f"host {', '.join(hosts)}"] if hosts else []
    return f" ({', '.join(where)})" if where else ""


_CAUSE = "killed, out of memory: dmesg names the OOM killer's victims, or its machine down"


def peer_loss(error: BaseException | None, wait_s: float = 3.0) -> PeerLoss | None:
    """If `error` (raised by a collective) says that another process of the run is gone: which one, and whether
    this process says so; None for any other error. `error` None: asked on a stop signal (torchrun stops the
    others once one of its processes has exited), answered at once from the processes of this host.

    A process of this host is gone when its pid is; one elsewhere cannot be looked at, so when none here is gone
    the lost one is elsewhere, named when it is the only one it can be. One that said it was leaving (`mark_left`)
    is not lost: it printed its own error where it ran, or left after a loss itself. Of the processes one launcher
    started (a machine's output), the lowest that is left says it, once."""
    if (error is not None and not _peer_gone(error)) or not _roster:
        return None
    me = _roster[rank()]
    others = [m for m in _roster if m.rank != me.rank]
    here = [m for m in others if m.host == me.host]  # their pids can be looked at
    deadline = time.monotonic() + (wait_s if error is not None else 0.0)
    while not (dead := [m for m in here if _gone(m.pid)]) and here and time.monotonic() < deadline:
        time.sleep(0.05)  # its connections close a moment before it is gone
    if error is None and not dead:
        return None
    marks = _marks(others)
    mine = [m for m in others if (m.node, m.host) == (me.node, me.host)]  # started by the same launcher
    quiet = any(marks.get(m.rank) in ("error", "reported") for m in mine) or \
        any(m.rank < me.rank and m.rank not in marks and not _gone(m.pid) for m in mine)  # it says it
    lost = [m for m in dead if m.rank not in marks]
    errors = [m for m in others if marks.get(m.rank) == "error"]
    elsewhere = [m for m in others if m.host != me.host and m.rank not in marks] if not dead else []
    if lost:
        launcher = bool(os.environ.get(LAUNCHED)) and all((m.node, m.host) == (me.node, me.host) for m in lost)
        return PeerLoss(f"{_names(lost)} was lost: its connection closed in the middle of a collective ({_CAUSE})",
                        says=not (quiet or launcher))
    if errors:  # it printed its error where it ran
        return PeerLoss(f"{_names(errors)} stopped on an error of its own, printed where it ran", says=not quiet)
    if len(elsewhere) == 1:
        return PeerLoss(f"{_names(elsewhere)} was lost: its connection closed in the middle of a collective "
                        f"({_CAUSE})", says=not quiet)
    if elsewhere:  # some of them: which, no process here can tell
        return PeerLoss(f"a training process{_where(elsewhere) or ' on another machine'} was lost: its connection "
                        f"closed in the middle of a collective ({_CAUSE})", says=not quiet)
    return PeerLoss(f"another training process was lost: its connection closed in the middle of a collective "
                    f"({_CAUSE})", says=not quiet)


def launch(nproc: int, argv: list[str], lost: Callable[[str], str] = str, rendezvous: list[str] | None = None) -> int:
    """`python -m grpokit.cli *argv` in `nproc` processes on this machine (`grpokit train --nproc-per-node N`),
    started by torch's own launcher (`torchrun --standalone`) run in this process; the run's exit code. With
    `rendezvous` (torchrun's `--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID`, from
    `grpokit train --nnodes N`) this machine's share of a run over several, the same command run on each.

    A process that fails says why itself (its `error:` line, once per machine for a start-up error, exit 2; a
    bug keeps its traceback); the launcher then ends with that process's exit code and adds nothing: not
    torchrun's `ChildFailedError` traceback (printed by torchrun's own process, which no rank can silence:
    `launch` is why), nor its agent's log lines. A process that ends without a word (a signal: `kill -9`, the
    OOM killer; an exit code grpokit never gives) is named here, in one line, `lost(what happened)` (the run
    folder's state and the command that continues), exit 2; the others leave it to this line (`LAUNCHED`)."""
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc}")
    import logging
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.run")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    launched = os.environ.get(LAUNCHED)
    said_fd, said_file = tempfile.mkstemp(prefix="grpokit-launch-")
    os.close(said_fd)
    os.environ[LAUNCHED] = said_file  # the processes inherit it
    done = threading.Event()
    quiet_later = threading.Thread(target=silenced_once_said, args=(said_file, done), daemon=True, name="launch-quiet")
    if rendezvous:
        quiet_later.start()
    try:
        try:
            run(parse_args([*(rendezvous or ["--standalone"]), "--nproc-per-node", str(nproc), "-m", "grpokit.cli",
                            *argv]))
        finally:
            done.set()  # this process's own output is its own again (the line below, a traceback)
            if quiet_later.is_alive():
                quiet_later.join()
    except ChildFailedError as e:
        said = (1, 2, 130)  # it printed why: a traceback, an `error:` line, a `stopped:` line
        stopped = (-signal.SIGTERM, -signal.SIGINT)  # how the launcher stops the others once one ended: no cause
        failures = sorted(e.failures.items())
        causes = [(r, f) for r, f in failures if f.exitcode not in said + stopped]
        if not causes and (spoken := [f for _, f in failures if f.exitcode in said]):
            return min(spoken, key=lambda f: f.timestamp).exitcode
        rank_, failure = (causes or failures)[0]  # (or only stopped ones: a signal from outside)
        if failure.exitcode >= 0:
            how = f"exited with code {failure.exitcode} without a word"
        else:
            try:
                name = signal.Signals(-failure.exitcode).name
            except ValueError:
                name = f"signal {-failure.exitcode}"
            how = f"was ended by {name} (killed from outside, or out of memory: dmesg names the OOM killer's victims)"
        print(f"error: {lost(f'training process {rank_} {how}, and the other processes were stopped')}",
              file=sys.stderr, flush=True)
        return 2
    except RendezvousError:  # the machine that keeps the rendezvous's store is gone (its launcher with it)
        if not os.path.getsize(said_file):  # no process here said why (it was busy, not in a collective)
            where = rendezvous[rendezvous.index("--rdzv-endpoint") + 1] if rendezvous else "?"
            what = (f"the rendezvous at {where} stopped answering: the machine that keeps it (its launcher) was lost "
                    f"({_CAUSE}), and the processes of this machine were stopped")
            print(f"error: {lost(what)}", file=sys.stderr, flush=True)
        return 2
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
        if launched is None:
            os.environ.pop(LAUNCHED, None)
        os.unlink(said_file)
    return 0

"""Moving the trainer's weights to whoever samples: one verb, one implementation per transport.

    trainer:  publisher.publish(model, step) -> seconds     # after the update of optimizer step `step`
    sampler:  subscriber.wait_for(step, timeout_s); subscriber.apply()  # between two batches (in-flight updates:
                                                                       # also between two decode steps)

The trainer's step is the weights' version everywhere: the start's push is step 0 (or the resumed checkpoint's),
the push after optimizer step s is version s. One publisher per run, chosen once (`rollout.weights.build_publisher`
for the run's engine, which training/setup.py's `build_run` makes the start's push with; the asynchronous rollout's
channel in training/rollout_source.py): the rollout source publishes through it after every update, and the loop
closes it when the run ends. No transport calls back into an engine: a sampler that
needs to know what it holds reads a subscriber (vLLM: `rollout.vllm.weights.ServedWeights`). prime-rl's
weight-broadcast interface is the model. The transports:
- `SharedModel` (here): the built-in sampler on the training model itself: nothing moves;
- `CallersEngine` (here): an engine of the caller's given to `train(engine=...)`, told through its `sync_weights`;
- `GlooPublisher` / `GlooSubscriber` (here): the built-in rollout workers, torch.distributed broadcast in buckets;
- rollout/vllm/weights.py: a colocated vLLM reloads in process (`InProcessReload`); a vLLM server takes them
  through vLLM's NCCL weight transfer (`NcclTransfer`, GPU) or reloads them from a safetensors folder both sides
  see (`FolderReload`, CPU, or any cluster with a shared filesystem); LoRA moves the adapter alone
  (`AdapterFolders`); asynchronous rollout against a server publishes under the lock its worker samples under
  (`LockedPublisher` / `ServerSubscriber`).

The gloo transport. The group is a gloo `ProcessGroup` built on its own `TCPStore` (127.0.0.1, a free port), not
the default group: under torchrun every trainer rank has its own workers and its own group, so no collective of
the training ranks ever waits on a worker (TRL's async trainer deadlocked above 2 trainer processes when its
weight sync shared the training group). gloo moves host tensors: a GPU trainer's buckets are copied to
the host, and a GPU worker copies them onto its device when it applies them (NCCL between GPUs would
skip the host; not built yet).

A transfer is announced first (a shared counter the worker's receiving thread polls), so the gloo
operations only start when the trainer is about to send and their timeout measures the transfer, not
the time between two syncs. A publisher's first transfer holds every parameter (the worker loaded the model
from its folder; the trainer may have resumed or been handed a model in memory); later ones only the
parameters that train (with LoRA the adapter alone). Parameters travel in buckets of about `bucket_mb`,
one flat tensor per bucket and dtype, in the order of `named_parameters()` on both sides.

An FSDP2 trainer (`model.fsdp`) holds shards (DTensor parameters; their names and shapes are the whole
model's): each rank gathers every parameter whole (`full_tensor()`, a collective over the training group:
every rank publishes at the same step and gathers the same parameters in the same order) into the bucket
it sends to its own workers, one parameter at a time, so at most a bucket and a parameter are whole at
once; the model stays sharded.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time

import torch
import torch.distributed as tdist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from grpokit.models.parallel import buckets

BUCKET_MB = 64


def transferred(model: torch.nn.Module, full: bool) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a transfer moves, in order: all of them, or those that train."""
    return [(n, p) for n, p in model.named_parameters() if full or p.requires_grad]


def bucket_indices(params: list[tuple[str, torch.Tensor]], bucket_mb: float = BUCKET_MB) -> list[list[int]]:
    """Indices of `params` in `parallel.buckets`' groups (one dtype, about bucket_mb each); the same on both sides,
    since both see the same shapes."""
    return [[i for i, _ in b] for b in buckets(((i, p) for i, (_, p) in enumerate(params)), bucket_mb * 2 ** 20)]


def _is_dtensor(p: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(p, DTensor)


def _whole(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter: an FSDP2 shard (DTensor) gathered over its mesh (a collective of the
    training ranks), or the parameter itself. No gradient, and the parameter stays sharded."""
    p = p.detach()
    return p.full_tensor() if _is_dtensor(p) else p


def _flat(parts: list[torch.Tensor]) -> torch.Tensor:
    """One bucket as one flat host tensor (gloo moves host memory), its parameters whole; under FSDP gathered
    one at a time into it (never the whole model at once)."""
    if not any(_is_dtensor(p) for p in parts):
        return _flatten_dense_tensors([p.detach() for p in parts]).cpu()
    flat = torch.empty(sum(p.numel() for p in parts), dtype=parts[0].dtype)  # a DTensor's numel: the whole's
    offset = 0
    for p in parts:
        whole = _whole(p)
        flat[offset:offset + whole.numel()].copy_(whole.reshape(-1))
        offset += whole.numel()
        del whole
    return flat


def _group(port: int, rank: int, size: int, timeout_s: float, is_master: bool, store=None):
    timeout = datetime.timedelta(seconds=timeout_s)
    store = store or tdist.TCPStore("127.0.0.1", port, size, is_master, timeout=timeout)
    return store, tdist.ProcessGroupGloo(store, rank, size, timeout)


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = tdist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class WeightPublisher:
    """The trainer's end of a transport: `publish` makes the sampler hold `model`'s weights as of optimizer step
    `step` and returns the seconds it took; `close` releases what the transport holds (groups, folders, a
    server's adapter). Under torchrun every rank calls `publish` at the same step."""

    def publish(self, model: torch.nn.Module, step: int) -> float:
        raise NotImplementedError

    def close(self) -> None:
        """Nothing held, nothing to release."""


class SharedModel(WeightPublisher):
    """The built-in sampler on the training model itself (`rollout.engine = "hf"` in the trainer's process): it
    always holds the newest weights, so nothing moves."""

    def publish(self, model: torch.nn.Module, step: int) -> float:
        return 0.0


class CallersEngine(WeightPublisher):
    """An engine of the caller's given to `train(engine=...)`: its `sync_weights(model)`, where it has one (a
    sampler with weights of its own), after every update and once at the start."""

    def __init__(self, engine):
        self.sync = getattr(engine, "sync_weights", None)

    def publish(self, model: torch.nn.Module, step: int) -> float:
        t0 = time.perf_counter()
        if self.sync is not None:
            self.sync(model)
        return time.perf_counter() - t0


class GlooPublisher(WeightPublisher):
    """The trainer's end to the built-in workers: rank 0 of a gloo group with its W workers."""

    def __init__(self, workers: int, timeout_s: float, announced):
        self.size, self.timeout_s, self.announced = workers + 1, timeout_s, announced  # announced: mp.Value
        self.store = tdist.TCPStore("127.0.0.1", 0, self.size, True, timeout=datetime.timedelta(seconds=timeout_s),
                                    wait_for_workers=False)
        self.group = None  # built by connect(), once the workers have started
        self.sent = False  # the first transfer moves every parameter, later ones those that train

    @property
    def port(self) -> int:
        return self.store.port

    def connect(self) -> None:
        """Form the group (every worker joins with its GlooSubscriber); a collective with the workers."""
        _, self.group = _group(self.port, 0, self.size, self.timeout_s, True, store=self.store)

    def publish(self, model: torch.nn.Module, step: int) -> float:
        """Send `model`'s weights as version `step` (the first time every parameter); the seconds it took.
        Raises RuntimeError (gloo's) when a worker does not take part within the timeout."""
        t0 = time.perf_counter()
        full, self.sent = not self.sent, True
        params = transferred(model, full)
        header = torch.tensor([step, int(full), len(params)], dtype=torch.long)
        with self.announced.get_lock():
            self.announced.value = step
        _broadcast(self.group, header)
        with torch.no_grad():
            for bucket in bucket_indices(params):  # FSDP2: shapes and sizes are the whole tensors', on every rank
                _broadcast(self.group, _flat([params[i][1] for i in bucket]))  # gloo: host memory
        return time.perf_counter() - t0


class GlooSubscriber:
    """A worker's end: a thread that takes every transfer into buffers of its own; `apply()` copies the
    newest into the model between two batches, and with `rollout.in_flight_updates` between two decode steps
    too (`DecodeSpeed.between_steps`: an answer then spans versions). Only whole transfers are staged, and only
    the worker's main thread writes the parameters, between two forwards, so no forward sees half a version."""

    def __init__(self, model: torch.nn.Module, port: int, rank: int, size: int, timeout_s: float, announced):
        self.model, self.announced = model, announced
        self.version = -1  # the version in the model now
        self._staged: dict[str, torch.Tensor] = {}  # name -> newest received tensor, not yet applied
        self._staged_version = -1
        self._received = threading.Condition()
        self.error: BaseException | None = None
        self.seconds = 0.0  # time spent receiving
        _, self.group = _group(port, rank, size, timeout_s, False)
        self._thread = threading.Thread(target=self._receive_forever, daemon=True, name="weight-receiver")
        self._thread.start()

    def _receive_forever(self) -> None:
        seen = -1
        try:
            while True:
                while self.announced.value <= seen:
                    time.sleep(0.002)
                t0 = time.perf_counter()
                header = torch.zeros(3, dtype=torch.long)
                _broadcast(self.group, header)
                version, full, count = (int(x) for x in header)
                params = transferred(self.model, bool(full))
                if len(params) != count:
                    raise RuntimeError(f"the trainer sent {count} parameters, this worker's model has {len(params)}")
                received = {}
                for bucket in bucket_indices(params):
                    parts = [params[i][1] for i in bucket]
                    flat = torch.empty(sum(p.numel() for p in parts), dtype=parts[0].dtype)  # host; apply() moves it
                    _broadcast(self.group, flat)
                    for i, t in zip(bucket, _unflatten_dense_tensors(flat, parts)):
                        received[params[i][0]] = t
                with self._received:
                    self._staged.update(received)
                    self._staged_version, seen = version, version
                    self.seconds += time.perf_counter() - t0
                    self._received.notify_all()
        except BaseException as e:  # noqa: BLE001 - told to the worker's main thread, which reports it
            with self._received:
                self.error = e
                self._received.notify_all()

    def wait_for(self, version: int, timeout_s: float) -> bool:
        """Block until a transfer of at least `version` has arrived (True), or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._received:
            while max(self._staged_version, self.version) < version and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._received.wait(min(left, 1.0))
        if self.error is not None:
            raise RuntimeError(f"receiving weights failed: {self.error}") from self.error
        return True

    def holding(self):
        """Nothing to hold while a batch is sampled: `apply` runs only between batches."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def apply(self) -> int:
        """Copy the newest received weights into the model; the version it now holds. Cheap when nothing is
        staged (one lock), since the decode calls it before every step with in-flight updates; the copy is in
        place, also under the decode's `torch.inference_mode`."""
        with self._received:
            staged, version = self._staged, self._staged_version
            self._staged = {}
        if staged:
            for name, p in self.model.named_parameters():
                if name in staged:
                    p.copy_(staged[name])
            self.version = max(self.version, version)
        return self.version

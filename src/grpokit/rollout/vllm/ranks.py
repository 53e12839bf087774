"""Several trainer processes (torchrun) on vLLM server(s): rank 0 pushes for all of them.

    RankZero(inner, served, lora)     every push, sync and async: rank 0 pushes while the others wait, every rank
                                      ends the push with rank 0's outcome (the same error, word for word)
    EveryRanksLock(lock)              async: the lock `LockedPublisher` takes before a push, held on every rank

A server is one sampler for all ranks, so one rank pushes. With FSDP (`model.fsdp`) the weights are DTensor shards
and gathering one whole is a collective: every rank takes part in each gather (vllm/tensors.py `gathers_in_step`),
rank 0 alone writes or sends it, one tensor at a time (the folder: in shards of `sync_bucket_mb`), so no rank holds
more than a shard and a tensor beyond its own parameters. The start's push is the exception: the probe after it
(`ServerPush`: the trainer scores the server's answer) runs a forward on rank 0 alone, which FSDP's per-layer
gathers cannot do, so for that push every rank holds the whole model once (`full_params_for_generation`, as the
built-in sampler does at every step).

In asynchronous rollout each rank has its own worker, which samples through the server(s) under its own lock; a
push must land inside no rank's batch, so every rank holds its worker's lock before rank 0 pushes. A rank that
cannot get its lock within the timeout ends every rank with one error naming it, never a rank left waiting in a
collective for one that gave up.
"""

from __future__ import annotations

import contextlib
import time

from grpokit.errors import RolloutWorkerError, UserError
from grpokit.models.fsdp import full_params_for_generation
from grpokit.models.parallel import is_distributed, is_fsdp, rank
from grpokit.models.weight_sync import WeightPublisher
from grpokit.rollout.vllm.engine import ServedWeights
from grpokit.rollout.vllm.tensors import gathers_in_step


class RankZero(WeightPublisher):
    """Under torchrun, the server(s): rank 0 publishes while the others wait for it (under FSDP taking part in each
    gather), then ask for the same weights (with LoRA: the adapter by its step's name). Rank 0's failure, whatever
    it is, reaches every rank as the same error, after every rank's gathers are made."""

    def __init__(self, inner: WeightPublisher, served: ServedWeights, lora: bool):
        self.inner, self.served, self.lora, self.pushed = inner, served, lora, False

    def publish(self, model, step: int) -> float:
        t0, failed = time.perf_counter(), None
        whole = full_params_for_generation(model) if is_fsdp(model) and not self.pushed else contextlib.nullcontext()
        with whole, gathers_in_step(model):
            if rank() == 0:
                try:
                    self.inner.publish(model, step)
                except Exception as e:  # noqa: BLE001 - every rank must hear of it, a bug included (re-raised below)
                    failed = e
        said = _from_rank_zero(failed)
        if failed is not None:
            raise failed
        if said is not None:
            raise said
        self.pushed = True
        if rank() != 0:
            self.served.use(step, self.served.adapter_prefix if self.lora else None)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.inner.close()


def _from_rank_zero(failed: BaseException | None) -> UserError | None:
    """Rank 0's error on every other rank (None where it pushed, and on rank 0): its own words where it is the
    user's to fix (an error names the server and the fix), else what it was; one broadcast, which the others are
    already waiting in."""
    if not is_distributed():
        return None
    import torch.distributed as tdist

    box = [None if failed is None else (type(failed), str(failed)) if isinstance(failed, UserError) else
           (RolloutWorkerError, f"rollout.vllm.server: rank 0 could not push the weights to the vLLM server "
                                f"({type(failed).__name__}: {failed}); its traceback is above")]
    tdist.broadcast_object_list(box, src=0)
    if rank() == 0 or box[0] is None:
        return None
    kind, message = box[0]
    try:  # the same class where it takes its message alone (the CLI prints `{label}: {message}` for it)
        return kind(message)
    except TypeError:
        return RolloutWorkerError(message)


class EveryRanksLock:
    """`lock` (this rank's worker's: held while it samples and grades a batch) as `LockedPublisher` takes it before
    a push, held on every rank before any pushes: each rank waits for its own (up to the timeout), then all say
    whether they got it. One that did not ends every rank with the same error naming it (each having let go of its
    own), so no rank pushes into a batch, and none waits for a rank that gave up."""

    def __init__(self, lock):
        self.lock = lock

    def acquire(self, timeout: float) -> bool:
        import torch.distributed as tdist

        got = self.lock.acquire(timeout=timeout)
        flags: list = [None] * tdist.get_world_size()
        tdist.all_gather_object(flags, bool(got))
        missing = [r for r, ok in enumerate(flags) if not ok]
        if not missing:
            return True
        if got:
            self.lock.release()
        ranks = ("rank " if len(missing) == 1 else "ranks ") + ", ".join(str(r) for r in missing)
        raise RolloutWorkerError(
            f"rollout.vllm.server: the rollout worker of trainer {ranks} held the vLLM server for more than "
            f"{timeout:g} s (rollout.worker_timeout_s) without ending its batch, so rank 0 could not push the new "
            "weights: a batch (sampling and grading) longer than that, or a worker that froze; raise "
            "rollout.worker_timeout_s or make a batch shorter, or set rollout.in_flight_updates = true (pushes "
            "then land inside batches, no lock)")

    def release(self) -> None:
        self.lock.release()


def every_ranks(lock):
    """`lock` as the trainer takes it to push: held on every rank (`EveryRanksLock`) under torchrun."""
    return EveryRanksLock(lock) if is_distributed() else lock

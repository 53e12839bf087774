"""The tensors a vLLM engine takes from the trainer: vLLM's checkpoint format, one whole tensor at a time.

Every transport to vLLM (vllm/weights.py, vllm/nccl.py) sends these: the names and tensors of a Hugging Face
checkpoint, so vLLM's own loader repacks them for its kernels (its CPU linear layers keep their weights in a packed
layout: writing into the live parameters, as `load_weights` does, broke them).

An FSDP trainer's tensors are DTensor shards: gathering one whole (`full_tensor()`) is a collective of every rank.
When rank 0 alone pushes (vllm/ranks.py `RankZero`), the other ranks must make the same gathers in the same order,
and rank 0 must make all of them even when its push fails half-way: `gathers_in_step` counts rank 0's and, when the
push ends, makes the ones it did not (on the other ranks: all of them), so no rank waits in a gather forever.
"""

from __future__ import annotations

import contextlib
import threading
import weakref


def sync_tensors(model):
    """(Hugging Face name, tensor) of every parameter and persistent buffer the sampler needs, ungathered (an FSDP
    shard's `shape` is the whole tensor's): a tied output head under its own name too (vLLM's reload re-creates
    each layer's tensors, untying them, and keeps the head's old ones when no `lm_head.weight` arrives; its loader
    skips the alias where the tie holds); other shared tensors once. Not sent: non-persistent buffers, which are
    not checkpoint weights (Gemma's `embed_scale`: vLLM's loader refuses the name) and rotary tables (the
    decoder's, a vision tower's rotary_pos_emb), which vLLM rebuilds."""
    seen = set()
    for name, t in list(model.named_parameters(remove_duplicate=False)) + _persistent_buffers(model):
        if "rotary_emb" in name or name.endswith("inv_freq") or (id(t) in seen and not _is_head(name)):
            continue
        seen.add(id(t))
        yield name, t


def _persistent_buffers(model) -> list:
    return [(f"{prefix}.{name}" if prefix else name, b) for prefix, module in model.named_modules()
            for name, b in module.named_buffers(recurse=False) if name not in module._non_persistent_buffers_set]


def _is_head(name: str) -> bool:
    return name.removeprefix("base_model.model.").endswith("lm_head.weight")


def _sharded(t) -> bool:
    return hasattr(t, "full_tensor")  # a DTensor (FSDP2); a plain tensor, or one FSDP unsharded, has none


def named_weights_for_sync(model):
    """`sync_tensors`, each whole, one at a time (FSDP shards are gathered here, one tensor at a time: every
    rank must iterate in step, or run inside `gathers_in_step`); a tied head as a copy of its own (safetensors
    refuses shared storage)."""
    sent, counted, k = set(), _IN_STEP.get(model), 0
    for name, t in sync_tensors(model):
        if _sharded(t):
            full = (counted.gather(t, k) if counted is not None else t.full_tensor()).detach()
            k += 1
        else:
            full = t.detach()
        yield name, full.clone() if id(t) in sent else full
        sent.add(id(t))


class _Gathers:
    """The gathers of one push on one rank: how many were made (in `named_weights_for_sync`'s order), and closed
    once the push ended (a sending thread still alive then must not gather behind the others' backs)."""

    def __init__(self):
        self.done, self.closed, self.lock = 0, False, threading.Lock()

    def gather(self, t, k: int):
        with self.lock:
            if self.closed or k != self.done:  # a second pass, or one after the push: the ranks would part
                raise RuntimeError("an FSDP weight push gathered its tensors out of step with the other ranks "
                                   f"(gather {k}, {self.done} made; closed: {self.closed})")
            self.done += 1
            return t.full_tensor()


_IN_STEP: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> _Gathers of the push in progress


@contextlib.contextmanager
def gathers_in_step(model):
    """A block in which this rank may push `model` (one pass of `named_weights_for_sync`, or none, or part of one):
    at its end, however it ends, this rank makes the gathers the pass did not, in order, each whole tensor dropped
    at once, so every rank has made the same collectives. Nothing to do for a model without DTensor shards."""
    if not any(_sharded(t) for _, t in sync_tensors(model)):
        yield
        return
    counted = _IN_STEP[model] = _Gathers()
    try:
        yield
    finally:
        _IN_STEP.pop(model, None)
        with counted.lock:
            counted.closed = True
            rest = [t for _, t in sync_tensors(model) if _sharded(t)][counted.done:]
            for t in rest:
                t.full_tensor()

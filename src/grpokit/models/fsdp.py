"""FSDP2 (`model.fsdp = true`): sharding the policy and the reference model over torchrun processes.

`fully_shard` goes on each decoder layer and on the root; gradients are reduce-scattered as
sums (divide factor 1) and scaled by `parallel.reduce_gradients`. The model loads on the CPU
and only its shards move to the rank's device. Rollout gathers the full parameters once for
the whole decode loop (ranks decode different numbers of steps, so per-layer all-gathers would
not line up). Full state dicts (for checkpoints and weight sync) are gathered here too.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as tdist

from grpokit.errors import SetupError
from grpokit.models.parallel import is_distributed, is_fsdp


def prepare_model(model, ref_model, linear_head: bool, *, fsdp: bool):
    """Shard (FSDP2) or replicate (plain DP) the policy and the reference model across ranks.

    Plain DP broadcasts rank 0's trainable parameters, so the replicas start identical even when an
    initialisation (a LoRA adapter's, say) was not. Under FSDP the fused log-prob head is off: it
    reads the head's weight directly, outside the root module's forward that gathers it."""
    if not is_distributed():
        if fsdp:
            raise SetupError("model.fsdp = true needs several processes: launch with torchrun --nproc_per_node N")
        return model, ref_model, linear_head
    if not fsdp:
        for p in model.parameters():
            if p.requires_grad:
                tdist.broadcast(p.data, src=0)
        return model, ref_model, linear_head
    return _shard(model), (None if ref_model is None else _shard(ref_model)), False


def _shard(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (tdist.get_world_size(),))
    layers = _decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if is_fsdp(module):  # plain sums (gloo has no pre-scaled sum); reduce_gradients scales by the loss type
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def _decoder_layers(model) -> list:
    """The repeated blocks of a Hugging Face decoder (`model.layers`, `transformer.h`, ...)."""
    base = getattr(model, "base_model", model)
    for name in ("layers", "h", "blocks", "decoder.layers"):
        obj = base
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList) and len(obj):
            return list(obj)
    raise SetupError(f"model.fsdp: cannot find the decoder layers of {type(model).__name__} to shard")


def load_device(config) -> str:
    """Where to load the weights: the CPU under FSDP (only the shards move to the accelerator); under
    torchrun "cuda:N" means this process's own GPU (LOCAL_RANK, set by `from_env`)."""
    if config.model.fsdp:
        return "cpu"
    device = config.model.device
    return "cuda" if is_distributed() and device.startswith("cuda") else device


@contextmanager
def full_params_for_generation(model):
    """Under FSDP, gather every layer's parameters for the whole decode loop (ranks decode different
    numbers of steps, so per-forward all-gathers would not pair up), then shard them again. Inside a block of
    its own (an evaluation gathers once for all its batches, each sampled by an engine that gathers too) it does
    nothing: ranks evaluating different numbers of batches make the same collectives."""
    if not is_fsdp(model) or id(model) in _GATHERED:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    _GATHERED.add(id(model))
    try:
        yield
    finally:
        _GATHERED.discard(id(model))
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


_GATHERED: set[int] = set()  # the models inside a full_params_for_generation block now


def full_state_dict(model) -> dict | None:
    """The full (unsharded) state dict on every rank under FSDP (a collective); None otherwise."""
    if not is_fsdp(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    seen, tied = set(), set()  # tied weights (lm_head = embeddings) come back as copies: keep the first name
    for name, p in model.named_parameters(remove_duplicate=False):
        (tied if id(p) in seen else seen).add(name if id(p) in seen else id(p))
    return {k: v for k, v in full.items() if k not in tied}


def optimizer_state(model, optimizer) -> dict:
    if not is_fsdp(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model, optimizer, state: dict) -> None:
    if not is_fsdp(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))

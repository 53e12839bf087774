"""Moving the KL reference toward the policy (TR-DPO; TRL's `sync_ref_model`):

    [algorithm]
    beta = 0.04
    ref_sync_every = 64       # after every 64th training step (0: the reference never moves)
    ref_mixup_alpha = 0.6     # reference <- α·policy + (1 - α)·reference

A step is one generation batch (`train.steps`); the sync runs right after that step's update, on
every process, so the next step's reference log-probs see the moved reference. (TRL counts
optimizer steps: `grpokit.trl` converts `ref_model_sync_steps`.)

- Full fine-tuning: each reference parameter is mixed in place with the policy's of the same name
  (`mix_parameters`; a tied weight is one parameter, mixed once). Data parallel: every process holds
  the same policy after the update, so the replicas stay equal. FSDP2: both models are sharded the
  same way, and each process mixes its own shards (after sharding the reference's root again: a
  forward without backward leaves it gathered).
- LoRA: no copy of the model; the reference becomes the base plus a low-rank delta of its own,
  mixed exactly (`models/lora.py`, `LoraReference`).

Once moved, the reference is part of every checkpoint (`checkpoint-N/reference/`, training/checkpoint.py)
and comes back on --resume; checkpoints written before the first sync need nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from grpokit.config.schema import Config
from grpokit.models.lora import LoraReference
from grpokit.models.parallel import is_fsdp

if TYPE_CHECKING:
    from grpokit.training.setup import Policy


def sync_reference(config: Config, policy: Policy, step: int) -> dict[str, float]:
    """After training step `step`: on every `algorithm.ref_sync_every`-th, move the reference toward
    the policy; `{"ref_sync": 1.0}` then (the step's metric), else nothing."""
    every = config.algorithm.ref_sync_every
    if not every or step % every or policy.ref_model is None:
        return {}
    alpha = config.algorithm.ref_mixup_alpha
    if isinstance(policy.ref_model, LoraReference):
        policy.ref_model.mix(alpha)
    else:
        mix_parameters(policy.ref_model, policy.model, alpha)
    policy.ref_moved = True
    return {"ref_sync": 1.0}


@torch.no_grad()
def mix_parameters(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """reference <- α·policy + (1 - α)·reference, in place, parameter by parameter matched by name.

    `named_parameters` yields a tied weight (embeddings = output head) once, so it is mixed once.
    Under FSDP2 both models hold the same shards of each parameter: the mix is local and exact."""
    resharded(reference)
    resharded(policy)
    source = dict(policy.named_parameters())
    for name, ref in reference.named_parameters():
        own = source.get(name)
        if own is None or own.shape != ref.shape or _local(own).shape != _local(ref).shape:
            raise ValueError(f"the reference's {name} has no match in the policy: they must be the same model")
        _local(ref).lerp_(_local(own).to(ref.dtype), alpha)


def resharded(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its parameters as shards again, under FSDP2: after a forward with no backward (the
    reference's) the root keeps its parameters gathered, and a change to those would be lost."""
    if is_fsdp(model):
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of an FSDP2 parameter (a DTensor; the same storage), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t

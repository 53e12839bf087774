"""The tensors a vLLM engine takes from the trainer: vLLM's checkpoint format, one whole tensor at a time.

Every transport to vLLM (vllm/weights.py, vllm/nccl.py) sends these: the names and tensors of a Hugging Face
checkpoint, so vLLM's own loader repacks them for its kernels (its CPU linear layers keep their weights in a packed
layout: writing into the live parameters, as `load_weights` does, broke them).
"""

from __future__ import annotations


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


def named_weights_for_sync(model):
    """`sync_tensors`, each whole, one at a time (FSDP shards are gathered here, one tensor at a time: every
    rank must iterate in step); a tied head as a copy of its own (safetensors refuses shared storage)."""
    sent = set()
    for name, t in sync_tensors(model):
        full = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
        yield name, full.clone() if id(t) in sent else full
        sent.add(id(t))

"""One decode step of a Llama-family model as a plain loop over its layers (`rollout.layer_loop`).

A decode step feeds one token per answer through every layer. Its matmuls are a few rows by every weight
matrix, so on a CPU the step is short (a 14M-parameter model: ~10 ms for 64 rows), and transformers'
per-step Python (the mask builder, keyword plumbing, module calls, `rotate_half`'s slices; ~4 ms per step
on that model, measured on a 2-core AMD EPYC) is a large share of it, the largest once most answers have
ended and few rows remain. This loop does the same arithmetic on the same modules' weights, in the same
order (RMSNorm in float32, rotary embedding as `q * cos + rotate_half(q) * sin`, grouped-query attention
with the query heads packed per key/value head, SiLU-gated MLP), with none of that plumbing: each linear
layer is called through its own `forward` (the oneDNN packed one inside `packed_linears`), so results
match the model's forward to float rounding (tests/test_layer_loop.py), and the prefill and every step
with more than one new token still run the model itself.

It applies only where it is the same computation: a model whose `model_type` is one of LAYER_LOOP_TYPES
(Llama, Qwen2, Mistral: the same decoder layer; biases and `head_dim` are read from the modules), full
attention in every layer computed by torch's SDPA (`attn_implementation = "sdpa"`, transformers' default), SiLU
MLPs, plain `nn.Linear` projections (a peft LoRA layer, a quantised or a
hooked module is not one), and the preallocated KV cache (rollout/decode.py). Anything else returns None
from `layer_loop_for` and decodes through the model as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LAYER_LOOP_TYPES = ("llama", "qwen2", "mistral")


def layer_loop_for(model, cache) -> "LayerLoop | None":
    """The layer loop for `model` decoding into `cache` (a DynamicCache of preallocated layers), or None
    where it would not be the model's own computation."""
    config = getattr(model, "config", None)
    body = getattr(model, "model", None)
    if config is None or getattr(config, "model_type", None) not in LAYER_LOOP_TYPES or body is None:
        return None
    layers = getattr(body, "layers", None)
    if layers is None or not hasattr(model, "lm_head") or len(cache.layers) != len(layers):
        return None
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return None
    if getattr(config, "_attn_implementation", None) != "sdpa":  # eager / flash kernels round differently
        return None
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()) or \
            (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)):
        return None
    if not all(getattr(layer, "preallocated", False) for layer in cache.layers):
        return None
    modules = [model, body, body.embed_tokens, body.norm, body.rotary_emb, model.lm_head]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(m) is not nn.Linear for m in linears) or hasattr(attn, "q_norm"):
            return None
        modules += [layer, attn, mlp, layer.input_layernorm, layer.post_attention_layernorm, *linears]
    # a hook (accelerate's offloading, a user's) must see every call: the loop would skip it
    if type(model.lm_head) is not nn.Linear or any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook")
                                                   for m in modules):
        return None
    return LayerLoop(model, cache)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's / Qwen2's RMSNorm, operation for operation (variance in float32)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LayerLoop:
    """Runs one new token per row through the model's layers, writing keys and values into `cache`."""

    def __init__(self, model, cache):
        body, config = model.model, model.config
        self.embed, self.rotary, self.cache = body.embed_tokens, body.rotary_emb, cache
        self.norm = (body.norm.weight, body.norm.variance_epsilon)
        self.head = model.lm_head.forward  # bound now: inside packed_linears, the packed forward
        self.layers = []
        for layer in body.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(dict(
                norm1=(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                norm2=(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                q=a.q_proj.forward, k=a.k_proj.forward, v=a.v_proj.forward, o=a.o_proj.forward,
                gate=m.gate_proj.forward, up=m.up_proj.forward, down=m.down_proj.forward))
        attn = body.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.kv_heads = config.num_key_value_heads
        self.heads = config.num_attention_heads

    def __call__(self, ids: Tensor, mask: Tensor, positions: Tensor) -> Tensor:
        """ids [n, 1], mask [n, past + 1] (1 = a real token), positions [n, 1] -> next-token logits [n, V]."""
        n, d, kvh = ids.shape[0], self.head_dim, self.kv_heads
        h = self.embed(ids)  # [n, 1, H]
        cos, sin = self.rotary(h, positions)  # [n, 1, d] each
        cos_q, sin_q = cos, sin  # broadcast over [n, heads, d]
        cos_k, sin_k = cos[:, :, None], sin[:, :, None]  # [n, 1, 1, d] over [n, kvh, 1, d]
        # left padding: which cached positions each row may attend to; none when every row has a full prompt
        attend = None if bool(mask.all()) else mask.bool()[:, None, None, :]  # [n, 1, 1, past + 1]
        for layer, kv in zip(self.layers, self.cache.layers):
            x = _rms_norm(h, *layer["norm1"])  # [n, 1, H]
            q = _rotate(layer["q"](x).view(n, self.heads, d), cos_q, sin_q)  # [n, heads, d]
            k = _rotate(layer["k"](x).view(n, kvh, 1, d), cos_k, sin_k)  # [n, kvh, 1, d]
            v = layer["v"](x).view(n, kvh, 1, d)  # [n, kvh, 1, d]
            keys, values = kv.update(k, v)  # [n, kvh, past + 1, d]
            # the query heads that share a key/value head attend together: [n, kvh, heads / kvh, d]
            out = F.scaled_dot_product_attention(q.view(n, kvh, self.heads // kvh, d), keys, values,
                                                 attn_mask=attend, scale=self.scaling)
            h = h + layer["o"](out.reshape(n, 1, self.heads * d))  # [n, 1, H]
            x = _rms_norm(h, *layer["norm2"])
            h = h + layer["down"](F.silu(layer["gate"](x)) * layer["up"](x))
        return self.head(_rms_norm(h, *self.norm))[:, -1]  # [n, V]

"""One decode step of a Llama-family model as a plain loop over its layers (`rollout.layer_loop`).

A decode step feeds one token per answer through every layer. Its matmuls are a few rows by every weight
matrix, so on a CPU the step is short (a 14M-parameter model: ~10 ms for 64 rows), and transformers'
per-step Python (the mask builder, keyword plumbing, module calls, `rotate_half`'s slices; ~4 ms per step
on that model, measured on a 2-core AMD EPYC) is a large share of it, the largest once most answers have
ended and few rows remain. This loop does the same arithmetic on the same modules' weights, in the same
order (RMSNorm in float32, rotary embedding as `q * cos + rotate_half(q) * sin`, grouped-query attention
with the query heads packed per key/value head, SiLU-gated MLP), with none of that plumbing: each linear
layer is called through its own `forward` (the oneDNN packed one inside `packed_linears`, where the
projections of one input, q/k/v and gate/up, are also stacked into one packed product), and the one-token
attention is, in float32, two batched matmuls and a softmax (`_one_query_attention`: SDPA's CPU kernel costs
up to twice as much for one query). Results match the model's forward to float rounding (tests/test_layer_loop.py);
the prefill and every step with more than one new token still run the model itself.

It applies only where it is the same computation: a model whose `model_type` is one of LAYER_LOOP_TYPES
(Llama, Qwen2, Mistral: the same decoder layer; biases and `head_dim` are read from the modules), full
attention in every layer with transformers' default `attn_implementation = "sdpa"` (a model set to eager or
another kernel keeps it: the model runs it), SiLU MLPs, plain `nn.Linear` projections (a peft LoRA layer,
a quantised or a hooked module is not one), and the preallocated KV cache (rollout/decode.py). Anything else
returns None from `layer_loop_for` and decodes through the model as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpokit.models.onednn import packed_side_by_side

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
    if getattr(config, "_attn_implementation", None) != "sdpa":  # a kernel the user chose: the model runs it
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


def _one_by_one(forwards: list):
    """x -> each forward's output, in order: projections of one input that are not stacked."""
    return lambda x: tuple(f(x) for f in forwards)


def _one_query_attention(q: Tensor, keys: Tensor, values: Tensor, blocked: Tensor | None, scale: float) -> Tensor:
    """softmax(q k^T * scale) v for one new query per row, the query heads that share a key/value head
    together: q [n, kvh, g, d], keys and values [n, kvh, past, d] (views of the preallocated cache),
    blocked [n, 1, 1, past] (True: left padding) or None -> [n, kvh, g, d].

    Two batched matmuls and a softmax, in float32 only (the caller keeps SDPA for bf16 and fp16, whose
    scores SDPA holds in float32). torch's SDPA (the model's own kernel) tiles its CPU flash kernel for long
    queries; for a one-token query it costs 1.5-2.5x as much on a 2-core AMD EPYC (64 rows, 40-160 cached
    positions: 271-477 us against 99-275 us per call), for the same result up to float rounding (~1e-7)."""
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale)  # [n, kvh, g, past]
    if blocked is not None:
        scores.masked_fill_(blocked, float("-inf"))
    return torch.matmul(scores.softmax(-1), values)  # [n, kvh, g, d]


class LayerLoop:
    """Runs one new token per row through the model's layers, writing keys and values into `cache`."""

    def __init__(self, model, cache):
        body, config = model.model, model.config
        self.embed, self.rotary, self.cache = body.embed_tokens, body.rotary_emb, cache
        self.norm = (body.norm.weight, body.norm.variance_epsilon)
        self.head = model.lm_head.forward  # bound now: inside packed_linears, the packed forward
        self.layers = []
        # where packed: one product for the projections of one input (models/onednn.py), else each module
        groups = [g for layer in body.layers for g in ([layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                         layer.self_attn.v_proj],
                                                        [layer.mlp.gate_proj, layer.mlp.up_proj])]
        stacked = packed_side_by_side(groups) or [_one_by_one([m.forward for m in g]) for g in groups]
        for i, layer in enumerate(body.layers):
            a, m = layer.self_attn, layer.mlp
            self.layers.append(dict(
                norm1=(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                norm2=(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                qkv=stacked[2 * i], gate_up=stacked[2 * i + 1], o=a.o_proj.forward, down=m.down_proj.forward))
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
        blocked = None if bool(mask.all()) else ~mask.bool()[:, None, None, :]  # [n, 1, 1, past + 1]
        for layer, kv in zip(self.layers, self.cache.layers):
            x = _rms_norm(h, *layer["norm1"])  # [n, 1, H]
            q, k, v = layer["qkv"](x)  # [n, 1, heads * d], [n, 1, kvh * d] twice
            q = _rotate(q.reshape(n, self.heads, d), cos_q, sin_q)  # [n, heads, d]
            k = _rotate(k.reshape(n, kvh, 1, d), cos_k, sin_k)  # [n, kvh, 1, d]
            v = v.reshape(n, kvh, 1, d)  # [n, kvh, 1, d]
            keys, values = kv.update(k, v)  # [n, kvh, past + 1, d]
            q = q.view(n, kvh, self.heads // kvh, d)  # the query heads that share a key/value head together
            if q.dtype == torch.float32:
                out = _one_query_attention(q, keys, values, blocked, self.scaling)
            else:  # bf16 / fp16: SDPA keeps the scores in float32, two low-precision matmuls would round them
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=None if blocked is None else ~blocked,
                                                     scale=self.scaling)
            h = h + layer["o"](out.reshape(n, 1, self.heads * d))  # [n, 1, H]
            x = _rms_norm(h, *layer["norm2"])
            gate, up = layer["gate_up"](x)  # [n, 1, I] each
            h = h + layer["down"](F.silu(gate) * up)
        return self.head(_rms_norm(h, *self.norm))[:, -1]  # [n, V]

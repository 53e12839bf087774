"""Per-token log-probabilities (and entropies) of the sampled tokens, in bounded memory.

Log-probabilities are computed in chunks of rows so that neither the full
[N, T, V] float32 log-softmax nor (with ``token_logprobs_from_hidden``) the
[N, T, V] logits ever exist at once; ``torch.utils.checkpoint`` makes backward
recompute each chunk rather than keep every chunk's activations alive.

Pure torch; no function modifies its inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from grpokit.algorithms.fused_logprobs import linear_logprobs


def _logp_entropy(logits: Tensor, ids: Tensor, temperature: float, with_entropy: bool):
    """Gathered log-prob (and entropy) of softmax(logits / temperature) for rows [R, V], ids [R]."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logz = logits.to(dtype) / temperature  # [R, V]
    logsm = torch.log_softmax(logz, dim=-1)  # [R, V]
    logp = logsm.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [R]
    if not with_entropy:
        return logp
    probs = logsm.exp()  # [R, V]
    # where() before the product keeps -inf logits (masked vocab) from giving 0 * -inf = NaN.
    entropy = -(probs * torch.where(probs > 0, logsm, 0.0)).sum(dim=-1)  # [R]
    return logp, entropy


def _row_chunks(x: Tensor, ids: Tensor, chunk_size: int) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """Split x [N, T, D] and ids [N, T] into matching chunks of rows [R, D], [R], in (n, t) order.

    ``split`` (not a loop of slices) so that backward assembles the gradient with one
    ``cat`` instead of one full-size zero tensor per chunk.
    """
    n, t, d = x.shape
    try:
        return x.view(n * t, d).split(chunk_size), ids.reshape(n * t).split(chunk_size)
    except RuntimeError:  # not viewable (e.g. a slice of longer logits): whole sequences per chunk
        per = max(1, chunk_size // max(t, 1))
        return tuple(c.reshape(-1, d) for c in x.split(per)), tuple(c.reshape(-1) for c in ids.split(per))


def _chunked(fn: Callable, x: Tensor, ids: Tensor, chunk_size: int, with_entropy: bool):
    """Apply ``fn(rows [R, D], ids [R])`` over chunks of rows, checkpointed when grads are on."""
    use_ckpt = torch.is_grad_enabled()
    logps, ents = [], []
    for rows, row_ids in zip(*_row_chunks(x, ids, chunk_size)):
        out = checkpoint(fn, rows, row_ids, use_reentrant=False) if use_ckpt else fn(rows, row_ids)
        logp, ent = out if with_entropy else (out, None)
        logps.append(logp)
        ents.append(ent)
    logp = torch.cat(logps).reshape(ids.shape)  # [N, T]
    return logp, (torch.cat(ents).reshape(ids.shape) if with_entropy else None)


def _check_logprob_args(lead: Tensor, name: str, token_ids: Tensor, temperature: float, chunk_size: int) -> None:
    if lead.dim() != 3:
        last = {"logits": "V", "hidden": "H"}[name]
        raise ValueError(f"{name} must have shape [N, T, {last}], got {tuple(lead.shape)}")
    if tuple(token_ids.shape) != tuple(lead.shape[:2]):
        raise ValueError(f"token_ids must have shape [N, T] = {tuple(lead.shape[:2])}, got {tuple(token_ids.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")


def token_logprobs(
    logits: Tensor,
    token_ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 4096,
    with_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-prob ``[N, T]`` of ``token_ids`` under softmax(logits / temperature), logits ``[N, T, V]``.

    With ``with_entropy`` also returns the entropy ``[N, T]`` of that distribution.
    Results are float32 (float64 for float64 logits); gradients flow to ``logits``.
    """
    _check_logprob_args(logits, "logits", token_ids, temperature, chunk_size)

    def fn(rows: Tensor, ids: Tensor):
        return _logp_entropy(rows, ids, temperature, with_entropy)  # rows: [R, V]

    logp, ent = _chunked(fn, logits, token_ids, chunk_size, with_entropy)  # [N, T], [N, T] | None
    return (logp, ent) if with_entropy else logp


def token_logprobs_from_hidden(
    hidden: Tensor,
    lm_head: torch.nn.Module,
    token_ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    grad_fn: Callable[[Tensor, int], Tensor] | None = None,
    fused: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob ``[N, T]`` (and entropy or None) from last hidden states ``[N, T, H]``.

    A head that is exactly ``torch.nn.Linear`` takes the fused path (``fused_logprobs``: one exp
    per logit, closed-form backward; ``grad_fn`` there enables the one-pass backward, with its
    row offsets counted in the flattened ``[N*T]`` order). Any other head module is called on
    chunks of rows under ``torch.utils.checkpoint`` (as is a linear head with ``fused=False``).

    ``lm_head`` maps H -> V (``model.get_output_embeddings()``). The ``[N, T, V]``
    logits are never built: each chunk of rows is projected, reduced and
    (under autograd) checkpointed, so peak memory is O(chunk_size * V) (O(T * V)
    when ``hidden`` cannot be viewed as [N*T, H] and chunks are whole sequences).
    Gradients flow to ``hidden`` and to ``lm_head``'s parameters.
    """
    _check_logprob_args(hidden, "hidden", token_ids, temperature, chunk_size)
    if fused and type(lm_head) is torch.nn.Linear:  # exactly a linear map: the fused path (fused_logprobs.py)
        n, t, d = hidden.shape
        # inside models/onednn.py's `onednn_linears` the head's forward names its kernel: the fused head uses it too
        logp, ent = linear_logprobs(hidden.reshape(n * t, d), lm_head.weight, lm_head.bias, token_ids.reshape(n * t),
                                    temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
                                    grad_fn=grad_fn, product=getattr(lm_head.forward, "product", None))
        return logp.view(n, t), (ent.view(n, t) if with_entropy else None)
    if grad_fn is not None:
        raise ValueError("grad_fn (the one-pass backward) needs an exactly torch.nn.Linear lm_head")

    def fn(rows: Tensor, ids: Tensor):
        return _logp_entropy(lm_head(rows), ids, temperature, with_entropy)  # rows: [R, H] -> logits [R, V]

    return _chunked(fn, hidden, token_ids, chunk_size, with_entropy)  # [N, T], [N, T] | None

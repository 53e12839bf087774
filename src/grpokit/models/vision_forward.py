"""The training forward of a vision-language model: log-probs of completions given prompt + pixels.

The same contract as `forward.completion_logprobs` (which calls this when the batch carries
`RowMedia`): each row's images travel with it (`RowMedia.model_inputs` lays them out as the
processor does), the positions are the family's (multimodal RoPE for Qwen2-VL), and with a linear
head the decoder's hidden states go through the chunked / fused log-prob head, so the [N, T, V]
logits never exist.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from grpokit.algorithms.logprobs import token_logprobs, token_logprobs_from_hidden
from grpokit.models.media import RowMedia

if TYPE_CHECKING:  # forward.py calls this module: no import back at run time
    from grpokit.models.forward import ForwardOptions


def vision_completion_logprobs(
    model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
    media: RowMedia, *, options: ForwardOptions, temperature: float = 1.0, with_entropy: bool = False, grad_fn=None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs `[N, T]` (and entropies) of the completion tokens under `model`, the rows' images in view.
    Of `options` (`forward.ForwardOptions`) only `chunk_size`, `linear_head` and `fused` apply: every row runs
    whole."""
    chunk_size, linear_head, fused = options.chunk_size, options.linear_head, options.fused
    if len(media) != prompt_ids.shape[0]:
        raise ValueError(f"media has {len(media)} rows for a batch of {prompt_ids.shape[0]}")
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, P+T]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [N, P+T]
    inputs = media.model_inputs(input_ids)
    positions, _ = media.position_ids(model, input_ids, attention_mask, inputs)  # [N, P+T] or [3, N, P+T]
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    if linear_head:
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                                  use_cache=False, **inputs).last_hidden_state[:, P - 1: P + T - 1]  # [N, T, H]
        return token_logprobs_from_hidden(hidden, model.get_output_embeddings(), completion_ids,
                                          temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
                                          grad_fn=grad_fn if fused else None, fused=fused)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False,
                   logits_to_keep=T + 1, **inputs).logits[:, :-1]  # [N, T, V]
    out = token_logprobs(logits, completion_ids, temperature=temperature, chunk_size=chunk_size,
                         with_entropy=with_entropy)
    return out if with_entropy else (out, None)

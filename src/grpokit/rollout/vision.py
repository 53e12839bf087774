"""Sampling with images: the prompt's pixels in the prefill, multimodal positions in the decode.

`sample_groups(..., media=RowMedia)` (rollout/decode.py) calls the model through `MediaPrefill`:

- **One image-encoder pass and one prefill per prompt.** The B prompts' pixels go into the [B, P]
  prefill only (laid out by `RowMedia.model_inputs` as the processor lays out a batch); the KV cache
  that holds the image features is then repeated to the N = B*G rows, exactly as the text path repeats
  it. Decode steps carry no pixels.
- **Positions that continue the prompt's.** Qwen2-VL numbers an image's tokens on a 3-D grid, so the
  prompt ends at a position below its token count: the model's `get_rope_index` gives the prefill's
  [3, B, P] positions and an offset per row [B, 1] (`rope delta`); a decode token at text position p
  (left padding skipped) sits at p + delta on all three axes, which is what the scoring forward
  (`models/vision_forward.py`) recomputes over the whole sequence. The offsets are repeated and
  selected with the cache rows. Idefics3 / SmolVLM number tokens as text models do.
- **Image tokens are never drawn** (`suppressed_tokens`: the image placeholder, and the video one
  where the family has it; TRL suppresses `image_token_id`): a sampled placeholder would have no image
  features behind it. The reported log-prob stays that of the unmasked distribution, which is what the
  trainer recomputes, so on-policy the ratio is exactly 1; the draw itself is from the distribution
  renormalised without them, which differs from it by at most the placeholders' probability mass.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpokit.models.media import RowMedia


def suppressed_tokens(model, device) -> Tensor | None:
    """The ids a vision-language model must never sample [S]: its image (and video) placeholders."""
    config = model.config
    ids = [getattr(config, name, None) for name in ("image_token_id", "video_token_id")]
    ids = sorted({int(i) for i in ids if i is not None})
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


class MediaPrefill:
    """What the decoder adds to its model calls for prompts with images: the pixels and positions of the
    prefill, then (multimodal RoPE) the per-row offsets of every later position."""

    def __init__(self, media: RowMedia):
        self.media = media
        self.deltas: Tensor | None = None  # [n, 1] Qwen2-VL's rope deltas of the rows still decoding
        self.prefilled = False

    def inputs(self, model, ids: Tensor, mask: Tensor, positions: Tensor) -> tuple[Tensor, dict]:
        """The positions and extra keyword arguments of a model call on ids [n, L] (mask [n, past+L],
        text positions [n, L])."""
        if not self.prefilled:
            if len(self.media) != ids.shape[0]:
                raise ValueError(f"media has {len(self.media)} rows for a prefill of {ids.shape[0]} prompts")
            self.prefilled = True
            extra = self.media.model_inputs(ids)
            positions, self.deltas = self.media.position_ids(model, ids, mask, extra)  # [3, n, L] or [n, L]
            return positions, extra
        if self.deltas is None:
            return positions, {}
        return (positions + self.deltas).unsqueeze(0).expand(3, -1, -1), {}  # [3, n, L]

    def repeat_rows(self, repeats: int) -> None:
        if self.deltas is not None:
            self.deltas = self.deltas.repeat_interleave(repeats, 0)

    def select_rows(self, rows: Tensor) -> None:
        if self.deltas is not None:
            self.deltas = self.deltas[rows]

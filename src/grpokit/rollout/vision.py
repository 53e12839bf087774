"""Sampling with images: the prompt's pixels in the prefill, multimodal positions in the decode.

`sample_groups(model, RolloutRequest(..., media=RowMedia))` (rollout/decode.py) calls the model through
`MediaPrefill`:

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
- **Images in tool results** (multi-turn, rollout/multiturn.py): a result given as content blocks with
  images (TRL's form) is rendered by the processor (`ToolImages`: the template's placeholders expanded
  to the images' tokens, the pixels encoded) and fed into the same KV cache as any result; that step's
  forward carries those rows' pixels, and for Qwen2-VL the result's own 3-D positions (its
  `get_rope_index`, shifted to where the row stands), the row's offset growing by the image's. The
  answer's images (the prompt's, then each result's) travel with it to the trainer (`PromptImages.join`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import Tensor

from grpokit.models.media import PromptImages, RowMedia


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

    def inputs(self, model, ids: Tensor, mask: Tensor, positions: Tensor,
               images: Sequence[PromptImages | None] | None = None) -> tuple[Tensor, dict]:
        """The positions and extra keyword arguments of a model call on ids [n, L] (mask [n, past+L],
        text positions [n, L]); `images` (after the prefill, one per row or None): tool results' images in
        these ids, each row's real tokens first and masked holes after."""
        if not self.prefilled:
            if len(self.media) != ids.shape[0]:
                raise ValueError(f"media has {len(self.media)} rows for a prefill of {ids.shape[0]} prompts")
            self.prefilled = True
            extra = self.media.model_inputs(ids)
            positions, self.deltas = self.media.position_ids(model, ids, mask, extra)  # [3, n, L] or [n, L]
            return positions, extra
        extra = {}
        if images is not None and any(r is not None for r in images):
            extra = RowMedia(self.media.family, tuple(images), self.media.image_token_id).model_inputs(ids)
        if self.deltas is None:
            return positions, extra
        grid = (positions + self.deltas).unsqueeze(0).repeat(3, 1, 1)  # [3, n, L]
        for k, r in enumerate(images or ()):
            if r is not None:
                grid[:, k] = self._result_positions(model, ids[k], mask[k, -ids.shape[1]:], grid[0, k, 0], r, k)
        return grid, extra

    def _result_positions(self, model, ids: Tensor, real: Tensor, start: Tensor, images: PromptImages, k: int
                          ) -> Tensor:
        """Row k's 3-D positions [3, L] for a fed tool result with images (ids [L], real [L]: 1 on its tokens,
        holes after), from `start` (where its first token sits); its offset grows by the result's own."""
        count = int(real.sum())
        one = ids[None, :count]  # [1, r]
        local, delta = model.base_model.get_rope_index(
            one, mm_token_type_ids=(one == self.media.image_token_id).long(),
            image_grid_thw=images.tensors["image_grid_thw"].to(ids.device), attention_mask=torch.ones_like(one))
        positions = local[:, 0] + start  # [3, r]
        self.deltas[k] += delta[0].to(self.deltas.dtype)
        return torch.cat([positions, positions[:, -1:].expand(-1, ids.shape[0] - count)], dim=1)  # holes: the last

    def repeat_rows(self, repeats: int) -> None:
        if self.deltas is not None:
            self.deltas = self.deltas.repeat_interleave(repeats, 0)

    def select_rows(self, rows: Tensor) -> None:
        if self.deltas is not None:
            self.deltas = self.deltas[rows]


def tool_images_for(model, path: str) -> "ToolImages | None":
    """The renderer of tool results for a vision-language policy (its processor read from `path`, the model's
    folder; checked for images in tool messages); None for a text model, whose image results are failed calls."""
    from grpokit.models.vision import has_vision_tower, load_processor, vision_family

    config = model.config
    if not has_vision_tower(config) or vision_family(config) is None:
        return None
    video = getattr(config, "video_token_id", None)
    return ToolImages(load_processor(path, config.model_type), vision_family(config), int(config.image_token_id),
                      None if video is None else int(video)).check()


class UnshowableImages(ValueError):
    """A tool result's images the processor could not encode (a 0x0 image, an aspect ratio it refuses)."""


class ToolImages:
    """Renders tool results for a vision-language model (the `render_results` hook of multi-turn sampling):
    results -> (the tokens after the assistant turn, the results' images as one `PromptImages` or None).

    As `tools.tool_suffix_ids`, against a minimal conversation cut after its end of turn, but through the
    processor: its chat template writes each image block's placeholder, and the processor expands it to the
    image's tokens and encodes the pixels, as it does a prompt's. The image placeholders' own strings in a
    result's text (`<|image_pad|>`, `<image>`: HTML or SVG may hold them) are escaped, so only real images
    become image tokens. `shows_images` (from `check`) is False where the chat template renders no image in a
    tool message: images are then refused as failed calls (`no_images`), text results render as ever."""

    def __init__(self, processor, family: str, image_token_id: int, video_token_id: int | None = None):
        self.processor, self.family, self.image_token_id = processor, family, image_token_id
        tokens = [i for i in (image_token_id, video_token_id) if i is not None]
        self.placeholders = [t for t in processor.tokenizer.convert_ids_to_tokens(tokens) if t]
        self.shows_images, self.no_images = True, None

    def check(self) -> "ToolImages":
        """At start-up: whether the chat template shows a tool message's image block (an image in, image tokens
        out); where it does not, `no_images` says so for the failed calls of tools that return images."""
        from PIL import Image

        from grpokit.rollout.tools import ToolResult

        probe = ToolResult("probe", "x", False, None, (("text", "x"), ("image", Image.new("RGB", (32, 32)))))
        try:
            ids, images = self([probe])
            self.shows_images = images is not None and self.image_token_id in ids
        except Exception:  # noqa: BLE001 - jinja and the processors raise many types
            self.shows_images = False
        if not self.shows_images:
            self.no_images = ("this model's chat template renders no image in a tool message; return text, or use a "
                              "template that renders {\"type\": \"image\"} blocks in tool messages")
        return self

    def _escaped(self, result):
        """`result` with the placeholders' strings in its text broken by a zero-width space."""
        def escape(text: str) -> str:
            for token in self.placeholders:
                text = text.replace(token, token[:-1] + "\u200b" + token[-1])
            return text

        parts = tuple((kind, escape(value) if kind == "text" else value) for kind, value in result.parts)
        return dataclasses.replace(result, content=escape(result.content), parts=parts)

    def __call__(self, results) -> tuple[list[int], PromptImages | None]:
        from grpokit.data.images import image_ref
        from grpokit.rollout.tools import call_conversation, tool_suffix_ids

        tokenizer = self.processor.tokenizer
        results = [self._escaped(r) for r in results]
        images = [image for r in results for image in r.images]
        if not images:
            return tool_suffix_ids(tokenizer, results), None
        conversation = call_conversation(results[0].name)
        render = self.processor.apply_chat_template
        prefix = render(conversation, tokenize=False, add_generation_prompt=False)
        full = render(conversation + [r.message() for r in results], tokenize=False, add_generation_prompt=True)
        cut = prefix.rfind(tokenizer.eos_token) + len(tokenizer.eos_token) if tokenizer.eos_token in prefix else len(
            prefix)
        if full[:cut] != prefix[:cut]:
            raise ValueError("the chat template renders an assistant turn differently once tool messages follow it; "
                             "tool results with images cannot be appended to the sampled tokens")
        try:
            encoded = self.processor(text=[full[cut:]], images=[images], return_tensors="pt", add_special_tokens=False)
        except Exception as e:  # noqa: BLE001 - the image processors raise several types for images they refuse
            raise UnshowableImages(f"the processor could not encode it ({type(e).__name__}: {str(e)[:200]}); "
                                   "return another image (RGB, a few pixels a side at least)") from None
        encoded_images = PromptImages.from_processor(self.family, encoded)
        refs = tuple(image_ref(image) for image in images)
        return encoded["input_ids"][0].tolist(), PromptImages(encoded_images.tensors, encoded_images.num_images,
                                                               encoded_images.digest, refs)

"""The images that travel with a batch's rows: one typed field, split and joined with the rows.

A prompt's images are encoded once by the processor into `PromptImages` (the family's tensors for
that prompt alone). `RowMedia` holds one entry per row of a batch (the G answers of a prompt share
the same object, so nothing is copied), and is indexed, repeated and concatenated exactly as the
rows are; `model_inputs` turns the rows' entries into the keyword arguments the model takes,
laid out as the processor lays out a batch:

- Qwen2-VL: `pixel_values` [sum of patches, D] and `image_grid_thw` [images, 3], concatenated in row
  order; `mm_token_type_ids` [N, L] (1 on image tokens), from the ids.
- Idefics3 / SmolVLM: `pixel_values` [N, max images, 3, H, W] and `pixel_attention_mask`
  [N, max images, H, W], zero-padded (an all-zero image is padding, which the model drops).
- Gemma 3: `pixel_values` [images, 3, H, W] concatenated in row order; `token_type_ids` [N, L] (1 on
  image tokens: the decoder attends bidirectionally within each image's block), from the ids.

`position_ids` numbers the tokens: multimodal RoPE [3, N, L] for Qwen2-VL (the model's own
`get_rope_index`), positions that skip left padding [N, L] for the others.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class PromptImages:
    """One prompt's images as its processor encoded them."""

    tensors: dict[str, Tensor]  # qwen2_vl: pixel_values [patches, D], image_grid_thw [I, 3]; idefics3: pixel_values
    # [I, 3, H, W], pixel_attention_mask [I, H, W]; gemma3: pixel_values [I, 3, H, W]
    num_images: int
    digest: str  # a hash of the pixels: equal prompts with equal images share a prefill; logs name images by it
    sources: tuple = ()  # data.images.ImageRef per image (hash, path, the decoded image): completions.jsonl names
    # the images by them and the run keeps their thumbnails; () where the caller did not give them

    @classmethod
    def from_processor(cls, family: str, encoded: dict) -> "PromptImages":
        """From the processor's output for ONE prompt (batch dimension 1 where the family has one)."""
        if family == "qwen2_vl":
            tensors = {"pixel_values": encoded["pixel_values"], "image_grid_thw": encoded["image_grid_thw"]}
            count = int(tensors["image_grid_thw"].shape[0])
        elif family == "gemma3":
            tensors = {"pixel_values": encoded["pixel_values"]}  # [I, 3, H, W]: the prompt's images
            count = int(tensors["pixel_values"].shape[0])
        else:
            tensors = {name: encoded[name][0] for name in ("pixel_values", "pixel_attention_mask")}
            count = int(tensors["pixel_values"].shape[0])
        digest = hashlib.sha256()
        for name in sorted(tensors):
            digest.update(tensors[name].detach().cpu().contiguous().numpy().tobytes())
        return cls(tensors, count, digest.hexdigest()[:16])


    @classmethod
    def join(cls, parts: Sequence["PromptImages | None"]) -> "PromptImages | None":
        """Several encodings of one row in order (its prompt's images, then each tool result's), laid out as
        the processor lays out one prompt holding them all: what the scoring forward takes for the whole row."""
        parts = [p for p in parts if p is not None and p.num_images]
        if len(parts) <= 1:
            return parts[0] if parts else None
        names = parts[0].tensors
        if "pixel_attention_mask" in names:  # Idefics3: images [I, 3, H, W] padded to the largest height and width
            tensors = {name: torch.cat(_padded_to([p.tensors[name] for p in parts])) for name in names}
        else:  # Qwen2-VL: patches and grids concatenated; Gemma 3: images of one size
            tensors = {name: torch.cat([p.tensors[name] for p in parts]) for name in names}
        digest = hashlib.sha256("".join(p.digest for p in parts).encode()).hexdigest()[:16]
        return cls(tensors, sum(p.num_images for p in parts), digest, tuple(s for p in parts for s in p.sources))


def _padded_to(tensors: list[Tensor]) -> list[Tensor]:
    """Zero-padded on the last two dimensions to the largest (pixels and pixel masks alike)."""
    height, width = max(t.shape[-2] for t in tensors), max(t.shape[-1] for t in tensors)
    return [torch.nn.functional.pad(t, (0, width - t.shape[-1], 0, height - t.shape[-2])) for t in tensors]


@dataclass(frozen=True)
class RowMedia:
    """Per-row images of a batch [N]; None for a row without images."""

    family: str  # "qwen2_vl" | "idefics3" | "gemma3" (models/vision.VISION_FAMILIES)
    rows: tuple[PromptImages | None, ...]
    image_token_id: int

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, index: Tensor | Sequence[int] | slice) -> "RowMedia":
        """The entries of the rows `index` picks (a slice, a list or a long / bool tensor, as the batch's)."""
        if isinstance(index, slice):
            picked = self.rows[index]
        else:
            if isinstance(index, Tensor):
                index = index.nonzero()[:, 0] if index.dtype == torch.bool else index
                index = index.tolist()
            picked = tuple(self.rows[i] for i in index)
        return RowMedia(self.family, tuple(picked), self.image_token_id)

    def __getitem__(self, index: Tensor | Sequence[int] | slice) -> "RowMedia":
        """`select`: so a batch's per-row fields are all indexed alike (`Draw.select`'s `field[rows]`)."""
        return self.select(index)

    def repeat_interleave(self, repeats: int) -> "RowMedia":
        return RowMedia(self.family, tuple(r for r in self.rows for _ in range(repeats)), self.image_token_id)

    @staticmethod
    def concat(parts: Sequence["RowMedia | None"], lengths: Sequence[int]) -> "RowMedia | None":
        """Rows of several batches in order (a part of None: `lengths` rows without images)."""
        known = next((p for p in parts if p is not None), None)
        if known is None:
            return None
        rows = tuple(r for p, n in zip(parts, lengths) for r in (p.rows if p is not None else (None,) * n))
        return RowMedia(known.family, rows, known.image_token_id)

    @property
    def num_images(self) -> list[int]:
        """Images per row (TRL's `num_images`)."""
        return [0 if r is None else r.num_images for r in self.rows]

    def model_inputs(self, input_ids: Tensor) -> dict[str, Tensor]:
        """The model's keyword arguments for these rows, with `input_ids` [N, L] their tokens."""
        present = [r for r in self.rows if r is not None and r.num_images]
        device = input_ids.device
        types = {"qwen2_vl": "mm_token_type_ids", "gemma3": "token_type_ids"}.get(self.family)
        marks = {} if types is None else {types: (input_ids == self.image_token_id).long()}  # [N, L]
        if not present:
            return marks
        if self.family in ("qwen2_vl", "gemma3"):
            return {name: torch.cat([r.tensors[name] for r in present]).to(device) for name in present[0].tensors} \
                | marks
        return _padded_images(self.rows, device)

    def position_ids(self, model, input_ids: Tensor, attention_mask: Tensor, inputs: dict[str, Tensor]
                     ) -> tuple[Tensor, Tensor | None]:
        """Positions of `input_ids` [N, L] (left-padded), and for multimodal RoPE the offsets [N, 1] that carry
        them on past the prompt: a token at text position p (padding skipped) sits at p + delta."""
        if self.family == "qwen2_vl":
            positions, deltas = model.base_model.get_rope_index(
                input_ids, mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw"),
                attention_mask=attention_mask)
            return positions, deltas  # [3, N, L], [N, 1]
        return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0), None  # [N, L]


def _padded_images(rows: Sequence[PromptImages | None], device) -> dict[str, Tensor]:
    """Idefics3's layout: images [N, I, 3, H, W] and masks [N, I, H, W], padded with all-zero images (and
    zero pixels to the largest height and width, as the processor pads a batch)."""
    present = [r for r in rows if r is not None and r.num_images]
    first = present[0].tensors["pixel_values"]
    count = max(r.num_images for r in present)
    height = max(r.tensors["pixel_values"].shape[-2] for r in present)
    width = max(r.tensors["pixel_values"].shape[-1] for r in present)
    pixels = first.new_zeros(len(rows), count, first.shape[1], height, width)  # [N, I, 3, H, W]
    masks = torch.zeros(len(rows), count, height, width, dtype=present[0].tensors["pixel_attention_mask"].dtype)
    for i, r in enumerate(rows):
        if r is None or not r.num_images:
            continue
        p, m = r.tensors["pixel_values"], r.tensors["pixel_attention_mask"]
        pixels[i, : p.shape[0], :, : p.shape[-2], : p.shape[-1]] = p
        masks[i, : m.shape[0], : m.shape[-2], : m.shape[-1]] = m
    return {"pixel_values": pixels.to(device), "pixel_attention_mask": masks.to(device)}

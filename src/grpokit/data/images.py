"""Images in prompt rows, in TRL's dataset formats.

A row carries its images in an `images` column (a list) or an `image` column (one image, or None);
each image is a PIL image, a file path, raw bytes, or a `{"bytes": ..., "path": ...}` dict (how a
Hugging Face `Image` feature stores one). URLs are refused: a run never fetches from the network.
The prompt must be conversational. Where every user turn is plain text, one `{"type": "image"}`
part per image is put before the first user turn's text (TRL's `prepare_multimodal_messages`);
otherwise the user turns' `{"type": "image"}` parts are the placeholders and their number must
equal the row's images. Reward functions receive the column as it is in the data (TRL passes
the `image` / `images` column through the same way).

Every bad row is one `DataError` naming the row (1-based) and the column, found before the model
loads.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from grpokit.errors import DataError

IMAGE_COLUMNS = ("images", "image")


def image_column(rows: Sequence[dict]) -> str | None:
    """The column that holds images (`images` wins over `image`, as in TRL), or None."""
    return next((c for c in IMAGE_COLUMNS if any(c in row for row in rows)), None)


def load_image(value, *, row: int, column: str, base: Path | None = None):
    """One image as an RGB PIL image; `row` is 1-based, for the message."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow ships with transformers' vision extras
        raise DataError("images in the data need Pillow: pip install 'grpokit[vision]'") from None

    where = f"row {row}, column {column!r}"
    if isinstance(value, dict):  # a datasets Image feature: bytes, or a path
        value = value.get("bytes") or value.get("path")
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, (bytes, bytearray)):
        try:
            return Image.open(io.BytesIO(value)).convert("RGB")
        except Image.DecompressionBombError as e:
            raise DataError(f"{where}: the image bytes {_over_pixel_limit(e)}") from None
        except Exception as e:  # noqa: BLE001 - PIL raises several kinds
            raise DataError(f"{where}: the image bytes cannot be decoded ({type(e).__name__}); give PNG/JPEG bytes, "
                            "a file path or a PIL image") from None
    if isinstance(value, (str, Path)):
        text = str(value)
        if text.startswith(("http://", "https://", "ftp://")):
            raise DataError(f"{where}: {text!r} is a URL; grpokit does not download images: save the file locally "
                            "and give its path")
        path = Path(text) if base is None or Path(text).is_absolute() else base / text
        if path.is_dir():
            raise DataError(f"{where}: {str(path)!r} is a directory, not an image file; give the path of the image "
                            "file in it")
        if not path.is_file():
            raise DataError(f"{where}: image file {str(path)!r} does not exist; fix the path (relative paths are "
                            "read from the data file's folder)")
        try:
            with Image.open(path) as image:
                return image.convert("RGB")
        except Image.DecompressionBombError as e:
            raise DataError(f"{where}: image file {str(path)!r} {_over_pixel_limit(e)}") from None
        except Exception as e:  # noqa: BLE001
            raise DataError(f"{where}: image file {str(path)!r} cannot be read as an image ({type(e).__name__}); "
                            "replace it with a PNG or JPEG") from None
    raise DataError(f"{where}: {type(value).__name__} is not an image; give a PIL image, a file path or bytes")


def _over_pixel_limit(e: Exception) -> str:
    """Pillow's refusal of a huge image (its decompression-bomb guard), said as what to do."""
    return (f"is over Pillow's pixel limit ({e}); resize it to fewer pixels (the model's processor scales "
            "it down to far fewer anyway)")


def row_images(row: dict, *, index: int, base: Path | None = None) -> list:
    """The row's images as PIL images ([] for none); `index` is 0-based."""
    column = "images" if "images" in row else "image" if "image" in row else None
    if column is None or row[column] is None:
        return []
    values = row[column] if column == "images" else [row[column]]
    if not isinstance(values, (list, tuple)):
        raise DataError(f"row {index + 1}, column 'images': a list of images is expected, got "
                        f"{type(values).__name__}; use the 'image' column for one image per row")
    return [load_image(v, row=index + 1, column=column, base=base) for v in values]


def _is_placeholder(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def count_placeholders(messages: list[dict]) -> int:
    """Image parts in the prompt's non-tool turns."""
    return sum(sum(1 for part in m["content"] if _is_placeholder(part)) for m in messages
               if isinstance(m.get("content"), list) and m.get("role") != "tool")


def with_image_placeholders(prompt, num_images: int, *, index: int, column: str = "images") -> list[dict]:
    """The prompt's messages with every content a list of parts and one image part per image (TRL's layout)."""
    if isinstance(prompt, str):
        raise DataError(f"row {index + 1}: rows with images need a conversational prompt (a list of messages whose "
                        "user turn holds {'type': 'image'} parts), got a plain string; wrap it as "
                        "[{'role': 'user', 'content': ...}]")
    structured = any(isinstance(m.get("content"), list) for m in prompt)
    out, placed = [], structured
    for m in prompt:
        content = m.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if m.get("role") == "user" and not placed:
                parts, placed = [{"type": "image"} for _ in range(num_images)] + parts, True
            m = {**m, "content": parts}
        out.append(m)
    found = count_placeholders(out)
    if found != num_images:
        raise DataError(f"row {index + 1}: the prompt has {found} image placeholder(s) ({{'type': 'image'}} parts) "
                        f"but column {column!r} holds {num_images} image(s); make them equal")
    return out


def check_image_rows(rows: Sequence[dict], *, model_type: str | None, supported: bool, has_vision: bool,
                     model_path: str, base: Path | None = None) -> bool:
    """Whether the rows carry images; every row checked (images readable, placeholders equal in number)
    against a model that can read them. Raised before the model loads."""
    column = image_column(rows)
    if column is None or not any(row.get(column) not in (None, []) for row in rows):
        _check_no_placeholders(rows, column)
        return False
    if not has_vision:
        raise DataError(f"the data has an {column!r} column but {model_path} is a text-only model (model_type "
                        f"{model_type!r}): use a vision-language model (e.g. Qwen2-VL, SmolVLM; grpokit tiny-model "
                        f"--arch qwen2_vl) or drop the {column!r} column")
    if not supported:
        raise DataError(f"{model_path}: model_type {model_type!r} is a vision-language model grpokit does not train "
                        "yet; supported: Qwen2-VL, Qwen2.5-VL, Idefics3, SmolVLM, Gemma 3")
    for i, row in enumerate(rows):
        images = row_images(row, index=i, base=base)
        with_image_placeholders(row["prompt"], len(images), index=i, column=column)
    return True


def _check_no_placeholders(rows: Sequence[dict], column: str | None) -> None:
    """Rows without images must not ask for any: a `{"type": "image"}` part with no image behind it would render
    the model's image token with no pixels (and train on it). One error naming the first such row."""
    for i, row in enumerate(rows):
        prompt = row.get("prompt")
        messages = [m for m in prompt if isinstance(m, dict)] if isinstance(prompt, list) else []
        found = count_placeholders(messages)
        if found:
            held = f"column {column!r} holds no image" if column else "the row has no 'images' or 'image' column"
            raise DataError(f"row {i + 1}: the prompt has {found} image placeholder(s) ({{'type': 'image'}} parts) "
                            f"but {held}; give the image(s) in the row's 'images' column, or remove the "
                            "placeholders")


@dataclass(frozen=True, eq=False)
class ImageRef:
    """How the logs name one image: a hash of its pixels (and its file path where it came from a file); the
    decoded image rides along in memory for the run's thumbnails (`completions.jsonl` never holds pixels)."""

    sha256: str  # the first 16 hex digits of SHA-256 over the RGB size and pixels
    path: str | None
    image: object  # the RGB PIL image

    def record(self) -> dict:
        return {"sha256": self.sha256, **({"path": self.path} if self.path else {})}


def image_refs(row: dict, images: Sequence) -> tuple[ImageRef, ...]:
    """The row's images (as `row_images` decoded them) named for the logs: hash, and path where the data gave
    one (as written in the data: relative paths stay relative to the data file)."""
    column = "images" if "images" in row else "image"
    values = row.get(column)
    values = [] if values is None else values if column == "images" else [values]
    refs = []
    for value, image in zip(values, images):
        source = value.get("path") if isinstance(value, dict) else value
        refs.append(image_ref(image, str(source) if isinstance(source, (str, Path)) else None))
    return tuple(refs)


def image_ref(image, path: str | None = None) -> ImageRef:
    """One decoded RGB image named for the logs (a tool's result images have no path)."""
    digest = hashlib.sha256(f"{image.size[0]}x{image.size[1]}:".encode() + image.tobytes()).hexdigest()[:16]
    return ImageRef(digest, path, image)

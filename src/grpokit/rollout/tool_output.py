"""What a tool's answer may be, and how it is shown to the model.

A plain value is shown as text any tokenizer accepts (`as_text`: `str()` of a non-string, as TRL; lone
surrogates and NUL bytes become U+FFFD). A list of content blocks, TRL's form for multimodal tool
responses (`[{"type": "text", "text": ...}, {"type": "image", "image": PIL.Image}]`), keeps its images in
order for a vision-language model (`content_parts`; rollout/vision.py renders them). Both are bounded by
`tools.max_result_chars`, checked before anything is copied.
"""

from __future__ import annotations

from typing import Any

# Why a tool's images are not shown to the model: the end of its failed call's message (ToolResult.unshown)
TEXT_NO_IMAGES = "this model reads text only; return text, or train a vision-language model"
SPLIT_NO_IMAGES = ("tools.history = \"split\" does not show tool images yet; return text, or set "
                   "tools.history = \"append\"")
ENGINE_NO_IMAGES = ("this engine does not show tool images (the built-in sampler does: rollout.engine = \"hf\"); "
                    "return text")


class ResultTooLong(ValueError):
    """A tool's result (or `reset`'s text) past `tools.max_result_chars`."""


def as_text(value: Any, limit: int = 0, what: str = "the result") -> str:
    """`value` as text any tokenizer accepts (`str()` of a non-string, as TRL): lone surrogates (invalid
    UTF-8) and NUL bytes become U+FFFD. ValueError past `limit` characters (0 = no limit), checked
    before anything is copied."""
    text = value if type(value) is str else str(value)
    if limit and len(text) > limit:
        raise ResultTooLong(f"{what} has {len(text)} characters, more than tools.max_result_chars = {limit}; "
                         "return less (or raise tools.max_result_chars)")
    if not text.isascii():
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")  # a lone surrogate -> U+FFFD
    return text.replace("\x00", "\ufffd")


class InvalidBlocks(ValueError):
    """A tool's content blocks that are not text and PIL images."""


def is_content_blocks(value: Any) -> bool:
    """A result given as TRL's content blocks: a non-empty list of dicts, each of type "text" or "image" (any
    other list, a list of search hits with their own "type" say, is shown as text, as before)."""
    return type(value) is list and bool(value) and all(type(p) is dict and p.get("type") in ("text", "image")
                                                       for p in value)


def content_parts(blocks: list[dict], limit: int = 0) -> tuple:
    """Content blocks -> (("text", str) | ("image", PIL image), ...): `{"type": "text", "text": str}` and
    `{"type": "image", "image": PIL.Image}` (TRL's form). InvalidBlocks names the first block that is neither;
    ResultTooLong when the text parts together pass `limit` characters."""
    from PIL import Image

    parts, chars = [], 0
    for k, block in enumerate(blocks):
        if block["type"] == "text" and isinstance(block.get("text"), str):
            text = as_text(block["text"])
            chars += len(text)
            parts.append(("text", text))
        elif block["type"] == "image" and isinstance(block.get("image"), Image.Image):
            parts.append(("image", block["image"].convert("RGB")))  # the decoded pixels, fixed now
        elif block["type"] == "image":
            raise InvalidBlocks(f"content block {k} of the result is an image block whose \"image\" is "
                                f"{type(block.get('image')).__name__}, not a PIL image; return "
                                "{\"type\": \"image\", \"image\": PIL.Image.open(...)}")
        else:
            kind = as_text(str(block["type"]))[:40]
            raise InvalidBlocks(f"content block {k} of the result is not {{\"type\": \"text\", \"text\": str}} or "
                                f"{{\"type\": \"image\", \"image\": PIL.Image}} (got type {kind!r} with keys "
                                f"{sorted(map(str, block))[:5]}); return those blocks, or a string")
    if limit and chars > limit:
        raise ResultTooLong(f"the result's text has {chars} characters, more than tools.max_result_chars = {limit}; "
                            "return less (or raise tools.max_result_chars)")
    return tuple(parts)

"""Vision-language models: which families grpokit knows, loading their processor, freezing the vision tower.

A vision-language model (`AutoModelForImageTextToText`) is a vision encoder, a projector and a
decoder; its processor renders text and pixels together. grpokit reads what it needs from the
config (`vision_family`), never from the class name, so a family is one entry here plus a collation
rule in `models/media.py`.

transformers 5 builds the processors of families that also read video (Qwen2-VL's) only when
torchvision is installed, even for a folder that is only ever given images. `load_processor` then
builds the same processor class from the folder's tokenizer and image processor with no video
processor, so an image-only run needs no torchvision; with torchvision it is plain `AutoProcessor`.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

# model_type -> family: how its media tensors collate (models/media.py) and how it numbers positions
VISION_FAMILIES = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",
    "idefics3": "idefics3",
    "smolvlm": "idefics3",
    "gemma3": "gemma3",
}


def vision_family(config) -> str | None:
    """The media family of a model config (or None for a text-only model)."""
    return VISION_FAMILIES.get(getattr(config, "model_type", None))


def has_vision_tower(config) -> bool:
    """Whether a config describes an image-text model at all (a family grpokit supports or not)."""
    return getattr(config, "vision_config", None) is not None


def processor_class_for(arch: str):
    import transformers

    return {"qwen2_vl": transformers.Qwen2VLProcessor, "idefics3": transformers.Idefics3Processor,
            "gemma3": transformers.Gemma3Processor}[VISION_FAMILIES[arch]]


@contextmanager
def _no_video_processor():
    """Let a processor be built with `video_processor=None` (transformers type-checks every sub-processor,
    and without torchvision it cannot even name the video class)."""
    from transformers.processing_utils import ProcessorMixin

    original = ProcessorMixin.check_argument_for_proper_class

    def check(self, name, argument):
        return None if name == "video_processor" and argument is None else original(self, name, argument)

    ProcessorMixin.check_argument_for_proper_class = check
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = original


def _needs_video_processor(cls) -> bool:
    from transformers.utils import is_torchvision_available

    return "video_processor" in cls.get_attributes() and not is_torchvision_available()


def build_processor(cls, **parts):
    """`cls(**parts)` (image_processor, tokenizer, chat_template, ...) without a video processor where
    transformers cannot build one."""
    if not _needs_video_processor(cls):
        return cls(**parts)
    with _no_video_processor():
        return cls(video_processor=None, **parts)


def load_processor(path: str | Path, model_type: str | None = None):
    """The folder's processor: `AutoProcessor`, or, for a family that also reads video on a machine without
    torchvision, the same class built from the folder's tokenizer and image processor."""
    import json

    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    path = Path(path)
    if model_type is None:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    family = VISION_FAMILIES.get(model_type)
    cls = processor_class_for(model_type) if family else None
    if cls is None or not _needs_video_processor(cls):
        return AutoProcessor.from_pretrained(str(path))
    settings = json.loads((path / "processor_config.json").read_text()) if (path / "processor_config.json").is_file() \
        else {}
    extra = {k: v for k, v in settings.items() if not isinstance(v, dict) and k != "processor_class"}
    template = path / "chat_template.jinja"
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return build_processor(cls, image_processor=AutoImageProcessor.from_pretrained(str(path)), tokenizer=tokenizer,
                           chat_template=template.read_text() if template.is_file() else tokenizer.chat_template,
                           **extra)


def save_processor(processor, path: str | Path) -> None:
    """`processor.save_pretrained(path)`; a processor built without its video processor writes the same
    files (tokenizer, processor_config.json with the image processor's settings, chat template)."""
    import json

    path = Path(path)
    if getattr(processor, "video_processor", True) is not None:
        processor.save_pretrained(str(path))
        return
    processor.tokenizer.save_pretrained(str(path))
    settings = {"image_processor": processor.image_processor.to_dict(), "processor_class": type(processor).__name__}
    (path / "processor_config.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    if processor.chat_template:
        (path / "chat_template.jinja").write_text(processor.chat_template)


def vision_tower(model):
    """The image encoder module of a supported vision-language model (Qwen2-VL `visual`, Idefics3
    `vision_model`)."""
    base = model.base_model
    for name in ("visual", "vision_model", "vision_tower"):
        if (tower := getattr(base, name, None)) is not None:
            return tower
    raise ValueError(f"{type(model).__name__} has no vision tower grpokit knows (visual, vision_model, vision_tower)")


def outside_language_model(model) -> str | None:
    """A regex (peft's `exclude_modules`) over every module of a vision-language model outside its language
    model (the vision tower, the projector), so LoRA adapts the language model only; None for a text model."""
    import re

    if not has_vision_tower(model.config):
        return None
    decoder = model.get_decoder()
    names = [name for name, child in model.base_model.named_children() if child is not decoder]
    return rf"(.*\.)?({'|'.join(map(re.escape, names))})(\..*)?" if names else None


def freeze_vision_tower(model) -> int:
    """Stop the gradient of the image encoder (the default: GRPO's reward is about the text). Returns how
    many parameters were frozen. The projector between encoder and decoder stays trainable."""
    tower = vision_tower(model)
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def encode_image_prompt(processor, messages: list[dict], images: list, family: str, tools: list | None = None):
    """One conversational prompt with its images -> (token ids, `PromptImages`): the chat template renders
    the placeholders (and `tools`' schemas), the processor expands each to its image's tokens and encodes
    the pixels."""
    from grpokit.models.media import PromptImages

    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **({"tools": tools} if tools else {}))
    if not images:
        return processor.tokenizer(text, add_special_tokens=False)["input_ids"], None
    try:
        encoded = processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
    except ValueError as e:  # a template that does not render the parts as the family's placeholders
        from grpokit.errors import DataError, ModelLoadError

        if "aspect ratio" in str(e):  # Qwen2-VL's resize: an image too long and thin to cut into patches
            k, (w, h) = max(enumerate(im.size for im in images), key=lambda s: max(s[1]) / max(1, min(s[1])))
            raise DataError(f"image {k + 1} is {w} x {h} pixels, an aspect ratio of {max(w, h) / max(1, min(w, h)):g}, "
                            f"which the {family} processor refuses ({e}); crop or pad it") from None
        raise ModelLoadError(f"the model's chat template and its processor disagree on a prompt with {len(images)} "
                             f"image(s) ({e}); the template must render each {{\"type\": \"image\"}} part as the "
                             "family's image placeholder: copy chat_template.jinja (or the template in "
                             "tokenizer_config.json) from the base model again") from None
    return encoded["input_ids"][0].tolist(), PromptImages.from_processor(family, encoded)

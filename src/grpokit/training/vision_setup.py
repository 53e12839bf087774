"""Setting a vision-language run up: what `setup.py` does for text, with a processor and images.

    vision = check_vision_inputs(config, data, folder)   # before anything loads: images vs the model, options
    tokenizer = vision_tokenizer(vision)                  # the processor's tokenizer (saves the whole processor)
    prompts = tokenize_image_prompts(config, data, vision)  # ids with each image expanded to its tokens
    model = load_policy_model(config)                     # AutoModelForImageTextToText, vision tower frozen

A model folder whose config has a vision tower is loaded as an image-text-to-text model and its
processor renders the prompts. The pixels are not kept for the whole data set (a 448x448 image is
about 5 MB of Qwen2-VL patches): the prompts' token ids are computed once here, for the context check
and the prompt table; each step's B prompts are encoded again (`PromptMedia.rows`), which is what TRL
does every step, and the result travels with the answers as `RowMedia`.

The `[eval]` section's rows may carry images too (`held_out_vision`: checked the same way, encoded again
at each evaluation). What is not built with images, refused here before the model loads: tool calls and
environments (multi-turn) and the vLLM engine. Asynchronous rollout workers load the same class and
processor (`load_policy_model`, `load_policy_tokenizer`) and encode their steps' images themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from grpokit.config.schema import Config
from grpokit.data.images import check_image_rows, image_refs, row_images, with_image_placeholders
from grpokit.errors import DataError, SetupError
from grpokit.models.media import RowMedia
from grpokit.models.vision import (
    encode_image_prompt,
    freeze_vision_tower,
    has_vision_tower,
    load_processor,
    save_processor,
    vision_family,
)
from grpokit.rollout.tools import ToolBox, check_tool_template


@dataclass
class VisionInputs:
    """A vision-language model's run: its family, whether the rows carry images, its processor."""

    family: str | None  # models/vision.VISION_FAMILIES; None: a vision-language model grpokit does not know
    images: bool  # the rows carry images
    model_config: object  # the folder's transformers config
    base: Path | None  # relative image paths are read from here (the data file's folder)
    processor: object = None  # loaded by vision_tokenizer

    @property
    def image_token_id(self) -> int:
        return int(self.model_config.image_token_id)


def _model_config(folder: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError):
        return None  # the model load names what is wrong with the folder


def vision_inputs(folder: Path, rows: Sequence[dict], *, model_path: str, base: Path | None) -> VisionInputs | None:
    """The model folder's vision-language inputs (None for a text model), `rows`' images checked against it
    (readable, placeholders equal in number, a model that reads them; relative paths from `base`)."""
    model_config = _model_config(folder)
    vision = model_config is not None and has_vision_tower(model_config)
    family = vision_family(model_config) if vision else None
    images = check_image_rows(rows, model_type=getattr(model_config, "model_type", None), supported=family is not None,
                              has_vision=vision, model_path=model_path, base=base)
    return VisionInputs(family, images, model_config, base) if vision else None


def check_vision_inputs(config: Config, data, folder: Path, *, environments: bool = False,
                        tools: bool = False) -> VisionInputs | None:
    """The checks of a run with a vision-language model or image rows, before any model loads; None for a
    text model with text rows. `environments`, `tools`: the run has them."""
    base = Path(config.data.path).parent if config.data.path and Path(config.data.path).is_file() else None
    vision = vision_inputs(folder, data.rows, model_path=config.model.path, base=base)
    if config.model.train_vision_tower and vision is None:
        raise SetupError(f"model.train_vision_tower: {config.model.path} is a text-only model (model_type "
                         f"{getattr(_model_config(folder), 'model_type', None)!r}), it has no vision tower; drop "
                         "the option")
    if config.model.train_vision_tower and config.model.lora:
        raise SetupError("model.train_vision_tower: with model.lora only the language model's adapters train; set "
                         "one of them, not both")
    if vision is not None and vision.images:
        _refuse_unbuilt(config, environments, tools)
    return vision


def _refuse_unbuilt(config: Config, environments: bool, tools: bool) -> None:
    """Options that cannot take image rows yet: one error naming the option, before the model loads."""
    unbuilt = [("tools.environment", environments, "environments with image rows (tools with images are built)",
                "text rows, or tools instead of an environment"),
               ("tools.history", config.tools.history == "split", "tools.history = \"split\" with images",
                "tools.history = \"append\""),
               ("rollout.engine", config.rollout.engine != "hf" and tools, "the vLLM engine with images in "
                "multi-turn rollouts", "the hf engine"),
               ("rollout.vllm.server", config.rollout.vllm_options.server is not None, "a vLLM server with images "
                "(token-id prompts over HTTP carry no pixels)", "the colocated vLLM engine or the hf engine")]
    for field, hit, what, fix in unbuilt:
        if hit:
            raise SetupError(f"{field}: {what} is not built yet; the data has image rows: use {fix}, or text rows")


def vision_tokenizer(vision: VisionInputs, path: str):
    """The processor's tokenizer, which is what the run decodes and pads with; its `save_pretrained` writes
    the whole processor, so every checkpoint loads as the vision-language model it is."""
    import copy

    processor = vision.processor = load_processor(path, vision.model_config.model_type)
    if processor.tokenizer.pad_token_id is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    tokenizer = copy.copy(processor.tokenizer)  # the same tokenizer; only its save differs (the processor's own
    # tokenizer keeps its save, which save_processor calls)
    tokenizer.save_pretrained = lambda directory, *args, **kwargs: save_processor(processor, directory)
    return tokenizer


def context_length(model_config) -> int | None:
    """The language model's context (a vision-language config keeps it in its text config)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return getattr(text, "max_position_embeddings", None)


class PromptMedia:
    """Each row's images, encoded again for the rows of each step: `rows(indices)` -> `RowMedia` [B]."""

    def __init__(self, vision: VisionInputs, rows: Sequence[dict], tools: ToolBox | None = None):
        self.vision, self.data = vision, rows
        self.schemas = tools.schemas if tools else None  # a run with tools: the prompts list them

    def encode(self, index: int):
        """Row `index`'s (token ids, PromptImages or None)."""
        row, v = self.data[index], self.vision
        images = row_images(row, index=index, base=v.base)
        messages = with_image_placeholders(row["prompt"], len(images), index=index,
                                           column="images" if "images" in row else "image")
        try:
            ids, encoded = encode_image_prompt(v.processor, messages, images, v.family, tools=self.schemas)
        except DataError as e:  # an image the processor refuses: which row
            raise DataError(f"row {index + 1}: {e}") from None
        return ids, None if encoded is None else replace(encoded, sources=image_refs(row, images))

    def rows(self, indices: Sequence[int]) -> RowMedia:
        return RowMedia(self.vision.family, tuple(self.encode(i)[1] for i in indices), self.vision.image_token_id)

    def select(self, index: slice | Sequence[int]) -> RowMedia:
        """`RowMedia.select` of the rows' encodings, encoded now: a batch's pixels only, at a time."""
        return self.rows(range(len(self.data))[index] if isinstance(index, slice) else index)


def tokenize_image_prompts(config: Config, data, vision: VisionInputs, tokenizer, tools: ToolBox | None = None, *,
                           budget_field: str = "rollout.max_new_tokens"):
    """The prompt table of image rows (`rollout.side.PromptTable`'s fields after the rows: ids, EOS ids, media): each
    prompt rendered by the processor with its images' tokens (and `tools`' schemas, the chat template checked
    for them first), checked against the context with `budget_field`'s answer length (an image's tokens count:
    a large image is named)."""
    if tools:
        try:
            check_tool_template(tokenizer, tools, history=config.tools.history)
        except ValueError as e:
            raise SetupError(f"tools: {config.model.path}: {e}") from None
    media = PromptMedia(vision, data.rows, tools)
    limit = context_length(vision.model_config)
    budget = (config.eval.max_new_tokens if budget_field == "eval.max_new_tokens" else 0) \
        or config.rollout.max_new_tokens
    ids = []
    for i in range(len(data.rows)):
        prompt_ids, images = media.encode(i)
        if limit and len(prompt_ids) + budget > limit:
            image_tokens = sum(1 for t in prompt_ids if t == vision.image_token_id)
            raise DataError(f"prompt row {i + 1} has {len(prompt_ids)} tokens ({image_tokens} of them for its "
                            f"{0 if images is None else images.num_images} image(s)); with {budget_field} = "
                            f"{budget} it exceeds the model's context of {limit}: use smaller images, shorten the "
                            f"prompt or lower {budget_field}")
        ids.append(prompt_ids)
    eos = tokenizer.eos_token_id
    return ids, [eos] if isinstance(eos, int) else list(eos or []), media


def held_out_vision(config: Config, rows: Sequence[dict], vision: VisionInputs | None, folder: Path, *,
                    environments: bool) -> VisionInputs | None:
    """The `[eval]` rows' images checked as the training rows' are (readable, placeholders equal in number, a
    model that reads them; relative paths from `eval.path`'s folder): the inputs to encode them with, or None
    for text rows. Raised before the model loads, naming `eval.path`."""
    base = Path(config.eval.path).parent if config.eval.path and Path(config.eval.path).is_file() else None
    source = f"eval.path {config.eval.path}" if config.eval.path else "the held-out rows"
    try:
        found = vision_inputs(folder, rows, model_path=config.model.path, base=base)
    except DataError as err:
        raise DataError(f"{source}: {err}") from None
    if found is None or not found.images:
        return None
    if environments:
        raise SetupError(f"{source}: the held-out rows have images and the run has environments; environments "
                         "with image rows are not built yet: evaluate on text rows, or use tools instead")
    return replace(vision, images=True, base=base)


def _vision_config_of(path: str):
    """The folder's transformers config when it describes a vision-language model, else None."""
    from grpokit.models.loading import check_model_folder

    model_config = _model_config(check_model_folder(path))
    return model_config if model_config is not None and has_vision_tower(model_config) else None


def load_policy_model(config: Config, loader, device=None):
    """The model of `config.model.path` (on `device`, else the run's): `loader` (setup's `load_model`) for a
    text model, else `AutoModelForImageTextToText` with the vision tower frozen unless `model.train_vision_tower`."""
    device = device or _device(config)
    if _vision_config_of(config.model.path) is None:
        return loader(config.model.path, dtype=config.model.dtype, device=device)
    return apply_vision_tower_option(config, load_vision_model(config.model.path, dtype=config.model.dtype,
                                                               device=device))


def policy_context_length(path: str, reader) -> int | None:
    """The language model's context: a vision-language config keeps it in its text config, else `reader(path)`
    (models/loading.max_positions_of), as the trainer's setup reads it."""
    model_config = _vision_config_of(path)
    return reader(path) if model_config is None else context_length(model_config)


def load_policy_tokenizer(path: str, loader):
    """The tokenizer a run decodes with: the processor's for a vision-language folder (`vision_tokenizer`), else
    `loader(path)` (models/loading.load_tokenizer). What an asynchronous rollout worker loads."""
    model_config = _vision_config_of(path)
    if model_config is None:
        return loader(path)
    return vision_tokenizer(VisionInputs(vision_family(model_config), False, model_config, None), path)


def _device(config: Config):
    from grpokit.models.fsdp import load_device

    return load_device(config)


def apply_vision_tower_option(config: Config, model):
    """Freeze the image encoder (the default: the reward is about the text) unless `model.train_vision_tower`."""
    if has_vision_tower(model.config) and vision_family(model.config) and not config.model.train_vision_tower:
        freeze_vision_tower(model)
    return model


def load_vision_model(path: str, *, dtype: str = "float32", device: str = "auto", field: str = "model.path"):
    """`AutoModelForImageTextToText.from_pretrained`, with the errors `models.loading.load_model` gives."""
    from transformers import AutoModelForImageTextToText

    from grpokit.models import loading

    p = loading.check_model_folder(path, field=field)
    target = loading.resolve_device(device)
    try:
        with loading.no_progress_bars():
            model = AutoModelForImageTextToText.from_pretrained(str(p), dtype=loading.DTYPES[dtype])
    except Exception as e:
        if not (isinstance(e, loading._load_errors()) or loading._raised_by_torch_load(e)):
            raise
        raise loading._load_failed(p, field, "model", e) from e
    model.to(target)
    model.config.use_cache = False
    return model

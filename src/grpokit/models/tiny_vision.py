"""Build a tiny vision-language model and its processor locally, with nothing from a hub.

The vision tests, the parity tests against TRL and the visual demo need real image-text-to-text
folders (`config.json`, weights, tokenizer, image-processor and processor files) that load through
`AutoProcessor` / `AutoModelForImageTextToText` as a user's model does (`models/vision.load_processor`
where this transformers cannot build the processor without torchvision). The tokenizer is the
character tokenizer of `models/tiny.py` plus the family's image tokens as single special tokens, and
the chat template renders `{"type": "image"}` parts as the family's real template does (the
processor then expands each image placeholder to the image's tokens).

Families (`TINY_VLM_ARCHS`, the `grpokit tiny-model --arch` choices beside the text ones):
- `qwen2_vl`: Qwen2-VL, a ViT over 4x4-pixel patches merged 2x2, multimodal RoPE (3-D positions).
- `idefics3`: Idefics3 (SmolVLM's architecture), a SigLIP encoder, pixel shuffle, a Llama decoder.
- `gemma3`: Gemma 3, a SigLIP encoder average-pooled to a fixed number of tokens per image, a Gemma 3
  decoder (sliding-window layers) that attends bidirectionally within each image's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpokit.models.tiny import TINY_VLM_ARCHS, TOOL_CHAT_TEMPLATE, TOOL_WORDS, build_char_tokenizer

# Each family's image placeholder inside a user turn, as its own chat template writes it.
IMAGE_PLACEHOLDER = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "idefics3": "<image>",
    "gemma3": "<start_of_image>",  # the processor expands it to the image begin, soft tokens and end
}
SPECIAL_TOKENS = {
    "qwen2_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"],
    "idefics3": ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"],
    "gemma3": ["<start_of_image>", "<image_soft_token>", "<end_of_image>"],
}
NAMED_TOKENS = {"gemma3": ("boi_token", "image_token", "eoi_token")}  # the tokenizer attributes its processor reads


def vlm_chat_template(arch: str, tools: bool = False) -> str:
    """`role: text` lines as the text tiny models' template, with image parts as the family's placeholder;
    with `tools`, the text tool template (`tiny.TOOL_CHAT_TEMPLATE`) with image parts in any message (a
    tool's result may hold images, as TRL's multimodal tool responses)."""
    placeholder = IMAGE_PLACEHOLDER[arch]
    content = ("{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
               "{% if p['type'] == 'image' %}" + placeholder + "{% elif p['type'] == 'text' %}{{ p['text'] }}"
               "{% endif %}{% endfor %}{% endif %}")
    if tools:
        return TOOL_CHAT_TEMPLATE.replace("{{ m['content'] }}", content)
    return ("{% for m in messages %}{{ m['role'] }}: " + content + "\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def _tokenizer(arch: str, tools: bool = False):
    tokenizer = build_char_tokenizer(words=TOOL_WORDS if tools else ())
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[arch]})
    if arch in NAMED_TOKENS:  # saved as the tokenizer config's extra_special_tokens, as a real Gemma 3 folder has them
        tokenizer._set_model_specific_special_tokens(special_tokens=dict(zip(NAMED_TOKENS[arch], SPECIAL_TOKENS[arch])))
    tokenizer.chat_template = vlm_chat_template(arch, tools)
    return tokenizer


def _ids(tokenizer, *tokens: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


def _text_config(tokenizer, hidden_size: int, num_layers: int, max_positions: int, **extra) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=max_positions, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                tie_word_embeddings=True, **extra)


def _qwen2_vl(tokenizer, hidden_size: int, num_layers: int, max_positions: int, image_size: int):
    from transformers import AutoConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    start, pad, end, video = _ids(tokenizer, *SPECIAL_TOKENS["qwen2_vl"])
    head_dim = hidden_size // 4
    config = AutoConfig.for_model(
        "qwen2_vl",
        text_config=_text_config(tokenizer, hidden_size, num_layers, max_positions, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0,
            "mrope_section": [head_dim // 8, head_dim // 8 * 3 // 2, head_dim // 2 - head_dim // 8 * 5 // 2]}),
        vision_config=dict(depth=num_layers, embed_dim=32, hidden_size=hidden_size, num_heads=2, mlp_ratio=2,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=pad, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    # images resized to at most image_size x image_size pixels (a multiple of 8: patch 4, merged 2x2)
    images = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                                      max_pixels=image_size * image_size)
    return config, images, {}


def _idefics3(tokenizer, hidden_size: int, num_layers: int, max_positions: int, image_size: int):
    from transformers import AutoConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    patch, scale = 8, 2
    config = AutoConfig.for_model(
        "idefics3",
        text_config=dict(model_type="llama", **_text_config(tokenizer, hidden_size, num_layers, max_positions)),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=2,
                           image_size=image_size, patch_size=patch),
        scale_factor=scale, image_token_id=_ids(tokenizer, "<image>")[0], tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": image_size},
                                       max_image_size={"longest_edge": image_size})
    return config, images, {"image_seq_len": (image_size // patch) ** 2 // scale ** 2}


def _gemma3(tokenizer, hidden_size: int, num_layers: int, max_positions: int, image_size: int):
    from transformers import AutoConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    boi, image, eoi = _ids(tokenizer, *SPECIAL_TOKENS["gemma3"])
    patch, tokens = 8, 4  # (image_size / 8)^2 patches pooled to 2 x 2 = 4 tokens an image
    config = AutoConfig.for_model(
        "gemma3",
        text_config=dict(model_type="gemma3_text", head_dim=hidden_size // 4, query_pre_attn_scalar=hidden_size // 4,
                         sliding_window=max_positions, **_text_config(tokenizer, hidden_size, num_layers,
                                                                        max_positions)),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=num_layers, num_attention_heads=2, image_size=image_size,
                           patch_size=patch),
        mm_tokens_per_image=tokens, boi_token_index=boi, eoi_token_index=eoi, image_token_index=image,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    images = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    return config, images, {"image_seq_length": tokens}


def build_tiny_vlm(path: str | Path | None = None, *, arch: str = "qwen2_vl", hidden_size: int = 64,
                   num_layers: int = 2, max_positions: int = 1024, image_size: int = 32, seed: int = 0,
                   tools: bool = False):
    """A randomly initialised image-text-to-text model and its processor; written to `path` in Hugging
    Face format when given. Returns `(model, processor)`. `tools`: a chat template that lists tools and
    writes calls as <tool_call>{json}</tool_call> (single tokens), `vlm_chat_template`."""
    import torch
    from transformers import AutoModelForImageTextToText

    from grpokit.models.vision import build_processor, processor_class_for

    if arch not in TINY_VLM_ARCHS:
        raise ValueError(f"unknown vision-language arch {arch!r}; choose one of {', '.join(TINY_VLM_ARCHS)}")
    tokenizer = _tokenizer(arch, tools)
    build = {"qwen2_vl": _qwen2_vl, "idefics3": _idefics3, "gemma3": _gemma3}[arch]
    config, image_processor, extra = build(tokenizer, hidden_size, num_layers, max_positions, image_size)
    processor = build_processor(processor_class_for(arch), image_processor=image_processor, tokenizer=tokenizer,
                                chat_template=tokenizer.chat_template, **extra)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    if arch == "gemma3":  # transformers starts Gemma 3's projection at zero (a pretrained one is trained): images
        # would not reach the decoder at all; random like the other weights instead
        model.model.multi_modal_projector.mm_input_projection_weight.data.normal_(0.0, config.initializer_range)
    if path is not None:
        from grpokit.models.loading import no_progress_bars

        Path(path).mkdir(parents=True, exist_ok=True)
        with no_progress_bars():
            model.save_pretrained(str(path))
        _save_processor(processor, Path(path), arch)
    return model, processor


def _save_processor(processor, path: Path, arch: str) -> None:
    """`processor.save_pretrained`, plus, for Qwen2-VL, the video processor's config a real folder has (so
    AutoProcessor loads the folder where torchvision is installed; no video is ever read here)."""
    from grpokit.models.vision import save_processor

    save_processor(processor, path)
    if arch == "qwen2_vl":
        video = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 4, "merge_size": 2,
                 "temporal_patch_size": 2, "processor_class": "Qwen2VLProcessor"}
        (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))


def build_tiny_any(path: str | Path, *, arch: str, tokenizer=None, **options):
    """`grpokit tiny-model`: a text model (`tiny.build_tiny_model`, with `tokenizer` if given) or, for a
    vision-language `arch`, `build_tiny_vlm` (which has its own tokenizer and template)."""
    from grpokit.errors import ConfigError
    from grpokit.models.tiny import build_tiny_model

    if arch not in TINY_VLM_ARCHS:
        return build_tiny_model(path, arch=arch, tokenizer=tokenizer, **options)
    if tokenizer is not None and arch == "gemma3":  # multi-turn sampling refuses its sliding-window layers
        raise ConfigError("--tools: multi-turn rollouts need full attention in every layer, and Gemma 3 has "
                          "sliding-window layers; choose --arch qwen2_vl or idefics3 for a vision-language model "
                          "with tools")
    return build_tiny_vlm(path, arch=arch, tools=tokenizer is not None, **options)

"""Tiny vision-language models: built locally, saved as normal Hugging Face folders, reloaded, run."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from grpokit.cli import main
from grpokit.models.tiny_vision import TINY_VLM_ARCHS, build_tiny_vlm
from grpokit.models.vision import encode_image_prompt, freeze_vision_tower, load_processor, vision_family, vision_tower


@pytest.mark.parametrize("arch", TINY_VLM_ARCHS)
def test_cli_writes_a_folder_that_loads_and_reads_images(arch, tmp_path, capsys):
    out = tmp_path / arch
    assert main(["tiny-model", str(out), "--arch", arch, "--hidden-size", "32", "--layers", "1"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == arch
    processor = load_processor(out)
    model = AutoModelForImageTextToText.from_pretrained(str(out)).eval()
    assert vision_family(model.config) == arch and model.config.get_text_config().hidden_size == 32
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "count"}]}]
    red, blue = Image.new("RGB", (32, 24), (255, 0, 0)), Image.new("RGB", (32, 24), (0, 0, 255))
    ids, images = encode_image_prompt(processor, messages, [red], arch)
    image_tokens = sum(1 for t in ids if t == model.config.image_token_id)
    assert image_tokens > 1 and images.num_images == 1  # the placeholder became the image's tokens
    _, other = encode_image_prompt(processor, messages, [blue], arch)
    assert other.digest != images.digest
    text_ids = processor.tokenizer("count", add_special_tokens=False)["input_ids"]
    assert len(text_ids) == 5  # the character tokenizer: image tokens are single special tokens, text is not merged


def test_tools_flag_builds_a_vlm_whose_template_lists_tools_and_is_refused_for_gemma3(tmp_path, capsys):
    """--tools on a VLM: the tool template (calls as <tool_call> tokens) with image parts; Gemma 3's
    sliding-window layers cannot run multi-turn rollouts, so it is refused before anything is written."""
    from grpokit.models.vision import load_processor
    from grpokit.rollout.tools import ToolBox, check_tool_template

    assert main(["tiny-model", str(tmp_path / "g"), "--arch", "gemma3", "--tools"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error: --tools: multi-turn rollouts need full attention") and not (tmp_path / "g").exists()
    assert main(["tiny-model", str(tmp_path / "q"), "--arch", "qwen2_vl", "--tools"]) == 0
    processor = load_processor(tmp_path / "q")

    def look(n: int) -> str:
        """Look.

        Args:
            n: what
        """
        return str(n)

    check_tool_template(processor.tokenizer, ToolBox([look]))  # shows the tools, renders results, reads calls back
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                           "text": "hi"}]}],
                                         tokenize=False, add_generation_prompt=True, tools=ToolBox([look]).schemas)
    assert text.startswith("tools: look\n") and "<|image_pad|>" in text
    assert len(processor.tokenizer("<tool_call>", add_special_tokens=False)["input_ids"]) == 1


@pytest.mark.parametrize("arch", TINY_VLM_ARCHS)
def test_freezing_the_vision_tower_keeps_the_decoder_trainable(arch):
    model, _ = build_tiny_vlm(arch=arch, hidden_size=32, num_layers=1)
    frozen = freeze_vision_tower(model)
    assert frozen == sum(p.numel() for p in vision_tower(model).parameters()) > 0
    assert not any(p.requires_grad for p in vision_tower(model).parameters())
    assert model.get_output_embeddings().weight.requires_grad
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) > 0


def test_unknown_arch_is_named():
    with pytest.raises(ValueError, match="'llava'.*qwen2_vl"):
        build_tiny_vlm(arch="llava")


def test_build_is_deterministic():
    a, _ = build_tiny_vlm(arch="qwen2_vl", hidden_size=32, num_layers=1, seed=5)
    b, _ = build_tiny_vlm(arch="qwen2_vl", hidden_size=32, num_layers=1, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))

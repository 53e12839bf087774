"""Tool results with images (TRL's multimodal tool responses) for vision-language models.

A random tiny model emits no tool-call syntax, so, as tests/test_multiturn.py does, a turn ends at any digit
(frequent under a random character model) and every turn "calls" the tool. The rendering is the real one:
the processor's chat template and image encoding (`rollout.vision.ToolImages`). What is checked: the sampled
log-probs equal the trainer's recompute of [prompt | completion] with every image of the answer (the prompt's,
then each result's) to float tolerance, for Qwen2-VL (3-D positions continue past a result's image) and
Idefics3; the images reach the model (another image, other log-probs); a text model is told it reads text only.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

from grpokit.models.forward import ForwardOptions
from grpokit.models.media import PromptImages, RowMedia
from grpokit.models.tiny_vision import build_tiny_vlm
from grpokit.models.vision import encode_image_prompt
from grpokit.models.vision_forward import vision_completion_logprobs
from grpokit.rollout.multiturn import sample_conversations
from grpokit.rollout.request import RolloutRequest, SamplingParams
from grpokit.rollout.tool_output import content_parts, is_content_blocks
from grpokit.rollout.tools import ToolBox, ToolCall, ToolResult
from grpokit.rollout.vision import ToolImages


def look(n: int) -> list:
    """Show an image of n.

    Args:
        n: what to draw
    """
    return [{"type": "text", "text": f"image {n}:"},
            {"type": "image", "image": Image.new("RGB", (16, 16), (200, 30, 30))}]


@pytest.fixture(scope="module", params=["qwen2_vl", "idefics3"])
def vlm(request):
    model, processor = build_tiny_vlm(None, arch=request.param, hidden_size=32, num_layers=1, seed=0, tools=True)
    return request.param, model.eval(), processor


def _prompts(arch, processor, n=2):
    ids, images = [], []
    for k in range(n):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"what {k}?"}]}]
        p, encoded = encode_image_prompt(processor, messages, [Image.new("RGB", (32, 32), (20, 40 * k, 200))], arch)
        ids.append(p)
        images.append(encoded)
    return ids, images


def _sample(vlm, *, seed=0, temperature=1.0, group_size=3, budget=120, render=True, with_prompt_images=True):
    arch, model, processor = vlm
    tok = processor.tokenizer
    ids, images = _prompts(arch, processor)
    digits = [tok.convert_tokens_to_ids(d) for d in "0123456789"]
    media = RowMedia(arch, tuple(images), int(model.config.image_token_id)) if with_prompt_images else None
    if not with_prompt_images:
        ids = [tok.encode("user: what?\nassistant: ", add_special_tokens=False)] * 2
    request = RolloutRequest(ids, group_size, SamplingParams(budget, tuple(digits), tok.pad_token_id, temperature),
                             torch.Generator().manual_seed(seed), tools=ToolBox([look]), media=media)
    return sample_conversations(
        model, request, tokenizer=tok, max_tool_turns=2,
        parse_calls=lambda text, **_: [ToolCall("look", {"n": len(text)})],
        render_results=ToolImages(processor, arch, int(model.config.image_token_id)) if render else None)


def _recompute(model, rollout):
    with torch.no_grad():
        logp, _ = vision_completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                             rollout.completion_mask, rollout.media,
                                             options=ForwardOptions(linear_head=False))
    return logp


@pytest.mark.parametrize("with_prompt_images", [True, False])
def test_sampled_log_probs_equal_the_recompute_with_every_image_of_the_answer(vlm, with_prompt_images):
    arch, model, processor = vlm
    rollout, stats = _sample(vlm, with_prompt_images=with_prompt_images)
    image_token = int(model.config.image_token_id)
    in_results = (rollout.completion_ids == image_token) & rollout.completion_mask.bool()
    assert in_results.any() and max(stats.turns) > 1 and sum(stats.failures) == 0
    assert (rollout.tool_mask.bool() | ~in_results).all()  # image tokens only ever in tool results (never sampled)
    results = [n for n in stats.calls]
    for i, row in enumerate(rollout.media.rows):  # one image per prompt (where given) and one per result run
        shown = int(in_results[i].any())
        assert row is not None and row.num_images == with_prompt_images + results[i] - (results[i] and not shown)
    logp = _recompute(model, rollout)
    action = rollout.action_mask.bool()
    torch.testing.assert_close(logp[action], rollout.logprobs[action], atol=1e-5, rtol=0)


def test_another_result_image_gives_other_log_probs(vlm):
    """The results' pixels reach the model: the same tokens scored with other pixels for the results' images
    (text prompts, so the tool's are the only images) get other log-probs."""
    _, model, _ = vlm
    rollout, _ = _sample(vlm, with_prompt_images=False)
    assert all(r is not None and r.num_images for r in rollout.media.rows)
    other = tuple(PromptImages({**r.tensors, "pixel_values": r.tensors["pixel_values"].flip(0) * 3 + 1}, r.num_images,
                               "other") for r in rollout.media.rows)
    before = _recompute(model, rollout)
    after = _recompute(model, dataclasses.replace(rollout, media=RowMedia(rollout.media.family, other,
                                                                          rollout.media.image_token_id)))
    action = rollout.action_mask.bool()
    assert (before[action] - after[action]).abs().max() > 1e-3


def test_a_text_render_makes_an_image_result_a_failed_call(vlm):
    rollout, stats = _sample(vlm, render=False)
    assert sum(stats.failures) == sum(stats.calls) > 0
    assert all("reads text only" in m["content"] for c in stats.conversations for m in c if m["role"] == "tool")


def test_content_blocks_are_read_as_trl_writes_them():
    red = Image.new("RGB", (4, 4), (255, 0, 0))
    parts = content_parts([{"type": "text", "text": "a"}, {"type": "image", "image": red}])
    assert [k for k, _ in parts] == ["text", "image"] and parts[1][1].tobytes() == red.tobytes()
    with pytest.raises(ValueError, match="content block 1 of the result is an image block whose \"image\" is str"):
        content_parts([{"type": "text", "text": "a"}, {"type": "image", "image": "a.png"}])
    with pytest.raises(ValueError, match="content block 0 .*got type 'audio' with keys \\['audio', 'type'\\]"):
        content_parts([{"type": "audio", "audio": b""}])
    assert not is_content_blocks([{"type": "hit", "url": "x"}])  # a list of the tool's own records: shown as text
    with pytest.raises(ValueError, match="max_result_chars = 3"):
        content_parts([{"type": "text", "text": "abcd"}], limit=3)
    result = ToolResult("t", "a", False, None, parts)
    assert result.message()["content"] == [{"type": "text", "text": "a"}, {"type": "image"}]
    assert "and why not" in result.unshown("why not").content and not ToolResult("t", "a", False).unshown("x").failed
    box = ToolBox([look])
    (got,) = box.run([ToolCall("look", {"n": 3})])
    assert not got.failed and got.content == "image 3:" and len(got.images) == 1

    def hits(q: str) -> list:
        """Search.

        Args:
            q: what
        """
        return [{"type": "hit", "title": q}]

    (shown,) = ToolBox([hits]).run([ToolCall("hits", {"q": "a"})])
    assert not shown.failed and shown.content == "[{'type': 'hit', 'title': 'a'}]" and not shown.parts


def _eager_turns(monkeypatch):
    """Scripted format hooks for `train`: every third decode step ends the turn for every row (EOS, with its
    log-prob under the same distribution, so the trainer's recompute still matches) and every turn calls `look`."""
    import grpokit.rollout.multiturn as multiturn

    real, steps = multiturn.sample_tokens, [0]

    def sample(logits, **kwargs):
        tokens, logps = real(logits, **kwargs)
        steps[0] += 1
        if steps[0] % 3:
            return tokens, logps
        eos = torch.full_like(tokens, multiturn_eos[0])
        z = logits.float() / (kwargs["temperature"] or 1.0)
        return eos, z.gather(1, eos[:, None])[:, 0] - z.logsumexp(-1)

    multiturn_eos = [None]
    monkeypatch.setattr(multiturn, "sample_tokens", sample)
    monkeypatch.setattr(multiturn, "call_parser", lambda tokenizer: multiturn_eos.__setitem__(0, tokenizer.eos_token_id)
                        or (lambda text, **_: [ToolCall("look", {"n": len(text)})]))


def saw_image(completions, **kwargs):
    """1 for answers whose conversation holds the tool's result."""
    return [float(any(m["role"] == "tool" for m in c)) for c in completions]


@pytest.mark.parametrize(("arch", "prompt_images", "isolation"), [
    ("qwen2_vl", True, "none"), ("qwen2_vl", False, "none"), ("idefics3", True, "none"), ("idefics3", False, "none"),
    ("qwen2_vl", True, "process")])
def test_a_vlm_trains_with_a_tool_that_returns_images(tmp_path, monkeypatch, arch, prompt_images, isolation):
    """`train` end to end: the tool's images reach sampler and trainer alike (the log-prob gap stays at float
    noise), completions.jsonl names every image of each answer (the prompt's, then the results'), thumbnails
    are kept. With tools.isolation = "process" the images come back from the tool's worker process."""
    import json

    from conftest import make_config
    from grpokit import train
    from grpokit.config.schema import ToolsConfig

    _eager_turns(monkeypatch)
    folder = tmp_path / "model"
    build_tiny_vlm(folder, arch=arch, hidden_size=32, num_layers=1, seed=1, tools=True)
    rows = [{"prompt": [{"role": "user", "content": "what?"}], "answer": str(k)} for k in range(4)]
    if prompt_images:
        rows = [{**r, "image": Image.new("RGB", (32, 32), (60 * k, 20, 200))} for k, r in enumerate(rows)]
    config = make_config(folder, tmp_path / "run", steps=2, prompts_per_step=2, max_new_tokens=80,
                         learning_rate=1e-2, output={"completions_every": 1},
                         algorithm={"is_correction": "token_truncate"})
    config = dataclasses.replace(config, tools=ToolsConfig(max_calls=2, isolation=isolation, workers=1))
    run = train(config, rows=rows, tools=[look], reward_functions=[saw_image])
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["tools/call_frequency"] > 0 for m in metrics)
    assert all(m["tools/failure_frequency"] == 0 for m in metrics)
    assert all(m["sampling/logprob_gap_max"] < 1e-4 for m in metrics)
    records = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    counts = [len(r.get("images") or []) for r in records]
    assert max(counts) >= 1 + prompt_images  # the prompt's image (where given) and at least one result's
    thumbnails = {p.stem for p in (run / "images").glob("*.png")}
    assert {i["sha256"] for r in records for i in r.get("images") or []} <= thumbnails


def _one_tool(result):
    def probe(n: int):
        """Probe.

        Args:
            n: what
        """
        return result

    return ToolBox([probe])


def _converse(vlm, box, *, render=None, history=None, with_prompt_images=True):
    arch, model, processor = vlm
    tok = processor.tokenizer
    ids, media = [tok.encode("user: what?\nassistant: ", add_special_tokens=False)] * 2, None
    if with_prompt_images:
        ids, images = _prompts(arch, processor)
        media = RowMedia(arch, tuple(images), int(model.config.image_token_id))
    digits = [tok.convert_tokens_to_ids(d) for d in "0123456789"]
    budget = 700  # room for an error's text after the first turn (a character each)
    request = RolloutRequest(ids, 2, SamplingParams(budget, tuple(digits), tok.pad_token_id),
                             torch.Generator().manual_seed(0), tools=box, history=history, media=media)
    return sample_conversations(
        model, request, tokenizer=tok, max_tool_turns=1,
        parse_calls=lambda text, **_: [ToolCall("probe", {"n": 1})],
        render_results=render or ToolImages(processor, arch, int(model.config.image_token_id)).check())


@pytest.mark.parametrize("size", [(0, 0), (2, 600)])
def test_an_image_the_processor_refuses_is_a_failed_call_not_a_crash(vlm, size):
    """A 0x0 image (any family) or one of aspect ratio 300 (Qwen2-VL's processor refuses past 200)."""
    arch, model, processor = vlm
    if size == (2, 600) and arch != "qwen2_vl":
        pytest.skip("Idefics3's processor encodes it")
    rollout, stats = _converse(vlm, _one_tool([{"type": "image", "image": Image.new("RGB", size)}]))
    shown = [m["content"] for c in stats.conversations for m in c if m["role"] == "tool"]
    assert shown and all("the processor could not encode it" in m for m in shown) and sum(stats.failures) == len(shown)
    assert not ((rollout.completion_ids == int(model.config.image_token_id)) & rollout.completion_mask.bool()).any()


def test_the_placeholders_string_in_a_tools_text_is_escaped_not_an_image_token(vlm):
    """A result whose text holds the image placeholder's own string (`<|image_pad|>`, `<image>`: HTML or SVG can)
    is shown as text: no image token without pixels behind it, and the trainer's recompute still matches."""
    arch, model, processor = vlm
    image_token = int(model.config.image_token_id)
    text = processor.tokenizer.convert_ids_to_tokens(image_token)
    rollout, stats = _converse(vlm, _one_tool(f"the page says {text} and {text}"))
    assert sum(stats.calls) > 0 and sum(stats.failures) == 0
    in_completions = (rollout.completion_ids == image_token) & rollout.completion_mask.bool()
    assert not in_completions.any()
    logp = _recompute(model, rollout)
    action = rollout.action_mask.bool()
    torch.testing.assert_close(logp[action], rollout.logprobs[action], atol=1e-5, rtol=0)


def test_a_template_without_images_in_tool_messages_runs_text_tools_and_fails_image_results(vlm):
    """A VLM whose chat template writes a tool message's content as text (many real ones do): `check` does not
    refuse the run; text results render as ever, and a result with images is a failed call naming the template."""
    from grpokit.models.tiny import TOOL_CHAT_TEMPLATE

    arch, model, processor = vlm
    saved = processor.chat_template
    processor.chat_template = TOOL_CHAT_TEMPLATE
    try:
        render = ToolImages(processor, arch, int(model.config.image_token_id)).check()
        assert not render.shows_images and "renders no image in a tool message" in render.no_images
        _, stats = _converse(vlm, _one_tool("42"), render=render, with_prompt_images=False)
        assert sum(stats.calls) > 0 and sum(stats.failures) == 0
        _, stats = _converse(vlm, _one_tool(look(1)), render=render, with_prompt_images=False)
        shown = [m["content"] for c in stats.conversations for m in c if m["role"] == "tool"]
        assert shown and all("renders no image in a tool message" in m for m in shown)
    finally:
        processor.chat_template = saved


def test_split_history_with_a_vlm_and_text_prompts_runs_and_fails_image_results(vlm):
    """tools.history = "split" on a VLM with text rows (it trained before tools could return images): it still
    samples; a result with images is a failed call saying split does not show them."""
    from grpokit.rollout.history import conversation_history

    arch, model, processor = vlm
    rows = [{"prompt": [{"role": "user", "content": "what?"}]}] * 2
    for result, failing in (("42", False), (look(1), True)):
        box = _one_tool(result)
        history = conversation_history(processor.tokenizer, rows, 2, box, None)
        _, stats = _converse(vlm, box, history=history, with_prompt_images=False)
        shown = [m["content"] for c in stats.conversations for m in c if m["role"] == "tool"]
        assert shown and all(('tools.history = \\"split\\" does not show tool images' in m) == failing for m in shown)


def test_idefics3_image_splitting_counts_crops_without_breaking_the_checks():
    """SmolVLM's processors split an image into crops (its `num_images` counts them): the start-up check still sees
    the template show tool images, and a prompt with one split image still goes to vLLM as one image."""
    from grpokit.data.images import image_ref
    from grpokit.rollout.vllm.engine import _request

    model, processor = build_tiny_vlm(None, arch="idefics3", hidden_size=32, num_layers=1, seed=0, tools=True)
    processor.image_processor.do_image_splitting, processor.image_processor.size = True, {"longest_edge": 96}
    assert ToolImages(processor, "idefics3", int(model.config.image_token_id)).check().shows_images
    image = Image.new("RGB", (300, 200), (1, 2, 3))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    ids, encoded = encode_image_prompt(processor, messages, [image], "idefics3")
    assert encoded.num_images > 1  # crops
    request = _request(ids, dataclasses.replace(encoded, sources=(image_ref(image),)))
    assert len(request["multi_modal_data"]["image"]) == 1

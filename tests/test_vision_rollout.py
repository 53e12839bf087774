"""Sampling with images: the sampler's log-probs equal the scoring forward's, and image tokens are never drawn.

For both families the KV-cached decode (one prefill with pixels per prompt, the cache repeated over the
group, Qwen2-VL's rope deltas carried into the decode positions) must give the very log-probs that a full
recompute by `completion_logprobs(..., media=...)` gives on the sampled tokens: that is what makes the
on-policy ratio 1. Prompts differ in length (left padding) and, for Qwen2-VL, in image count and size.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from grpokit.data.images import with_image_placeholders
from grpokit.models.forward import ForwardOptions, completion_logprobs
from grpokit.models.media import PromptImages, RowMedia
from grpokit.models.tiny_vision import build_tiny_vlm
from grpokit.models.vision import encode_image_prompt, vision_family
from grpokit.rollout.batch import concat_rollouts
from grpokit.rollout.decode import DecodeSpeed, sample_groups
from grpokit.rollout.request import RolloutRequest, SamplingParams
from grpokit.rollout.sampling import sample_tokens

G, TEMPERATURE = 3, 0.8


def _image(color, size):
    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 3):
        image.putpixel((x, x % size[1]), (255 - color[0], 40, 200))
    return image


def _rows(arch):
    if arch == "qwen2_vl":
        return [{"prompt": [{"role": "user", "content": "how many?"}], "images": [_image((200, 10, 10), (20, 28))]},
                {"prompt": [{"role": "user", "content": "which one is bigger"}],
                 "images": [_image((10, 200, 10), (32, 32)), _image((10, 10, 200), (32, 16))]},
                {"prompt": [{"role": "user", "content": "no"}], "images": [_image((90, 90, 10), (16, 16))]}]
    return [{"prompt": [{"role": "user", "content": "how many?"}], "images": [_image((200, 10, 10), (32, 32))]},
            {"prompt": [{"role": "user", "content": "what shape is it"}], "images": [_image((10, 200, 10), (32, 32))]}]


def _encode(processor, family, rows):
    encoded = [encode_image_prompt(processor, with_image_placeholders(r["prompt"], len(r["images"]), index=i),
                                   r["images"], family) for i, r in enumerate(rows)]
    return [e[0] for e in encoded], tuple(e[1] for e in encoded)


@pytest.fixture(scope="module", params=["qwen2_vl", "idefics3", "gemma3"])
def vlm(request):
    model, processor = build_tiny_vlm(arch=request.param, seed=4)
    model.eval()
    with torch.no_grad():  # sharper than the 0.02 init, so that a wrong position or pixel shows
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(5.0)
    family = vision_family(model.config)
    ids, images = _encode(processor, family, _rows(request.param))
    return model, processor, ids, RowMedia(family, images, model.config.image_token_id)


def _sample(model, processor, ids, media, share_prefill=True, **sampling):
    sampling = {"max_new_tokens": 12, "pad_token_id": processor.tokenizer.pad_token_id, "temperature": TEMPERATURE,
                **sampling}
    request = RolloutRequest(ids, G, SamplingParams(**sampling), torch.Generator().manual_seed(0), media=media)
    return sample_groups(model, request, speed=DecodeSpeed(share_prefill=share_prefill))


@pytest.mark.parametrize("share_prefill", [True, False])
def test_sampled_logprobs_equal_the_scoring_forward(vlm, share_prefill):
    model, processor, ids, media = vlm
    rollout = _sample(model, processor, ids, media, share_prefill=share_prefill)
    assert rollout.media is not None and len(rollout.media) == len(ids) * G
    assert rollout.media.rows[G] is media.rows[1]  # each answer carries its own prompt's images, not a copy
    with torch.no_grad():
        for linear_head in (True, False):
            logp, _ = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                          rollout.completion_mask, temperature=TEMPERATURE, media=rollout.media,
                                          options=ForwardOptions(linear_head=linear_head))
            m = rollout.completion_mask.bool()
            torch.testing.assert_close(rollout.logprobs[m], logp[m], atol=1e-5, rtol=0)
    assert rollout.logprobs[m].std() > 0.1  # the distribution is not flat: a wrong position would show
    assert rollout.completion_mask.sum() == rollout.completion_mask.numel()  # no EOS: 12 tokens each


def test_the_images_steer_the_samples(vlm):
    """Other pixels, other log-probs of the same tokens: the decode sees the prefill's image features."""
    model, processor, ids, media = vlm
    rollout = _sample(model, processor, ids, media)
    turned = [{**r, "images": [im.transpose(Image.Transpose.ROTATE_180) for im in r["images"]]}
              for r in _rows(media.family)]
    same_ids, images = _encode(processor, media.family, turned)
    assert same_ids == ids
    shuffled = RowMedia(media.family, images, media.image_token_id)
    with torch.no_grad():
        other, _ = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                       rollout.completion_mask, temperature=TEMPERATURE,
                                       media=shuffled.repeat_interleave(G))
    assert (other - rollout.logprobs)[rollout.completion_mask.bool()].abs().max() > 1e-3


@pytest.mark.parametrize("temperature,top_k", [(TEMPERATURE, 0), (TEMPERATURE, 5), (0.0, 0)])
def test_image_tokens_are_never_sampled(vlm, temperature, top_k):
    """With the image placeholder made the likeliest token by far, it is still never drawn, and the reported
    log-prob is that of the unmasked distribution (the trainer's recompute, here through the model's logits)."""
    model, processor, ids, media = vlm
    image_id = model.config.image_token_id
    boost = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: out.index_add(-1, torch.tensor([image_id]), torch.full((*out.shape[:-1], 1), 30.0)))
    try:
        rollout = _sample(model, processor, ids, media, temperature=temperature, top_k=top_k)
        with torch.no_grad():
            logp, _ = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                          rollout.completion_mask, temperature=temperature or 1.0,
                                          media=rollout.media, options=ForwardOptions(linear_head=False))
        text_only = sample_groups(model, RolloutRequest(  # no media: no suppression
            ids[:1], 2, SamplingParams(4, pad_token_id=processor.tokenizer.pad_token_id, temperature=TEMPERATURE),
            torch.Generator().manual_seed(0)))
    finally:
        boost.remove()
    m = rollout.completion_mask.bool()
    assert not (rollout.completion_ids[m] == image_id).any()
    assert (text_only.completion_ids == image_id).float().mean() > 0.9  # the boost works: without media it wins
    torch.testing.assert_close(rollout.logprobs[m], logp[m], atol=1e-4, rtol=0)
    assert rollout.logprobs[m].max() < -10  # the unmasked distribution's: the image token holds nearly all mass


def test_suppressed_sampling_reports_unmasked_logprobs():
    """sample_tokens with `suppress`: hand-checked on 3 tokens, the suppressed one most likely."""
    logits = torch.tensor([[0.0, 2.0, 0.0]]).repeat(2000, 1)
    tokens, logp = sample_tokens(logits, temperature=1.0, suppress=torch.tensor([1]),
                                 generator=torch.Generator().manual_seed(0))
    assert not (tokens == 1).any() and 0.4 < (tokens == 0).float().mean() < 0.6
    expected = -torch.tensor([0.0, 2.0, 0.0]).logsumexp(0)  # log(1 / (2 + e^2)), not log(1/2)
    torch.testing.assert_close(logp, expected.expand(2000))


def test_rollouts_with_images_concat_and_select(vlm):
    """concat_rollouts and Draw.select keep each answer's images with it."""
    from grpokit.rollout.grading import Draw

    model, processor, ids, media = vlm
    a = _sample(model, processor, ids[:1], media.select([0]), max_new_tokens=3)
    b = _sample(model, processor, ids[1:], media.select(slice(1, None)), max_new_tokens=5)
    both = concat_rollouts([a, b], processor.tokenizer.pad_token_id)
    assert both.media.rows == a.media.rows + b.media.rows
    n = both.num_sequences
    draw = Draw(both, torch.zeros(n, 1), torch.zeros(n), [None] * n, [""] * n)
    keep = torch.zeros(n, dtype=torch.bool)
    keep[[0, G + 1]] = True
    picked = draw.select(keep).rollout
    assert picked.media.rows == (media.rows[0], media.rows[1])
    with torch.no_grad():  # the selected rows still score to their sampled log-probs
        logp, _ = completion_logprobs(model, picked.prompt_ids, picked.prompt_mask, picked.completion_ids,
                                      picked.completion_mask, temperature=TEMPERATURE, media=picked.media)
    m = picked.completion_mask.bool()
    torch.testing.assert_close(picked.logprobs[m], logp[m], atol=1e-5, rtol=0)


def test_media_rows_must_match_the_prompts(vlm):
    model, processor, ids, media = vlm
    with pytest.raises(ValueError, match="media has 1 rows for"):
        _sample(model, processor, ids, media.select([0]))


def test_the_shared_prompt_forward_equals_every_row_whole_in_values_and_gradients(vlm):
    """`train.shared_prompt_forward` with images: each distinct (prompt, images) runs once with its pixels and its
    cache is repeated over its answers. Two prompts with the same text but other images must not share (the
    shapes task's prompts are one sentence): the same log-probs and parameter gradients as running every row
    whole, and for the families with full attention the shared path ran (Gemma 3's sliding layers: it falls
    back)."""
    from grpokit.models.forward import _shared_prompt_hidden

    model, processor, ids, media = vlm
    same_text = [ids[0], ids[0]]  # one prompt's ids, two images
    first = media.rows[0]
    other = PromptImages({k: v.flip(-1) if k == "pixel_values" else v for k, v in first.tensors.items()},
                         first.num_images, "flipped")  # other pixels, the same image tokens
    two = RowMedia(media.family, (first, other), media.image_token_id)
    rollout = _sample(model, processor, same_text, two)
    args = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    results = []
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        logp, _ = completion_logprobs(model, *args, temperature=TEMPERATURE, media=rollout.media,
                                      options=ForwardOptions(share_prompts=share))
        (logp * rollout.completion_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logp.detach(), grads))
    model.zero_grad(set_to_none=True)
    (shared, g_shared), (whole, g_whole) = results
    torch.testing.assert_close(shared, whole, atol=1e-5, rtol=0)
    assert g_shared.keys() == g_whole.keys() and g_shared
    for name in g_shared:
        torch.testing.assert_close(g_shared[name], g_whole[name], atol=1e-4, rtol=1e-4, msg=name)
    assert not torch.allclose(whole[0], whole[G], atol=1e-4)  # the two images give other log-probs
    with torch.no_grad():
        ran = _shared_prompt_hidden(model, *args, rollout.media)
    assert (ran is None) == (media.family == "gemma3")

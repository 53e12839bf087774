"""Vision-language scoring against TRL 1.16's own GRPOTrainer code, on tiny VLMs of three families.

TRL's side is executed, not retyped: its `prepare_multimodal_messages` and `apply_chat_template`
render the prompts, the processor encodes the whole batch at once as TRL's
`_generate_and_score_completions` does (`mm_token_type_ids` / Gemma 3's `token_type_ids` extended with
zeros over the completions, `num_images` per row), its `add_fused_lm_head` patches the model, and
`GRPOTrainer._get_per_token_logps_and_entropies` / `_compute_loss` run on a stand-in `self`
(tests/test_trl_parity.py's). grpokit's side encodes each prompt alone (`encode_image_prompt`),
carries the pixels per row in `RowMedia` and scores with `completion_logprobs(..., media=...)`.

Idefics3 and Gemma 3 prompts are of equal length here: TRL passes no position ids and their decoders number left
padding as positions, which grpokit (and generation) do not; for Qwen2-VL the model's multimodal
RoPE skips padding in both, so its prompts differ in length and image count.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

pytest.importorskip("trl")
grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
from PIL import Image  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402
from trl.data_utils import apply_chat_template, prepare_multimodal_messages  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from grpokit.algorithms.objectives import Accumulation, LossSpec, policy_loss  # noqa: E402
from grpokit.data.images import with_image_placeholders  # noqa: E402
from grpokit.models.forward import ForwardOptions, completion_logprobs  # noqa: E402
from grpokit.models.media import RowMedia  # noqa: E402
from grpokit.models.tiny_vision import build_tiny_vlm  # noqa: E402
from grpokit.models.vision import encode_image_prompt, load_processor, vision_family  # noqa: E402
from grpokit.rollout.batch import left_pad  # noqa: E402
from test_trl_parity import EPS, EPS_HIGH, _fake_trainer  # noqa: E402

G, T, TEMPERATURE = 2, 6, 0.7


def _image(color, size):
    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 3):  # some structure, so that the patches differ
        image.putpixel((x, x % size[1]), (255 - color[0], 40, 200))
    return image


def _rows(arch):
    if arch == "qwen2_vl":  # unequal text, image counts and sizes -> left padding, several grids
        return [{"prompt": [{"role": "user", "content": "how many?"}], "images": [_image((200, 10, 10), (20, 28))]},
                {"prompt": [{"role": "user", "content": [{"type": "text", "text": "which is bigger"},
                                                         {"type": "image"}, {"type": "image"}]}],
                 "images": [_image((10, 200, 10), (32, 32)), _image((10, 10, 200), (32, 16))]}]
    return [{"prompt": [{"role": "user", "content": "how many?"}], "images": [_image((200, 10, 10), (32, 32))]},
            {"prompt": [{"role": "user", "content": "what shape"}], "images": [_image((10, 200, 10), (32, 32))]}]


@pytest.fixture(scope="module", params=["qwen2_vl", "idefics3", "gemma3"])
def vlm(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_tiny_vlm(path, arch=request.param, seed=3)

    def load():
        model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():  # sharper than the 0.02 init, so that a wrong pixel or position shows
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(6.0)
        return model

    return request.param, load_processor(path), load


def _completions(vocab_ids, seed):
    gen = torch.Generator().manual_seed(seed)
    n = 2 * G
    ids = vocab_ids[torch.randint(len(vocab_ids), (n, T), generator=gen)]  # [N, T] text tokens only
    lengths = torch.tensor([T, 3, 5, 1])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # [N, T]
    return ids.masked_fill(mask == 0, 0), mask


def _trl_side(arch, processor, model, rows, completion_ids, completion_mask):
    """TRL's batch layout and its per-token log-probs / entropies for these rows (each repeated G times)."""
    prompts = [prepare_multimodal_messages(r["prompt"], images=r["images"]) for r in rows for _ in range(G)]
    images = [r["images"] for r in rows for _ in range(G)]
    texts = [apply_chat_template({"prompt": p}, processor)["prompt"] for p in prompts]
    encoded = processor(images=images, text=texts, padding=True, return_tensors="pt")
    forward_kwargs = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask")}
    for key in ("mm_token_type_ids", "token_type_ids"):  # Qwen2-VL's, Gemma 3's: zeros over the completions
        if key in forward_kwargs:
            forward_kwargs[key] = torch.cat([forward_kwargs[key], torch.zeros_like(completion_ids)], dim=1)
    num_images = [len(i) for i in images]
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    fake = _fake_trainer("dapo", "token", 0.0, None)
    fake.accelerator.autocast = contextlib.nullcontext
    fake.accelerator.is_main_process = True
    fake._get_per_token_logps_and_entropies = functools.partial(
        grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies, fake)
    inputs = {"prompt_ids": encoded["input_ids"], "prompt_mask": encoded["attention_mask"],
              "completion_ids": completion_ids, "completion_mask": completion_mask, "num_images": num_images,
              **forward_kwargs}
    ids = torch.cat([inputs["prompt_ids"], completion_ids], 1)
    mask = torch.cat([inputs["prompt_mask"], completion_mask], 1)
    logp, entropy, _ = fake._get_per_token_logps_and_entropies(
        model, ids, mask, T, batch_size=3, compute_entropy=True, num_images=num_images,  # micro-batches of 3 rows
        **forward_kwargs)
    return fake, inputs, logp, entropy


def _grpokit_side(arch, processor, model, rows, completion_ids, completion_mask, **kwargs):
    family = vision_family(model.config)
    encoded = [encode_image_prompt(processor, with_image_placeholders(r["prompt"], len(r["images"]), index=i),
                                   r["images"], family) for i, r in enumerate(rows)]
    ids, mask = left_pad([e[0] for e in encoded], processor.tokenizer.pad_token_id, "cpu")  # [B, P]
    media = RowMedia(family, tuple(e[1] for e in encoded), model.config.image_token_id).repeat_interleave(G)
    return ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), media, completion_logprobs(
        model, ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), completion_ids, completion_mask,
        temperature=TEMPERATURE, with_entropy=True, media=media, **kwargs)


def _text_ids(processor):
    return torch.tensor(processor.tokenizer("abcdefghij0123456789 +=?", add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("fused", [True, False])
def test_logprobs_and_entropy_match_trl(vlm, fused):
    arch, processor, load = vlm
    rows = _rows(arch)
    completion_ids, completion_mask = _completions(_text_ids(processor), seed=1)
    _, trl_inputs, trl_logp, trl_entropy = _trl_side(arch, processor, load(), rows, completion_ids, completion_mask)
    prompt_ids, prompt_mask, _, (logp, entropy) = _grpokit_side(
        arch, processor, load(), rows, completion_ids, completion_mask, options=ForwardOptions(fused=fused))
    assert torch.equal(prompt_ids, trl_inputs["prompt_ids"])  # the same tokens, image tokens expanded alike
    m = completion_mask.bool()
    torch.testing.assert_close(logp[m], trl_logp[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[m], trl_entropy[m], atol=1e-5, rtol=0)
    assert logp[m].std() > 0.1  # not a flat distribution: the comparison can fail


def test_images_change_the_logprobs(vlm):
    """The pixels reach the decoder: other images, other log-probs (guards the parity test above)."""
    arch, processor, load = vlm
    model, rows = load(), _rows(arch)
    completion_ids, completion_mask = _completions(_text_ids(processor), seed=1)
    *_, (logp, _) = _grpokit_side(arch, processor, model, rows, completion_ids, completion_mask)
    swapped = [{**r, "images": [im.transpose(Image.Transpose.ROTATE_180) for im in r["images"]]} for r in rows]
    *_, (other, _) = _grpokit_side(arch, processor, model, swapped, completion_ids, completion_mask)
    assert (logp - other)[completion_mask.bool()].abs().max() > 1e-3


def test_loss_and_gradient_match_trl(vlm):
    """TRL's `_compute_loss` on the VLM batch equals grpokit's log-probs through `policy_loss`, and so do the
    gradients of the decoder's weights."""
    arch, processor, load = vlm
    rows = _rows(arch)
    completion_ids, completion_mask = _completions(_text_ids(processor), seed=2)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    trl_model = load()
    fake, inputs, _, _ = _trl_side(arch, processor, trl_model, rows, completion_ids, completion_mask)
    fake.epsilon_high = EPS_HIGH
    inputs = {**inputs, "advantages": advantages, "num_items_in_batch": completion_mask.sum()}
    trl_loss = grpo_trainer.GRPOTrainer._compute_loss(fake, trl_model, inputs)
    trl_loss.backward()

    model = load()
    *_, (logp, _) = _grpokit_side(arch, processor, model, rows, completion_ids, completion_mask)
    loss, _ = policy_loss(logp, None, advantages, completion_mask,
                          LossSpec(epsilon=EPS, epsilon_high=EPS_HIGH, loss_type="dapo"),
                          accumulation=Accumulation(completion_mask.sum()))
    loss.backward()
    assert abs(loss.item() - trl_loss.item()) < 1e-5
    head, trl_head = model.get_output_embeddings().weight, trl_model.get_output_embeddings().weight
    torch.testing.assert_close(head.grad, trl_head.grad, atol=1e-5, rtol=1e-4)
    assert head.grad.abs().sum() > 0

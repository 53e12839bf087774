"""`train.optimizer_state_dtype = "bfloat16"`: AdamW's moments stored in bfloat16 with stochastic
rounding. The rounding is unbiased and lands on a neighbour; one step is torch's AdamW to bfloat16
precision; over many steps the second moment keeps moving where round-to-nearest would freeze it and the
trajectory follows fp32 AdamW's; the state takes 4 bytes a parameter; a resumed optimizer continues
bit for bit; the in-backward optimizer gives the same weights; FSDP is refused."""

from __future__ import annotations

import io

import pytest
import torch

from conftest import make_config, parity
from grpokit.errors import ConfigError
from grpokit.training.low_precision_state import AdamWBF16State, round_stochastic
from grpokit.training.optimizer import AdamWInBackward, build_optimizer


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    x = torch.full((200_000,), 1.0 + 3 * 2**-10)  # 3/8 of the way from 1 to the next bfloat16 (1 + 2^-7)
    r = round_stochastic(x, torch.Generator().manual_seed(0)).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert (r == 1.0 + 2**-7).float().mean().item() == pytest.approx(3 / 8, abs=0.005)
    assert r.mean().item() == pytest.approx(x[0].item(), rel=1e-5)
    neg = round_stochastic(-x, torch.Generator().manual_seed(0)).float()
    assert torch.equal(neg, -r)  # the magnitude rounds the same way
    exact = torch.tensor([0.0, 1.5, -2.0, float("inf"), -float("inf")])
    assert torch.equal(round_stochastic(exact, torch.Generator()).float(), exact)
    assert round_stochastic(torch.tensor([float("nan"), 3.0e38]), torch.Generator()).float()[0].isnan()


def _pair(seed=0, n=(64, 33), **kw):
    torch.manual_seed(seed)
    a = torch.nn.Parameter(torch.randn(*n))
    b = torch.nn.Parameter(a.detach().clone())
    args = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1, **kw)
    return a, b, torch.optim.AdamW([a], **args), AdamWBF16State([b], seed=1, **args)


def test_one_step_is_adamw_to_bfloat16_precision():
    a, b, fp32, bf16 = _pair()
    g = torch.randn_like(a)
    for p, opt in ((a, fp32), (b, bf16)):
        p.grad = g.clone()
        opt.step()
    # the first update is computed from fp32 values in both (the zero moments are exact in bfloat16)
    torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=1e-7)
    st = bf16.state[b]
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
    torch.testing.assert_close(st["exp_avg"].float(), fp32.state[a]["exp_avg"], rtol=2**-7, atol=0)
    torch.testing.assert_close(st["exp_avg_sq"].float(), fp32.state[a]["exp_avg_sq"], rtol=2**-7, atol=0)
    assert sum(t.numel() * t.element_size() for k, t in st.items() if k != "step") == 4 * b.numel()


def test_the_second_moment_keeps_moving_and_the_trajectory_follows_fp32():
    """A constant gradient for 2000 steps: v -> g^2 (1 - 0.999^t), 0.86 g^2 at the end. Rounded to nearest,
    v stops growing once its 0.1% steps fall under half of bfloat16's spacing (near g^2 / 3); rounded
    stochastically it tracks fp32."""
    steps = 2000
    a, b, fp32, bf16 = _pair(n=(1024,))
    start = a.detach().clone()
    g = torch.rand(1024) + 0.5
    for _ in range(steps):
        for p, opt in ((a, fp32), (b, bf16)):
            p.grad = g.clone()
            opt.step()
    v32, v16 = fp32.state[a]["exp_avg_sq"], bf16.state[b]["exp_avg_sq"].float()
    assert (v16.mean() / v32.mean()).item() == pytest.approx(1.0, abs=0.01)
    nearest = torch.zeros(1024, dtype=torch.bfloat16)  # the same recursion rounded to nearest
    for _ in range(steps):
        nearest = (nearest.float() * 0.999 + 0.001 * g * g).to(torch.bfloat16)
    assert (nearest.float().mean() / v32.mean()).item() < 0.7  # what stochastic rounding avoids
    moved_fp32, moved_bf16 = a.detach() - start, b.detach() - start  # where the two trajectories went
    assert ((moved_bf16 - moved_fp32).norm() / moved_fp32.norm()).item() < 0.02  # measured: 1.0%


def test_a_resumed_optimizer_continues_bit_for_bit():
    torch.manual_seed(0)
    grads = [torch.randn(40, 7) for _ in range(4)]
    start = torch.randn(40, 7)

    def run(split: int | None):
        p = torch.nn.Parameter(start.clone())
        opt = AdamWBF16State([p], seed=3, lr=1e-2)
        for i, g in enumerate(grads):
            if i == split:  # save and reload into a fresh optimizer (through torch.save, as a checkpoint does)
                buf = io.BytesIO()
                torch.save(opt.state_dict(), buf)
                opt = AdamWBF16State([p], seed=3, lr=1e-2)
                opt.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
                assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
            p.grad = g.clone()
            opt.step()
        return p.detach()

    assert torch.equal(run(None), run(2))


def test_in_backward_gives_the_weights_of_the_default_path():
    torch.manual_seed(0)
    model_a, x = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)), torch.randn(8, 6)
    model_b = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    model_b.load_state_dict(model_a.state_dict())
    kw = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0, state_dtype="bfloat16", seed=4)
    default = build_optimizer(model_a.parameters(), in_backward=False, **kw)
    inside = build_optimizer(model_b.parameters(), in_backward=True, **kw)
    assert isinstance(default, AdamWBF16State) and isinstance(inside, AdamWInBackward)
    for _ in range(3):
        model_a(x).square().sum().backward()
        default.step()
        default.zero_grad()
        model_b(x).square().sum().backward()  # updated inside
        inside.finish_step()
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
    assert all(s["exp_avg_sq"].dtype == torch.bfloat16 for s in inside.state.values())


def test_a_run_with_bfloat16_state_trains_and_resumes_exactly(tiny_model_dir, tmp_path):
    """Two steps straight, or one step and a --resume for the second: the same weights, bit for bit,
    and the checkpoint's moments are bfloat16."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from grpokit.training.loop import train

    bf16 = {"optimizer_state_dtype": "bfloat16"}
    straight = train(make_config(tiny_model_dir, tmp_path / "a", steps=2, train=bf16), reward_functions=[parity])
    config = make_config(tiny_model_dir, tmp_path / "b", steps=1, train=bf16)
    train(config, reward_functions=[parity])
    resumed = train(replace(config, train=replace(config.train, steps=2)), reward_functions=[parity], resume=True)
    wa = load_file(straight / "checkpoint-2" / "model.safetensors")
    wb = load_file(resumed / "checkpoint-2" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    state = torch.load(resumed / "checkpoint-2" / "trainer_state.pt", weights_only=False)["optimizer"]
    moments = [s["exp_avg"] for s in state["state"].values()]
    assert moments and all(m.dtype == torch.bfloat16 for m in moments)


def test_bfloat16_state_with_fsdp_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="train.optimizer_state_dtype"):
        make_config(tiny_model_dir, tmp_path, model={"fsdp": True}, train={"optimizer_state_dtype": "bfloat16"})

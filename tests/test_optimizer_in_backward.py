"""`train.optimizer_in_backward`: AdamW's update of each parameter inside the backward, its gradient freed
at once. The weights and the optimizer state are the default path's (max_grad_norm = 0), with several
optimizer steps per batch, LoRA and activation checkpointing; no gradient is left after a backward;
checkpoints resume exactly, in either setting; a non-finite gradient never reaches a weight; and the
settings it cannot honour are one error naming it."""

from __future__ import annotations

import pytest
import torch

from conftest import comparable, make_config, parity
from grpokit.errors import ConfigError
from grpokit.observe.tracking import read_metrics
from grpokit.training.loop import train
from grpokit.training.optimizer import AdamWInBackward, build_optimizer, fused_kernel_applies


def run(tiny_model_dir, out, *, train_options=None, resume=False, **sections):
    config = make_config(tiny_model_dir, out, num_prompts=16, prompts_per_step=2, learning_rate=1e-2,
                         model={"device": "cpu", **sections.pop("model", {})},
                         train={"steps": 2, "max_grad_norm": 0.0, **(train_options or {})}, **sections)
    return train(config, reward_functions=[parity], resume=resume)


def state_of(run_dir, step):
    from safetensors.torch import load_file

    weights = load_file(str(run_dir / f"checkpoint-{step}" / "model.safetensors"))
    trainer = torch.load(run_dir / f"checkpoint-{step}" / "trainer_state.pt", weights_only=False)
    return weights, trainer["optimizer"]["state"]


def assert_same_state(a, b):
    (wa, sa), (wb, sb) = a, b
    assert wa.keys() == wb.keys() and sa.keys() == sb.keys() and sa
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-7, rtol=1e-6)
    for i in sa:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sb[i][k], sa[i][k], atol=1e-9, rtol=1e-6)


@pytest.mark.parametrize("options", [
    {"algorithm": {"num_iterations": 2}, "train_options": {"minibatch_size": 4}},  # 4 optimizer steps a batch
    {"model": {"lora": {"r": 4, "alpha": 8}}},
    {"train_options": {"gradient_checkpointing": True}},
    {"algorithm": {"beta": 0.04, "loss_type": "grpo"}},
])
def test_same_weights_and_optimizer_state_as_the_default_path(tiny_model_dir, tmp_path, options):
    train_options = options.get("train_options", {})
    rest = {k: v for k, v in options.items() if k != "train_options"}
    plain = run(tiny_model_dir, tmp_path / "plain", train_options=train_options, **rest)
    inside = run(tiny_model_dir, tmp_path / "inside", train_options={**train_options, "optimizer_in_backward": True},
                 **rest)
    assert_same_state(state_of(plain, 2), state_of(inside, 2))
    a, b = read_metrics(plain), read_metrics(inside)
    for ra, rb in zip(a, b):
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-5)
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5, abs=1e-7)


def test_no_gradient_is_left_after_the_backward_and_the_weights_moved():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    before = [p.detach().clone() for p in model.parameters()]
    opt = build_optimizer(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0, in_backward=True)
    alive = []
    model[0].weight.register_post_accumulate_grad_hook(  # runs after the optimizer's hook on this weight
        lambda p: alive.append(sum(q.grad is not None for q in model.parameters())))
    model(torch.randn(4, 8)).pow(2).sum().backward()
    norm, finite = opt.finish_step()
    assert finite and norm > 0
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert alive == [0]  # when the first layer's weight was done, no other gradient was held either


def test_a_non_finite_gradient_never_reaches_its_weight():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = AdamWInBackward([a, b], lr=0.1)
    (a.sum() * float("nan") + b.sum()).backward()
    _, finite = opt.finish_step()
    assert not finite and torch.equal(a.detach(), torch.ones(3)) and not torch.equal(b.detach(), torch.ones(3))
    assert a not in opt.state or not opt.state[a]  # its moments untouched too
    (a.sum() + b.sum()).backward()
    assert opt.finish_step()[1]  # the next step is whole again


def test_resume_is_exact_in_either_setting(tiny_model_dir, tmp_path):
    straight = run(tiny_model_dir, tmp_path / "straight", train_options={"steps": 3, "optimizer_in_backward": True})
    for first, second in ((True, True), (False, True), (True, False)):
        part = tmp_path / f"part-{first}-{second}"
        run(tiny_model_dir, part, train_options={"steps": 2, "optimizer_in_backward": first})
        resumed = run(tiny_model_dir, part, train_options={"steps": 3, "optimizer_in_backward": second}, resume=True)
        assert_same_state(state_of(straight, 3), state_of(resumed, 3))
        assert [r["loss"] for r in comparable(read_metrics(resumed))] == pytest.approx(
            [r["loss"] for r in comparable(read_metrics(straight))], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("train_options, says", [
    ({"max_grad_norm": 1.0}, r"train.optimizer_in_backward: .* set train.max_grad_norm = 0 \(now 1\)"),
    ({"max_grad_norm": 0.0, "micro_batch_size": 4}, r"train.optimizer_in_backward: needs the whole minibatch"),
])
def test_what_it_cannot_honour_is_one_config_error(tiny_model_dir, tmp_path, train_options, says):
    with pytest.raises(ConfigError, match=says):
        make_config(tiny_model_dir, tmp_path, prompts_per_step=2,
                    train={"optimizer_in_backward": True, **train_options})


def test_plain_cpu_parameters_get_the_fused_kernel_and_its_update_is_adamws():
    """torch runs AdamW's fused kernel on a CPU only when asked (`fused=True`); the update must be the
    default loop's to float rounding, in both settings, and a tensor subclass (FSDP2's DTensor) keeps the
    default."""
    torch.manual_seed(0)
    weights = [torch.randn(64, 32), torch.randn(32)]
    grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]
    results = {}
    for in_backward in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = build_optimizer(params, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1, in_backward=in_backward)
        singles = opt._single.values() if in_backward else [opt]
        assert all(o.param_groups[0]["fused"] for o in singles)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
                if in_backward:
                    opt._update(p)
            opt.step()
        results[in_backward] = [p.detach() for p in params]
    reference = [torch.nn.Parameter(w.clone()) for w in weights]
    default = torch.optim.AdamW(reference, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1)
    assert not default.param_groups[0]["fused"]
    for step in grads:
        for p, g in zip(reference, step):
            p.grad = g.clone()
        default.step()
    for got in results.values():
        for a, b in zip(got, reference):
            torch.testing.assert_close(a, b.detach(), atol=1e-7, rtol=1e-6)

    class Subclass(torch.Tensor):
        pass

    assert fused_kernel_applies([torch.nn.Parameter(torch.zeros(2)).as_subclass(Subclass)]) is None
    assert fused_kernel_applies([torch.zeros(2, dtype=torch.long)]) is None
    assert fused_kernel_applies([torch.nn.Parameter(torch.zeros(3, 2).t())]) is None  # its layout: not fused

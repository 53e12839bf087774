"""CPU linear layers through oneDNN. The decode on packed weights (`rollout.packed_weights`): the same
logits and samples as the plain path, the modules put back afterwards, the plain path wherever packing
does not apply. Training (`train.onednn_linear`): the same loss and gradients as aten's linear for
each loss shape, with and without activation checkpointing, and a run ends at the same weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grpokit.models import onednn
from grpokit.models.cpu import isa_of
from grpokit.models.loading import load_model_and_tokenizer
from grpokit.models.onednn import kernel_available, kernel_note, onednn_linears, packed_linears
from grpokit.rollout.engines import HFEngine
from grpokit.rollout.request import RolloutRequest, SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model_and_tokenizer(tiny_model_dir, device="cpu")


def linears(model) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def test_packed_logits_match_the_plain_path_and_the_modules_are_restored(tiny):
    model, _ = tiny
    ids = torch.randint(3, 40, (5, 9))  # [5, 9]
    with torch.inference_mode():
        want = model(input_ids=ids).logits  # [5, 9, V]
        with packed_linears(model, rows=5) as n:
            assert n == len(linears(model)) > 0  # every projection and the head
            assert all("forward" in m.__dict__ for m in linears(model))
            got = model(input_ids=ids).logits
    assert not any("forward" in m.__dict__ for m in linears(model))
    # fp32 accumulation in another order: float32 rounding, no more
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def no_bf16_kernel(monkeypatch):
    """This CPU as an AVX2-only one: oneDNN has no bfloat16 linear kernel (float32 still runs)."""
    monkeypatch.setitem(onednn._AVAILABLE, torch.bfloat16, False)


def bf16_layer_and_input():
    torch.manual_seed(0)
    return nn.Linear(64, 48).to(torch.bfloat16), torch.randn(7, 64, dtype=torch.bfloat16)


def test_bf16_weights_are_packed_where_the_cpu_has_the_kernel():
    layer, x = bf16_layer_and_input()
    with torch.inference_mode():
        want = layer(x)
        with packed_linears(layer, rows=7) as n:
            got = layer(x)
    assert n == (1 if kernel_available(torch.bfloat16) else 0)  # AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: packed
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_without_a_bf16_kernel_bf16_layers_take_the_plain_path_and_float32_is_still_packed(no_bf16_kernel):
    layer, x = bf16_layer_and_input()
    with torch.inference_mode():
        want = layer(x)
        with packed_linears(layer, rows=7) as n:
            got = layer(x)
        assert n == 0 and torch.equal(got, want)  # nothing changed: bit for bit the plain path
        with packed_linears(nn.Linear(8, 4), rows=2) as n32:
            assert n32 == (1 if kernel_available(torch.float32) else 0)
    with onednn_linears(layer) as n:
        assert n == 0
        layer(x.requires_grad_()).sum().backward()  # the training path too: aten's linear
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


def test_the_start_up_note_names_the_fields_and_the_cpu(no_bf16_kernel):
    cpu = torch.device("cpu")
    [note] = kernel_note("bfloat16", cpu, packed_weights=True, onednn_linear=True)
    assert note.startswith("rollout.packed_weights and train.onednn_linear: this CPU (")
    assert "no oneDNN bfloat16 linear kernel" in note and "plain path" in note
    assert kernel_note(torch.bfloat16, cpu, packed_weights=False, onednn_linear=True)[0].startswith(
        "train.onednn_linear:")
    assert kernel_note(torch.bfloat16, cpu, packed_weights=False, onednn_linear=False) == []  # nothing asked
    assert kernel_note(torch.float16, cpu, packed_weights=True, onednn_linear=True) == []  # never packed anyway
    assert kernel_note("bfloat16", torch.device("meta"), packed_weights=True, onednn_linear=True) == []  # not a CPU
    if kernel_available(torch.float32):
        assert kernel_note(torch.float32, cpu, packed_weights=True, onednn_linear=True) == []


def test_the_probe_reads_the_ops_own_refusal(monkeypatch):
    """Where the capability query passes but the op raises (a CPU torch does not know), the probe says no."""
    def refuse(*args):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or ...")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert onednn._probe(torch.bfloat16) is False and onednn._probe(torch.float32) is False


def test_an_avx2_only_onednn_has_no_bf16_kernel_and_a_bf16_run_trains(tiny_model_dir, tmp_path):
    """oneDNN capped at AVX2 (ONEDNN_MAX_CPU_ISA, as on an AVX2-only host, where the reorder raises
    "bf16 path needs the cpu support ..."): the probe says no, and a bfloat16 run trains on the plain
    path with one note saying so."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    config = tmp_path / "bf16.toml"
    config.write_text(f"""[model]\npath = "{tiny_model_dir}"\ndtype = "bfloat16"\n[data]\ntask = "addition"
num_prompts = 8\n[rollout]\ngroup_size = 2\nmax_new_tokens = 4\n[train]\nsteps = 1\nprompts_per_step = 2
[output]\ndir = "{tmp_path / 'run'}"\nconsole = false\n""")
    out = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(config)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no oneDNN bfloat16 linear kernel" in out.stdout, out.stdout
    assert "Traceback" not in out.stderr
    assert (tmp_path / "run" / "checkpoint-1").is_dir()


def test_isa_names():
    avx512 = {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert isa_of({"sse4_2", "avx", "avx2", "fma"}) == "AVX2"
    assert isa_of(avx512) == "AVX-512" and isa_of(avx512 | {"avx512_bf16"}) == "AVX-512 (BF16)"
    assert isa_of(avx512 | {"avx512_bf16", "amx_tile", "amx_bf16"}) == "AMX"
    assert isa_of({"sse2"}) == "no AVX2"


def test_a_forward_with_gradients_inside_the_block_takes_the_plain_path():
    """The packed copy is detached: a forward that needs gradients must not go through it."""
    layer = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with packed_linears(layer, rows=3) as n:
        assert n == 1
        layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    with torch.no_grad(), packed_linears(layer, rows=3):
        y = layer(x)  # under no_grad: packed
    torch.testing.assert_close(y, x @ layer.weight.detach().T + layer.bias.detach(), rtol=1e-5, atol=1e-6)


def test_modules_are_restored_when_the_block_raises():
    layer = nn.Linear(8, 4)
    with pytest.raises(RuntimeError, match="boom"):
        with packed_linears(layer, rows=2):
            raise RuntimeError("boom")
    assert "forward" not in layer.__dict__


def test_what_cannot_be_packed_runs_as_before():
    class MyLinear(nn.Linear):  # a subclass may have its own forward: left alone
        pass

    model = nn.Sequential(MyLinear(4, 4), nn.Linear(4, 4).to(torch.float64))
    with packed_linears(model, rows=2) as n:
        assert n == 0
    with packed_linears(nn.Linear(4, 4), rows=2, enabled=False) as n:
        assert n == 0


def test_the_engine_samples_the_same_answers_packed_or_not(tiny):
    """Same generator, same prompts: the same tokens (greedy and sampled) and log-probs to float32 rounding."""
    model, tok = tiny
    prompts = [tok("1+2=")["input_ids"], tok("30+4=")["input_ids"]]
    for temperature in (0.0, 1.0):
        s = SamplingParams(max_new_tokens=8, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                           temperature=temperature)
        runs = [HFEngine(model, tok, packed_weights=p).generate(
            RolloutRequest(prompts, 4, s, torch.Generator().manual_seed(3))).rollout for p in (False, True)]
        assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
        torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, rtol=0, atol=1e-5)
    assert not any("forward" in m.__dict__ for m in linears(model))


# ---- training: forward and input gradient through oneDNN (`train.onednn_linear`) -------------------


@pytest.mark.parametrize("algo", [dict(loss_type="dapo"), dict(loss_type="grpo", importance_sampling_level="sequence")])
@pytest.mark.parametrize("regime", ["on_policy", "off_policy", "kl"])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_training_loss_and_gradients_match_aten(tiny_model_dir, algo, regime, checkpointed):
    """The same micro-step with and without the oneDNN linears: loss and every gradient to float32
    rounding; with activation checkpointing the replay saves what the first forward saved."""
    import dataclasses

    from grpokit.models.checkpointing import enable_activation_checkpointing
    from grpokit.models.loading import load_model, load_tokenizer
    from test_fast_paths import _batch, _config, _loss_and_grads, _rollout

    model = load_model(tiny_model_dir, device="cpu").eval()
    if checkpointed:
        enable_activation_checkpointing(model)
    beta = 0.04 if regime == "kl" else 0.0
    batch = _batch(_rollout((model, load_tokenizer(tiny_model_dir))), off_policy=regime != "on_policy", ref=beta > 0)
    config = _config(tiny_model_dir, fused=True, skip=True, beta=beta, **algo)
    if checkpointed:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, shared_prompt_forward=False))
    loss_a, _, grads_a = _loss_and_grads(config, model, batch)
    with onednn_linears(model) as n:
        assert n == len(linears(model)) > 0
        loss_b, _, grads_b = _loss_and_grads(config, model, batch)
    assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-7)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k], atol=2e-7, rtol=1e-4)


def test_the_autograd_linear_matches_nn_linear_in_every_gradient():
    """Weight, bias and input gradients of a 3-D input, a frozen weight, a bias-free layer."""
    torch.manual_seed(0)
    for bias, frozen in ((True, False), (False, False), (True, True)):
        layer = nn.Linear(48, 40, bias=bias)
        layer.weight.requires_grad_(not frozen)
        x = torch.randn(3, 7, 48, requires_grad=True)
        g = torch.randn(3, 7, 40)
        layer(x).backward(g)
        want = [t.grad.clone() for t in (x, layer.weight, layer.bias) if t is not None and t.grad is not None]
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with onednn_linears(layer):
            layer(x).backward(g)
        got = [t.grad for t in (x, layer.weight, layer.bias) if t is not None and t.grad is not None]
        assert len(got) == len(want) == 1 + (not frozen) + bias  # (a frozen weight: its bias still learns)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_packed_block_inside_a_training_block_puts_the_training_forward_back():
    layer = nn.Linear(8, 4)
    with onednn_linears(layer):
        training_forward = layer.__dict__["forward"]
        with torch.no_grad(), packed_linears(layer, rows=2):
            assert layer.__dict__["forward"] is not training_forward
        assert layer.__dict__["forward"] is training_forward
    assert "forward" not in layer.__dict__


def test_a_run_trains_to_the_same_weights_with_or_without_onednn(tiny_model_dir, tmp_path):
    """Two steps of training, everything else equal: the same metrics and final weights to rounding."""
    from safetensors.torch import load_file

    from conftest import comparable, make_config, parity
    from grpokit.observe.tracking import read_metrics
    from grpokit.training.loop import train

    runs = {}
    for on in (True, False):
        config = make_config(tiny_model_dir, tmp_path / str(on), train={"onednn_linear": on},
                             rollout={"packed_weights": on})
        run_dir = train(config, reward_functions=[parity])
        runs[on] = (comparable(read_metrics(run_dir)), load_file(next(run_dir.glob("checkpoint-*/model.safetensors"))))
    (rows_a, w_a), (rows_b, w_b) = runs[True], runs[False]
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b] == [1, 2]
    for a, b in zip(rows_a, rows_b):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-5), k
    for k in w_b:
        torch.testing.assert_close(w_a[k], w_b[k], rtol=1e-4, atol=1e-6)


def test_no_packing_when_the_copy_would_crowd_the_memory(monkeypatch):
    from grpokit.models import onednn

    layer = nn.Linear(8, 4)
    monkeypatch.setattr(onednn, "_memory_allows", lambda nbytes: nbytes < 100)  # 128 bytes of weight: too much
    with torch.no_grad(), packed_linears(layer, rows=2) as n:
        assert n == 0 and "forward" not in layer.__dict__
    monkeypatch.undo()
    assert onednn._memory_allows(1) and not onednn._memory_allows(1 << 60)  # this machine's /proc/meminfo


@pytest.mark.skipif(not kernel_available(torch.float32), reason="no oneDNN float32 linear kernel on this CPU")
def test_side_by_side_projections_are_the_separate_products_and_only_where_packed(monkeypatch):
    """The layer loop's one product per group (q/k/v, some with a bias, some without; gate/up): each output
    equals its module's own packed product; with gradients the modules run; outside the packing block, or
    where memory is short for all groups together, there is none (and the memory is asked before a copy)."""
    torch.manual_seed(0)
    q, k, v = nn.Linear(32, 32), nn.Linear(32, 16, bias=False), nn.Linear(32, 16)
    gate, up = nn.Linear(32, 64, bias=False), nn.Linear(32, 64, bias=False)
    groups = [[q, k, v], [gate, up]]
    parent = nn.ModuleList([q, k, v, gate, up])
    x = torch.randn(5, 1, 32)
    assert onednn.packed_side_by_side(groups) is None  # not packed: the caller runs the modules
    with packed_linears(parent, rows=5):
        qkv, gate_up = onednn.packed_side_by_side(groups)
        with torch.inference_mode():
            for fused, group in ((qkv, groups[0]), (gate_up, groups[1])):
                outs = fused(x)
                assert [o.shape[-1] for o in outs] == [m.out_features for m in group]
                for out, module in zip(outs, group):
                    torch.testing.assert_close(out, module(x), rtol=1e-6, atol=1e-6)
                    torch.testing.assert_close(out, x @ module.weight.T + (0 if module.bias is None else module.bias),
                                               rtol=1e-5, atol=1e-5)
        with torch.enable_grad():  # a forward with gradients: the modules themselves, differentiable
            assert all(o.requires_grad for o in qkv(x))
        asked = []
        monkeypatch.setattr(onednn, "_memory_allows", lambda nbytes: asked.append(nbytes) or False)
        monkeypatch.setattr(torch, "cat", lambda *a, **kw: pytest.fail("copied before the memory check"))
        assert onednn.packed_side_by_side(groups) is None
        weights = 4 * sum(m.weight.numel() for m in parent.children())
        assert asked == [weights + 4 * 2 * 64 * 32]  # all groups' copies, and the largest group's stack


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_head_computes_logits_and_hidden_gradient_with_the_layers_product(one_pass, bias):
    """Inside `onednn_linears` the head's forward names its oneDNN product, and the fused log-softmax head
    uses it for the logits and for dL/dh (not for dL/dW): the same log-probs and gradients as torch's mm."""
    from grpokit.algorithms.fused_logprobs import linear_logprobs
    from grpokit.algorithms.logprobs import token_logprobs_from_hidden

    torch.manual_seed(0)
    head = nn.Linear(24, 50, bias=bias)
    hidden = torch.randn(2, 9, 24)
    ids = torch.randint(0, 50, (2, 9))
    coef = torch.randn(18)
    grad_fn = (lambda lp, start: coef[start:start + lp.shape[0]]) if one_pass else None

    def run(call):
        h = hidden.clone().requires_grad_()
        head.zero_grad(set_to_none=True)
        logp, _ = call(h)
        (logp.reshape(-1) * coef).sum().backward()
        return [logp.detach(), h.grad, head.weight.grad] + ([head.bias.grad] if bias else [])

    want = run(lambda h: token_logprobs_from_hidden(h, head, ids, chunk_size=5, grad_fn=grad_fn))
    calls = []
    with onednn_linears(head) as n:
        product = head.forward.product
        assert n == (1 if kernel_available(torch.float32) else 0)
        if not n:
            pytest.skip("this CPU has no oneDNN float32 linear")

        def counting(x, w, b):
            calls.append("logits" if w is head.weight else "dh")
            return product(x, w, b)

        got = run(lambda h: linear_logprobs(h.reshape(18, 24), head.weight, head.bias, ids.reshape(18),
                                            chunk_size=5, grad_fn=grad_fn, product=counting))
        assert "logits" in calls and "dh" in calls  # 4 chunks: 4 of each (one-pass), or 4 + 4 (recompute)
        calls.clear()
        head.forward.product = counting  # what token_logprobs_from_hidden finds on the module
        via_module = run(lambda h: token_logprobs_from_hidden(h, head, ids, chunk_size=5, grad_fn=grad_fn))
        assert "logits" in calls and "dh" in calls
    for g in (got, via_module):
        torch.testing.assert_close(g[0].reshape(want[0].shape), want[0], rtol=1e-5, atol=1e-6)
        for a, b in zip(g[1:], want[1:]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

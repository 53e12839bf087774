"""Reference model sync (TR-DPO; TRL's sync_ref_model): `algorithm.ref_sync_every`, `algorithm.ref_mixup_alpha`.

After every ref_sync_every-th step the reference becomes α·policy + (1 - α)·reference: a full model in
place (a tied weight mixed once), LoRA as the base plus an exactly mixed delta of its own (no copy).
Checkpoints hold the moved reference and a resume is exact; 2 processes (DP, FSDP2, LoRA) end with
the reference one process computes.

The 2-process side is this file run by `torchrun --nproc_per_node 2` (see `__main__` below).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import comparable, make_config, parity
from grpokit.models.forward import completion_logprobs
from grpokit.models.loading import load_model
from grpokit.observe.tracking import read_metrics
from grpokit.training.reference import mix_parameters, sync_reference

ALPHA = 0.6
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}
REF = ("reference", "weights.safetensors")

# This file's runs: β > 0 and the reference synced after every step (a reward with signal on a random model).
sync_config = partial(make_config, num_prompts=32, prompts_per_step=2, model={"device": "cpu"},
                      algorithm={"beta": 0.04, "ref_sync_every": 1, "ref_mixup_alpha": ALPHA})
lora_sync_config = partial(sync_config, learning_rate=1e-2, model={"device": "cpu", "lora": LORA})


def _train(config, **kwargs) -> Path:
    from grpokit.training.loop import train

    return train(config, reward_functions=[parity], **kwargs)


def _reference(run: Path, step: int) -> dict:
    return load_file(str(run / f"checkpoint-{step}" / REF[0] / REF[1]))


def _weights(run: Path, step: int) -> dict:
    return load_file(str(run / f"checkpoint-{step}" / "model.safetensors"))


def _logprobs(model, seq=(5, 6, 7, 8), completion=(9, 10, 11)):
    ids, mask = torch.tensor([list(seq)]), torch.ones(1, len(seq), dtype=torch.long)
    comp, cmask = torch.tensor([list(completion)]), torch.ones(1, len(completion), dtype=torch.long)
    with torch.no_grad():
        return completion_logprobs(model, ids, mask, comp, cmask)[0]


# ---- the mix, by hand ----------------------------------------------------------------------------


class _Tied(torch.nn.Module):
    """Embeddings tied to the output head (one parameter under two names), and a bias."""

    def __init__(self, embedding, bias):
        super().__init__()
        self.embed = torch.nn.Embedding(2, 2)
        self.head = torch.nn.Linear(2, 2, bias=False)
        self.head.weight = self.embed.weight
        self.bias = torch.nn.Parameter(torch.tensor(bias))
        with torch.no_grad():
            self.embed.weight.copy_(torch.tensor(embedding))


def test_mix_by_hand_a_tied_weight_is_mixed_once():
    policy, ref = _Tied([[1.0, 2.0], [3.0, 4.0]], [10.0]), _Tied([[0.0, 0.0], [1.0, 1.0]], [0.0])
    mix_parameters(ref, policy, 0.6)  # 0.6·p + 0.4·r
    want = torch.tensor([[0.6, 1.2], [2.2, 2.8]])  # mixed twice it would be 0.84·p + 0.16·r: [[0.84, 1.68], ...]
    torch.testing.assert_close(ref.embed.weight.detach(), want)
    assert ref.head.weight is ref.embed.weight  # still one tied parameter
    torch.testing.assert_close(ref.bias.detach(), torch.tensor([6.0]))
    torch.testing.assert_close(policy.embed.weight.detach(), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # untouched
    mix_parameters(ref, policy, 1.0)  # α = 1: the reference is the policy
    assert torch.equal(ref.embed.weight, policy.embed.weight) and torch.equal(ref.bias, policy.bias)
    with pytest.raises(ValueError, match="no match in the policy"):
        mix_parameters(torch.nn.Linear(2, 3), torch.nn.Linear(2, 2), 0.5)


def test_sync_happens_on_every_nth_step_only(tiny_model_dir, tmp_path):
    config = sync_config(tiny_model_dir, tmp_path, algorithm={"beta": 0.04, "ref_sync_every": 3})
    policy = SimpleNamespace(model=_Tied([[1.0, 1.0], [1.0, 1.0]], [1.0]), ref_model=_Tied([[0.0] * 2] * 2, [0.0]),
                             ref_moved=False)
    assert [sync_reference(config, policy, s) for s in (1, 2)] == [{}, {}] and not policy.ref_moved
    assert sync_reference(config, policy, 3) == {"ref_sync": 1.0} and policy.ref_moved
    torch.testing.assert_close(policy.ref_model.bias.detach(), torch.tensor([0.6]))  # default α = 0.6
    never = sync_config(tiny_model_dir, tmp_path, algorithm={"beta": 0.04})
    assert sync_reference(never, policy, 3) == {}


# ---- full fine-tuning ----------------------------------------------------------------------------


def test_full_model_reference_moves_toward_the_policy(tiny_model_dir, tmp_path):
    """Synced after step 2 only: checkpoint-1 has no reference (it is the initial model), checkpoint-2 holds
    α·policy_2 + (1 - α)·initial, with the tied embeddings stored once."""
    run = _train(sync_config(tiny_model_dir, tmp_path, steps=2, output={"save_every": 1},
                             algorithm={"beta": 0.04, "ref_sync_every": 2, "ref_mixup_alpha": ALPHA}))
    rows = read_metrics(run)
    assert "ref_sync" not in rows[0] and rows[1]["ref_sync"] == 1.0
    assert not (run / "checkpoint-1" / REF[0]).exists()
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    ref, policy = _reference(run, 2), _weights(run, 2)
    names = {n for n, _ in load_model(tiny_model_dir, device="cpu").named_parameters()}
    assert set(ref) == names and "lm_head.weight" not in ref  # every parameter, the tied head once
    assert any(not torch.equal(ref[k], initial[k]) for k in ref)
    for k in ref:
        torch.testing.assert_close(ref[k], ALPHA * policy[k] + (1 - ALPHA) * initial[k], atol=1e-7, rtol=1e-6)


def test_every_step_sync_compounds(tiny_model_dir, tmp_path):
    run = _train(sync_config(tiny_model_dir, tmp_path, steps=2, output={"save_every": 1}))
    assert [r["ref_sync"] for r in read_metrics(run)] == [1.0, 1.0]
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    ref1, ref2, p1, p2 = _reference(run, 1), _reference(run, 2), _weights(run, 1), _weights(run, 2)
    for k in ref2:
        want1 = ALPHA * p1[k] + (1 - ALPHA) * initial[k]
        torch.testing.assert_close(ref1[k], want1, atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(ref2[k], ALPHA * p2[k] + (1 - ALPHA) * want1, atol=1e-7, rtol=1e-6)


# ---- LoRA: the base plus a delta of its own, mixed exactly -----------------------------------------


def _lora_model(tiny_model_dir, lora=LORA):
    pytest.importorskip("peft")
    from grpokit.models.lora import LoraReference, adapter_of, apply_lora

    model = apply_lora(load_model(tiny_model_dir, device="cpu"), lora)
    return model, LoraReference(model), adapter_of(model)


def _new_policy(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)


def test_lora_reference_is_the_exact_mix_of_effective_weights(tiny_model_dir):
    from grpokit.models.lora import AdapterDisabled, merged_state_dict

    model, ref, wrapper = _lora_model(tiny_model_dir)
    _new_policy(model, 0)
    base = load_model(tiny_model_dir, device="cpu")
    assert torch.equal(_logprobs(ref), _logprobs(AdapterDisabled(model)))  # before a sync: exactly the base, as today
    want = {k: v.clone() for k, v in base.state_dict().items()}
    plain = load_model(tiny_model_dir, device="cpu")
    for sync in range(6):  # q_proj (32 x 32, r = 4) turns dense at its 4th sync: both forms are checked
        _new_policy(model, sync + 1)
        policy_before = _logprobs(model)
        merged = merged_state_dict(wrapper)
        ref.mix(ALPHA)
        want = {k: ALPHA * merged[k] + (1 - ALPHA) * want[k] for k in want}
        got = ref.merged_state_dict()
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-5, msg=lambda m: f"sync {sync} {k}: {m}")
        plain.load_state_dict(got)  # the hooks score with exactly these effective weights
        torch.testing.assert_close(_logprobs(ref), _logprobs(plain), atol=1e-5, rtol=1e-5)
        assert torch.equal(_logprobs(model), policy_before)  # the policy is untouched, its adapters on again
    assert ref.dense and ref.factors  # q_proj went dense; v_proj (16 x 32) and up_proj stay factored
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())  # still trains its adapters


def test_lora_reference_drops_blocks_below_float32_rounding(tiny_model_dir):
    from grpokit.models.lora import kept_blocks, merged_state_dict

    assert (kept_blocks(0.6), kept_blocks(1.0)) == (19, 1)  # 0.4^19 < 2^-24 <= 0.4^18
    alpha = 0.99  # kept_blocks = 4: rank r = 1 per sync, capped at 4 on a 32 x 32 layer (dense only from 16)
    model, ref, wrapper = _lora_model(tiny_model_dir, {"r": 1, "alpha": 2, "target_modules": ["q_proj"]})
    want = {k: v.clone() for k, v in merged_state_dict(wrapper).items()}  # B = 0: the base
    for sync in range(8):
        _new_policy(model, sync)
        merged = merged_state_dict(wrapper)
        ref.mix(alpha)
        want = {k: alpha * merged[k] + (1 - alpha) * want[k] for k in want}
    assert {a.shape[0] for a, _ in ref.factors.values()} == {kept_blocks(alpha)} and not ref.dense
    got = ref.merged_state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-5)


def test_lora_reference_needs_linear_adapters(tiny_model_dir):
    from grpokit.errors import SetupError

    with pytest.raises(SetupError, match="supports LoRA on linear layers only; model.embed_tokens is a Embedding"):
        _lora_model(tiny_model_dir, {"r": 2, "alpha": 4, "target_modules": ["embed_tokens", "q_proj"]})


def test_lora_run_syncs_the_reference_adapter_delta(tiny_model_dir, tmp_path):
    """Through `train`: checkpoint-N/reference/ holds the delta; base + delta = the mix of the merged policies."""
    pytest.importorskip("peft")
    run = _train(lora_sync_config(tiny_model_dir, tmp_path, steps=2, output={"save_every": 1}))
    rows = read_metrics(run)
    assert [r["ref_sync"] for r in rows] == [1.0, 1.0] and rows[0]["kl"] == pytest.approx(0.0, abs=1e-9)
    assert rows[1]["kl"] > 0
    still = read_metrics(_train(lora_sync_config(tiny_model_dir, tmp_path / "still", algorithm={"beta": 0.04})))
    assert still[1]["reward"] == rows[1]["reward"]  # the same answers at step 2 (the sync is after the update) ...
    assert still[1]["kl"] != pytest.approx(rows[1]["kl"], rel=1e-3)  # ... scored against the moved reference
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    want = dict(base)
    for step in (1, 2):
        policy, delta = _weights(run, step), _reference(run, step)
        want = {k: ALPHA * policy[k] + (1 - ALPHA) * want[k] for k in want}
        layers = {k.rsplit(".", 1)[0] for k in delta}
        assert layers and all(any(t in name for t in LORA["target_modules"]) for name in layers)
        for k in want:
            owner = k.removesuffix(".weight")
            got = base[k]
            if owner in layers:
                d = delta.get(f"{owner}.delta")
                got = got + (d if d is not None else delta[f"{owner}.lora_B"] @ delta[f"{owner}.lora_A"])
            torch.testing.assert_close(got, want[k], atol=1e-6, rtol=1e-5, msg=lambda m: f"step {step} {k}: {m}")


# ---- exact resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_resume_with_a_moved_reference_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path, kind):
    """3 steps straight == 2 steps, then --resume to 3: the reference synced at steps 1 and 2 comes back
    from checkpoint-2 (the kl of step 3 reads it)."""
    if kind == "lora":
        pytest.importorskip("peft")
    config = sync_config if kind == "full" else lora_sync_config
    straight = _train(config(tiny_model_dir, tmp_path / "s", steps=3))
    _train(config(tiny_model_dir, tmp_path / "r", steps=2, output={"save_every": 1}))
    resumed = _train(config(tiny_model_dir, tmp_path / "r", steps=3, output={"save_every": 1}), resume=True)
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3] and b[2]["kl"] > 0
    assert comparable(a) == comparable(b)
    for x, y in ((_weights(straight, 3), _weights(resumed, 3)), (_reference(straight, 3), _reference(resumed, 3))):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# ---- 2 processes: data parallel, FSDP2, LoRA ------------------------------------------------------

SCENARIOS = {"dp": {}, "fsdp": {"fsdp": True}, "lora": {"lora": LORA}}


def scenario_config(name: str, model_dir, out, *, one_process: bool = False):
    model = {"device": "cpu", **SCENARIOS[name]}
    if one_process:
        model.pop("fsdp", None)
    return make_config(model_dir, out, max_new_tokens=6, model=model, train={"micro_batch_size": 4},
                       learning_rate=1e-2 if name == "lora" else 1e-3,
                       algorithm={"beta": 0.04, "ref_sync_every": 1, "ref_mixup_alpha": ALPHA})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_end_with_the_same_reference(tiny_model_dir, tmp_path):
    """Every rank mixes its own copy (DP, LoRA) or its own shards (FSDP2): the ranks agree, and the
    reference equals the one 1 process computes on the same answers. Under FSDP2 a resume gathers the
    moved reference from checkpoint-1 into the shards again: 1 step + resume = 2 steps straight."""
    from test_distributed import per_prompt_engine

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), __file__, str(tiny_model_dir), str(tmp_path / "two"), *SCENARIOS,
           "resume-fsdp"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        one = {name: _train(scenario_config(name, tiny_model_dir, tmp_path / "one" / name, one_process=True),
                            engine=per_prompt_engine) for name in SCENARIOS}
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    for name in SCENARIOS:
        two = tmp_path / "two" / name
        rank0, rank1 = (load_file(str(two / f"reference-rank{r}.safetensors")) for r in (0, 1))
        assert rank0.keys() == rank1.keys(), name
        if name == "fsdp":  # each rank holds its rows of every parameter
            held = {k: torch.cat([rank0[k], rank1[k]]) for k in rank0}
        else:  # each rank a whole copy (a whole delta): the same one
            assert all(torch.equal(rank0[k], rank1[k]) for k in rank0), name
            held = rank0
        want = _reference(one[name], 2)
        assert want.keys() == held.keys(), name
        for k in want:
            torch.testing.assert_close(held[k], want[k], atol=2e-5, rtol=1e-4, msg=lambda m: f"{name} {k}: {m}")
        assert [r["ref_sync"] for r in read_metrics(two)] == [1.0, 1.0]
        for a, b in zip(read_metrics(one[name]), read_metrics(two)):
            assert b["kl"] == pytest.approx(a["kl"], rel=1e-4, abs=1e-7), name
    straight, resumed = tmp_path / "two" / "resume-fsdp" / "straight", tmp_path / "two" / "resume-fsdp" / "resumed"
    assert comparable(read_metrics(straight)) == comparable(read_metrics(resumed))
    a, b = _reference(straight, 2), _reference(resumed, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _run_resume(model_dir, out: Path) -> None:
    """FSDP2, the built-in engine: 2 steps straight, and 1 step + --resume for the second."""
    for name, steps, resume in (("straight", 2, False), ("resumed", 1, False), ("resumed", 2, True)):
        config = scenario_config("fsdp", model_dir, out / name)
        _train(replace(config, train=replace(config.train, steps=steps),
                       output=replace(config.output, save_every=1, keep_last=3)), resume=resume)


def _run_rank(name: str, model_dir, out: Path) -> None:
    """One rank's run; after each sync it writes the reference as it holds it: a copy, a LoRA delta, or
    under FSDP its own shards."""
    import torch.distributed as tdist
    from safetensors.torch import save_file

    import grpokit.training.loop as loop
    from grpokit.models.parallel import is_fsdp
    from grpokit.training.checkpoint import _reference_weights
    from test_distributed import per_prompt_engine

    def sync_and_dump(config, policy, step):
        metrics = sync_reference(config, policy, step)
        ref = policy.ref_model
        weights = {n: p.to_local().detach().clone() for n, p in ref.named_parameters()} if is_fsdp(ref) \
            else _reference_weights(ref)

        out.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(out / f"reference-rank{tdist.get_rank()}.safetensors"))
        return metrics

    loop.sync_reference = sync_and_dump
    try:
        _train(scenario_config(name, model_dir, out), engine=per_prompt_engine)
    finally:
        loop.sync_reference = sync_reference


# One torchrun process: python -m torch.distributed.run ... test_reference_sync.py MODEL OUT NAMES
if __name__ == "__main__":
    import torch.distributed as tdist

    torch.set_num_threads(1)
    model_dir, out_root, *names = sys.argv[1:]
    tdist.init_process_group("gloo")  # once for all scenarios: train() joins it and leaves it open
    for scenario in names:
        if scenario == "resume-fsdp":
            _run_resume(model_dir, Path(out_root) / scenario)
        else:
            _run_rank(scenario, model_dir, Path(out_root) / scenario)
    tdist.destroy_process_group()

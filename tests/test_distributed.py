"""Data parallel and FSDP2 over torchrun: 2 CPU processes (gloo) make the same update as 1 process.

Both runs must see the same answers, so the rollout engine here samples each prompt with its
own generator, seeded by the prompt's tokens and the step: the 1-process batch is then exactly
the concatenation of the 2 ranks' batches, and the comparison isolates the update (sharding,
normalisers, gradient all-reduce, metric reduction, rank-0-only files).

The 2-process side is this file run by `torchrun --nproc_per_node 2` (see `__main__` below).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import comparable, make_config, parity
from grpokit.config.schema import Config, DataConfig, ModelConfig, RolloutConfig, TrainConfig
from grpokit.errors import ConfigError
from grpokit.models.parallel import DistributedContext, ShardedStream, buckets
from grpokit.rollout.batch import concat_rollouts
from grpokit.rollout.engines import HFEngine
from grpokit.rollout.request import RolloutResult

SCENARIOS = {
    # dapo: the global token count normalises; micro-batches of 2 answers (gradient accumulation on each rank)
    # + evaluation during training: each rank scores its share of the held-out prompts, the counts are summed
    "dapo": dict(train={"micro_batch_size": 2}, eval={"every": 2, "num_prompts": 6, "samples_per_prompt": 2,
                                                      "greedy": True, "correct_threshold": 0.5}),
    # grpo with a reference model (β > 0) and μ = 2 (old log-probs, clipping)
    "grpo_kl": dict(algorithm={"loss_type": "grpo", "beta": 0.04, "num_iterations": 2, "epsilon": 0.1}),
    # LoRA adapters (only they are all-reduced) with the adapters-off reference
    # (and activation checkpointing: the layers run again inside the backward, adapters and all)
    "lora": dict(model={"lora": {"r": 4, "alpha": 8}}, algorithm={"beta": 0.04},
                 train={"learning_rate": 1e-2, "gradient_checkpointing": True}),
    # FSDP2 on 2 CPU processes against the plain 1-process run, with activation checkpointing: the replay in
    # the backward runs on the gathered weights of each layer
    "fsdp": dict(model={"fsdp": True}, train={"micro_batch_size": 4, "gradient_checkpointing": True},
                 eval={"every": 1, "num_prompts": 5,
                                                                          "greedy": True, "correct_threshold": 0.5}),
}


def scenario_config(name: str, model_dir, out) -> Config:
    s = SCENARIOS[name]
    return make_config(model_dir, out, max_new_tokens=6, model={"device": "cpu", **s.get("model", {})},
                       algorithm=s.get("algorithm"), train=s.get("train"), output={"completions_every": 1},
                       eval=s.get("eval"))


class PerPromptEngine(HFEngine):
    """Each prompt sampled alone, with a generator seeded by (prompt tokens, call number): the
    answers do not depend on which other prompts share the batch, nor on the process."""

    calls = 0

    def generate(self, request):
        self.calls += 1
        parts = []
        for p in request.prompt_ids:
            g = torch.Generator().manual_seed(zlib.crc32(bytes(str(p), "utf-8")) + 7919 * self.calls)
            parts.append(super().generate(replace(request, prompt_ids=[p], generator=g)).rollout)
        return RolloutResult(concat_rollouts(parts, request.sampling.pad_token_id))


def per_prompt_engine(config, model, tokenizer):
    return PerPromptEngine(model, tokenizer)


def run_scenario(name: str, model_dir, out, *, fsdp_off: bool = False) -> Path:
    from grpokit.training.loop import train

    config = scenario_config(name, model_dir, out)
    if fsdp_off:
        config = replace(config, model=replace(config.model, fsdp=False))
    return train(config, reward_functions=[parity], engine=per_prompt_engine)


def run_resume(kind: str, model_dir, out: Path) -> None:
    """2 steps straight, and 1 step + `--resume` for the second, with the built-in engine (each rank's
    own sampling generator must come back from the checkpoint)."""
    from grpokit.training.loop import train

    base = scenario_config("fsdp" if kind == "fsdp" else "dapo", model_dir, out)
    base = replace(base, eval=type(base.eval)())  # a segment's last step evaluates: the segments would differ
    for name, steps, resume in (("straight", 2, False), ("resumed", 1, False), ("resumed", 2, True)):
        cfg = replace(base, train=replace(base.train, steps=steps),
                      output=replace(base.output, dir=str(out / name), save_every=1, keep_last=3))
        train(cfg, reward_functions=[parity], resume=resume)


# ---- the 2-process runs --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoint-2" / "model.safetensors"))


COMPARED = ("reward", "reward_std", "frac_reward_zero_std", "rewards/parity/mean", "rewards/parity/std", "loss",
            "grad_norm", "entropy", "clip_ratio/region_mean", "completions/mean_length", "completions/min_length",
            "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
            "learning_rate")


RESUMES = ("resume-dp", "resume-fsdp")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """One torchrun launch (2 processes) for every scenario, while this process runs the 1-process side."""
    root = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), __file__, str(tiny_model_dir), str(root / "two"), *SCENARIOS, *RESUMES]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        singles = {name: run_scenario(name, tiny_model_dir, root / "one" / name, fsdp_off=True) for name in SCENARIOS}
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    return singles, root / "two"


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_make_the_same_update_as_one(runs, tiny_model_dir):
    singles, two_root = runs
    for name in SCENARIOS:
        one, two = singles[name], two_root / name
        m1, m2 = _metrics(one), _metrics(two)
        assert [r["step"] for r in m2] == [1, 2], name  # rank 0 alone wrote, once per step
        assert m1[0]["reward_std"] > 0 and m1[0]["grad_norm"] > 0  # there was an update to compare
        for a, b in zip(m1, m2):
            for key in COMPARED + (("kl",) if "kl" in a else ()):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (name, a["step"], key)
            # greedy answers do not depend on the sampling: two processes' shares sum to the one-process value
            assert b.get("eval/greedy_accuracy") == a.get("eval/greedy_accuracy"), (name, a["step"])
        c1 = (one / "completions.jsonl").read_text().splitlines()
        c2 = (two / "completions.jsonl").read_text().splitlines()
        assert [json.loads(x)["completion"] for x in c1] == [json.loads(x)["completion"] for x in c2], name
        w1, w2 = _weights(one), _weights(two)
        assert w1.keys() == w2.keys(), name
        before = _initial_weights(tiny_model_dir)
        assert not all(torch.equal(w1[k], before[k]) for k in w1), name  # the update moved the weights
        for k in w1:
            torch.testing.assert_close(w2[k], w1[k], atol=2e-5, rtol=1e-4, msg=lambda m: f"{name} {k}: {m}")
        state = torch.load(two / "checkpoint-2" / "trainer_state.pt", weights_only=False)
        assert isinstance(state["sampler"], list) and len(state["sampler"]) == 2  # each rank's generator


@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_two_processes_resume_exactly(runs, kind):
    """Per-rank generators, the sharded stream, optimizer state (gathered from FSDP shards and sharded
    again) all come back: 1 step + resume = 2 steps straight."""
    root = runs[1] / f"resume-{kind}"
    straight, resumed = _metrics(root / "straight"), _metrics(root / "resumed")
    assert [r["step"] for r in resumed] == [1, 2]
    assert comparable(resumed) == comparable(straight)
    a, b = _weights(root / "straight"), _weights(root / "resumed")
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=0, rtol=0, msg=lambda m: f"{kind} {k}: {m}")


def _initial_weights(model_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


# ---- pieces, without processes -------------------------------------------------------------------


def _config(**train) -> Config:
    return Config(model=ModelConfig(path="m"), data=DataConfig(task="addition"),
                  rollout=RolloutConfig(group_size=4), train=TrainConfig(**train))


DRAIN = """
import time, torch, torch.distributed as dist
from grpokit.models.gloo_exit import _gloo_workers, _thread_state, drain_gloo_workers
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for _ in range(50):  # tensors Python drops while gloo's workers may still hold them
    t = torch.ones(1000)
    dist.all_reduce(t, async_op=True).wait()
    del t
workers = _gloo_workers()
t0 = time.monotonic()
drain_gloo_workers()
print(len(workers), time.monotonic() - t0, all(_thread_state(w) == "S" for w in workers))
"""


def test_gloo_workers_are_found_and_drained_before_the_interpreter_exits():
    """The drain at a torchrun process's exit (models/gloo_exit.py: under load a gloo worker that dropped its
    last tensor during the interpreter's finalization aborted the process) finds gloo's worker threads by the
    name torch gives them and returns once they wait for work: a torch that renamed them would leave it blind."""
    done = subprocess.run([sys.executable, "-c", DRAIN], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    workers, seconds, parked = done.stdout.split()
    assert int(workers) >= 1 and float(seconds) < 1.0 and parked == "True", done.stdout


def test_local_config_splits_the_batch_and_checks_it_splits_evenly():
    two = DistributedContext(rank=1, world_size=2)
    local = two.local_config(_config(prompts_per_step=8, minibatch_size=16, micro_batch_size=4))
    assert (local.train.prompts_per_step, local.minibatch_size, local.micro_batch_size) == (4, 8, 4)
    assert DistributedContext().local_config(cfg := _config()) is cfg  # one process: untouched
    with pytest.raises(ConfigError, match="train.prompts_per_step: 3 prompts cannot be split over 2"):
        two.local_config(_config(prompts_per_step=3))
    with pytest.raises(ConfigError, match="train.micro_batch_size: 8 .* per-process minibatch of 4"):
        two.local_config(_config(prompts_per_step=4, minibatch_size=8, micro_batch_size=8))
    with pytest.raises(ConfigError, match="model.fsdp with model.lora is not supported yet"):
        two.local_config(replace(_config(), model=ModelConfig(path="m", fsdp=True, lora={"r": 4})))
    with pytest.raises(ConfigError, match="model.fsdp: sharding needs several processes"):
        DistributedContext().local_config(replace(_config(), model=ModelConfig(path="m", fsdp=True)))


def test_sharded_stream_gives_each_rank_its_contiguous_share():
    class Stream:
        def next_batch(self):
            return list(range(8))

    assert ShardedStream(Stream(), 0, 2).next_batch() == [0, 1, 2, 3]
    assert ShardedStream(Stream(), 1, 2).next_batch() == [4, 5, 6, 7]


def test_buckets_group_by_size_and_dtype():
    ts = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("c", torch.zeros(30)),
          ("d", torch.zeros(2, dtype=torch.int64)), ("e", torch.zeros(1))]
    groups = [[n for n, _ in b] for b in buckets(ts, bucket_bytes=100)]
    assert groups == [["a", "b"], ["c"], ["d"], ["e"]]


# One torchrun process: python -m torch.distributed.run ... test_distributed.py MODEL OUT NAMES
if __name__ == "__main__":
    import faulthandler

    import torch.distributed as tdist

    # a native abort (SIGABRT, SIGSEGV) prints every thread's Python stack: where it happened, in CI's log
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    model_dir, out_root, *names = sys.argv[1:]
    tdist.init_process_group("gloo")  # once for all scenarios: train() joins it and leaves it open
    for scenario in names:
        if scenario.startswith("resume-"):
            run_resume(scenario.removeprefix("resume-"), model_dir, Path(out_root) / scenario)
        else:
            run_scenario(scenario, model_dir, Path(out_root) / scenario)
        print(f"rank {tdist.get_rank()}: {scenario} done", flush=True)
    tdist.destroy_process_group()
    print(f"rank {tdist.get_rank() if tdist.is_initialized() else os.environ.get('RANK')}: exiting", flush=True)
    # the interpreter's own teardown, as a user's script has it: train() registered the drain of gloo's worker
    # threads (models/gloo_exit.py), without which this aborted now and then under load ("terminate called
    # without an active exception")

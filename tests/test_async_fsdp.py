"""Asynchronous rollout with an FSDP2-sharded trainer (rollout.mode = "async", model.fsdp = true): two torchrun
processes (gloo), each with its own worker and its own weight group; each gathers the whole parameters from
the shards (a collective of the training ranks) and sends them to its worker.

One torchrun launch (this file's `__main__`): first a transfer checked piece by piece (a sharded model
published to a receiver in the same process), then 3 steps in sync mode and the same 3 steps in async mode
with max_staleness = 0, which must agree: a worker that held other weights than the trainer's would sample
other answers, and the rewards, losses and weights would differ.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import comparable, make_config, parity

STEPS = 3


def run_config(model_dir, out, mode: str):
    # both samplers decode through the model: the FSDP trainer's modules carry FSDP's hooks, so its sampler
    # cannot take the layer loop (rollout/layer_loop.py), and the worker's loop would round its attention
    # differently (float noise that Adam lifts, at this learning rate, where gradients are ~0)
    return make_config(model_dir, out, steps=STEPS, learning_rate=1e-2, model={"device": "cpu", "fsdp": True},
                       rollout={"mode": mode, "max_staleness": 0, "worker_timeout_s": 60, "layer_loop": False},
                       train={"num_threads": 1})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_fsdp_trainer_sends_its_workers_whole_weights_and_equals_sync(tiny_model_dir, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), __file__, str(tiny_model_dir), str(tmp_path)]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("transfer checked") == 2, done.stdout[-3000:]
    sync, run = _rows(tmp_path / "sync"), _rows(tmp_path / "async")
    assert [r["step"] for r in sync] == [r["step"] for r in run] == list(range(1, STEPS + 1))
    assert len({r["loss"] for r in sync}) == STEPS and sync[0]["reward_std"] > 0  # something to compare
    for x, y in zip(comparable(sync), comparable(run)):
        assert y["async/staleness_max"] == 0
        for key in x:  # the async rows add their own keys (async/*, sampling/*)
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)
    assert all("time/weight_sync" in r for r in run[:-1])  # versions 1 and 2 travelled (the first at start-up)
    w_sync = load_file(tmp_path / "sync" / f"checkpoint-{STEPS}" / "model.safetensors")
    w_async = load_file(tmp_path / "async" / f"checkpoint-{STEPS}" / "model.safetensors")
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert w_sync.keys() == w_async.keys()
    assert any(not torch.equal(w_async[n], initial[n]) for n in w_async if n in initial)  # it trained
    for name in w_sync:  # the correction's weights are 1 up to float noise, which Adam lifts where gradients are ~0
        torch.testing.assert_close(w_async[name], w_sync[name], rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")


def check_transfer(model_dir: str) -> None:
    """In each rank: a sharded model (shards of uneven size: the tiny vocabulary is odd), its weights moved
    away from the folder's, published to a receiver thread of this process holding the folder's model: the
    receiver gets the whole tensors; a later transfer moves only what trains; the model stays sharded."""
    import multiprocessing
    import threading

    from torch.distributed.tensor import DTensor

    from grpokit.models.checkpointing import enable_activation_checkpointing
    from grpokit.models.fsdp import prepare_model
    from grpokit.models.loading import load_model
    from grpokit.models.weight_sync import GlooPublisher, GlooSubscriber
    from grpokit.training.rollout_workers import parameter_shapes

    rank = torch.distributed.get_rank()
    model, receiver_model = load_model(model_dir, device="cpu"), load_model(model_dir, device="cpu")
    enable_activation_checkpointing(model)  # as train.gradient_checkpointing: the names stay the model's
    model, _, _ = prepare_model(model, None, False, fsdp=True)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert parameter_shapes(model) == parameter_shapes(receiver_model)  # the whole shapes, names, dtypes
    local = {n: p.to_local().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.to_local().add_(1.0 + i + 100 * rank)  # each rank's shard its own change: the whole is both
    expected = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    announced = multiprocessing.Value("q", -1)
    channel = GlooPublisher(1, 60, announced)
    got = {}
    joining = threading.Thread(target=lambda: got.update(r=GlooSubscriber(receiver_model, channel.port, 1, 2, 60,
                                                                          announced)))
    joining.start()
    channel.connect()
    joining.join()
    receiver = got["r"]
    channel.publish(model, 0)  # the first transfer: every parameter
    assert receiver.wait_for(0, 60) and receiver.apply() == 0
    for n, p in receiver_model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], rtol=0, atol=0, msg=lambda m: f"rank {rank} {n}: {m}")
    frozen = "model.embed_tokens.weight"  # later transfers: only the parameters that train
    for m in (model, receiver_model):
        m.get_parameter(frozen).requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():  # the frozen one too: it must not travel
            p.to_local().mul_(2.0)
    channel.publish(model, 1)
    assert receiver.wait_for(1, 60) and receiver.apply() == 1
    for n, p in receiver_model.named_parameters():
        want = expected[n] if n == frozen else 2 * expected[n]
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=0, msg=lambda m: f"rank {rank} {n}: {m}")
    for i, (n, p) in enumerate(model.named_parameters()):  # still shards, untouched by the gathers, no gradient
        assert isinstance(p, DTensor) and p.grad is None, n
        torch.testing.assert_close(p.to_local(), 2 * (local[n] + (1.0 + i + 100 * rank)), rtol=0, atol=0)
    print(f"rank {rank}: transfer checked", flush=True)


# One torchrun process: python -m torch.distributed.run ... test_async_fsdp.py MODEL OUT
if __name__ == "__main__":
    import faulthandler

    import torch.distributed as tdist

    from grpokit.training.loop import train

    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    tdist.init_process_group("gloo")  # train() joins it and leaves it open
    check_transfer(model_dir)
    for mode in ("sync", "async"):
        train(run_config(model_dir, out / mode, mode), reward_functions=[parity])
        print(f"rank {tdist.get_rank()}: {mode} done", flush=True)
    tdist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as test_distributed.py: no interpreter teardown with native threads about

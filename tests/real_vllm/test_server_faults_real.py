"""What a new user and an adversary broke in a shared vLLM server (issue 52's first five points), against the real
server (vLLM's CPU build): a run on another model, two runs on one server, a push stopped half-way, settings the
server refuses, a server stopped while a request is open. The one fault injected by hand is the Ctrl-C itself
(a KeyboardInterrupt raised in the trainer while its push is in flight): a signal cannot be timed to land inside
one HTTP call from a test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import parity
from grpokit.errors import RolloutWorkerError, UserError
from grpokit.rollout.vllm.lease import LEASE_PATH, ServerLease
from grpokit.rollout.vllm.server import ServerClient
from grpokit.rollout.vllm.weights import FolderReload
from grpokit.training.loop import train
from real_vllm.conftest import vllm_call
from real_vllm.test_vllm_engine import served_logprobs, server_config

LEASED = ["--middleware", "grpokit.rollout.vllm.lease.RunLease"]  # as `grpokit serve` starts vLLM
PROMPT, TOKENS = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]


def _no_model_load(monkeypatch):
    """The run's policy must not load: the error comes first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the server's refusal was said")

    monkeypatch.setattr("grpokit.training.setup.build_policy", refuse)


def test_a_run_on_another_model_is_refused_before_any_push_and_a_failed_push_is_undone(
        vllm_model_dir, fresh_server, tmp_path, monkeypatch):
    """A 128-wide model against a server on a 64-wide one: one error naming the sizes, before the model loads and
    before any push, and the server serves its weights as before. A push that fails inside the server anyway
    (here: pushed by hand, past the check) loads the server's previous weights back and leaves it unpaused."""
    from grpokit.models.tiny import build_tiny_model

    model = str(vllm_model_dir)
    before = served_logprobs(fresh_server, model, PROMPT, TOKENS)
    wide = tmp_path / "wide"
    build_tiny_model(wide, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=1, seed=0)
    with monkeypatch.context() as m:
        _no_model_load(m)
        with pytest.raises(UserError, match=r"serves another model than model.path \(Qwen2ForCausalLM with hidden "
                                            r"size 64 where model.path has 128\).*grpokit serve"):
            train(server_config(wide, tmp_path / "wide-run", fresh_server), reward_functions=[parity])
    assert served_logprobs(fresh_server, model, PROMPT, TOKENS) == pytest.approx(before, abs=1e-5)

    from transformers import AutoModelForCausalLM

    push = FolderReload(ServerClient(fresh_server, 60))
    with pytest.raises(RolloutWorkerError, match="holds its previous weights again"):
        push.publish(AutoModelForCausalLM.from_pretrained(wide), 1)
    assert vllm_call(fresh_server, "GET", "/is_paused")["is_paused"] is False
    assert served_logprobs(fresh_server, model, PROMPT, TOKENS) == pytest.approx(before, abs=1e-5)
    push.close()


def test_settings_the_server_refuses_are_named_before_the_model_loads(vllm_model_dir, fresh_server, tmp_path,
                                                                      monkeypatch, server_factory):
    """Five stop strings (vLLM takes four), a LoRA rank above the server's --max-lora-rank, a CPU server with
    chunked prefill on: each one error naming the field or flag and the fix, before the model loads."""
    _no_model_load(monkeypatch)
    url = fresh_server
    with pytest.raises(UserError, match=r"rollout.stop_strings: 5 strings.*at most 4.*VLLM_MAX_STOP_STRINGS"):
        train(server_config(vllm_model_dir, tmp_path / "stops", url,
                            rollout={"stop_strings": ["a", "b", "c", "d", "e"]}), reward_functions=[parity])
    with pytest.raises(UserError, match=r"model.lora.r = 16:.*rank at most 8.*grpokit serve MODEL --lora-rank 16"):
        train(server_config(vllm_model_dir, tmp_path / "rank", url, model={"lora": {"r": 16}}),
              reward_functions=[parity])
    chunked = server_factory(vllm_model_dir, lora_rank=None, extra_args=["--enable-chunked-prefill"])
    with pytest.raises(UserError, match="chunked prefill on.*--no-enable-chunked-prefill"):
        train(server_config(vllm_model_dir, tmp_path / "chunked", chunked.url), reward_functions=[parity])


def test_a_second_run_on_a_leased_server_is_refused_naming_the_first(vllm_model_dir, tmp_path, server_factory,
                                                                     capfd):
    """Run X holds the server (a process that claimed it); run Y is one error naming X, and pushes nothing. Once
    X's process is gone, Y takes over at once, trains, and frees the server at its end. A run whose lease lapsed
    and was claimed by another is refused on its next call, not served the other's weights."""
    server = server_factory(vllm_model_dir, lora_rank=None, extra_args=LEASED)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from grpokit.rollout.vllm.lease import ServerLease
        from grpokit.rollout.vllm.server import ServerClient
        assert ServerLease(ServerClient({server.url!r}), "run-x").claim()
        print("claimed", flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        before = served_logprobs(server.url, server.model, PROMPT, TOKENS)
        with pytest.raises(UserError, match=rf"in use by another run \(run run-x, process {holder.pid} on "):
            train(server_config(vllm_model_dir, tmp_path / "y", server.url, steps=1), reward_functions=[parity])
        assert served_logprobs(server.url, server.model, PROMPT, TOKENS) == before  # Y pushed nothing
        stale = ServerClient(server.url, 30)
        stale.run = "run-z"  # a run whose lease lapsed: another holds the server now
        with pytest.raises(RolloutWorkerError, match=r"is now held by another run \(run run-x.*--resume"):
            stale.call("POST", "/v1/completions", json={"model": server.model, "prompt": PROMPT, "max_tokens": 1})
    finally:
        holder.kill()
        holder.wait()
    capfd.readouterr()
    train(server_config(vllm_model_dir, tmp_path / "y2", server.url, steps=1), reward_functions=[parity])
    assert "has no lease" not in capfd.readouterr().err
    assert vllm_call(server.url, "GET", LEASE_PATH)["holder"] is None  # freed at the run's end


def test_a_push_stopped_mid_way_resumes_the_server_and_a_paused_one_is_named(vllm_model_dir, tmp_path,
                                                                            server_factory, capfd):
    """A Ctrl-C while the server reloads the pushed weights: the server is resumed on the way out. A server left
    paused anyway (its run was SIGKILLed mid-push: /pause by hand here) is resumed by the next run, with a note,
    so a LoRA run (which never pauses) does not wait out its timeout; a request waited on while another run holds
    the server paused is said to be paused, with the fix, after 30 s rather than its timeout."""
    from transformers import AutoModelForCausalLM

    server = server_factory(vllm_model_dir, lora_rank=8, extra_args=LEASED)
    push = FolderReload(ServerClient(server.url, 60))
    sent = push._reload

    def interrupted(client, folder):  # the reload request reaches the server; the trainer is interrupted meanwhile
        threading.Thread(target=sent, args=(client, folder), daemon=True).start()
        time.sleep(0.2)
        raise KeyboardInterrupt

    push._reload = interrupted
    with pytest.raises(KeyboardInterrupt):
        push.publish(AutoModelForCausalLM.from_pretrained(vllm_model_dir), 1)
    assert vllm_call(server.url, "GET", "/is_paused")["is_paused"] is False
    push.close()

    vllm_call(server.url, "POST", "/pause", params={"mode": "keep"})
    capfd.readouterr()
    t0 = time.monotonic()
    train(server_config(vllm_model_dir, tmp_path / "lora", server.url, steps=1, timeout_s=120,
                        model={"lora": {"r": 4}}), reward_functions=[parity])
    assert time.monotonic() - t0 < 100
    assert "was paused (a run stopped during its weight push leaves it so); resumed it" in capfd.readouterr().err

    vllm_call(server.url, "POST", "/pause", params={"mode": "keep"})
    lease = ServerLease(ServerClient(server.url), "run-x")  # a run that does hold it: the next one cannot lease it
    assert lease.claim()
    try:
        client = ServerClient(server.url, 60)
        with pytest.raises(RolloutWorkerError, match=r"is paused \(/is_paused\).*curl -X POST .*/resume"):
            client.call("POST", "/v1/completions", json={"model": server.model, "prompt": PROMPT, "max_tokens": 1})
    finally:
        lease.release()
        vllm_call(server.url, "POST", "/resume")


def test_a_server_stopped_while_a_request_is_open_is_said_within_seconds(vllm_model_dir, server_factory):
    """SIGTERM to vLLM's API server while its engine is busy with the trainer's request (frozen here, so the
    request cannot end on its own): vLLM stops taking connections but waits for the open request, and so would
    the trainer, for all of server_timeout_s. The watch beside the request says "stopped" within seconds."""
    server = server_factory(vllm_model_dir, lora_rank=None)
    client = ServerClient(server.url, 600)
    engine = [int(p) for p in subprocess.run(["pgrep", "-g", str(server.proc.pid)], capture_output=True,
                                             text=True).stdout.split() if int(p) != server.proc.pid]
    assert engine, "vLLM's engine core process was not found in the server's process group"

    for pid in engine:  # the request is taken, and never answered
        os.kill(pid, signal.SIGSTOP)
    threading.Timer(2.0, os.kill, (server.proc.pid, signal.SIGTERM)).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(RolloutWorkerError, match="stopped answering: it refuses connections.*--resume"):
            client.call("POST", "/v1/completions", json={"model": server.model, "prompt": PROMPT, "max_tokens": 8})
        assert time.monotonic() - t0 < 60
    finally:
        for pid in engine:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

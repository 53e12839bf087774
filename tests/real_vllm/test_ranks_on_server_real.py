"""Two torchrun ranks on one real vLLM server (vLLM's CPU build), in async mode with an FSDP-sharded trainer
(rollout/vllm/ranks.py): each rank's worker samples through the server, both ranks gather every tensor, rank 0
writes it to the folder the server reloads. What the real server cannot show (pushes counted against batches, a
push that fails on rank 0) is in tests/test_ranks_on_servers.py's stand-in."""

from __future__ import annotations

import subprocess
import sys

import torch

from real_vllm.test_vllm_engine import GAP, run_toml, served_logprobs

PROMPT, TOKENS = [1, 5, 6, 7], [8, 9, 10, 11]


def test_two_ranks_async_with_fsdp_train_and_the_server_holds_the_trained_weights(vllm_model_dir, fresh_server,
                                                                                  tmp_path):
    """`grpokit train --nproc-per-node 2` with rollout.mode = "async" and model.fsdp: it trains to the end, every
    batch sampled on the trainer's weights (max_staleness 0: the sampler's log-probs are the trainer's), and the
    server holds the weights of step 2 (the last pushed: none is after the last step), not the base's."""
    from grpokit.models.loading import load_model_and_tokenizer
    from grpokit.observe.tracking import read_metrics

    toml = run_toml(tmp_path / "run.toml", vllm_model_dir, tmp_path / "run",
                    vllm=f'{{server = "{fresh_server}", server_timeout_s = 60, weight_transfer = "folder"}}')
    sets = ["rollout.mode=async", "rollout.max_staleness=0", "model.fsdp=true", "model.device=cpu",
            "output.save_every=1"]
    done = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(toml), "--nproc-per-node", "2",
                           *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3] and max(r["sampling/logprob_gap_max"] for r in rows) < GAP

    def ours(folder):
        model, _ = load_model_and_tokenizer(folder, device="cpu", dtype="float32")
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([PROMPT + TOKENS])).logits[0].float(), -1)
        return torch.stack([lp[len(PROMPT) - 1 + k, t] for k, t in enumerate(TOKENS)])

    served = torch.tensor(served_logprobs(fresh_server, str(vllm_model_dir), PROMPT, TOKENS))
    assert float((served - ours(tmp_path / "run" / "checkpoint-2")).abs().max()) < GAP
    assert float((served - ours(vllm_model_dir)).abs().max()) > 10 * GAP  # control: not the base's

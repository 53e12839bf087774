"""The GRPO training loop, readable top to bottom.

    prompts ─► rollout: G answers per prompt ─► rewards r[B, G] ─► advantages A[B, G]
            ─► [dynamic sampling] ─► old / ref logprobs (only when needed)
            ─► μ passes × minibatches × micro-batches: clipped surrogate + β·KL
            ─► metrics, checkpoint

`train(config)` is the whole product: everything that can be checked is checked
before the model loads (config, model folder, data, reward functions, output
folder), then the loop runs. The math lives in `advantages` and `objectives`;
this module only moves tensors between them.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from .advantages import group_advantages
from .checkpoint import list_checkpoints, load_trainer_state, rng_state, save_checkpoint, set_rng_state
from .config import Config, to_toml
from .modeling import check_model_folder, completion_logprobs, head_is_linear, load_model, load_tokenizer
from .objectives import policy_loss
from .grading import Draw, grade, write_completions
from .rewards import RewardSpec, reward_metrics
from .rollout import Rollout, sample_groups
from .diagnostics import Diagnostics
from .run_setup import (PreparedData, PromptTable, max_positions_of, prepare_data, prepare_output_dir,
                        resolve_reward_specs, tokenize_prompts)
from .tracking import ConsoleProgress, MetricsWriter, completion_metrics, reward_summary


@dataclass
class GenerationBatch:
    """One step's sampled, graded answers; N = B * G rows, group by group."""

    draw: Draw  # rollout (ids, masks, sampling logprobs, truncation), rewards [N] and [N, F], texts
    advantages: torch.Tensor  # [N]
    loss_mask: torch.Tensor  # [N, T] completion mask, truncated answers zeroed if asked
    old_logp: torch.Tensor | None = None  # [N, T] only when μ > 1 or several minibatches
    ref_logp: torch.Tensor | None = None  # [N, T] only when β > 0

    @property
    def rollout(self) -> Rollout:
        return self.draw.rollout


def train(
    config: Config,
    *,
    reward_functions: Sequence[Callable] | None = None,
    rows: Iterable[dict] | None = None,
    resume: bool = False,
) -> Path:
    """Run GRPO as `config` says; returns the run folder. Python-side callables and
    rows may replace the config's `rewards.functions` and data source."""
    # ---- checks and setup, all before the model loads -------------------------------
    check_model_folder(config.model.path)
    data: PreparedData = prepare_data(config, rows)
    specs: list[RewardSpec] = resolve_reward_specs(config, data.task, reward_functions)
    tokenizer = load_tokenizer(config.model.path)
    prompts: PromptTable = tokenize_prompts(config, data, tokenizer, max_positions_of(config.model.path))
    run_dir = prepare_output_dir(config, resume=resume)
    torch.manual_seed(config.train.seed)

    model = load_model(config.model.path, dtype=config.model.dtype, device=config.model.device)
    ref_model = None
    if config.algorithm.beta > 0:  # with β = 0 no reference model is loaded at all
        ref_model = load_model(config.model.path, dtype=config.model.dtype, device=config.model.device)
        ref_model.eval().requires_grad_(False)
    model.eval()  # dropout stays off throughout: ratio is exactly 1 before the first update
    linear_head = head_is_linear(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.learning_rate,
                                  betas=config.train.adam_betas, weight_decay=config.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    sampler = torch.Generator(device=model.device).manual_seed(config.train.seed)
    stream = data.stream(config.train.prompts_per_step, seed=config.data.seed)

    start_step = 0
    if resume and (checkpoints := list_checkpoints(run_dir)):
        start_step = _restore(checkpoints[-1], model, optimizer, scheduler, sampler, stream)
    (run_dir / "config.toml").write_text(to_toml(config), encoding="utf-8")
    writer = MetricsWriter(run_dir, append=start_step > 0, tensorboard=config.output.tensorboard,
                           wandb=config.output.wandb)
    console = ConsoleProgress(config.train.steps, start_step, enabled=config.output.console)
    diagnostics = Diagnostics.from_config(config)  # the seeds' common mistakes, each printed once
    for message in diagnostics.check_config(config):
        console.print(message)

    # ---- the loop -------------------------------------------------------------------
    def save(step: int) -> Path:
        state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "rng": rng_state(), "sampler": sampler.get_state(), "stream": stream.state_dict()}
        return save_checkpoint(run_dir, step, model, tokenizer, state, config.output.keep_last)

    failed_steps = 0  # consecutive steps whose every update was skipped as non-finite
    try:
        with GracefulStop() as stop:
            for step in range(start_step + 1, config.train.steps + 1):
                t0 = time.perf_counter()
                batch, gen_metrics = generate_and_grade(config, model, tokenizer, prompts, stream, specs, sampler)
                t1 = time.perf_counter()
                score_old_and_ref(config, model, ref_model, batch, linear_head)
                train_metrics = optimize(config, model, optimizer, scheduler, batch, linear_head)
                t2 = time.perf_counter()
                n_tokens = batch.rollout.completion_mask.sum().item()
                metrics = {**gen_metrics, **train_metrics,
                           "learning_rate": scheduler.get_last_lr()[0],
                           "time/rollout": gen_metrics.pop("time/rollout"), "time/train": t2 - t1,
                           "time/step": t2 - t0, "tokens_per_sec": n_tokens / (t2 - t0)}
                writer.write(step, metrics)
                for message in diagnostics.update(step, metrics):
                    console.print(message)
                if config.output.completions_every and step % config.output.completions_every == 0:
                    write_completions(run_dir, step, batch.draw, batch.advantages, specs)
                console.update(step, metrics)
                failed_steps = failed_steps + 1 if math.isnan(metrics["grad_norm"]) else 0
                if config.train.max_consecutive_skips and failed_steps >= config.train.max_consecutive_skips:
                    raise TrainingDiverged(_diverged_message(run_dir, failed_steps))
                due = step == config.train.steps or (config.output.save_every and step % config.output.save_every == 0)
                if due or stop.requested:
                    path = save(step)
                if stop.requested:
                    console.print(f"{stop.requested}: stopped after step {step}; saved {path}. "
                                  f"Continue with: grpokit train CONFIG --resume")
                    break
    finally:
        console.close()
        writer.close()
    return run_dir


class TrainingDiverged(RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient."""


def _diverged_message(run_dir: Path, failed_steps: int) -> str:
    last = list_checkpoints(run_dir)
    where = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written yet"
    return (f"{failed_steps} steps in a row had a NaN/inf loss or gradient, so no update was applied; "
            f"stopping ({where}, untouched). Lower train.learning_rate, check the reward functions for "
            f"extreme values, or raise train.max_consecutive_skips.")


class GracefulStop:
    """SIGINT / SIGTERM ask the loop to finish its step, save and exit; a second SIGINT stops at once."""

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def lr_lambda(config: Config) -> Callable[[int], float]:
    """Linear warmup, then constant or cosine decay to 0 at the last step."""
    warmup, total, cosine = config.train.warmup_steps, config.train.steps, config.train.lr_schedule == "cosine"

    def factor(step: int) -> float:  # `step` counts optimizer steps taken so far
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if not cosine:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _restore(checkpoint: Path, model, optimizer, scheduler, sampler, stream) -> int:
    from safetensors.torch import load_file

    weights = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(str(shard), device=str(model.device)))
    model.load_state_dict(weights, strict=False)  # tied weights may be stored once
    state = load_trainer_state(checkpoint)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    sampler.set_state(state["sampler"])
    stream.load_state_dict(state["stream"])
    return int(state["step"])


# ---- 1. rollout and grading ---------------------------------------------------------


def generate_and_grade(config, model, tokenizer, prompts: PromptTable, stream, specs, sampler):
    """Sample G answers for B prompts and grade them; with dynamic sampling, keep drawing
    prompt batches (up to `max_resample_rounds` more) until B groups carry signal."""
    G, B, algo = config.rollout.group_size, config.train.prompts_per_step, config.algorithm
    draws: list[Draw] = []
    t_rollout = t_reward = 0.0
    for _ in range(1 + (algo.max_resample_rounds if algo.dynamic_sampling else 0)):
        indices = stream.next_batch()  # B row indices
        t0 = time.perf_counter()
        rollout = sample_groups(
            model, [prompts.ids[i] for i in indices], group_size=G,
            max_new_tokens=config.rollout.max_new_tokens, eos_token_ids=prompts.eos_token_ids,
            pad_token_id=tokenizer.pad_token_id, temperature=config.rollout.temperature,
            top_p=config.rollout.top_p, top_k=config.rollout.top_k, stop_strings=config.rollout.stop_strings,
            tokenizer=tokenizer, generator=sampler, ignore_eos=config.rollout.ignore_eos)
        t1 = time.perf_counter()
        draws.append(grade(rollout, [prompts.rows[i] for i in indices], tokenizer, specs, G))
        t_rollout, t_reward = t_rollout + t1 - t0, t_reward + time.perf_counter() - t1
        if not algo.dynamic_sampling or sum(d.with_signal(G).size for d in draws) >= B * G:
            break
    seen = reward_summary(torch.cat([d.total for d in draws]), G)  # before any filtering
    draw = draws[0] if not algo.dynamic_sampling else Draw.join([d.with_signal(G) for d in draws], B * G,
                                                                 tokenizer.pad_token_id, fallback=draws[-1])
    rollout = draw.rollout
    advantages = group_advantages(draw.total, G, scale_rewards=algo.scale_rewards, std=algo.std)
    loss_mask = rollout.completion_mask.clone()
    if algo.mask_truncated_completions:  # truncated answers carry no gradient
        loss_mask[rollout.truncated] = 0
    metrics = {**reward_summary(draw.total, G), **reward_metrics(specs, draw.per_fn),
               **completion_metrics(rollout.completion_mask, rollout.truncated),
               "time/rollout": t_rollout, "time/reward": t_reward}
    if algo.dynamic_sampling:  # what the filter saw before it dropped groups
        metrics["frac_reward_zero_std"] = seen["frac_reward_zero_std"]
        metrics["dynamic_sampling/groups_kept"] = draw.size / G
        metrics["dynamic_sampling/draws"] = len(draws)
    return GenerationBatch(draw, advantages, loss_mask), metrics


# ---- 2. reference and old log-probs (only when needed) ------------------------------


@torch.no_grad()
def score_old_and_ref(config: Config, model, ref_model, batch: GenerationBatch, linear_head: bool) -> None:
    if config.needs_old_logprobs:
        batch.old_logp = _score(config, model, batch, linear_head)
    if ref_model is not None:
        batch.ref_logp = _score(config, ref_model, batch, linear_head)


def _score(config: Config, model, batch: GenerationBatch, linear_head: bool) -> torch.Tensor:
    r, out = batch.rollout, []
    for rows in torch.arange(len(batch.advantages)).split(config.micro_batch_size):
        logp, _ = completion_logprobs(model, r.prompt_ids[rows], r.prompt_mask[rows], r.completion_ids[rows],
                                      r.completion_mask[rows], temperature=config.rollout.temperature,
                                      chunk_size=config.train.logprob_chunk_size, linear_head=linear_head)
        out.append(logp)
    return torch.cat(out)  # [N, T]


# ---- 3. policy update ---------------------------------------------------------------


def optimize(config: Config, model, optimizer, scheduler, batch: GenerationBatch, linear_head: bool) -> dict:
    """μ passes over the batch; each pass is split into minibatches (one optimizer step
    each), each minibatch into micro-batches (gradient accumulation)."""
    algo = config.algorithm
    N = len(batch.advantages)
    sums: dict[str, float] = {}
    grad_norms, losses, skipped = [], [], 0
    for _ in range(algo.num_iterations):
        order = torch.randperm(N) if config.minibatch_size < N else torch.arange(N)
        for minibatch in order.split(config.minibatch_size):
            optimizer.zero_grad(set_to_none=True)
            micro_batches = minibatch.split(config.micro_batch_size)
            n_items = batch.loss_mask[minibatch].sum().clamp(min=1)  # dapo: tokens of the whole minibatch
            loss = 0.0
            for rows in micro_batches:
                micro_loss, stats = _micro_step(config, model, batch, rows, n_items, len(micro_batches), linear_head)
                loss += micro_loss
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
            losses.append(loss)
            norm = _clip_grad(model, config.train.max_grad_norm)
            if math.isfinite(norm):
                optimizer.step()
                grad_norms.append(norm)
            else:  # a NaN/inf gradient must never reach the weights
                skipped += 1
            scheduler.step()
    tokens = sums.pop("_tokens")
    metrics = {k: v / max(tokens, 1) for k, v in sums.items()}  # all-masked batches report 0
    metrics["loss"] = sum(losses) / len(losses)
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics["skipped_updates"] = skipped
    return metrics


def _micro_step(config, model, batch, rows, n_items, n_micro, linear_head) -> tuple[float, dict[str, float]]:
    """Forward + backward on one micro-batch; returns its share of the minibatch loss
    and token-weighted sums of its stats."""
    algo, r = config.algorithm, batch.rollout
    T = int(r.completion_mask[rows].sum(-1).max().clamp(min=1))  # trim padding columns of this micro-batch
    mask = batch.loss_mask[rows, :T]
    logp, entropy = completion_logprobs(
        model, r.prompt_ids[rows], r.prompt_mask[rows], r.completion_ids[rows, :T], r.completion_mask[rows, :T],
        temperature=config.rollout.temperature, chunk_size=config.train.logprob_chunk_size,
        with_entropy=True, linear_head=linear_head)  # [n, T]
    loss, stats = policy_loss(
        logp, None if batch.old_logp is None else batch.old_logp[rows, :T], batch.advantages[rows], mask,
        ref_logp=None if batch.ref_logp is None else batch.ref_logp[rows, :T], beta=algo.beta,
        epsilon=algo.epsilon, epsilon_high=algo.clip_high, loss_type=algo.loss_type,
        importance_sampling_level=algo.importance_sampling_level,
        max_completion_length=config.rollout.max_new_tokens, num_items_in_batch=n_items)
    if algo.loss_type not in ("dapo", "cispo"):  # their normaliser already spans the minibatch
        loss = loss / n_micro
    loss.backward()
    tokens = mask.sum().item()
    out = {k: float(v) * tokens for k, v in stats.items()}
    out["entropy"] = (entropy.detach() * mask).sum().item()
    out["_tokens"] = tokens
    return loss.item(), out


def _clip_grad(model, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    limit = max_norm if max_norm > 0 else float("inf")
    return float(torch.nn.utils.clip_grad_norm_(params, limit))

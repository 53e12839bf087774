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

import errno
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from .errors import UserError
from .advantages import group_advantages
from .allocator import keep_freed_memory
from .checkpoint import CheckpointError, list_checkpoints, load_trainer_state, rng_state, save_checkpoint, set_rng_state
from .config import Config, to_toml
from .modeling import (check_model_folder, completion_logprobs, head_is_linear, load_model, load_tokenizer,
                       resolve_device)
from .objectives import policy_loss
from .grading import Draw, grade, write_completions
from .rewards import RewardSpec, reward_metrics
from .rollout import Rollout
from .diagnostics import Diagnostics
from .distributed import (CheckpointWeights, DistributedContext, all_ranks, gather_states, global_sum,
                          load_checkpoint_weights, load_device, load_optimizer_state, local_state, optimizer_state,
                          prepare_model, reduce_gradients)
from .engines import SamplingParams, build_engine, truncated_importance_weights
from .lora import AdapterDisabled, apply_lora
from .run_folder import RunFolder, RunFolderLock, prepare_run_folder, record_segment, with_resolved_paths
from .run_setup import (PreparedData, PromptTable, SetupError, max_positions_of, prepare_data, resolve_reward_specs,
                        tokenize_prompts)
from .tracking import ConsoleProgress, MetricsWriter, completion_metrics, drop_rows_after, reward_summary


@dataclass
class GenerationBatch:
    """One step's sampled, graded answers; N = B * G rows, group by group."""

    draw: Draw  # rollout (ids, masks, sampling logprobs, truncation), rewards [N] and [N, F], texts
    advantages: torch.Tensor  # [N]
    loss_mask: torch.Tensor  # [N, T] completion mask, truncated answers zeroed if asked
    old_logp: torch.Tensor | None = None  # [N, T] only when μ > 1 or several minibatches
    ref_logp: torch.Tensor | None = None  # [N, T] only when β > 0
    tis_weight: torch.Tensor | None = None  # [N, T] only with algorithm.tis_cap (a sampler other than the trainer)

    @property
    def rollout(self) -> Rollout:
        return self.draw.rollout


def train(
    config: Config,
    *,
    reward_functions: Sequence[Callable] | None = None,
    rows: Iterable[dict] | None = None,
    resume: bool = False,
    engine: Callable | None = None,
    command: str | None = None,
) -> Path:
    """Run GRPO as `config` says; returns the run folder. Python-side callables and
    rows may replace the config's `rewards.functions` and data source, and `engine(config,
    model, tokenizer)` the rollout engine (engines.py). Under torchrun every process runs this
    together (distributed.py): each takes its share of every batch, rank 0 writes the files.
    `command` is how the run was started (the CLI's own words); stop messages build the exact
    command that continues the run from it."""
    dist = DistributedContext.from_env()  # alone: rank 0 of 1, and every collective is a no-op
    lock = RunFolderLock(config.output.dir, command) if dist.is_main else None  # rank 0 holds the folder
    resume_hint = f"{command} --resume" if command and "--resume" not in command.split() else \
        command or "train(config, resume=True)"
    try:
        return _train(config, dist, lock, resume_hint, reward_functions=reward_functions, rows=rows, resume=resume,
                      engine=engine, command=command)
    except KeyboardInterrupt:  # a second Ctrl-C (or one before the loop): stop now, without a traceback
        last = list_checkpoints(config.output.dir)
        raise StoppedNow("interrupted (Ctrl-C): the run stopped at once; a step in progress is lost. "
                         + (f"The newest checkpoint is {last[-1]}; continue with: {resume_hint}" if last
                            else "No checkpoint was written yet; start again with the same command")) from None
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        last = list_checkpoints(config.output.dir)
        raise CheckpointError(f"{e.filename or config.output.dir}: could not write ({e.strerror}); "
                              + (f"the newest checkpoint is {last[-1]}; free space and continue with: {resume_hint}"
                                 if last else "no checkpoint was written yet; free space and start again")) from e
    finally:
        if lock is not None:
            lock.release()


def _train(config: Config, dist: DistributedContext, lock, resume_hint: str, *, reward_functions, rows, resume,
           engine, command) -> Path:
    # ---- checks and setup, all before the model loads -------------------------------
    run = dist.local_config(config)  # this process's share: B / world prompts per step
    check_model_folder(config.model.path)
    resolve_device(config.model.device)  # a device this machine lacks fails here, not after the folder is prepared
    data: PreparedData = prepare_data(config, rows)
    specs: list[RewardSpec] = resolve_reward_specs(config, data.task, reward_functions)
    tokenizer = load_tokenizer(config.model.path)
    prompts: PromptTable = tokenize_prompts(config, data, tokenizer, max_positions_of(config.model.path))
    folder: RunFolder = dist.run_on_main(prepare_run_folder, config, resume=resume, lock=lock)
    run_dir = folder.path
    if dist.is_main:
        for note in folder.notes:
            print(note, flush=True)
    if resume and folder.resume_step == config.train.steps:
        if dist.is_main:
            print(f"{run_dir} is already complete at step {folder.resume_step} (train.steps = {config.train.steps}); "
                  "raise train.steps to continue it", flush=True)
        return run_dir
    torch.manual_seed(config.train.seed)

    if config.train.keep_freed_memory and resolve_device(config.model.device).type == "cpu":
        keep_freed_memory()  # glibc: freed buffers stay mapped for the next step (allocator.py)
    model = load_model(config.model.path, dtype=config.model.dtype, device=load_device(config))
    ref_model = None
    if config.algorithm.beta > 0 and not config.model.lora:  # with β = 0 no reference model is loaded at all
        ref_model = load_model(config.model.path, dtype=config.model.dtype, device=load_device(config))
        ref_model.eval().requires_grad_(False)
    model.eval()  # dropout stays off throughout: ratio is exactly 1 before the first update
    linear_head = head_is_linear(model)
    if config.model.lora:  # adapters only; the KL reference is the same weights with the adapters off
        model = apply_lora(model, config.model.lora)
        ref_model = AdapterDisabled(model) if config.algorithm.beta > 0 else None
    model, ref_model, linear_head = prepare_model(model, ref_model, linear_head, fsdp=config.model.fsdp)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.train.learning_rate,
                                  betas=config.train.adam_betas, weight_decay=config.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    sampler = torch.Generator(device=model.device).manual_seed(config.train.seed + dist.rank)
    stream = dist.shard_stream(data.stream(config.train.prompts_per_step, seed=config.data.seed))
    rollout_engine = (engine or build_engine)(run, model, tokenizer)

    start_step = 0
    if resume and (checkpoints := list_checkpoints(run_dir)):
        start_step = _restore(checkpoints[-1], model, optimizer, scheduler, sampler, stream)
        for log in ("metrics.jsonl", "completions.jsonl"):
            if dist.is_main:
                drop_rows_after(run_dir / log, start_step)
    rollout_engine.sync_weights(model)  # vLLM starts from the trainer's (resumed) weights; HF: nothing to do
    if dist.is_main:
        record_segment(run_dir, config, folder, start_step, command)
    writer = dist.main_only(lambda: MetricsWriter(run_dir, append=start_step > 0, tensorboard=config.output.tensorboard,
                                                  wandb=config.output.wandb))
    console = dist.main_only(lambda: ConsoleProgress(config.train.steps, start_step, enabled=config.output.console))
    diagnostics = Diagnostics.from_config(config)  # the seeds' common mistakes, each printed once
    for message in diagnostics.check_config(config):
        console.print(message)

    # ---- the loop -------------------------------------------------------------------
    def save(step: int) -> Path:
        state = {"step": step, "optimizer": optimizer_state(model, optimizer), "scheduler": scheduler.state_dict(),
                 "rng": rng_state(), "sampler": gather_states(sampler.get_state()), "stream": stream.state_dict()}
        weights = CheckpointWeights(model)  # gathered under FSDP; with LoRA the merged model + adapter/
        return dist.run_on_main(save_checkpoint, run_dir, step, weights, tokenizer, state, config.output.keep_last,
                                config_text, resume_hint)

    config_text = to_toml(with_resolved_paths(config))  # what each checkpoint records; a resume is checked against it

    failed_steps = 0  # consecutive steps whose every update was skipped as non-finite
    try:
        with GracefulStop() as stop:
            for step in range(start_step + 1, config.train.steps + 1):
                t0 = time.perf_counter()
                batch, gen_metrics = generate_and_grade(run, model, tokenizer, prompts, stream, specs, sampler,
                                                        rollout_engine)
                t1 = time.perf_counter()
                score_old_and_ref(run, model, ref_model, batch, linear_head)
                if run.algorithm.tis_cap:  # the sampler is not the trainer (vLLM): weight tokens by their gap
                    gen_metrics.update(_tis(run, model, batch, linear_head))
                train_metrics = optimize(run, model, optimizer, scheduler, batch, linear_head)
                rollout_engine.sync_weights(model)  # vLLM: push the new weights; HF: the sampler is the model
                t2 = time.perf_counter()
                n_tokens = batch.rollout.completion_mask.sum().item()
                metrics = {**gen_metrics, **train_metrics,
                           "learning_rate": scheduler.get_last_lr()[0],
                           "time/rollout": gen_metrics.pop("time/rollout"), "time/train": t2 - t1,
                           "time/step": t2 - t0, "tokens_per_sec": n_tokens / (t2 - t0)}
                metrics = dist.reduce_metrics(metrics, batch, specs, run)  # over all processes
                writer.write(step, metrics)
                for message in diagnostics.update(step, metrics):
                    console.print(message)
                if config.output.completions_every and step % config.output.completions_every == 0:
                    draw, advantages = dist.gather_draw(batch.draw, batch.advantages)
                    if dist.is_main:
                        write_completions(run_dir, step, draw, advantages, specs)
                console.update(step, metrics)
                failed_steps = failed_steps + 1 if math.isnan(metrics["grad_norm"]) else 0
                if config.train.max_consecutive_skips and failed_steps >= config.train.max_consecutive_skips:
                    raise TrainingDiverged(_diverged_message(run_dir, failed_steps))
                due = step == config.train.steps or (config.output.save_every and step % config.output.save_every == 0)
                stopping = dist.any(bool(stop.requested))  # a signal to any process stops them all
                if due or stopping:
                    path = save(step)
                if stopping:
                    console.print(f"{stop.requested or 'a stop on another process'}: stopped after step {step}; saved {path}. "
                                  f"Continue with: {resume_hint}")
                    break
    finally:
        console.close()
        writer.close()
        dist.close()
    return run_dir


class TrainingDiverged(UserError, RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient."""


class StoppedNow(UserError, KeyboardInterrupt):
    """Ctrl-C stopped the run at once (a second one in the loop, or one before the loop started): the CLI says so in one line and exits 130 (as shells
    expect of Ctrl-C); Python callers can still catch it as KeyboardInterrupt."""

    label, exit_code = "stopped", 130


def _diverged_message(run_dir: Path, failed_steps: int) -> str:
    last = list_checkpoints(run_dir)
    where = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written yet"
    return (f"{failed_steps} steps in a row had a NaN/inf loss or gradient, so no update was applied; "
            f"stopping ({where}, untouched). Lower train.learning_rate, check the reward functions for "
            f"extreme values, or raise train.max_consecutive_skips.")


class GracefulStop:
    """SIGINT / SIGTERM ask the loop to finish its step, save and exit; a second SIGINT stops at once.
    The first one says so at once (a step may take long, or hang in a reward function)."""

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        # os.write, not print: a signal handler may run in the middle of another print
        os.write(2, f"\n{self.requested}: stopping after the current step, which is then saved; press Ctrl-C "
                    "again to stop at once (that step is lost, the newest checkpoint stays)\n".encode())

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
    load_checkpoint_weights(checkpoint, model)  # plain, FSDP-sharded, or the LoRA adapter alone
    state = load_trainer_state(checkpoint)
    load_optimizer_state(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    sampler.set_state(local_state(state["sampler"]))  # this process's generator
    try:
        stream.load_state_dict(state["stream"])
    except ValueError as e:  # a different dataset or seed than the run being resumed
        raise SetupError(f"--resume from {checkpoint}: {e}") from e
    return int(state["step"])


# ---- 1. rollout and grading ---------------------------------------------------------


def generate_and_grade(config, model, tokenizer, prompts: PromptTable, stream, specs, sampler, engine=None):
    """Sample G answers for B prompts and grade them; with dynamic sampling, keep drawing
    prompt batches (up to `max_resample_rounds` more) until B groups carry signal."""
    engine = engine or build_engine(config, model, tokenizer)
    sampling = SamplingParams.from_config(config, prompts.eos_token_ids, tokenizer.pad_token_id)
    G, B, algo = config.rollout.group_size, config.train.prompts_per_step, config.algorithm
    draws: list[Draw] = []
    t_rollout = t_reward = 0.0
    for _ in range(1 + (algo.max_resample_rounds if algo.dynamic_sampling else 0)):
        indices = stream.next_batch()  # B row indices
        t0 = time.perf_counter()
        rollout = engine.generate([prompts.ids[i] for i in indices], group_size=G, sampling=sampling,
                                  generator=sampler)
        t1 = time.perf_counter()
        draws.append(grade(rollout, [prompts.rows[i] for i in indices], tokenizer, specs, G))
        t_rollout, t_reward = t_rollout + t1 - t0, t_reward + time.perf_counter() - t1
        # several processes: every one draws as often as the one that needs most (streams stay in step)
        if not algo.dynamic_sampling or all_ranks(sum(d.with_signal(G).size for d in draws) >= B * G):
            break
    seen = reward_summary(torch.cat([d.total for d in draws]), G)  # before any filtering
    draw = draws[0] if not algo.dynamic_sampling else Draw.join([d.with_signal(G) for d in draws], B * G,
                                                                 tokenizer.pad_token_id, fallback=draws[-1])
    rollout = draw.rollout
    advantages = group_advantages(draw.total, G, scale_rewards=algo.scale_rewards, std=algo.std,
                                  estimator=algo.advantage_estimator)
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
        mode = config.algorithm.old_logprobs
        if mode == "sampler":  # the rollout's own log-probs: the same policy, no extra pass
            batch.old_logp = batch.rollout.logprobs
        elif mode == "recompute" or config.minibatch_size < len(batch.advantages):
            batch.old_logp = _score(config, model, batch, linear_head)
        # "first_pass" with one minibatch: optimize() keeps the first pass's log-probs (no update precedes them)
    if ref_model is not None:
        batch.ref_logp = _score(config, ref_model, batch, linear_head)


def _score(config: Config, model, batch: GenerationBatch, linear_head: bool) -> torch.Tensor:
    r, out = batch.rollout, []
    for rows in torch.arange(len(batch.advantages)).split(config.micro_batch_size):
        logp, _ = completion_logprobs(model, r.prompt_ids[rows], r.prompt_mask[rows], r.completion_ids[rows],
                                      r.completion_mask[rows], temperature=config.rollout.temperature,
                                      chunk_size=config.train.logprob_chunk_size, linear_head=linear_head,
                                      fused=config.train.fused_logprobs)
        out.append(logp)
    return torch.cat(out)  # [N, T]


def _tis(config: Config, model, batch: GenerationBatch, linear_head: bool) -> dict:
    """Truncated importance sampling (engines.py): per-token weights min(exp(trainer - sampler), cap),
    with the trainer's log-probs before the update (the old ones when the trainer computed them, else a
    no-grad pass; never the sampler's own, which algorithm.old_logprobs = "sampler" would reuse)."""
    own = batch.old_logp is not None and batch.old_logp is not batch.rollout.logprobs
    with torch.no_grad():
        trainer_logp = batch.old_logp if own else _score(config, model, batch, linear_head)
    batch.tis_weight, stats = truncated_importance_weights(trainer_logp, batch.rollout.logprobs, batch.loss_mask,
                                                           config.algorithm.tis_cap)
    return stats


# ---- 3. policy update ---------------------------------------------------------------


def optimize(config: Config, model, optimizer, scheduler, batch: GenerationBatch, linear_head: bool) -> dict:
    """μ passes over the batch; each pass is split into minibatches (one optimizer step
    each), each minibatch into micro-batches (gradient accumulation)."""
    algo = config.algorithm
    N = len(batch.advantages)
    sums: dict[str, float] = {}
    grad_norms, losses, skipped = [], [], 0
    # old_logprobs = "first_pass": the first pass runs on-policy (ratio 1) and its log-probs become the old ones
    first_logp = torch.zeros(batch.loss_mask.shape, device=batch.loss_mask.device) \
        if config.needs_old_logprobs and batch.old_logp is None else None
    for iteration in range(algo.num_iterations):
        order = torch.randperm(N) if config.minibatch_size < N else torch.arange(N)
        for minibatch in order.split(config.minibatch_size):
            optimizer.zero_grad(set_to_none=True)
            micro_batches = minibatch.split(config.micro_batch_size)
            n_items = global_sum(batch.loss_mask[minibatch].sum()).clamp(min=1)  # dapo: minibatch tokens, all ranks
            loss = 0.0
            for rows in micro_batches:
                micro_loss, stats, logp = _micro_step(config, model, batch, rows, n_items, len(micro_batches),
                                                      linear_head)
                if first_logp is not None and iteration == 0:
                    first_logp[rows, :logp.shape[1]] = logp
                loss += micro_loss
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
            losses.append(loss)
            reduce_gradients(model, algo.loss_type)  # several processes: the whole batch's gradient on each
            norm = _clip_grad(model, config.train.max_grad_norm)
            if math.isfinite(norm):
                optimizer.step()
                grad_norms.append(norm)
            else:  # a NaN/inf gradient must never reach the weights
                skipped += 1
            scheduler.step()
        if first_logp is not None and iteration == 0:
            batch.old_logp = first_logp
    tokens, entropy_tokens = sums.pop("_tokens"), sums.pop("_entropy_tokens")
    metrics = {k: v / max(tokens, 1) for k, v in sums.items()}  # all-masked batches report 0
    # entropy: over the answers that went through the model (all of them unless zero-advantage ones were skipped)
    metrics["entropy"] = sums["entropy"] / entropy_tokens if entropy_tokens else 0.0 if not tokens else float("nan")
    metrics["loss"] = sum(losses) / len(losses)
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics["skipped_updates"] = skipped
    return metrics


def _micro_step(config, model, batch, rows, n_items, n_micro, linear_head):
    """Forward + backward on one micro-batch; returns its share of the minibatch loss, token-weighted
    sums of its stats, and its log-probs [n, T] (detached).

    With β = 0 an answer whose advantage is 0 adds exactly 0 to the loss and to its gradient, so it
    is left out of the forward (`train.skip_zero_advantage`); the loss is still evaluated on the full
    [n, T] layout (0 log-probs in those rows), so every normaliser stays what it was."""
    algo, r, train = config.algorithm, batch.rollout, config.train
    T = int(r.completion_mask[rows].sum(-1).max().clamp(min=1))  # trim padding columns of this micro-batch
    mask, adv = batch.loss_mask[rows, :T], batch.advantages[rows]
    old = None if batch.old_logp is None else batch.old_logp[rows, :T]
    ref = None if batch.ref_logp is None else batch.ref_logp[rows, :T]
    tis = None if batch.tis_weight is None else batch.tis_weight[rows, :T]

    def loss_of(logp, entropy=None):  # [n, T] -> this micro-batch's share of the minibatch loss, stats
        loss, stats = policy_loss(
            logp, old, adv, mask, ref_logp=ref, beta=algo.beta, epsilon=algo.epsilon, epsilon_high=algo.clip_high,
            loss_type=algo.loss_type, importance_sampling_level=algo.importance_sampling_level,
            max_completion_length=config.rollout.max_new_tokens, num_items_in_batch=n_items,
            kl_bias_correction=algo.kl_bias_correction, entropy=entropy, entropy_coef=algo.entropy_coef,
            top_entropy_quantile=algo.top_entropy_quantile, token_weights=tis)
        # dapo's and cispo's normaliser already spans the minibatch
        return (loss if algo.loss_type in ("dapo", "cispo") else loss / n_micro), stats

    n = len(rows)
    # entropy options: a zero-advantage answer still has an entropy gradient, and its tokens count in the quantile
    skippable = train.skip_zero_advantage and algo.beta == 0 and not algo.uses_entropy
    keep = (adv != 0).nonzero()[:, 0] if skippable else torch.arange(n)
    keep = keep.to(mask.device)
    constant = old is None and algo.beta == 0  # on-policy, no KL: dLoss/dlogp does not depend on logp
    grad_fn = None
    if len(keep) and linear_head and train.fused_logprobs and not algo.uses_entropy and \
            (constant or algo.importance_sampling_level == "token"):  # one-pass: the loss must depend on logp only
        grad_fn = _logp_grad_fn(loss_of, n, T, keep, constant)
    if len(keep):
        sel = rows if len(keep) == n else rows[keep.to(rows.device)]
        logp_kept, entropy = completion_logprobs(
            model, r.prompt_ids[sel], r.prompt_mask[sel], r.completion_ids[sel, :T], r.completion_mask[sel, :T],
            temperature=config.rollout.temperature, chunk_size=train.logprob_chunk_size, with_entropy=True,
            linear_head=linear_head, fused=train.fused_logprobs, grad_fn=grad_fn)  # [k, T]
        logp = logp_kept if len(keep) == n else logp_kept.new_zeros(n, T).index_copy(0, keep, logp_kept)
    else:  # nothing carries a gradient: no model call at all
        logp = torch.zeros(n, T, device=mask.device)
    loss, stats = loss_of(logp, entropy if algo.uses_entropy else None)
    if logp.requires_grad:
        loss.backward()
    tokens = mask.sum().item()
    out = {k: float(v) * tokens for k, v in stats.items()}
    kept_mask = mask[keep]
    out["entropy"] = (entropy.detach() * kept_mask).sum().item() if len(keep) else 0.0
    out["_entropy_tokens"] = kept_mask.sum().item()
    out["_tokens"] = tokens
    return loss.item(), out, logp.detach()


def _logp_grad_fn(loss_of, n: int, T: int, keep: torch.Tensor, constant: bool):
    """dLoss/dlogp for a chunk of the kept rows' flattened [k*T] log-probs: the input of the fused
    head's one-pass backward. Valid because each loss here is a sum of per-token terms (or, when
    `constant`, has a gradient independent of logp); fused_logprobs checks it against autograd's."""
    k = len(keep)

    def grad_at(flat: torch.Tensor) -> torch.Tensor:  # [k*T] -> [k*T]
        with torch.enable_grad():
            logp = flat.new_zeros(n, T).index_copy(0, keep, flat.view(k, T)).requires_grad_()
            (g,) = torch.autograd.grad(loss_of(logp)[0], logp)
        return g.index_select(0, keep).reshape(-1)

    if constant:
        g = grad_at(torch.zeros(k * T, device=keep.device))
        return lambda lp, start: g[start:start + len(lp)]
    buf = torch.zeros(k * T, device=keep.device)

    def per_chunk(lp: torch.Tensor, start: int) -> torch.Tensor:
        buf[start:start + len(lp)] = lp
        return grad_at(buf)[start:start + len(lp)]

    return per_chunk


def _clip_grad(model, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    limit = max_norm if max_norm > 0 else float("inf")
    return float(torch.nn.utils.clip_grad_norm_(params, limit))

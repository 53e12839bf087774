"""The GRPO training loop, readable top to bottom.

    prompts ─► rollout: G answers per prompt ─► rewards r[B, G] ─► advantages A[B, G]
            ─► [dynamic sampling] ─► old / ref logprobs (only when needed)
            ─► μ passes × minibatches × micro-batches: clipped surrogate + β·KL
            ─► metrics, checkpoint

`train(config)` is the whole product: everything that can be checked is checked
before the model loads (setup.py), then each step is rollout -> grade ->
advantages (generate.py) -> update (update.py) -> log -> save. The math lives in
`algorithms/`; this module only says in which order things happen.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from grpokit.config.loading import to_toml
from grpokit.config.schema import Config
from grpokit.errors import RewardError, RolloutWorkerError, TrainingDiverged
from grpokit.models.lora import check_given_model
from grpokit.models.onednn import onednn_linears
from grpokit.models.parallel import DistributedContext
from grpokit.models.threads import configure_threads
from grpokit.observe.diagnostics import Diagnostics
from grpokit.observe.metrics import num_tokens, reduce_metrics
from grpokit.observe.tracking import ConsoleProgress, MetricsWriter, drop_rows_after, write_completions
from grpokit.rollout.agent_engine import agent_engine_from_config
from grpokit.training.checkpoint import CheckpointWeights, list_checkpoints, save_checkpoint, trainer_state
from grpokit.training.evaluation import BestCheckpoint, HeldOut
from grpokit.training.reference import sync_reference
from grpokit.training.rollout_source import build_rollouts, check_async, split_threads
from grpokit.training.run_folder import RunFolderLock, record_segment, with_resolved_paths
from grpokit.training.setup import Run, build_run, check_inputs
from grpokit.training.stopping import (
    GracefulStop,
    continue_command,
    diverged_message,
    stop_messages,
    ungraded_message,
)
from grpokit.training.update import optimize, score_old_and_ref, with_is_weights


def train(
    config: Config,
    *,
    reward_functions: Sequence[Callable] | None = None,
    rows: Iterable[dict] | None = None,
    resume: bool = False,
    engine: Callable | None = None,
    command: str | None = None,
    tools: Sequence[Callable] | None = None,
    environment_factory: Callable | dict | None = None,
    eval_rows: Iterable[dict] | None = None,
    model=None,
    ref_model=None,
) -> Path:
    """Run GRPO as `config` says; returns the run folder. Python-side callables and
    rows may replace the config's `rewards.functions` and data source, `tools` and `environment_factory`
    its `tools.functions` and `tools.environment` (TRL's: multi-turn rollouts), and `engine(config,
    model, tokenizer)` the rollout engine (rollout/engines.py), and `eval_rows` the held-out prompts of
    `[eval]` (its `eval.path`), and `model` an already-loaded module of `config.model.path`'s weights to train
    in place (the TRL drop-in's `trainer.model`) instead of loading the folder, and `ref_model` a loaded copy of
    them as the KL reference (β > 0 without LoRA; the drop-in's `trainer.ref_model`). Under torchrun every process runs
    this together (models/parallel.py): each takes its share of every batch, rank 0 writes the
    files. `command` is how the run was started (the CLI's own words); stop messages build the
    exact command that continues the run from it."""
    if engine is None and config.tools.agent:  # a black-box agent: the endpoint on the run's own engine
        engine = agent_engine_from_config(config)
    dist = DistributedContext.from_env()  # alone: rank 0 of 1, and every collective is a no-op
    lock = RunFolderLock(config.output.dir, command) if dist.is_main else None  # rank 0 holds the folder
    hint = continue_command(command)
    inputs = None
    try:
        with stop_messages(Path(config.output.dir).absolute(), hint):  # Ctrl-C, a full disk: how to continue
            inputs = check_inputs(config, dist, lock, rows=rows, reward_functions=reward_functions, resume=resume,
                                  tools=tools, environment_factory=environment_factory, eval_rows=eval_rows)
            if dist.is_main:
                for note in inputs.folder.notes + inputs.notes:
                    print(note, flush=True)
            if inputs.complete:
                if dist.is_main:
                    print(f"{inputs.folder.path} is already complete at step {config.train.steps} (train.steps = "
                          f"{config.train.steps}); raise train.steps to continue it", flush=True)
                return inputs.folder.path
            check_async(config, engine)
            if model is not None:
                check_given_model(model)
            threads = split_threads(config)[0] if config.rollout.mode == "async" else config.train.num_threads
            _, crowded = configure_threads(threads)
            if crowded and dist.is_main:
                print(crowded, flush=True)
            run = build_run(config, inputs, dist, engine, model, ref_model)
            objects = dict(rows=rows, reward_functions=reward_functions, tools=tools,
                           environment_factory=environment_factory)  # what async rollout workers rebuild
            try:
                return _loop(config, run, dist, hint, command, objects)
            finally:  # an agent engine's endpoint (rollout/agent_endpoint.py) stops with the run
                getattr(run.engine, "stop_serving", lambda: None)()
    finally:
        if inputs is not None and inputs.reward_pool is not None:
            inputs.reward_pool.close()  # the isolated rewards' worker processes
        for kind in inputs.environments.kinds.values() if inputs is not None and inputs.environments else ():
            getattr(kind.cls, "grpokit_close", lambda: None)()  # servers grpokit started (rollout/adapters.py)
        if lock is not None:
            lock.release()


def _loop(config: Config, run: Run, dist: DistributedContext, hint: str, command: str | None,
          objects: dict) -> Path:
    local, inputs, policy = run.inputs.local, run.inputs, run.policy  # local: this process's share
    run_dir = inputs.folder.path
    if dist.is_main:
        for log in ("metrics.jsonl", "completions.jsonl") if run.start_step else ():  # steps after it are redone
            drop_rows_after(run_dir / log, run.start_step)
        record_segment(run_dir, config, inputs.folder, run.start_step, command)
    writer = dist.main_only(lambda: MetricsWriter(run_dir, append=run.start_step > 0,
                                                  tensorboard=config.output.tensorboard, wandb=config.output.wandb))
    console = dist.main_only(lambda: ConsoleProgress(config.train.steps, run.start_step, enabled=config.output.console))
    diagnostics = Diagnostics.from_config(config)  # common mistakes, each said once
    for message in diagnostics.check_config(config):
        console.print(message)
    config_text = to_toml(with_resolved_paths(config))  # what each checkpoint records; a resume is checked against it
    held_out = HeldOut(inputs.held_out, config, inputs.tools, inputs.environments) \
        if inputs.held_out is not None else None
    best = BestCheckpoint(run_dir, config.output.keep_best) if config.output.keep_best and dist.is_main else None

    def save(step: int, keep_step: int | None = None) -> Path:
        state = trainer_state(step, policy, run.sampler, run.stream)
        weights = CheckpointWeights(policy.model)  # gathered under FSDP; with LoRA the merged model + adapter/
        return dist.run_on_main(save_checkpoint, run_dir, step, weights, inputs.tokenizer, state,
                                config.output.keep_last, config_text, hint, keep_step)

    failed_steps = 0  # consecutive steps whose every update was skipped as non-finite
    ungraded_steps = 0  # consecutive steps in which no reward function graded any answer
    saved = run.start_step  # the newest step with a checkpoint
    rollouts = None
    try:
        with GracefulStop() as stop:
            rollouts = build_rollouts(config, run, run_dir, **objects)  # sync, or worker processes (async)
            for step in range(run.start_step + 1, config.train.steps + 1):
                t0 = time.perf_counter()
                # rollout -> grade -> advantages (async: a batch the workers sampled meanwhile)
                try:
                    batch, gen_metrics = rollouts.next(step)
                except RolloutWorkerError as e:  # the finished steps are kept, the folder resumable
                    path = save(step - 1) if step - 1 > saved and dist.world_size == 1 else None
                    kept = f"step {step - 1} is saved ({path})" if path else "the newest checkpoint stays"
                    if path is None and not list_checkpoints(run_dir):  # nothing to --resume from
                        raise RolloutWorkerError(f"{e}; no checkpoint was written yet: start again with the same "
                                                 "command") from None
                    raise RolloutWorkerError(f"{e}; {kept}. Continue with: {hint}") from None
                t1 = time.perf_counter()
                # update: old / reference log-probs, then μ passes of clipped-surrogate steps
                # (oneDNN linears: the backward runs inside the block)
                with onednn_linears(policy.model, policy.ref_model, enabled=local.train.onednn_linear):
                    batch = score_old_and_ref(local, policy, batch)
                    if local.algorithm.is_correction != "none":  # the sampler's log-probs are not the trainer's
                        batch, is_metrics = with_is_weights(local, policy, batch)
                        gen_metrics.update(is_metrics)
                    train_metrics, _ = optimize(local, policy, batch)
                train_metrics.update(sync_reference(local, policy, step))  # ref_sync_every: reference -> policy
                train_metrics.update(rollouts.publish(policy.model, step))  # the samplers get the new weights
                t2 = time.perf_counter()
                # log
                n_tokens = batch.rollout.completion_mask.sum().item()
                metrics = {**gen_metrics, **train_metrics, "learning_rate": policy.scheduler.get_last_lr()[0],
                           "time/rollout": gen_metrics.pop("time/rollout"), "time/train": t2 - t1,
                           "time/step": t2 - t0, "tokens_per_sec": n_tokens / (t2 - t0)}
                metrics = reduce_metrics(metrics, batch, inputs.specs, local)  # over all processes
                metrics["num_tokens"] = num_tokens(run_dir / "metrics.jsonl", batch.rollout)  # TRL's: tokens seen
                if held_out is not None and held_out.due(step):  # [eval]: every process scores its share
                    t3 = time.perf_counter()
                    try:
                        metrics.update(held_out.run(policy.model, inputs.tokenizer, inputs.specs))
                    except Exception:
                        if dist.world_size == 1:  # the step itself finished: its row and a checkpoint stay
                            writer.write(step, metrics)
                            path = save(step, best.step if best else None)
                            console.print(f"step {step} finished and is saved ({path}); its evaluation failed. "
                                          f"Continue with: {hint}")
                        raise
                    metrics["time/eval"] = time.perf_counter() - t3
                    console.print(f"step {step}: " + "  ".join(f"{k} {v:.3f}" for k, v in metrics.items()
                                                                if k.startswith("eval/")))
                writer.write(step, metrics)
                for message in diagnostics.update(step, metrics):
                    console.print(message)
                if config.output.completions_every and step % config.output.completions_every == 0:
                    draw, advantages = dist.gather_draw(batch.draw, batch.advantages)
                    if dist.is_main:
                        write_completions(run_dir, step, draw, advantages, inputs.specs)
                console.update(step, metrics)
                failed_steps = failed_steps + 1 if math.isnan(metrics["grad_norm"]) else 0
                if config.train.max_consecutive_skips and failed_steps >= config.train.max_consecutive_skips:
                    raise TrainingDiverged(diverged_message(run_dir, failed_steps))
                # rewards.on_error = "skip" with a grader that is down: no answer graded, nothing learned
                ungraded_steps = ungraded_steps + 1 if not dist.any(bool((~batch.draw.total.isnan()).any())) else 0
                if config.train.max_consecutive_skips and ungraded_steps >= config.train.max_consecutive_skips:
                    raise RewardError(ungraded_message(run_dir, ungraded_steps, metrics, hint))
                # save
                due = step == config.train.steps or (config.output.save_every and step % config.output.save_every == 0)
                improved = dist.any(best is not None and best.improves(metrics))  # rank 0 decides
                stopping = dist.any(bool(stop.requested))  # a signal to any process stops them all
                if due or stopping or improved:
                    path, saved = save(step, step if improved else (best.step if best else None)), step
                if improved and best is not None:
                    best.record(step, metrics[best.metric], path)
                    console.print(f"step {step}: best {best.metric} so far ({best.value:.4f}): {path.name} is kept")
                if stopping:
                    console.print(f"{stop.requested or 'a stop on another process'}: stopped after step {step}; "
                                  f"saved {path}. Continue with: {hint}")
                    break
    finally:
        if rollouts is not None:
            rollouts.close()  # async: the worker processes stop
        console.close()
        writer.close()
        dist.close()
    return run_dir

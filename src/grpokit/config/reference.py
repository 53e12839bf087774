"""docs/CONFIG.md, generated from the config dataclasses: every field of every section.

    python -m grpokit.config.reference > docs/CONFIG.md

Nothing here repeats what schema.py says: the fields, their types and defaults come from the
dataclasses (`SECTIONS`), each field's meaning from its comment in schema.py's source (the trailing
`# ...`, or the comment block above it), its allowed values from the `one_of(self.FIELD, ...)`
calls of the section's checks, and its constraint from the constant messages of its `check(...,
"section.field", "must ...")` calls. What schema.py cannot say is kept here: the matching TRL
`GRPOConfig` names (`TRL_NAMES`), and a meaning for the few fields that have no comment yet
(`_MEANINGS`; a test fails once schema.py gives such a field a comment of its own).
tests/test_config_reference.py fails when docs/CONFIG.md is out of date.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import typing
from functools import cache

from grpokit.config import algorithm, evaluation, options, schema, variants
from grpokit.config.checks import field_types, toml_value
from grpokit.config.presets import PRESETS

REGENERATE = "python -m grpokit.config.reference > docs/CONFIG.md"

# grpokit field -> the TRL (1.16) `GRPOConfig` field(s) closest to it; several names joined by " + ".
# A note after " (" is shown as written. tests/test_config_reference.py checks each name against TRL.
TRL_NAMES = {
    "model.dtype": "model_init_kwargs (its dtype)",
    "model.fsdp": "fsdp",
    "rewards.weights": "reward_weights",
    "rollout.group_size": "num_generations",
    "data.shuffle": "shuffle_dataset",
    "rollout.max_new_tokens": "max_completion_length",
    "rollout.temperature": "temperature",
    "rollout.top_p": "top_p",
    "rollout.top_k": "top_k",
    "rollout.stop_strings": "generation_kwargs (its stop_strings)",
    "rollout.engine": "use_vllm + vllm_mode (\"vllm\" = use_vllm=True, vllm_mode=\"colocate\" or \"server\")",
    "rollout.vllm": "vllm_gpu_memory_utilization + vllm_enable_sleep_mode + vllm_max_model_length (server: "
                    "vllm_server_base_url or vllm_server_host + vllm_server_port, server_timeout_s: "
                    "vllm_server_timeout)",
    "algorithm.loss_type": "loss_type",
    "algorithm.beta": "beta",
    "algorithm.epsilon": "epsilon",
    "algorithm.epsilon_high": "epsilon_high",
    "algorithm.scale_rewards": "scale_rewards",
    "algorithm.importance_sampling_level": "importance_sampling_level",
    "algorithm.num_iterations": "num_iterations",
    "algorithm.mask_truncated_completions": "mask_truncated_completions",
    "algorithm.entropy_coef": "entropy_coef",
    "algorithm.top_entropy_quantile": "top_entropy_quantile",
    "algorithm.kl_bias_correction": "use_bias_correction_kl",
    "algorithm.tis_cap": "vllm_importance_sampling_cap (TRL's deprecated spelling of its clip_max)",
    "algorithm.delta": "delta",
    "algorithm.sapo_temperature_pos": "sapo_temperature_pos",
    "algorithm.sapo_temperature_neg": "sapo_temperature_neg",
    "algorithm.vespo_k_pos": "vespo_k_pos",
    "algorithm.vespo_lambda_pos": "vespo_lambda_pos",
    "algorithm.vespo_k_neg": "vespo_k_neg",
    "algorithm.vespo_lambda_neg": "vespo_lambda_neg",
    "algorithm.off_policy_mask_threshold": "off_policy_mask_threshold",
    "algorithm.adaptive_entropy": "use_adaptive_entropy",
    "algorithm.entropy_target": "entropy_target",
    "algorithm.entropy_coef_min": "entropy_coef_min",
    "algorithm.entropy_coef_max": "entropy_coef_max",
    "algorithm.entropy_coef_delta": "entropy_coef_delta",
    "algorithm.is_correction": "vllm_importance_sampling_mode + vllm_importance_sampling_correction (\"none\" = "
                               "correction off; TRL corrects only with use_vllm)",
    "algorithm.is_cap_max": "vllm_importance_sampling_clip_max",
    "algorithm.is_cap_min": "vllm_importance_sampling_clip_min",
    "algorithm.ref_sync_every": "sync_ref_model + ref_model_sync_steps (TRL counts optimizer steps)",
    "algorithm.ref_mixup_alpha": "ref_model_mixup_alpha",
    "rewards.aggregation": "multi_objective_aggregation",
    "train.steps": "max_steps (TRL counts optimizer steps)",
    "train.prompts_per_step": "generation_batch_size (TRL counts answers: prompts_per_step × group_size)",
    "train.minibatch_size": "gradient_accumulation_steps (minibatch = per_device_train_batch_size × processes × "
                            "gradient_accumulation_steps)",
    "train.micro_batch_size": "per_device_train_batch_size",
    "train.learning_rate": "learning_rate",
    "train.weight_decay": "weight_decay",
    "train.adam_betas": "adam_beta1 + adam_beta2",
    "train.warmup_steps": "warmup_steps",
    "train.lr_schedule": "lr_scheduler_type",
    "train.max_grad_norm": "max_grad_norm",
    "train.seed": "seed",
    "output.dir": "output_dir",
    "output.save_every": "save_steps",
    "output.keep_last": "save_total_limit",
    "output.completions_every": "log_completions",
    "output.console": "disable_tqdm (inverted)",
    "output.tensorboard": "report_to (\"tensorboard\")",
    "output.wandb": "report_to (\"wandb\")",
    "tools.max_calls": "max_tool_calling_iterations",
    "eval.every": "eval_steps (with eval_strategy=\"steps\")",
    "eval.max_new_tokens": "max_completion_length (TRL evaluates with the training settings)",
    "output.keep_best": "metric_for_best_model (with load_best_model_at_end)",
}

# grpokit field -> the `GRPOTrainer(...)` argument it corresponds to (not a GRPOConfig field).
TRL_TRAINER_ARGS = {
    "model.path": "model",
    "model.lora": "peft_config",
    "rewards.functions": "reward_funcs",
    "tools.functions": "tools",
    "tools.environment": "environment_factory",
}

# A meaning for the fields schema.py gives no comment; a comment in schema.py wins (and a test then
# asks to delete the entry here).
_MEANINGS = {
    "model.path": "the model to train: a local Hugging Face model folder (config.json, weights, tokenizer)",
    "data.prompt_column": "the column holding the prompt (a string or a list of chat messages)",
    "data.seed": "seed of the generated prompts of a built-in task and of the prompt order",
    "rollout.max_new_tokens": "tokens per answer at most",
    "rollout.temperature": "sampling temperature (the trainer scores the answers at the same temperature)",
    "rollout.top_p": "nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1 = off",
    "rollout.top_k": "sample from the k most likely tokens only; 0 = off",
    "rollout.stop_strings": "an answer ends at the first of these strings (kept in the answer)",
    "algorithm.epsilon": "clip range of the policy ratio: [1 - epsilon, 1 + epsilon_high]",
    "algorithm.mask_truncated_completions": "answers cut off at max_new_tokens add nothing to the loss (DAPO)",
    "train.steps": "optimizer steps of the run (each on a fresh generation batch)",
    "train.learning_rate": "AdamW learning rate (the peak, after warmup)",
    "train.weight_decay": "AdamW weight decay; 0 = off",
    "train.adam_betas": "AdamW (beta1, beta2)",
    "train.warmup_steps": "steps of linear learning-rate warmup from 0",
    "train.seed": "seed of sampling, prompt order and initialisation",
    "output.dir": "the run folder: metrics.jsonl, config.toml, checkpoints, logs",
}

# Allowed values the checks do not spell as `one_of(self.FIELD, ...)`.
_EXTRA_CHOICES = {"data.task": variants.TASK_NAMES, "algorithm.preset": ("",) + variants.PRESET_NAMES}


# The modules that define sections and their checks (schema.py, and sections or checks kept apart).
SCHEMA_MODULES = (schema, algorithm, options, evaluation)


@cache
def _module_source(module=schema) -> tuple[str, ast.Module]:
    source = inspect.getsource(module)
    return source, ast.parse(source)


@cache
def _comments(module=schema) -> dict[int, tuple[str, bool]]:
    """Line number -> (comment text without '#', whether the comment is the whole line)."""
    source, _ = _module_source(module)
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            found[row] = (tok.string.lstrip("#").strip(), not tok.line[:col].strip())
    return found


def _schema_module(cls):
    """The schema module that defines `cls` (schema.py for a class defined anywhere else)."""
    return next((m for m in SCHEMA_MODULES if m.__name__ == cls.__module__), schema)


def _class_node(cls) -> ast.ClassDef | None:
    _, tree = _module_source(_schema_module(cls))
    return next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__), None)


def _field_nodes(cls) -> dict[str, ast.AnnAssign]:
    node = _class_node(cls)
    return {n.target.id: n for n in (node.body if node else [])
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def source_comments(cls) -> dict[str, str]:
    """Field name -> its comment in schema.py: the trailing `# ...` of its line(s), else the block of
    whole-line comments right above it; a field right below a block-commented field with no comment of
    its own shares that block (`see section.field`)."""
    module = _schema_module(cls)
    comments, lines = _comments(module), _module_source(module)[0].splitlines()
    result, block_owner = {}, None
    for name, node in _field_nodes(cls).items():
        trailing = [comments[i][0] for i in range(node.lineno, node.end_lineno + 1)
                    if i in comments and not comments[i][1]]
        above, i = [], node.lineno - 1
        while i in comments and comments[i][1]:
            above.insert(0, comments[i][0])
            i -= 1
        if trailing:
            result[name], block_owner = " ".join(trailing), None
        elif above:
            result[name], block_owner = " ".join(above), name
        elif block_owner and lines[node.lineno - 2].strip():  # right below the block's fields, no blank line
            result[name] = f"see `{block_owner}`"
        else:
            block_owner = None
    return result


def _section_doc(cls) -> str:
    node = _class_node(cls)
    return (ast.get_docstring(node) if node else None) or ""


def _calls(name: str):
    """Every call of the function `name` anywhere in the schema modules."""
    for module in SCHEMA_MODULES:
        for node in ast.walk(_module_source(module)[1]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name:
                yield node


def _constant(node) -> typing.Any:
    if isinstance(node, ast.Name):
        return next(getattr(m, node.id) for m in SCHEMA_MODULES if hasattr(m, node.id))
    return ast.literal_eval(node)


@cache
def allowed_values() -> dict[str, tuple]:
    """`section.field` -> the values its check allows, from `one_of(self.FIELD, VALUES, "section.field")`."""
    found = dict(_EXTRA_CHOICES)
    for call in _calls("one_of"):
        target, values, key = call.args
        if isinstance(target, ast.Attribute) and isinstance(key, ast.Constant) and key.value.count(".") == 1:
            found[key.value] = tuple(_constant(values))
    return found


def _first_clause(message: str) -> str:
    """The message up to its first `;` outside parentheses."""
    depth = 0
    for i, ch in enumerate(message):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
        if ch == ";" and depth <= 0:
            return message[:i]
    return message


@cache
def constraints() -> dict[str, list[str]]:
    """`section.field` (or `section`) -> the constant messages of its `check` calls that say what it must be."""
    found: dict[str, list[str]] = {}
    for call in _calls("check"):
        _, key, message = call.args
        if isinstance(key, ast.Constant) and isinstance(message, ast.Constant) and isinstance(message.value, str):
            text = _first_clause(message.value).strip()
            if text.startswith(("must", "set ")) and text not in found.get(key.value, []):
                found.setdefault(key.value, []).append(text)
    return found


def _type_name(kind) -> str:
    """An annotation as a TOML user reads it."""
    words = {bool: "bool", int: "integer", float: "number", str: "string", dict: "table"}
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is tuple:
        plural = {int: "integers", float: "numbers", str: "strings"}[args[0]]
        return f"list of {plural}" if args[-1] is Ellipsis else f"list of {len(args)} {plural}"
    if origin is dict:
        return "table of tables" if args and args[1] is dict else "table"
    return words[kind]


def _default(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return toml_value(value)


def _trl(key: str) -> str:
    if key in TRL_TRAINER_ARGS:
        return f"`GRPOTrainer({TRL_TRAINER_ARGS[key]}=...)`"
    if key not in TRL_NAMES:
        return ""
    text, note = TRL_NAMES[key], ""
    if " (" in text:
        text, note = text.split(" (", 1)
        note = " (" + note
    return " + ".join(f"`{name}`" for name in text.split(" + ")) + note


def trl_field_names() -> set[str]:
    """Every GRPOConfig field name TRL_NAMES mentions."""
    return {name for text in TRL_NAMES.values() for name in text.split(" (", 1)[0].split(" + ")}


def meaning(key: str, comment: str | None) -> str:
    return comment or _MEANINGS.get(key, "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section_table(name: str, cls) -> list[str]:
    comments, hints = source_comments(cls), field_types(cls)
    out = [f"## [{name}]", ""]
    doc = " ".join(_section_doc(cls).split())
    if doc:
        out += [doc, ""]
    for rule in constraints().get(name, []):
        out += [f"Check: {rule}.", ""]
    out += ["| field | type | default | allowed values / check | meaning | TRL |", "|---|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        key = f"{name}.{f.name}"
        allowed = allowed_values().get(key)
        checks = ([("one of " + ", ".join(f"`{toml_value(v)}`" for v in allowed))] if allowed else []) \
            + constraints().get(key, [])
        if key == "rollout.vllm":
            checks.append("keys: " + ", ".join(f"`{k}`" for k in options.VLLM_OPTIONS))
        row = [f"`{f.name}`", _type_name(hints[f.name]), f"`{_default(f)}`", "; ".join(checks),
               meaning(key, comments.get(f.name)), _trl(key)]
        out.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return out + [""]


def _presets_table() -> list[str]:
    names = list(PRESETS)
    fields = sorted({k for p in PRESETS.values() for k in p.get("algorithm", {})},
                    key=[f.name for f in dataclasses.fields(schema.AlgorithmConfig)].index)
    out = ["## Presets", "",
           "`algorithm.preset = \"NAME\"` fills in these `[algorithm]` fields under the ones you set yourself "
           "(config/presets.py, docs/VARIANTS.md):", "",
           "| field | " + " | ".join(f"`{n}`" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for key in fields:
        values = [PRESETS[n].get("algorithm", {}).get(key) for n in names]
        out.append(f"| `{key}` | " + " | ".join("" if v is None else f"`{toml_value(v)}`" for v in values) + " |")
    adds = [f"+ `{PRESETS[n]['rewards']}`" if "rewards" in PRESETS[n] else "" for n in names]
    if any(adds):
        out.append("| rewards.functions | " + " | ".join(adds) + " |")
    return out + [""]


def markdown() -> str:
    """docs/CONFIG.md."""
    out = ["# Config reference", "",
           f"<!-- Generated from src/grpokit/config/schema.py by `{REGENERATE}`; do not edit by hand. -->", "",
           "A run config is TOML with the sections " + " ".join(f"`[{n}]`" for n in schema.SECTIONS)
           + "; `[model]` and `[data]` are required, every other field has the default below. Any field can be set "
           "on the command line with `--set section.field=value` (the value is read as TOML). "
           "`grpokit config RUN.toml [--set ...] [--json]` prints the resolved config (defaults and the preset "
           "filled in) and checks it without loading a model. From Python: `Config(model=ModelConfig(path=...), "
           "data=DataConfig(task=...), ...)` takes the same fields.", "",
           "The TRL column names the closest `trl.GRPOConfig` field (or `GRPOTrainer` argument); a field "
           "without one has no TRL counterpart. The exact conversion (batch sizes, step counts) is in "
           "[TRL.md](TRL.md), with grpokit's drop-in `grpokit.trl.GRPOConfig`.", ""]
    for name, cls in schema.SECTIONS.items():
        out += _section_table(name, cls)
    out += _presets_table()
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(markdown())

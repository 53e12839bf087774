"""`grpokit eval`: held-out rows, rewards and tools from the command line's words.

The scoring itself (`evaluate`: sampled accuracy, pass@k, greedy accuracy, mean reward; its settings
`EvalSettings` with a `SamplingParams`, and `ToolUse`) lives in training/evaluation.py, where evaluation during
training uses it too; it is re-exported here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from grpokit.data.files import load_prompts
from grpokit.data.prompts import render_prompt
from grpokit.errors import SetupError
from grpokit.rewards.registry import reward_specs
from grpokit.rollout.request import SamplingParams
from grpokit.rollout.tools import ToolBox
from grpokit.tasks import cli_task, task_tools
from grpokit.training.evaluation import EvalSettings, ToolUse, evaluate, pass_at_k

__all__ = ["EvalSettings", "SamplingParams", "ToolUse", "check_context", "eval_prompts", "eval_rows_and_specs",
           "eval_tools", "evaluate", "load_eval_model", "pass_at_k"]


def eval_rows_and_specs(*, task, task_args, data, prompt_column, rewards, num_prompts, seed):
    """Held-out rows, reward specs and the task (None for a file) of `grpokit eval`."""
    if bool(task) == bool(data):
        raise SetupError("give exactly one of --task NAME or --data FILE")
    if task:
        t = cli_task(task, task_args)
        specs = reward_specs(rewards) if rewards else t.reward_functions()
        return t.generate(num_prompts, seed=seed, split="eval"), specs, "prompt", t
    if not rewards:
        raise SetupError("--data needs at least one --reward NAME or --reward file.py:function")
    rows = load_prompts(data, prompt_column=prompt_column)[:num_prompts]
    return rows, reward_specs(rewards), "prompt", None


def eval_tools(*, task, tools: Sequence[str], timeout_s: float, tokenizer) -> ToolBox | None:
    """The tools of `grpokit eval`: `--tool` references, else the built-in `task`'s own (multiplication's
    calculator; `--no-tools` passes no task); None without any. The chat template must show them."""
    from grpokit.rewards.registry import load_reward
    from grpokit.rollout.tools import check_tool_template

    functions = [load_reward(ref, kind="tool") for ref in tools] if tools else task_tools(task)
    if not functions:
        return None
    flag = "--tool" if tools else f"--task {task.name} (it brings its own tool; --no-tools evaluates without it)"
    try:
        box = ToolBox(functions, timeout_s=timeout_s)
    except ValueError as e:
        raise SetupError(f"--tool: {e}") from None
    try:
        check_tool_template(tokenizer, box)
    except ValueError as e:
        raise SetupError(f"--model: {e}; tools from {flag}") from None
    return box


def check_context(model, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """Every prompt plus `--max-new-tokens` fits the model's context (the sampler refuses it otherwise)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", None)
    longest = max((len(p) for p in prompt_ids), default=0)
    if limit is not None and longest + max_new_tokens > limit:
        room = f"at most --max-new-tokens {limit - longest}" if limit > longest else "a shorter prompt"
        raise SetupError(f"--max-new-tokens {max_new_tokens}: the longest prompt has {longest} tokens, and the "
                         f"model's context (max_position_embeddings) is {limit} positions; use {room}")


def load_eval_model(path: str, rows: Sequence[dict], *, data: str | None, dtype: str, device: str,
                    tools: bool = False):
    """`grpokit eval`'s model, tokenizer and vision inputs (None for a text model). A vision-language folder
    loads as the image-text-to-text model it is, with its processor's tokenizer; image rows are checked first
    (with a text-only model, or an unreadable image: one error before the weights load). With `tools`, a model
    whose attention multi-turn sampling cannot pad (sliding windows: Gemma 3) is refused then too."""
    from transformers import AutoConfig

    from grpokit.models.loading import check_model_folder, load_model_and_tokenizer
    from grpokit.rollout.multiturn import check_full_attention
    from grpokit.training import vision_setup

    base = Path(data).parent if data and Path(data).is_file() else None
    folder = check_model_folder(path, field="--model")
    vision = vision_setup.vision_inputs(folder, rows, model_path=path, base=base)
    if tools:
        try:
            check_full_attention(AutoConfig.from_pretrained(folder))
        except ValueError as e:
            raise SetupError(f"--model {path}: {e}") from None
    if vision is None:
        return (*load_model_and_tokenizer(path, dtype=dtype, device=device, field="--model"), None)
    tokenizer = vision_setup.vision_tokenizer(vision, path)
    return vision_setup.load_vision_model(path, dtype=dtype, device=device, field="--model"), tokenizer, vision


def eval_prompts(tokenizer, rows: Sequence[dict], prompt_column: str, tools: ToolBox | None, vision):
    """Each row's prompt ids (with `tools`, their schemas rendered) and, for image rows, their images
    (`training.vision_setup.PromptMedia`: each batch encoded again when it is sampled, so the pixels of one
    batch are held at a time), rendered by the processor as in training."""
    if vision is None or not vision.images:
        schemas = tools.schemas if tools else None
        return [tokenizer(render_prompt(tokenizer, r[prompt_column], tools=schemas), add_special_tokens=False)
                ["input_ids"] for r in rows], None
    from grpokit.training.vision_setup import PromptMedia

    media = PromptMedia(vision, rows, tools)
    return [media.encode(i)[0] for i in range(len(rows))], media

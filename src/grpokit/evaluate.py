"""`grpokit eval`: held-out rows, rewards and tools from the command line's words.

The scoring itself (`evaluate`: sampled accuracy, pass@k, greedy accuracy, mean reward) lives in
training/evaluation.py, where evaluation during training uses it too; it is re-exported here.
"""

from __future__ import annotations

from typing import Sequence

from grpokit.data.files import load_prompts
from grpokit.errors import SetupError
from grpokit.rewards.registry import reward_specs
from grpokit.rollout.tools import ToolBox
from grpokit.tasks import cli_task, task_tools
from grpokit.training.evaluation import evaluate, pass_at_k

__all__ = ["check_context", "eval_rows_and_specs", "eval_tools", "evaluate", "pass_at_k"]


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

"""Held-out evaluation: sampled accuracy, pass@k, greedy accuracy, mean reward.

Sampled accuracy (the mean correctness of answers drawn at the training
temperature) is what GRPO optimises; pass@k says how often the right answer is
within reach at all. A warm start with high pass@k and low pass@1 is where RL
helps most: it turns pass@k into pass@1.
"""

from __future__ import annotations

from math import comb
from typing import Sequence

import torch

from grpokit.data.files import load_prompts
from grpokit.errors import SetupError
from grpokit.rewards.core import RewardSpec
from grpokit.rewards.registry import reward_specs
from grpokit.rollout.decode import sample_groups
from grpokit.rollout.grading import grade
from grpokit.rollout.multiturn import sample_conversations
from grpokit.rollout.tools import ToolBox
from grpokit.tasks import cli_task, task_tools


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _grade(model, tokenizer, prompt_ids, rows, specs, *, group_size, temperature, max_new_tokens, generator,
           batch_prompts, stop_strings, prompt_column, tools, max_tool_turns):
    """Total rewards [num_prompts, group_size] of `group_size` sampled answers per prompt, and with
    tools the calls and failed calls of every answer ([num_prompts * group_size] each)."""
    totals, calls, failures = [], [], []
    common = dict(group_size=group_size, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                  temperature=temperature, tokenizer=tokenizer, generator=generator)
    for start in range(0, len(prompt_ids), batch_prompts):
        batch_ids, batch_rows = prompt_ids[start:start + batch_prompts], rows[start:start + batch_prompts]
        conversations = None
        if tools:
            rollout, stats = sample_conversations(model, batch_ids, eos_token_ids=[tokenizer.eos_token_id],
                                                  tools=tools, max_tool_turns=max_tool_turns, **common)
            conversations = stats.conversations
            calls += stats.calls
            failures += stats.failures
        else:
            rollout = sample_groups(model, batch_ids, eos_token_ids=tokenizer.eos_token_id,
                                    stop_strings=stop_strings, **common)
        draw = grade(rollout, batch_rows, tokenizer, specs, group_size, prompt_column=prompt_column,
                     conversations=conversations)
        totals.append(draw.total.view(-1, group_size))
    return torch.cat(totals), calls, failures  # [num_prompts, group_size], [N], [N]


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    rows: Sequence[dict],
    prompt_ids: Sequence[Sequence[int]],
    specs: Sequence[RewardSpec],
    *,
    samples_per_prompt: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    correct_threshold: float = 1.0,
    greedy: bool = True,
    seed: int = 0,
    batch_prompts: int = 64,
    prompt_column: str = "prompt",
    stop_strings: Sequence[str] = (),
    tools: ToolBox | None = None,
    max_tool_turns: int = 8,
) -> dict:
    """Metrics over `rows` (with their tokenized prompts): an answer is correct when its
    total reward reaches `correct_threshold`. With `tools` (the prompts rendered with their
    schemas) answers are multi-turn conversations, as in training, and the result also has
    `tool_call_share` (answers that called a tool at least once) and `tool_failure_rate`
    (failed calls / calls) of the sampled answers."""
    model.eval()
    generator = torch.Generator(device=model.device).manual_seed(seed)
    common = dict(max_new_tokens=max_new_tokens, generator=generator, batch_prompts=batch_prompts,
                  stop_strings=stop_strings, prompt_column=prompt_column, tools=tools,
                  max_tool_turns=max_tool_turns)
    sampled, calls, failures = _grade(model, tokenizer, prompt_ids, rows, specs, group_size=samples_per_prompt,
                     temperature=temperature, **common)  # [P, k]
    correct = torch.nan_to_num(sampled, nan=0.0) >= correct_threshold
    k = samples_per_prompt
    result = {
        "num_prompts": len(rows),
        "samples_per_prompt": k,
        "temperature": temperature,
        "accuracy": correct.float().mean().item(),
        f"pass@{k}": sum(pass_at_k(k, int(c), k) for c in correct.sum(-1)) / len(rows),
        "mean_reward": torch.nanmean(sampled).item(),
    }
    if tools:
        result["tool_call_share"] = sum(c > 0 for c in calls) / len(calls)
        result["tool_failure_rate"] = sum(failures) / sum(calls) if sum(calls) else 0.0
    if greedy:
        best, _, _ = _grade(model, tokenizer, prompt_ids, rows, specs, group_size=1, temperature=0.0,
                      **common)
        result["greedy_accuracy"] = (torch.nan_to_num(best, nan=0.0) >= correct_threshold).float().mean().item()
    return result


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

"""Which tools and environments a run has (`[tools]`, or what `train()` was given), and where they run."""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Sequence

from grpokit.config.schema import Config
from grpokit.errors import SetupError
from grpokit.rewards.registry import load_reward
from grpokit.rollout.adapters import adapt_environment, was_adapted
from grpokit.rollout.environments import Environments
from grpokit.rollout.tools import SPLIT_CHOSEN, ToolBox, rewrites_earlier_turns
from grpokit.tasks import task_environment, task_tools
from grpokit.training.split_rows import check_history_setup
from grpokit.training.turn_credit import check_turn_setup


def resolve_tools(config: Config, functions: Sequence[Callable] | None = None,
                  environment_factory: Callable | dict | None = None,
                  task=None) -> tuple[ToolBox | None, Environments | None]:
    """Python callables given to `train(tools=...)` (`[]`: none), else `tools.functions`, else (with no
    environment either, unless `tools.task_tools = false`) the built-in task's own tools; the environment
    factory given to `train`, else `tools.environment`. (None, None) when there are none."""
    t = config.tools
    factory = environment_factory or (load_reward(t.environment, kind="environment") if t.environment else None)
    adapted = None if factory is None else adapt_environment(factory)  # OpenEnv's, verifiers' (rollout/adapters.py)
    if factory is not None and was_adapted(factory, adapted) and t.isolation == "process":
        raise SetupError("tools.isolation = \"process\": environments from OpenEnv or verifiers run in the trainer's "
                         "process (an OpenEnv server is a process of its own: openenv_environment(serve=True)); set "
                         "tools.isolation = \"none\"")
    factory = adapted
    own_functions = functions is None and bool(t.functions)
    if functions is None:
        functions = [load_reward(ref, kind="tool") for ref in t.functions]
        if not functions and factory is None and t.task_tools:
            functions = task_tools(task)
            factory = task_environment(task)  # gridworld's GridWorld
    if not functions and factory is None:
        check_turn_setup(config, None, None)
        check_history_setup(config, None, None)
        return None, None
    functions = list(functions)
    try:
        environments = None if factory is None else Environments(factory, functions, timeout_s=t.timeout_s,
                                                                 max_result_chars=t.max_result_chars)
        box = environments.toolbox if environments is not None else \
            ToolBox(functions, timeout_s=t.timeout_s, max_result_chars=t.max_result_chars)
        if t.isolation == "process":  # tools and environments in worker processes
            from grpokit.rollout.tool_workers import attach_workers
            attach_workers(box, environments, t, None if own_functions else functions, environment_factory)
    except ValueError as e:
        raise SetupError(f"{'tools.environment' if factory is not None else 'tools.functions'}: {e}") from None
    check_turn_setup(config, box, environments)  # algorithm.turn_advantage: what it needs of the tools
    check_history_setup(config, box, environments)  # tools.history = "split": what it cannot run with yet
    return box, environments


def choose_history(config: Config, tokenizer, tool_name: str | None, *, images: bool, world: int,
                   say: bool) -> Config:
    """`tools.history = "split"` for a chat template that rewrites earlier turns once tool messages follow them
    (Qwen3's), which "append" cannot run, with one note line on stderr (`say`: this process speaks); `config` as it
    is otherwise (no tools: `tool_name` None; "split" already; image rows, which only "append" takes). The probe
    calls `tool_name`, as `check_tool_template` does."""
    if tool_name is None or config.tools.history != "append" or images \
            or not rewrites_earlier_turns(tokenizer, tool_name):
        return config
    if world > 1:
        raise SetupError(f"tools: the chat template of {config.model.path} renders an assistant turn differently once "
                         "tool messages follow it (as Qwen3's drops earlier turns' <think>), so tool results cannot be "
                         "appended to the sampled tokens, and tools.history = \"split\", which trains such "
                         f"conversations, runs in one process for now ({world} here): run one process, or use a "
                         "chat template that does not rewrite earlier turns")
    if say:
        print(SPLIT_CHOSEN.format(model=config.model.path), file=sys.stderr, flush=True)
    return dataclasses.replace(config, tools=dataclasses.replace(config.tools, history="split"))

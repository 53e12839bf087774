"""What a rollout side grades with: the run's reward functions, resolved the same way in every process.

    spec = RolloutSpec(config, rows, prompts, reward_functions, tools, environment_factory)   # picklable
    toolbox, environments = resolve_tools(config, spec.tools, spec.environment_factory, data.task)
    specs, pool = resolve_rewards(config, data, spec.reward_functions, environments)
    side = RolloutSide.for_training(config, spec.prompts, specs, engine, tokenizer, environments)

The trainer resolves the tools, environments and reward functions while it checks its inputs (setup.py's
`check_inputs`); an asynchronous rollout worker (rollout_workers.py) is sent the same `RolloutSpec` (what
`train()` was given) and resolves it with the same two functions in its own process, next to its sampler, so
both grade with the same rewards and call the same tools. The rows and prompts travel prepared and tokenized:
a worker checks nothing the trainer has checked.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from grpokit.config.schema import Config
from grpokit.errors import SetupError
from grpokit.models.loading import resolve_device
from grpokit.rewards.core import RewardSpec
from grpokit.rewards.pooled_reward import isolate
from grpokit.rewards.registry import reward_specs, unique_reward_names
from grpokit.rewards.remote import RemoteGrader
from grpokit.rewards.reward_model import RewardModel
from grpokit.rewards.worker_pool import RewardPool, check_isolatable
from grpokit.rollout.environments import Environments
from grpokit.rollout.side import PromptTable


@dataclass
class RolloutSpec:
    """A rollout side's description: what an asynchronous worker is sent at spawn to build its side (pickled:
    module-level functions, not lambdas)."""

    config: Config  # this trainer process's share of the run
    prompts: PromptTable  # the prepared training rows, tokenized and checked
    reward_functions: Sequence[Callable | str] | Callable | str | None = None  # train()'s; None: the config's
    tools: Sequence[Callable] | None = None  # train()'s; None: the config's
    environment_factory: Callable | dict | None = None


def resolve_rewards(config: Config, data, reward_functions=None, environments: Environments | None = None
                    ) -> tuple[list[RewardSpec], RewardPool | None]:
    """Every reward function of the run (`resolve_reward_specs`; none needed when an environment grades), the
    Python ones isolated in worker processes with `rewards.isolation = "process"` (`isolate_rewards`), the
    environments' own (`get_reward`) last: they read the live instances, in this process."""
    own = environments.reward_specs() if environments is not None else []
    specs, pool = isolate_rewards(config, resolve_reward_specs(config, data.task, reward_functions,
                                                               optional=bool(own), rows=data.rows))
    return specs + own, pool


def resolve_reward_specs(config: Config, task, functions: Sequence[Callable | str] | Callable | str | None = None, *,
                         optional: bool = False, rows: Sequence[dict] = ()) -> list[RewardSpec]:
    """Python callables given to `train`, else `rewards.functions`, else the task's verifier (none, when
    `optional`: an environment's own reward is there).

    `functions` is what TRL's `reward_funcs` is: one entry or a list; an entry is a callable, a
    `RewardSpec`, a string as `rewards.functions` takes (a built-in name, a reference, a reward-model
    folder, a grader URL; resolved with its `rewards.args`) or a loaded reward model; anything else is one
    error naming its position (`registry.reward_entries`). A callable is named by its `__name__`
    (`reward_<i>` without one); callables sharing a name are told apart by their module (`mod_a.score`,
    `mod_b.score`), else numbered (`score`, `score_2`): see `unique_reward_names`.

    `rows`, the training rows: a reward model that cannot read their prompts (chat messages, a tokenizer
    without a chat template) is refused here, before the policy loads, not at the first step."""
    from grpokit.errors import RewardLoadError
    from grpokit.rewards.core import check_columns, is_conversational
    from grpokit.rewards.registry import reward_entries

    r = config.rewards
    timeout = r.timeout_s or None  # your own functions are bounded (rewards.timeout_s); built-ins bound themselves
    context = dict(on_error=r.on_error, device=str(resolve_device(config.model.device)))
    functions = reward_entries(functions, device=context["device"])
    if functions:
        if r.weights and len(r.weights) != len(functions):  # zip below would drop functions silently
            raise RewardLoadError(f"rewards.weights has {len(r.weights)} weights for the {len(functions)} reward "
                                  f"functions given to train(reward_functions=...); give one per function")
        weights = list(r.weights) or [1.0] * len(functions)
        named = [f for f in functions if isinstance(f, str)]  # resolved with their rewards.args, as in the config
        resolved = iter(reward_specs(named, (), r.args, timeout, **context) if named else [])
        built = [next(resolved) if isinstance(f, str) else f for f in functions]
        names = unique_reward_names(
            [f.name if isinstance(f, RewardSpec) else getattr(f, "__name__", None) or f"reward_{i}"
             for i, f in enumerate(built)],
            [None if isinstance(f, RewardSpec) else m if (m := getattr(f, "__module__", None)) != "__main__" else None
             for f in built])
        specs = [replace(f, name=n, weight=w) if isinstance(f, RewardSpec) else RewardSpec(n, f, w, timeout)
                 for n, f, w in zip(names, built, weights)]
    elif r.functions:
        specs = reward_specs(list(r.functions), r.weights, r.args, default_timeout=timeout, **context)
    elif task is not None:
        specs = task.reward_functions()
    elif optional:
        specs = []
    else:
        raise SetupError("no reward functions: set rewards.functions (a built-in name such as 'numeric_match', "
                         "'file.py:function', a reward-model folder or a grader URL), or use a built-in data.task")
    check_columns(specs, rows, config.data.path or "the data")  # code_execution without `tests`: now, not at step 1
    chat = next((i for i, row in enumerate(rows) if is_conversational(row.get("prompt"))), None)
    for spec in specs if chat is not None else ():
        if isinstance(spec.fn, RewardModel) and (why := spec.fn.unreadable(rows[chat]["prompt"])):
            raise RewardLoadError(f"{why} (prompt row {chat + 1} of the data is a list of chat messages)")
    return specs


SELF_BOUNDED = ("code_execution",)  # run their answers in their own killable processes already


def isolate_rewards(config: Config, specs: list[RewardSpec]) -> tuple[list[RewardSpec], RewardPool | None]:
    """With `rewards.isolation = "process"`, the Python reward functions moved into a pool of worker
    processes (rewards/worker_pool.py): `rewards.timeout_s` (or a function's own timeout) then kills a
    call that hangs, and a crash costs a worker, not the run. Reward models, remote graders and the
    self-bounded built-ins stay as they are. Whether each function can be rebuilt in a worker is checked
    here, before the model loads; the workers start at the first batch."""
    r = config.rewards
    if r.isolation != "process":
        return specs, None
    pool, out = RewardPool(r.workers), []
    for spec in specs:
        if isinstance(spec.fn, (RemoteGrader, RewardModel)) or (spec.source and spec.source[0] in SELF_BOUNDED):
            out.append(spec)
            continue
        limited = replace(spec, timeout=spec.timeout or r.timeout_s or None)
        check_isolatable(limited, spec.source)
        out.append(isolate(limited, pool, source=spec.source, on_error=r.on_error,
                           group_size=config.rollout.group_size))
    return out, pool

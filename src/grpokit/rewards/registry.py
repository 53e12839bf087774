"""Reward functions by name ("numeric_match", "countdown", ...) or by reference ("file.py:fn").

The registry maps a name to a factory: `get_reward(name, **kwargs)` calls
`factory(**kwargs)` and returns the reward function. The built-in tasks'
verifiers (`verifiers.py`) are built-in rewards like any other; the tasks
themselves sit above this package and only name them.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from grpokit.errors import RewardLoadError
from grpokit.rewards.graders import format_reward, math_equivalence, numeric_match, soft_overlong_penalty
from grpokit.rewards.remote import RemoteGrader, is_url, url_reward_name
from grpokit.rewards.sandbox import code_execution_reward
from grpokit.rewards.verifiers import addition_reward, countdown_reward_fn

if TYPE_CHECKING:
    from grpokit.rewards.core import RewardSpec


def _constant(fn: Callable) -> Callable[[], Callable]:
    def factory() -> Callable:
        return fn
    factory.__signature__ = inspect.Signature()  # takes no arguments
    return factory


_REGISTRY: dict[str, Callable[..., Callable]] = {
    "numeric_match": _constant(numeric_match),
    "math_equivalence": _constant(math_equivalence),
    "format": format_reward,
    "soft_overlong_penalty": soft_overlong_penalty,
    "code_execution": code_execution_reward,
    "addition": _constant(addition_reward),  # the built-in tasks' verifiers (tasks/)
    "countdown": countdown_reward_fn,
    "multiplication": _constant(addition_reward),  # the same exact match, of the final answer
    "shapes": _constant(addition_reward),  # the count, matched exactly
}


def register_reward(name: str, factory: Callable[..., Callable], *, overwrite: bool = False) -> None:
    """Make `get_reward(name, **kwargs)` return `factory(**kwargs)`."""
    if name in _REGISTRY and not overwrite and _REGISTRY[name] is not factory:
        raise ValueError(f"a reward named {name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[name] = factory


def available_rewards() -> list[str]:
    """Names `get_reward` knows, built-in tasks' verifiers included."""
    return sorted(_REGISTRY)


def get_reward(name: str, **kwargs) -> Callable:
    """The reward function registered under `name`, built with `kwargs`."""
    if name not in _REGISTRY:
        hint = " (a file reference needs ':function', e.g. my_rewards.py:score)" if name.endswith(".py") else ""
        raise RewardLoadError(f"unknown reward {name!r}{hint}; known rewards: {', '.join(available_rewards())}, "
                              f"or a reference 'path/to/file.py:function' / 'package.module:function', a local "
                              f"reward-model folder, or an http(s):// grader URL")
    return _build(name, _REGISTRY[name], kwargs)


def _build(name: str, factory: Callable, kwargs: dict, fixed: dict | None = None) -> Callable:
    """`factory(**kwargs, **fixed)`, with a wrong argument or value as one `RewardLoadError` line;
    `fixed` holds the arguments grpokit fills in (not the user's to set)."""
    fixed = fixed or {}
    accepted = [p for p in inspect.signature(factory).parameters if p not in fixed]
    try:
        if set(kwargs) & set(fixed):
            raise TypeError(f"{', '.join(sorted(set(kwargs) & set(fixed)))} is set by grpokit")
        inspect.signature(factory).bind(**kwargs, **fixed)
    except TypeError as e:
        raise RewardLoadError(f"reward {name!r} got arguments {sorted(kwargs)}: {e}; "
                              f"it accepts: {', '.join(accepted) or 'none'}") from None
    try:
        return factory(**kwargs, **fixed)
    except ValueError as e:  # a bad option value: a user error, not a traceback
        raise RewardLoadError(f"reward {name!r}: {e}") from e


def _import_file(path: Path, ref: str, kind: str = "reward"):
    if not path.is_file():
        raise RewardLoadError(f"{kind} {ref!r}: file {str(path)!r} not found (relative paths start at "
                              f"{Path.cwd()}); fix the path or use 'package.module:function'")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    mod_name = f"grpokit_user_{resolved.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    # The file's folder goes on sys.path so that it can import helper modules next to it.
    if str(resolved.parent) not in sys.path:
        sys.path.insert(0, str(resolved.parent))
    spec = importlib.util.spec_from_file_location(mod_name, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[mod_name]
        raise RewardLoadError(f"{kind} {ref!r}: importing {str(path)!r} raised "
                              f"{type(e).__name__}: {e}") from e
    return module


def _import_module(name: str, ref: str, kind: str = "reward"):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise RewardLoadError(f"{kind} {ref!r}: module {name!r} not found ({e}); for a file write "
                              f"'path/to/{name.split('.')[-1]}.py:function'") from e
    except Exception as e:
        raise RewardLoadError(f"{kind} {ref!r}: importing module {name!r} raised {type(e).__name__}: {e}") from e


def load_reward(ref: str, *, kind: str = "reward") -> Callable:
    """A user's reward function from "path/to/file.py:function" or "package.module:function" (or another
    user function: a tool, with `kind` naming it in the errors)."""
    where, sep, attr = ref.rpartition(":")
    if not sep or not where or not attr:
        raise RewardLoadError(f"{kind} reference {ref!r} must look like 'path/to/file.py:function' "
                              f"or 'package.module:function'")
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    module = _import_file(Path(where), ref, kind) if is_file else _import_module(where, ref, kind)
    if not hasattr(module, attr):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise RewardLoadError(f"{kind} {ref!r}: {where!r} has no attribute {attr!r}; "
                              f"functions defined there: {found or 'none'}")
    fn = getattr(module, attr)
    if not callable(fn):
        signature = "f(completions, **kwargs) -> list[float | None]" if kind == "reward" else "a function"
        raise RewardLoadError(f"{kind} {ref!r}: {attr!r} is a {type(fn).__name__}, not a function; point the "
                              f"reference at {signature}")
    return fn


def resolve_reward(ref: str, *, on_error: str = "raise", device: str = "cpu", **kwargs) -> Callable:
    """The reward function an entry of `rewards.functions` names, built with its `kwargs`:

    - "http://..." / "https://...": a remote grader (rewards/remote.py), checked to accept connections
      now, before any model loads; `on_error` is its default for a request that fails for good.
    - "file.py:function" / "module:function": `load_reward(ref)`.
    - a registered name: `get_reward(ref, **kwargs)`.
    - a local folder of a sequence-classification model: a reward model (rewards/reward_model.py) on
      `device`, scoring prompt + completion with its own tokenizer.
    """
    return _resolve(ref, kwargs, on_error=on_error, device=device)


def _resolve(ref: str, kwargs: dict, *, on_error: str, device: str) -> Callable:
    """`resolve_reward`, with the entry's own arguments apart from grpokit's: a grader's `on_error` in
    `rewards.args` wins over `rewards.on_error`, and any other key named like grpokit's (a reward model's
    `device`) reaches the builder, which names it in one line, instead of clashing in the call."""
    scheme, sep, _ = ref.partition("://")
    if sep and scheme.isalpha() and not is_url(ref):  # "htp://...": a mistyped URL, not a file
        raise RewardLoadError(f"reward {ref!r}: unknown URL scheme {scheme!r}; a remote grader's URL starts with "
                              f"http:// or https://")
    if is_url(ref):
        grader = _build(ref, RemoteGrader, {"on_error": on_error, **kwargs}, {"url": ref})
        grader.check_reachable()
        return grader
    if ":" in ref:
        if kwargs:
            raise RewardLoadError(f"reward {ref!r}: arguments {sorted(kwargs)} only apply to built-in rewards, "
                                  f"reward models and graders; give the function defaults instead")
        return load_reward(ref)
    if ref not in _REGISTRY and Path(ref).is_dir():
        from grpokit.rewards.reward_model import load_reward_model  # transformers: only when one is named

        return _build(ref, load_reward_model, kwargs, {"path": ref, "device": device})
    return get_reward(ref, **kwargs)


_ENTRIES = ("a callable f(prompts, completions, **kwargs) -> list[float | None], a RewardSpec, a string as "
            "rewards.functions takes (a built-in name, 'file.py:function', a reward-model folder, a grader URL) or "
            "a loaded reward model (AutoModelForSequenceClassification with num_labels = 1)")


def reward_entries(functions: Any, *, device: str = "cpu") -> list | None:
    """`train(reward_functions=...)` as a list of callables, `RewardSpec`s and strings (None stays None).

    As TRL takes `reward_funcs`: a single entry (a function, a name) is a list of one, not a sequence to
    iterate (a string would become its characters), and a loaded reward model (a `PreTrainedModel`) is
    wrapped as the TRL drop-in wraps it (`reward_model_from_object`, on `device`). Anything else is one
    `RewardLoadError` naming its position, here rather than at the first step."""
    from grpokit.rewards.core import RewardSpec  # torch: not at the top (reward workers import this module)
    from grpokit.rewards.reward_model import is_model_object, reward_model_from_object

    if functions is None:
        return None
    entries = list(functions) if isinstance(functions, (list, tuple)) else [functions]
    out = []
    for i, f in enumerate(entries):
        if is_model_object(f):
            f = reward_model_from_object(
                f, device=device, field=f"reward_functions[{i}]", tokenizer_field=f"reward_functions[{i}]",
                tokenizer_fix="save the model and its tokenizer in one folder (save_pretrained) and give the folder")
        elif not (isinstance(f, (str, RewardSpec)) or callable(f)):
            shown = repr(f) if len(repr(f)) <= 40 else repr(f)[:37] + "..."
            raise RewardLoadError(f"reward_functions[{i}]: {shown} (type {type(f).__name__}) is not a reward function; "
                                  f"give {_ENTRIES}, or a list of them")
        out.append(f)
    return out


def reward_name(ref: str) -> str:
    """The metric name of a reward: the registry name, the function name of a reference, a reward
    model's folder name (as TRL names it), or a grader URL's host, port and path ("127.0.0.1_8000_score")."""
    if is_url(ref):
        return url_reward_name(ref)
    if ":" in ref:
        return ref.rpartition(":")[2]
    return ref if ref in _REGISTRY else Path(ref).name or ref


def _timeout_of(ref: str, kwargs: dict, default: float | None) -> float | None:
    """Pop the `timeout` key (seconds, for any reward; 0 = no limit) out of a reward's arguments;
    without one, references (your own code) get `default` and built-in rewards none (they bound
    their own time: math-verify's parse timeouts, the code sandbox's limits)."""
    if "timeout" not in kwargs:
        return default if ":" in ref and not is_url(ref) else None
    timeout = kwargs.pop("timeout")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0 \
            or timeout == float("inf"):
        raise RewardLoadError(f"reward {ref!r}: timeout must be a number of seconds >= 0 (0 = no limit), "
                              f"got {timeout!r}")
    return float(timeout) or None


def _qualifier(ref: str) -> str | None:
    """What tells a reference apart from another of the same function name: the file's stem
    ("rewards/a.py:score" -> "a") or the module ("pkg.mod:score" -> "pkg.mod"); None for a built-in."""
    where, sep, _ = ref.rpartition(":")
    if not sep or is_url(ref):
        return None
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    return Path(where).stem if is_file else where


def unique_reward_names(names: Sequence[str], qualifiers: Sequence[str | None] = ()) -> list[str]:
    """Distinct metric names for reward functions whose names may collide.

    A name shared by functions of different qualifiers (file stems or modules) is prefixed with
    each one's qualifier: `a.py:score` and `b.py:score` become `a.score` and `b.score`, logged
    as `rewards/a.score/mean` and `rewards/b.score/mean`. A name still shared after that (the same
    reference twice, two files of the same stem, two callables of one script) gets `_2`, `_3`, ...
    in order: `score`, `score_2`. Names that collide with nothing are kept as they are."""
    qualifiers = list(qualifiers) or [None] * len(names)
    groups: dict[str, set] = {}
    for n, q in zip(names, qualifiers):
        groups.setdefault(n, set()).add(q)
    # Qualify only where it tells functions apart (not the same function listed twice).
    wanted = [f"{q}.{n}" if q and len(groups[n]) > 1 else n for n, q in zip(names, qualifiers)]
    taken: set[str] = set()
    out = []
    for n in wanted:
        candidate, k = n, 2
        while candidate in taken:
            candidate, k = f"{n}_{k}", k + 1
        taken.add(candidate)
        out.append(candidate)
    return out


def reward_specs(refs: Sequence[str], weights: Sequence[float] = (), args: dict[str, dict] | None = None,
                 default_timeout: float | None = None, *, on_error: str = "raise",
                 device: str = "cpu") -> list[RewardSpec]:
    """RewardSpecs for names/references, with optional weights and per-reference keyword arguments.

    The argument `timeout` (seconds, 0 = no limit) applies to any reward, references included: it
    becomes `RewardSpec.timeout` instead of being passed to the factory. References without one get
    `default_timeout` (`rewards.timeout_s`). Each spec's name (its metrics are
    `rewards/<name>/mean` and `/std`) is the registry name or the function name; references that
    share a function name are told apart by `unique_reward_names` (`a.py:score`, `b.py:score` ->
    `a.score`, `b.score`). `args` may be keyed by the reference, the function name or that name.
    """
    from grpokit.rewards.core import RewardSpec  # torch: not at the top (reward workers import this module)

    if weights and len(weights) != len(refs):
        raise RewardLoadError(f"{len(weights)} reward weights for {len(refs)} reward functions; give one per function")
    args = args or {}
    names = unique_reward_names([reward_name(r) for r in refs], [_qualifier(r) for r in refs])
    unknown = sorted(set(args) - set(refs) - {reward_name(r) for r in refs} - set(names))
    if unknown:
        raise RewardLoadError(f"reward arguments given for {unknown}, which are not among the reward functions "
                              f"{list(refs)}")
    weights = list(weights) or [1.0] * len(refs)
    specs = []
    for r, name, w in zip(refs, names, weights):
        kwargs = dict(args.get(r, args.get(name, args.get(reward_name(r), {}))))
        timeout = _timeout_of(r, kwargs, default_timeout)
        if is_url(r):
            kwargs.setdefault("name", name)  # its rewards/<name>/ungraded count goes with its other metrics
        fn = _resolve(r, kwargs, on_error=on_error, device=device)
        source = None if is_url(r) or not (":" in r or r in _REGISTRY) else (r, kwargs)  # a worker rebuilds it so
        specs.append(RewardSpec(name, fn, float(w), timeout, source))
    return specs

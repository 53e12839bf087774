"""Field checks shared by every config section: types from the annotations, ranges, suggestions.

Each check raises `ConfigError` naming the field (`section.key`) and the fix; `check_fields`
checks a section's values against its dataclass annotations, so a new field is checked the
moment it is declared.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
import tomllib
import typing
from typing import Any

from grpokit.errors import ConfigError


def check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}: {message}")


def one_of(value: Any, allowed: tuple, field_name: str) -> None:
    check(value in allowed, field_name, f"got {value!r}; choose one of {', '.join(map(repr, allowed))}")


def check_in_flight(rollout) -> None:
    """`rollout.in_flight_updates`: weights that land inside an answer need samplers in processes of their own
    that take weights while they sample (asynchronous workers, or a vLLM server paused with mode=keep)."""
    if not rollout.in_flight_updates:
        return
    check(not rollout.partial_rollouts, "rollout.in_flight_updates",
          "with rollout.partial_rollouts: streaming groups already continue unfinished answers under the newer "
          "weights (sync mode); set in_flight_updates = false")
    check(rollout.mode == "async", "rollout.in_flight_updates",
          f"needs rollout.mode = \"async\" (it is {rollout.mode!r}: the sync loop samples with the weights of the "
          "step it trains, so no weights can land inside an answer); set rollout.mode = \"async\" or "
          "in_flight_updates = false")
    check(rollout.engine == "hf" or rollout.vllm_options.server is not None, "rollout.in_flight_updates",
          "a colocated vLLM engine (rollout.engine = \"vllm\" without rollout.vllm.server) cannot take weights "
          "mid-answer; sample on a vLLM server (rollout.vllm = {server = \"http://...\"}) or the built-in workers "
          "(engine = \"hf\"), or set in_flight_updates = false")
    check(rollout.max_staleness >= 1, "rollout.in_flight_updates",
          "with rollout.max_staleness = 0 does nothing: every batch waits for the newest weights, so none can land "
          "inside an answer; set max_staleness >= 1 or in_flight_updates = false")


def check_partial_rollouts(config) -> None:
    """`rollout.partial_rollouts` (streaming groups, docs/STREAMING.md): what it is built for (single-turn text
    prompts, the built-in sampler, sync mode), each other combination refused naming its field."""
    r, algo, tools = config.rollout, config.algorithm, config.tools
    if not r.partial_rollouts:
        return
    check(r.max_staleness >= 1, "rollout.max_staleness",
          "is 0, but rollout.partial_rollouts = true continues unfinished answers into the next step under newer "
          "weights, at least 1 step old: set max_staleness >= 1 (e.g. 1) or partial_rollouts = false")
    check(r.mode == "sync", "rollout.partial_rollouts",
          "with rollout.mode = \"async\" is not built yet: use mode = \"sync\" or partial_rollouts = false")
    check(r.engine == "hf", "rollout.partial_rollouts",
          f"streams groups through the built-in sampler; rollout.engine = {r.engine!r} is not built yet: use "
          "engine = \"hf\" or partial_rollouts = false")
    for name in ("functions", "environment", "agent"):
        check(not getattr(tools, name), "rollout.partial_rollouts",
              f"with tools.{name} (multi-turn rollouts) is not built yet: drop tools.{name} or set "
              "partial_rollouts = false")
    check(not algo.dynamic_sampling, "rollout.partial_rollouts",
          "with algorithm.dynamic_sampling is not built yet: set dynamic_sampling = false or partial_rollouts = false")


# The fix shown for a field whose default is empty; other fields show their default.
_EXAMPLES = {
    "model.path": '"models/Qwen2.5-0.5B"',
    "model.lora": "{r = 8, alpha = 16}",
    "data.task": '"addition"',
    "data.path": '"prompts.jsonl"',
    "data.task_args": "{digits = 2}",
    "rewards.functions": '["addition"]',
    "rewards.weights": "[1.0, 0.5]",
    "rewards.args": "{countdown = {format_score = 0.1}}",
    "rollout.stop_strings": '["\\n\\n"]',
    "rollout.vllm": "{gpu_memory_utilization = 0.3}",
    "algorithm.preset": '"dapo"',
    "tools.functions": '["tools.py:calculator"]',
    "tools.environment": '"envs.py:Counter"',
    "tools.agent": '"agents.py:my_agent"',
}


_KINDS = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string", dict: "a table"}


_PLURALS = {int: "integers", float: "finite numbers", str: "strings", dict: "tables"}


@functools.cache
def field_types(cls) -> dict[str, Any]:
    """A section's field name -> annotated type (resolved: this module postpones annotations)."""
    return typing.get_type_hints(cls)


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def show_value(value) -> str:
    """A value as an error message shows it: `2.5 (float)`, `'false' (a string)`."""
    text = repr(value) if not isinstance(value, bool) else str(value).lower()
    text = text if len(text) <= 60 else text[:57] + "..."
    kind = {bool: "a boolean", int: "int", float: "float", str: "a string", list: "a list", tuple: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)
    return f"{text} ({kind})"


def _problem(kind, value) -> str | None:
    """Why `value` is not of the scalar type `kind` (bool is not an int; floats are finite), or None."""
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    return None if ok else f"must be {_KINDS[kind]}, got {show_value(value)}"


def _fix(name: str, kind, value, example: str) -> str:
    if isinstance(value, str) and kind not in (str, dict):  # a quoted number or boolean
        text = value.strip().lower() if kind is bool else value.strip()
        try:
            unquoted = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            unquoted = None
        if unquoted is not None and _problem(kind, unquoted) is None:
            return f"write it without quotes: {name} = {text}"
    if kind is str and isinstance(value, (int, float)):
        return f"quote it: {name} = {toml_value(toml_value(value))}"
    if kind is bool:
        return f"write true or false without quotes, e.g. {name} = {example}"
    return f"e.g. {name} = {example}"


def checked_value(name: str, kind, value, example: str):
    """`value` checked against the annotation `kind` (bool, int, float, str, dict, dict[str, dict],
    tuple[X, ...], tuple[X, X]) and normalised: an int given for a float becomes a float, a list a
    tuple. A wrong type is a ConfigError naming the field and the fix."""
    origin, args = typing.get_origin(kind) or kind, typing.get_args(kind)
    if origin is tuple:
        item, fixed = args[0], args[-1] is not Ellipsis
        if isinstance(value, str):
            example = toml_value([value])
        if not isinstance(value, (list, tuple)) or (fixed and len(value) != len(args)):
            size = f"{len(args)} " if fixed else ""
            raise ConfigError(f"{name}: must be a list of {size}{_PLURALS[item]}, got {show_value(value)}; "
                              f"e.g. {name} = {example}")
        for i, v in enumerate(value, 1):
            problem = _problem(item, v) or ("must not be empty" if v == "" else None)
            check(problem is None, name, f"item {i} {problem}; e.g. {name} = {example}")
        return tuple(float(v) if item is float else v for v in value)
    problem = _problem(origin, value)
    check(problem is None, name, f"{problem}; {_fix(name, origin, value, example)}")
    if args:  # dict[str, dict]: a table of tables
        for key, v in value.items():
            check(isinstance(v, args[1]), f"{name}.{key}",
                  f"must be a table, got {show_value(v)}; e.g. {name} = {example}")
    return float(value) if origin is float else value


def field_example(cls, name: str, key: str) -> str:
    return _EXAMPLES.get(key) or toml_value(cls.__dataclass_fields__[name].default)


def check_fields(section, name: str) -> None:
    """Check (and normalise, in place) every field of a section object against its annotation;
    a string field with a non-empty default must not be empty."""
    for f in dataclasses.fields(section):
        key = f"{name}.{f.name}"
        kind = field_types(type(section))[f.name]
        example = field_example(type(section), f.name, key)
        value = checked_value(key, kind, getattr(section, f.name), example)
        check(value != "" or f.default in ("", dataclasses.MISSING), key, f"must not be empty; e.g. {key} = {example}")
        object.__setattr__(section, f.name, value)


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def did_you_mean(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _toml_key(key: str) -> str:
    """A table key as TOML reads it back: bare when it can be, else quoted ("a.py:score", URLs)."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_value(key)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):  # JSON escapes \\, " and C0 controls as TOML does; DEL is TOML's extra one
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")

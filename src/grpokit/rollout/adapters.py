"""Environments from other libraries, as grpokit (TRL) environments: OpenEnv's and `verifiers`'.

    [tools]
    environment = "envs.py:GuessEnvironment"     # an OpenEnv `Environment` subclass: adapted as it is
    environment = "envs.py:load_environment"     # verifiers' convention: a function returning a vf.Environment

    grpokit.train(config, environment_factory=openenv_environment(GuessEnvironment, serve=True))  # over HTTP
    grpokit.train(config, environment_factory=openenv_environment(url="http://127.0.0.1:8000"))  # a running server
    grpokit.train(config, environment_factory={"guess": GuessEnvironment, "math": vf_env})       # several

`adapt_environment` (called on whatever `tools.environment` or `train(environment_factory=...)` names)
turns these into grpokit environment classes and leaves everything else as it is:

- **OpenEnv** (`openenv` on PyPI; Gym-style `reset` / `step(action)` with pydantic `Action` and
  `Observation` models, usually served over HTTP). The model gets one tool, `step`, whose arguments are
  the Action's fields (its JSON schema) and whose result is the observation (its fields other than
  done / reward / metadata: the text of a single field, else JSON). `reset(**row)` passes the row's
  columns that the environment's `reset` names and appends the first observation to the prompt. Each
  step's `reward` is the turn's step reward (`get_turn_reward`, for `algorithm.turn_advantage`), their
  sum the outcome reward (`get_reward`, a reward column named after the environment), the observation
  the turn's state (`get_state`). A step after `done` is a failed call ("the episode is over").
  In-process by default (one instance per answer); `serve=True` starts OpenEnv's own HTTP server
  (`create_app`, uvicorn) on 127.0.0.1 at a free port at the first batch and stops it when the process
  ends (or `.close()`), each answer a session of OpenEnv's `GenericEnvClient`; `url=` connects to a
  server someone else runs.
- **verifiers** (`verifiers` on PyPI, its classic `vf.Environment`s): a `ToolEnv` / `StatefulToolEnv` /
  `SingleTurnEnv` gives its tools; its rubric's reward functions (weight != 0) become reward columns
  `<env>/<function>` with the rubric's weights, called as verifiers calls them (`prompt`, `completion` as
  messages, `answer`, `info`, `task`, `state`, `parser`: those each function names). The rows are
  grpokit's (`train(rows=vf_env.get_dataset())` takes the environment's own dataset).

Several environments in one run (TRL's multi-environment form): a mapping of names to any of these;
each row names its environment in an "environment" column, and each environment's rewards score only
its own answers (None for the others), so every environment keeps its own reward columns.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import json
import re
import socket
import threading
import time
import typing
from typing import Any, Callable, Mapping

from grpokit.errors import SetupError
from grpokit.rewards.core import RewardSpec

EXTRA = "pip install 'grpokit[agents]'"


def _require(module: str, what: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        raise SetupError(f"{what} needs the `{module.split('.')[0]}` package, which is not installed ({e}); "
                         f"{EXTRA} installs it") from None


def _from_library(obj, library: str, name: str) -> bool:
    """Whether `obj` (a class, or an instance's class) derives from `library`'s class `name`, without importing it."""
    cls = obj if inspect.isclass(obj) else type(obj)
    return any(c.__name__ == name and c.__module__.split(".")[0] == library for c in cls.__mro__)


def adapt_environment(factory):
    """`factory` as a grpokit environment factory: OpenEnv and verifiers environments adapted (see the module
    docstring); a mapping adapted name by name; anything else unchanged."""
    if isinstance(factory, Mapping):
        return {name: adapt_environment(f) for name, f in factory.items()}
    if inspect.isclass(factory) and _from_library(factory, "openenv", "Environment"):
        return openenv_environment(factory)
    if not inspect.isclass(factory) and _from_library(factory, "verifiers", "Environment"):
        return verifiers_environment(factory)
    if inspect.isfunction(factory) and factory.__name__ == "load_environment":  # verifiers' module convention
        try:
            made = factory()
        except Exception:  # noqa: BLE001 - the environment check names it, with the factory
            return factory
        return verifiers_environment(made) if _from_library(made, "verifiers", "Environment") else factory
    return factory


def why_not_adapted(factory, made) -> str | None:
    """Why `made`, what a factory that `adapt_environment` left as it is returned, is not a grpokit environment
    though it is a verifiers one (None when it is not a verifiers environment): the documented refusal of its
    kind, else how to have it adapted."""
    if not _from_library(made, "verifiers", "Environment"):
        return None
    try:
        verifiers_environment(made)
    except SetupError as e:
        return str(e)
    name = getattr(factory, "__name__", repr(factory))
    return (f"environment factory {name!r} returns a verifiers {type(made).__name__}, which grpokit adapts from a "
            "function named load_environment (verifiers' convention) or from the environment itself "
            f"(train(environment_factory=vf_env)); rename {name} to load_environment")


def was_adapted(original, adapted) -> bool:
    """Whether `adapt_environment` changed anything (in a mapping: any of its environments)."""
    if isinstance(original, Mapping):
        return any(adapted[name] is not f for name, f in original.items())
    return adapted is not original


# ---- OpenEnv -----------------------------------------------------------------------------------------


class _Server:
    """OpenEnv's HTTP server for one environment class, on 127.0.0.1 at a free port, in a thread."""

    def __init__(self, env_cls, action_cls, observation_cls):
        http_server = _require("openenv.core.env_server.http_server", "openenv_environment(serve=True)")
        uvicorn = _require("uvicorn", "openenv_environment(serve=True)")
        if not getattr(env_cls, "SUPPORTS_CONCURRENT_SESSIONS", False):
            raise SetupError(f"openenv_environment({env_cls.__name__}, serve=True): the environment does not set "
                             "SUPPORTS_CONCURRENT_SESSIONS = True, so its server takes one session and every answer "
                             "needs its own; set it on the class, or run it in-process (serve=False)")
        app = http_server.create_app(env_cls, action_cls, observation_cls, max_concurrent_envs=4096)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"grpokit-openenv-{env_cls.__name__}")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise SetupError(f"openenv_environment({env_cls.__name__}, serve=True): its server did not start on "
                                 f"127.0.0.1:{self.port} within 30 s")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        atexit.register(self.close)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _hints(function) -> dict:
    """`function`'s type hints, resolved (string annotations too); {} where they cannot be."""
    try:
        return typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 - a hint naming something undefined: treated as none
        return {}


def _action_class(env_cls):
    """The Action model of `env_cls.step(action: ...)`, from its type hint."""
    annotation = _hints(env_cls.step).get("action")
    if not (inspect.isclass(annotation) and hasattr(annotation, "model_fields")):
        raise SetupError(f"OpenEnv environment {env_cls.__name__}: step's `action` has no Action type hint; annotate "
                         "it (def step(self, action: MyAction, ...)) or give openenv_environment(..., action=MyAction)")
    return annotation


def _observation_class(env_cls):
    annotation = _hints(env_cls.step).get("return")
    if inspect.isclass(annotation) and hasattr(annotation, "model_fields"):
        return annotation
    return _require("openenv.core.env_server.types", "an OpenEnv environment").Observation


def _step_tool(action_cls) -> Callable:
    """A `step(**fields)` method whose signature, type hints and docstring are the Action's fields."""
    fields = {k: f for k, f in action_cls.model_fields.items() if k != "metadata"}
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(k, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=f.annotation,
                                 default=inspect.Parameter.empty if f.is_required() else f.default)
               for k, f in fields.items()]

    def step(self, **arguments) -> str:
        return self._step(arguments)

    step.__signature__ = inspect.Signature(params, return_annotation=str)
    step.__annotations__ = {**{k: f.annotation for k, f in fields.items()}, "return": str}
    summary = " ".join((action_cls.__doc__ or f"Take one step with a {action_cls.__name__}.").split())
    lines = [f"        {k}: {' '.join((f.description or k).split())}" for k, f in fields.items()]
    step.__doc__ = f"{summary}\n\n    Args:\n" + "\n".join(lines) + "\n    "
    return step


def _shown(observation) -> str:
    """An observation as the model reads it: a single field's text, else its fields as JSON."""
    data = observation if isinstance(observation, dict) else observation.model_dump()
    data = {k: v for k, v in data.items() if k not in ("done", "reward", "metadata")}
    if len(data) == 1 and isinstance(next(iter(data.values())), str):
        return next(iter(data.values()))
    return json.dumps(data, default=str)


def openenv_environment(env_cls=None, *, action=None, url: str | None = None, serve: bool = False,
                        reset_columns: tuple[str, ...] | None = None, name: str | None = None) -> type:
    """A grpokit environment class over an OpenEnv environment: `env_cls` in-process, `serve=True` the same
    behind OpenEnv's HTTP server that grpokit starts, or `url` a running server (`action` its Action class
    or None for dict actions with the fields the tool schema lists; `reset_columns` the row columns reset
    receives)."""
    if env_cls is None and url is None:
        raise SetupError("openenv_environment: give the environment class, or url= of a running OpenEnv server")
    if url is not None and not re.match(r"^https?://", url):
        raise SetupError(f"openenv_environment: url {url!r} must start with http:// or https://")
    if url is not None or serve:
        _require("openenv.core.generic_client", "openenv_environment(url=... or serve=True)")
    action_cls = action or (_action_class(env_cls) if env_cls is not None else None)
    if action_cls is None:
        raise SetupError("openenv_environment(url=...): give action=<the server's Action class> (its fields are the "
                         "step tool's arguments)")
    accepted = reset_columns
    if accepted is None and env_cls is not None:
        accepted = tuple(k for k, p in inspect.signature(env_cls.reset).parameters.items()
                         if k != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    state: dict = {}

    def connect():
        if env_cls is not None and not serve:
            return env_cls()
        if "url" not in state:
            state["server"] = _Server(env_cls, action_cls, _observation_class(env_cls)) if serve else None
            state["url"] = state["server"].url if serve else url
        from openenv.core.generic_client import GenericEnvClient

        return GenericEnvClient(base_url=state["url"]).sync()

    class OpenEnvAdapter:
        def __init__(self):
            self._env, self._rewards, self._turn, self._done, self._last = connect(), [], [], False, None

        def reset(self, **row) -> str | None:
            kwargs = {k: v for k, v in row.items() if k in (accepted or ())}
            self._rewards, self._turn, self._done = [], [], False
            result = self._env.reset(**kwargs)
            observation = getattr(result, "observation", result)  # a client's StepResult, or the Observation
            self._last = _shown(observation)
            return self._last

        def _step(self, arguments: dict) -> str:
            if self._done:
                raise RuntimeError("the episode is over (the environment said done); give the final answer")
            act = action_cls(**arguments)
            result = self._env.step(act if env_cls is not None and not serve else act.model_dump())
            observation = getattr(result, "observation", result)
            reward = getattr(result, "reward", None)
            reward = getattr(observation, "reward", None) if reward is None else reward
            done = getattr(result, "done", None) or getattr(observation, "done", False)
            if reward is not None:
                self._rewards.append(float(reward))
                self._turn.append(float(reward))
            self._done, self._last = bool(done), _shown(observation)
            return self._last

        def get_turn_reward(self) -> float | None:
            value, self._turn = (sum(self._turn) if self._turn else None), []
            return value

        def get_state(self):
            return self._last

        def get_reward(self) -> float:
            return float(sum(self._rewards))

        step = _step_tool(action_cls)

    OpenEnvAdapter.__name__ = OpenEnvAdapter.__qualname__ = name or (env_cls.__name__ if env_cls else "OpenEnv")
    def close(cls) -> None:
        """Stop the server this adapter started (a later instance starts a new one)."""
        server = state.pop("server", None)
        state.pop("url", None)
        if server is not None:
            server.close()

    # classmethods, so not tools; train() calls grpokit_close when the run ends
    OpenEnvAdapter.close = OpenEnvAdapter.grpokit_close = classmethod(close)
    return OpenEnvAdapter


# ---- verifiers ---------------------------------------------------------------------------------------


def verifiers_environment(env, name: str | None = None) -> type:
    """A grpokit environment class over a verifiers environment: its tools, its rubric as reward columns."""
    vf = _require("verifiers", "verifiers_environment")
    kinds = tuple(getattr(vf, k) for k in ("ToolEnv", "StatefulToolEnv", "SingleTurnEnv") if hasattr(vf, k))
    label = name or type(env).__name__
    if not isinstance(env, kinds):
        raise SetupError(f"verifiers environment {label}: a {type(env).__name__} answers with its own env_response, "
                         "which grpokit does not run; ToolEnv, StatefulToolEnv and SingleTurnEnv are supported "
                         "(their tools run as grpokit tools)")
    rubric = env.rubric
    funcs, weights = rubric._get_reward_funcs(), rubric._get_reward_weights()
    group = [getattr(f, "__name__", str(f)) for f in funcs if rubric._is_group_func(f)]
    if group:
        raise SetupError(f"verifiers environment {label}: the rubric's group reward functions {group} score a whole "
                         "group at once, which grpokit does not call yet; give them per-rollout")
    namespace = {t.__name__: staticmethod(t) for t in getattr(env, "tools", None) or []}
    namespace["reset"] = lambda self, **row: None
    cls = type(label, (), namespace)
    cls.grpokit_reward_specs = [RewardSpec(f"{label}/{getattr(f, '__name__', 'reward')}",
                                           _rubric_reward(cls, f, env.parser), float(w))
                                for f, w in zip(funcs, weights) if w != 0]
    return cls


def _rubric_reward(cls, func, parser) -> Callable:
    """A verifiers reward function as a grpokit one, scoring the answers of `cls` only (None for others)."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        params = {}
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())

    def reward(prompts, completions, environments=None, **columns) -> list[float | None]:
        out: list[float | None] = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            if environments is None or type(environments[i]) is not cls:
                out.append(None)
                continue
            row = {k: v[i] for k, v in columns.items() if isinstance(v, list) and len(v) == len(completions)}
            call: dict[str, Any] = {"prompt": prompt, "completion": completion, "answer": row.get("answer", ""),
                                    "info": row.get("info", {}), "task": row.get("task", "default"), "parser": parser}
            call["state"] = {**call, "trajectory": [], "responses": []}
            value = func(**(call if takes_all else {k: v for k, v in call.items() if k in params}))
            out.append(float(asyncio.run(value) if inspect.iscoroutine(value) else value))
        return out

    reward.__name__ = getattr(func, "__name__", "reward")
    return reward

"""Tools the policy may call inside a rollout, as TRL defines them.

A tool is a plain Python function (sync or async) with type hints and a Google-style docstring;
its JSON schema comes from `transformers.utils.get_json_schema` and the tokenizer's chat template
renders the list into the prompt (`apply_chat_template(..., tools=schemas)`). A tool function
written for TRL's `GRPOTrainer(tools=[...])` works unchanged.

Calls are read from the text of one assistant turn in the Hermes / Qwen format,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

(several per turn allowed). Every way a call can go wrong is a failed call whose result is
`{"error": "..."}`, shown to the model as the tool's answer, as TRL does: text between the tags
that is not a JSON object with a string "name" and an object "arguments", an unknown tool name,
arguments the function does not take, an exception inside the tool, or a call still running
after `timeout_s` (left to finish in its thread; the rollout goes on).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call read from a turn: `name` and `arguments`, or `error` when the text is not a valid call."""

    name: str | None
    arguments: dict
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    name: str  # the tool's name, or "unknown" when the call named none
    content: str  # what the model is shown
    failed: bool


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` block of one assistant turn, in order."""
    calls = []
    for block in CALL.findall(text):
        try:
            data = json.loads(block)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, {}, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(ToolCall(None, {}, 'a tool call must be a JSON object with a string "name"'))
            continue
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some templates write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(data["name"], {}, '"arguments" must be a JSON object'))
            continue
        calls.append(ToolCall(data["name"], arguments))
    return calls


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="grpokit-tool")


class ToolBox:
    """The tools of a run by name, their JSON schemas for the chat template, and a bounded way to call them."""

    def __init__(self, functions: Sequence[Callable], *, timeout_s: float = 30.0):
        from transformers.utils import get_json_schema

        self.functions: dict[str, Callable] = {}
        self.schemas: list[dict] = []
        for fn in functions:
            try:
                schema = get_json_schema(fn)
            except Exception as e:  # noqa: BLE001 - transformers raises several types for a bad docstring
                raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: {e}; a tool needs type hints and a "
                                 "Google-style docstring with an Args: section") from None
            name = schema["function"]["name"]
            if name in self.functions:
                raise ValueError(f"two tools are named {name!r}; tool names must be unique")
            self.functions[name] = fn
            self.schemas.append(schema)
        self.timeout_s = timeout_s

    def __bool__(self) -> bool:
        return bool(self.functions)

    def rebound(self, functions: Sequence[Callable]) -> "ToolBox":
        """The same tools (names, schemas, timeout) calling other functions of the same names: an
        environment instance's own bound methods."""
        box = ToolBox.__new__(ToolBox)
        box.functions = {**self.functions, **{fn.__name__: fn for fn in functions}}
        box.schemas, box.timeout_s = self.schemas, self.timeout_s
        return box

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run calls at once (threads); each result within `timeout_s` of the start."""
        return run_calls([(self, call) for call in calls])

    @staticmethod
    def _call(fn: Callable, arguments: dict) -> Any:
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as e:
            raise TypeError(f"wrong arguments {sorted(arguments)}: {e}") from None
        value = fn(**arguments)
        return asyncio.run(value) if inspect.iscoroutine(value) else value


def run_calls(pairs: Sequence[tuple[ToolBox, ToolCall]]) -> list[ToolResult]:
    """Run each call with its own tool box (rows may each have their own: environments), all at once."""
    futures = [None if call.error or call.name not in box.functions else
               _POOL.submit(box._call, box.functions[call.name], call.arguments) for box, call in pairs]
    results = []
    for (box, call), future in zip(pairs, futures):
        name = call.name or "unknown"
        if call.error:
            results.append(ToolResult(name, _error(call.error), True))
        elif future is None:
            known = ", ".join(box.functions)
            results.append(ToolResult(name, _error(f"unknown tool {call.name!r}; the tools are: {known}"), True))
        else:
            try:
                value = future.result(timeout=box.timeout_s or None)
                results.append(ToolResult(name, value if isinstance(value, str) else str(value), False))
            except concurrent.futures.TimeoutError:
                results.append(ToolResult(name, _error(f"the tool did not answer within {box.timeout_s:g} s"), True))
            except Exception as e:  # noqa: BLE001 - a tool's own failure is the model's problem, not the run's
                results.append(ToolResult(name, _error(f"{type(e).__name__}: {e}"), True))
    return results


def _error(message: str) -> str:
    return json.dumps({"error": message})


def tool_suffix_ids(tokenizer, results: Sequence[ToolResult], **template_kwargs) -> list[int]:
    """The tokens the chat template puts after an assistant turn that called tools: the tool messages,
    then the header of the next assistant turn. Rendered against a minimal conversation, as TRL does,
    and cut at that conversation's end of turn (EOS), which the sampled turn already ends with."""
    calls = [{"type": "function", "function": {"name": results[0].name, "arguments": {}}}]
    conversation = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
    prefix = tokenizer.apply_chat_template(conversation, add_generation_prompt=False, tokenize=True,
                                           return_dict=False, **template_kwargs)
    full = tokenizer.apply_chat_template(conversation + messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False, **template_kwargs)
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template renders an assistant turn differently once tool messages follow it; "
                         "grpokit cannot append tool results to the sampled tokens with this template")
    return full[len(prefix):]


def check_tool_template(tokenizer, tools: ToolBox) -> None:
    """Fail at start-up, naming the fix, when the chat template cannot show the model its tools or
    cannot render a tool result after an assistant turn."""
    fix = ("use a model whose chat template supports tools (Qwen2.5/Qwen3, Llama 3.1+, Hermes, ...) or set "
           "tokenizer.chat_template to one that renders `tools` and messages with role \"tool\"")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tools need a chat template, and the tokenizer has none; {fix}")
    user = [{"role": "user", "content": "x"}]
    try:
        plain = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True,
                                                   tools=tools.schemas)
        suffix = tool_suffix_ids(tokenizer, [ToolResult(next(iter(tools.functions)), "42", False)])
    except Exception as e:  # noqa: BLE001 - jinja raises many types
        raise ValueError(f"the chat template fails on tool messages ({type(e).__name__}: {e}); {fix}") from None
    if plain == with_tools:
        raise ValueError(f"the chat template ignores the tools (the prompt is the same with and without them); {fix}")
    if "42" not in tokenizer.decode(suffix):
        raise ValueError(f"the chat template drops tool results (a tool message renders as nothing); {fix}")

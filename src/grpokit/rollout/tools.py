"""Tools the policy may call inside a rollout, as TRL defines them.

A tool is a plain Python function (sync or async) with type hints and a Google-style docstring;
its JSON schema comes from `transformers.utils.get_json_schema` and the tokenizer's chat template
renders the list into the prompt (`apply_chat_template(..., tools=schemas)`). A tool function
written for TRL's `GRPOTrainer(tools=[...])` works unchanged.

Calls are read from the text of one assistant turn with the tokenizer's response template where it
has one (`call_parser`), else in the Hermes / Qwen format,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

(several per turn allowed; run in the order written). Every way a call can go wrong is a failed
call whose result is `{"error": "..."}`, shown to the model as the tool's answer, as TRL does: text
between the tags that is not a JSON object with a string "name" and an object "arguments", an
unknown tool name, arguments the function does not take, an exception inside the tool (any, even
SystemExit), a result longer than `max_result_chars`, or a call still running after `timeout_s` (left
to finish in its daemon thread; the rollout goes on; past `MAX_ABANDONED` such threads still running,
further calls fail without starting one). A result is shown as text a tokenizer accepts (`as_text`:
lone surrogates and NUL bytes become U+FFFD).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from grpokit.exit_guard import TOOL, ToolExit, guarded
from grpokit.rollout.tool_output import InvalidBlocks, ResultTooLong, as_text, content_parts, is_content_blocks

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_ABANDONED = 64  # timed-out calls whose threads still run; past it, calls fail without a new thread
_abandoned: list[threading.Thread] = []
HOOKS = ("reset", "get_reward", "get_turn_reward", "get_state")  # an environment's contract methods, never tools


@dataclass(frozen=True)
class ToolCall:
    """One call read from a turn: `name` and `arguments`, or `error` when the text is not a valid call."""

    name: str | None
    arguments: dict
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    name: str  # the tool's name, or "unknown" when the call named none
    content: str  # what the model is shown (a result with images: its text parts, one per line)
    failed: bool
    reward: float | None = None  # the step reward the tool returned with its result (`WithReward`)
    parts: tuple = ()  # a result given as content blocks (TRL's multimodal tool responses): ("text", str) and
    # ("image", PIL image) in order; () for a plain result

    @property
    def images(self) -> list:
        return [value for kind, value in self.parts if kind == "image"]

    def message(self) -> dict:
        """The tool message the chat template renders: content blocks (`{"type": "image"}` placeholders, whose
        pixels the processor encodes) where the result holds images, else its text."""
        if not self.images:
            return {"role": "tool", "name": self.name, "content": self.content}
        return {"role": "tool", "name": self.name, "content": [
            {"type": "image"} if kind == "image" else {"type": "text", "text": value} for kind, value in self.parts]}

    def unshown(self, reason: str) -> "ToolResult":
        """This result where its images cannot be shown (`reason` says why and what to do): a failed call where it
        holds images, itself otherwise."""
        if not self.images:
            return self
        return ToolResult(self.name, tool_error(f"the tool returned {len(self.images)} image(s), and {reason}"), True)


@dataclass(frozen=True)
class WithReward:
    """What a tool returns to give its turn a step reward besides its result: the model is shown `value`
    (as any result), `reward` (a finite number) adds to the turn's reward for per-turn credit
    (`algorithm.turn_advantage`). A reward that is not a finite number makes the call a failed one."""

    value: Any
    reward: float


def parse_tool_calls(text: str, **_) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` block of one assistant turn, in order."""
    calls = []
    for block in CALL.findall(text):
        try:
            data = json.loads(block)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, {}, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
            continue
        calls.append(_as_call(data))
    return calls


def _as_call(data: Any) -> ToolCall:
    """A call from its parsed JSON, `{"name": str, "arguments": {...}}`; a failed call otherwise."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall(None, {}, 'a tool call must be a JSON object with a string "name"')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(data["name"], {}, '"arguments" must be a JSON object')
    return ToolCall(data["name"], arguments)


def call_parser(tokenizer) -> Callable[..., list[ToolCall]]:
    """How calls are read from the text of one turn (special tokens kept): through the tokenizer's own
    response template when it has one (transformers' `parse_response`; the model's authors ship it,
    or TRL's `add_response_schema` sets it for Llama 3.1, gpt-oss, GLM, Qwen3, ...), else with the
    Hermes / Qwen parser above. The template parser sees, as in TRL, the conversation before the turn
    (`prefix`: a generation prompt that opens `<think>` makes what follows reasoning, not calls) and
    the tools' schemas (`tools`: arguments typed by them). A turn it cannot parse is one failed call."""
    template = getattr(tokenizer, "response_template", None)
    if template is None:
        return parse_tool_calls
    try:
        from transformers.utils.chat_parsing.response_templates import load_response_template

        load_response_template(template)
    except ImportError:  # pragma: no cover - an older transformers: parse_response reports it
        pass
    except Exception as e:  # noqa: BLE001 - any reason the template is unusable
        raise ValueError(f"the tokenizer's response_template is not usable ({e}); fix or remove it "
                         "(tokenizer_config.json)") from None

    def parse(text: str, *, prefix: str = "", tools: list[dict] | None = None) -> list[ToolCall]:
        try:
            message = tokenizer.parse_response(text, prefix=prefix, tools=tools or None)
        except Exception as e:  # noqa: BLE001 - the parser raises several types for malformed output
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            return [ToolCall(None, {}, f"the tool call could not be parsed ({reason})")]
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        return [_as_call(c.get("function") if isinstance(c, dict) else c) for c in calls or []]

    return parse


class ToolBox:
    """The tools of a run by name, their JSON schemas for the chat template, and a bounded way to call them."""

    def __init__(self, functions: Sequence[Callable], *, timeout_s: float = 30.0, max_result_chars: int = 100_000):
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
        self.timeout_s, self.max_result_chars = timeout_s, max_result_chars
        self.workers, self.answer = None, None  # tools.isolation = "process": tool_workers.ToolWorkers, answer

    def __bool__(self) -> bool:
        return bool(self.functions)

    def rebound(self, functions: Sequence[Callable]) -> "ToolBox":
        """The same tools (names, schemas, timeout) calling other functions of the same names: an
        environment instance's own bound methods."""
        box = ToolBox.__new__(ToolBox)
        box.functions = {**self.functions, **{fn.__name__: fn for fn in functions}}
        box.schemas, box.timeout_s, box.max_result_chars = self.schemas, self.timeout_s, self.max_result_chars
        box.workers, box.answer = getattr(self, "workers", None), getattr(self, "answer", None)
        return box

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run one answer's calls, in order."""
        return run_calls([[(self, call) for call in calls]])[0]

    @staticmethod
    def _call(fn: Callable, arguments: dict) -> Any:
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as e:
            raise TypeError(f"wrong arguments {sorted(arguments)}: {e}") from None
        value = fn(**arguments)
        return asyncio.run(value) if inspect.iscoroutine(value) else value


def run_calls(answers: Sequence[Sequence[tuple[ToolBox, ToolCall]]]) -> list[list[ToolResult]]:
    """The calls of several answers: each answer's in order (as TRL runs them: a stateful environment
    sees them in the order the model wrote them), different answers at the same time. Each call gets
    its box's `timeout_s`; one still running then is reported as failed and left to finish in its
    daemon thread (it may still change its environment afterwards, and never holds up the exit)."""
    remote = next((box.workers for calls in answers for box, _ in calls if getattr(box, "workers", None)), None)
    if remote is not None:  # tools.isolation = "process": in the answers' own workers
        return remote.call([(calls[0][0].answer if calls[0][0].answer is not None else i, [c for _, c in calls])
                            if calls else (i, []) for i, calls in enumerate(answers)])
    results: list[list[ToolResult]] = [[] for _ in answers]

    def run_in_order(i: int, calls) -> None:
        results[i] = [run_one_call(box, call) for box, call in calls]

    workers = [threading.Thread(target=run_in_order, args=(i, calls), daemon=True) for i, calls in enumerate(answers)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()  # each call is bounded by its timeout, so each answer is too
    return results


def run_one_call(box: ToolBox, call: ToolCall) -> ToolResult:
    name = as_text(call.name or "unknown")  # the model's JSON may spell a lone surrogate
    if call.error:
        return ToolResult(name, tool_error(call.error), True)
    if call.name not in box.functions:
        known = ", ".join(box.functions)
        return ToolResult(name, tool_error(f"unknown tool {call.name!r}; the tools are: {known}"), True)
    fn, limit = box.functions[call.name], box.max_result_chars

    def work() -> tuple[bool, str | tuple, float | None]:  # shown as text (or blocks) here, within the timeout
        try:
            value = box._call(fn, call.arguments)
        except BaseException as e:  # noqa: BLE001 - SystemExit, CancelledError...: the model's problem, not the run's
            return False, _describe(e), None
        reward = None
        if isinstance(value, WithReward):
            value, reward = value.value, value.reward
            if not is_finite_number(reward):
                return False, f"the tool returned the reward {as_text(repr(reward))[:80]} ({type(reward).__name__}); " \
                              "a step reward must be a finite number", None
        try:
            if is_content_blocks(value):
                parts = content_parts(value, limit)
                return True, parts, None if reward is None else float(reward)
            return True, as_text(value, limit), None if reward is None else float(reward)
        except (ResultTooLong, InvalidBlocks) as e:
            return False, str(e), None
        except BaseException as e:  # noqa: BLE001 - a result whose __str__ raises
            return False, f"the result could not be shown as text ({_describe(e)})", None

    try:
        ok, content, reward = call_within(work, box.timeout_s, f"grpokit-tool-{call.name}")
    except TimeoutError as e:
        return ToolResult(name, tool_error(str(e)), True)
    except ToolExit as e:  # a thread the tool started tried to end the trainer, after the tool itself returned
        return ToolResult(name, tool_error(_describe(e)), True)
    if ok and isinstance(content, tuple):  # content blocks
        text = "\n".join(value for kind, value in content if kind == "text")
        return ToolResult(name, text, False, reward, content if any(k == "image" for k, _ in content) else ())
    return ToolResult(name, content if ok else tool_error(content), not ok, reward)


def is_finite_number(value: Any) -> bool:
    """A real number (int, float, numpy's, bool) that is neither NaN nor infinite: what a step reward must be."""
    return isinstance(value, numbers.Real) and math.isfinite(value)


def call_within(fn: Callable[[], Any], timeout_s: float, name: str = "grpokit-tool") -> Any:
    """`fn()` in a daemon thread, waited for at most `timeout_s` (0 = no limit). Its value; what it raises
    is raised here (BaseException as well: catch it in `fn` where that matters); TimeoutError past the
    deadline, the thread left to finish (it never holds up the exit). At most `MAX_ABANDONED` such threads
    run at once: past that, TimeoutError at once, with no new thread. In the thread, `os._exit`, a signal
    to this process and the like raise `exit_guard.ToolExit` instead of ending it."""
    _abandoned[:] = [t for t in _abandoned if t.is_alive()]
    if len(_abandoned) >= MAX_ABANDONED:
        raise TimeoutError(f"not run: {len(_abandoned)} earlier calls are still running past tools.timeout_s; set "
                           "tools.isolation = \"process\" to have such calls killed")
    outcome: dict = {}
    run = guarded(fn, TOOL)  # os._exit & co. raise in its thread (and in threads it starts)

    def target() -> None:
        try:
            outcome["value"] = run()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True, name=name)
    thread.start()
    thread.join(timeout_s or None)
    if thread.is_alive():
        _abandoned.append(thread)
        raise TimeoutError(f"the tool did not answer within {timeout_s:g} s")
    if isinstance(outcome.get("error"), KeyboardInterrupt):  # signals reach the main thread: this is the code's own
        raise RuntimeError("KeyboardInterrupt raised by the code itself (a Ctrl-C reaches the main thread, not "
                           "this one)") from outcome["error"]
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _describe(e: BaseException) -> str:
    try:
        text = f"{type(e).__name__}: {e}"
        return as_text(text if len(text) <= 2000 else text[:2000] + "...")
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises
        return type(e).__name__


def tool_error(message: str) -> str:
    return json.dumps({"error": message})


def call_conversation(name: str) -> list[dict]:
    """The minimal conversation a turn's tool results are rendered after: a user turn and an assistant turn that
    called `name` (the template's output past its end of turn is what a sampled turn is followed by)."""
    calls = [{"type": "function", "function": {"name": name, "arguments": {}}}]
    return [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]


def tool_suffix_ids(tokenizer, results: Sequence[ToolResult], **template_kwargs) -> list[int]:
    """The tokens the chat template puts after an assistant turn that called tools: the tool messages,
    then the header of the next assistant turn. Rendered against a minimal conversation, as TRL does,
    and cut at that conversation's end of turn (EOS), which the sampled turn already ends with."""
    prefix, full = _call_and_results(tokenizer, results, **template_kwargs)
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template renders an assistant turn differently once tool messages follow it "
                         "(as Qwen3's drops earlier turns' <think>), so tool results cannot be appended to the "
                         "sampled tokens; set tools.history = \"split\" to train such conversations as the template "
                         "renders them (a new training row where it rewrites them), or use a template that does not")
    return full[len(prefix):]


def _call_and_results(tokenizer, results: Sequence[ToolResult], **template_kwargs) -> tuple[list[int], list[int]]:
    """The minimal conversation's tokens up to the called turn's end (EOS), and with `results` after it plus the
    next assistant header."""
    conversation = call_conversation(results[0].name)
    messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
    prefix = tokenizer.apply_chat_template(conversation, add_generation_prompt=False, tokenize=True,
                                           return_dict=False, **template_kwargs)
    full = tokenizer.apply_chat_template(conversation + messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False, **template_kwargs)
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    return (prefix[: eos[-1] + 1] if eos else prefix), full


def rewrites_earlier_turns(tokenizer, name: str = "dummy") -> bool:
    """Whether the chat template renders an assistant turn differently once tool messages follow it (Qwen3's
    drops earlier turns' <think>; TRL's `is_chat_template_prefix_preserving`, negated): then tool results
    cannot be appended to the sampled tokens, and `tools.history = "split"` trains such conversations. False
    when the template cannot render the probe at all (`check_tool_template` names that)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    try:
        prefix, full = _call_and_results(tokenizer, [ToolResult(name, "42", False)])
    except Exception:  # noqa: BLE001 - jinja raises many types; check_tool_template says which
        return False
    return full[: len(prefix)] != prefix


SPLIT_CHOSEN = ("note: tools.history = \"split\": the chat template of {model} renders an assistant turn differently "
                "once tool messages follow it (as Qwen3's drops earlier turns' <think>), so tool results cannot be "
                "appended to the sampled tokens; each turn is sampled from the conversation as the template renders "
                "it, a new training row where it rewrites earlier turns")


def check_tool_template(tokenizer, tools: ToolBox, history: str = "append") -> None:
    """Fail at start-up, naming the fix, when the chat template cannot show the model its tools, cannot
    render a tool result after an assistant turn, or writes tool calls in a format that neither the
    tokenizer's response template nor the Hermes / Qwen parser reads back. With `history = "split"`
    (tools.history) the results are rendered in the whole conversation, which may rewrite earlier turns."""
    fix = ("use a model whose chat template writes calls as <tool_call>{json}</tool_call> (Qwen2.5, Hermes) or whose "
           "tokenizer has a response template that reads its calls (tokenizer.response_template; TRL's "
           "add_response_schema sets one for Llama 3.1, gpt-oss, Qwen3, ...), or set tokenizer.chat_template to one "
           "that renders `tools`, assistant `tool_calls` and messages with role \"tool\"")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tools need a chat template, and the tokenizer has none; {fix}")
    name = next(iter(tools.functions))
    user = [{"role": "user", "content": "x"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": {"probe": 1}}}]}
    call_parser(tokenizer)  # an unusable response template: its own reason
    try:
        plain = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True,
                                                   tools=tools.schemas)
        with_call = tokenizer.apply_chat_template(user + [call], tokenize=False)
        if history == "split":  # the probe conversation rendered whole, as each turn will be
            shown = tokenizer.apply_chat_template(user + [call, {"role": "tool", "name": name, "content": "42"}],
                                                  tokenize=False, add_generation_prompt=True)
        else:
            shown = tokenizer.decode(tool_suffix_ids(tokenizer, [ToolResult(name, "42", False)]))
    except Exception as e:  # noqa: BLE001 - jinja raises many types
        raise ValueError(f"the chat template fails on tool messages ({type(e).__name__}: {e}); {fix}") from None
    if plain == with_tools:
        raise ValueError(f"the chat template ignores the tools (the prompt is the same with and without them); {fix}")
    if "42" not in shown:
        raise ValueError(f"the chat template drops tool results (a tool message renders as nothing); {fix}")
    if not with_call.startswith(plain):
        raise ValueError(f"the chat template renders the start of an assistant turn differently once it holds a "
                         f"call; {fix}")
    read = call_parser(tokenizer)(with_call[len(plain):], prefix=plain, tools=tools.schemas)
    if not any(c.name == name and set(c.arguments) == {"probe"} for c in read):  # "probe" may come back as "1"
        raise ValueError(f"the chat template writes tool calls in a format grpokit does not read yet; {fix}")

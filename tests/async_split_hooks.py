"""Scripted tool calls for runs whose sampling happens in a rollout worker process (tests/test_async_split.py).

The tiny random model writes no call syntax, so test_history_split.py scripts its turns: a turn ends at a digit
or "=" and every turn "calls" `add`. A monkeypatch in the test process does not reach a spawned worker; this
module does: the run's tool (`add`) and reward (`final_parity`) live here, so a worker imports it when it
unpickles them, and with SCRIPTED set in the environment (inherited by the worker) that import installs the same
hook there. The hook wraps the built-in engine's `sample_conversations` (rollout/engines.py) and changes only the
stop tokens and the call parser: the sampler, the chat template's rendering, the forks and the rows are the real
path in both processes.
"""

from __future__ import annotations

import dataclasses
import os

import grpokit.rollout.engines as engines
from grpokit.rollout.multiturn import sample_conversations
from grpokit.rollout.tools import ToolCall

SCRIPTED = "GRPOKIT_TEST_SCRIPTED_TOOLS"  # "1": install the hook at import (a worker process)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def final_parity(completions, **kwargs):
    text = [c[-1]["content"] for c in completions]
    return [sum(ord(ch) % 2 == 0 for ch in t) / max(1, len(t)) for t in text]


def scripted_calls(text, **_):
    return [ToolCall("add", {"a": len(text), "b": 1})]


def scripted_conversations(model, request, *, tokenizer, **kwargs):
    """The engine's multi-turn sampling with turns that end at a digit or "=" and always call `add`."""
    digits = tuple(tokenizer.convert_tokens_to_ids(d) for d in "0123456789=")
    request = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, eos_token_ids=digits))
    return sample_conversations(model, request, tokenizer=tokenizer, parse_calls=scripted_calls, **kwargs)


if os.environ.get(SCRIPTED) == "1":  # a worker process (the test process patches with monkeypatch instead)
    engines.sample_conversations = scripted_conversations

"""Tool-call formats other than Hermes / Qwen: read through the tokenizer's own response template
(transformers' `parse_response`), as TRL does. The template here is Llama 3.1's format (a bare JSON
object with "parameters", closed by the end-of-turn token) on the tiny tokenizer."""

from __future__ import annotations

import pytest

from grpokit.models.loading import load_tokenizer
from grpokit.models.tiny import build_char_tokenizer, build_tiny_model
from grpokit.rollout.multiturn import _Answers
from grpokit.rollout.request import RolloutRequest, SamplingParams
from grpokit.rollout.tools import ToolBox, ToolCall, call_parser, check_tool_template, parse_tool_calls

# Llama 3.1's way of writing a call, on the tiny tokenizer: the JSON object alone, then the end of turn.
LLAMA_STYLE_TEMPLATE = (
    "{% if tools %}tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}assistant: {{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}"
    "{{ {'name': c['function']['name'], 'parameters': c['function']['arguments']} | tojson }}{% endfor %}"
    "<eos>{{ '\\n' }}"
    "{% elif m['role'] == 'tool' %}tool: {{ m['content'] }}{{ '\\n' }}"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# The response template TRL's add_response_schema sets for Llama 3.1, with this tokenizer's end of turn.
LLAMA_STYLE_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "assistant: ",
    "fields": {
        "tool_calls": {
            "open_pattern": '\\{"name":\\s*"(?P<name>[^"]+)",\\s*"parameters":\\s*',
            "close_pattern": "\\}<eos>\\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": "<eos>\\s*", "content": "text"},
    },
}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


@pytest.fixture()
def llama_style(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = LLAMA_STYLE_TEMPLATE
    tokenizer.response_template = LLAMA_STYLE_RESPONSE
    build_tiny_model(tmp_path, tokenizer=tokenizer, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    return load_tokenizer(tmp_path)  # the template travels in tokenizer_config.json, as a model's own does


def test_calls_are_read_with_the_tokenizers_response_template(llama_style):
    assert llama_style.response_template == LLAMA_STYLE_RESPONSE
    parse = call_parser(llama_style)
    assert parse('{"name": "add", "parameters": {"a": 3, "b": 4}}<eos>') == [ToolCall("add", {"a": 3, "b": 4})]
    assert parse("just an answer<eos>") == []
    (broken,) = parse('{"name": "add", "parameters": {"a": 3,<eos>')  # malformed: one failed call, no crash
    assert broken.name is None and broken.error.startswith("the tool call could not be parsed")
    # the Hermes parser would not see this format at all
    assert parse_tool_calls('{"name": "add", "parameters": {"a": 3, "b": 4}}<eos>') == []


def test_the_start_up_check_accepts_a_format_the_response_template_reads(llama_style):
    box = ToolBox([add])
    check_tool_template(llama_style, box)  # passes: the template reads the format back
    llama_style.response_template = None
    with pytest.raises(ValueError, match="does not read yet.*response template"):
        check_tool_template(llama_style, box)


def test_the_sampler_parses_with_the_tokenizer_by_default(llama_style):
    box = ToolBox([add])
    request = RolloutRequest([llama_style.encode("user: x\nassistant: ", add_special_tokens=False)], 1,
                             SamplingParams(64), tools=box)
    answers = _Answers(request, llama_style, 2, None, lambda results: [])
    ids = llama_style.encode('{"name": "add", "parameters": {"a": 1, "b": 2}}<eos>', add_special_tokens=False)
    answers.add(0, ids, [0.0] * len(ids))
    assert answers.end_turn(0, ended=True) == [ToolCall("add", {"a": 1, "b": 2})]
    # the conversation keeps the turn's text without special tokens
    assert answers.stats.conversations[0] == [{"role": "assistant",
                                               "content": '{"name": "add", "parameters": {"a": 1, "b": 2}}'}]


# A reasoning model's format: the generation prompt opens <think>, calls are Hermes tags, and only
# calls after </think> are calls (Qwen3-style, as TRL's response template for it reads them).
THINKING_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "assistant: ",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": "</think>\\s*", "content": "text"},
        "tool_calls": {"open": "<tool_call>", "close_pattern": "</tool_call>\\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": "<eos>\\s*", "content": "text"},
    },
}


def test_the_template_parser_sees_the_conversation_before_the_turn_and_the_tool_schemas():
    tokenizer = build_char_tokenizer()
    tokenizer.response_template = THINKING_RESPONSE
    parse = call_parser(tokenizer)
    turn = 'maybe <tool_call>{"name": "add", "arguments": {"a": "1", "b": 2}}</tool_call></think>no call<eos>'
    assert parse(turn, prefix="user: x\nassistant: <think>") == []  # reasoning that mentions a call runs nothing
    turn = '</think><tool_call>{"name": "add", "arguments": {"a": "1", "b": 2}}</tool_call><eos>'
    (call,) = parse(turn, prefix="user: x\nassistant: <think>", tools=ToolBox([add]).schemas)
    assert call == ToolCall("add", {"a": 1, "b": 2})  # "1" typed by the schema (a: int), as TRL does


def test_an_unusable_response_template_is_a_start_up_error_with_its_reason(llama_style):
    llama_style.response_template = {"fields": {}}
    with pytest.raises(ValueError, match=r"not usable \(response_template.fields must be a non-empty dict\)"):
        check_tool_template(llama_style, ToolBox([add]))

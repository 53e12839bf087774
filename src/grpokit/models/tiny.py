"""Build a tiny causal LM and tokenizer locally, with nothing from a hub.

The demo, the tests and the benchmarks need a real Hugging Face model folder
(`config.json`, safetensors weights, tokenizer files) that loads through the
same `from_pretrained(path)` code path a user's model does. This module writes
one: a character-level tokenizer built with the `tokenizers` library and a
small randomly initialised decoder (Qwen2 by default; `TINY_ARCHS` lists the
architectures it is tested with, the ones `grpokit tiny-model --arch` offers).
"""

from __future__ import annotations

import string
from pathlib import Path

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


# The decoder families grpokit is tested on (tests/test_architectures.py): the choices of
# `grpokit tiny-model --arch`. `build_tiny_model` takes other `model_type`s at the caller's risk.
TINY_ARCHS = ("gemma", "gpt2", "gpt_neox", "llama", "mistral", "phi3", "qwen2", "qwen3")
# The vision-language families (models/tiny_vision.py: `build_tiny_vlm`, `build_tiny_any`).
TINY_VLM_ARCHS = ("qwen2_vl", "idefics3", "gemma3")


# A minimal chat template so that conversational prompts work on the tiny
# tokenizer exactly as they do on a real chat model.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# The same with tools, Hermes-style, compact for a character model: the tool names in a first line,
# calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, an assistant turn ending in EOS,
# results as "tool: ..." lines.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}tools: {% for t in tools %}{{ t['function']['name'] }}{% if not loop.last %}, {% endif %}"
    "{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}assistant: {{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<eos>{{ '\\n' }}"
    "{% elif m['role'] == 'tool' %}tool: {{ m['content'] }}{{ '\\n' }}"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


# The tool-call tags as single tokens, as in Qwen's vocabulary.
TOOL_WORDS = ("<tool_call>", "</tool_call>")


def build_char_tokenizer(path: str | Path | None = None, alphabet: str | None = None,
                         words: tuple[str, ...] = ()):
    """A character-level fast tokenizer: one token per printable ASCII character.

    Characters are the right unit for arithmetic tasks (each digit is its own
    token), and the vocabulary stays ~100 tokens so a tiny model trains fast.
    `words` become single tokens too, as a real tokenizer's added tokens do
    (e.g. TOOL_WORDS: Qwen's vocabulary has `<tool_call>` as one token).
    Saved with `save_pretrained(path)` when `path` is given.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = alphabet if alphabet is not None else string.printable[:95] + "\n"
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *dict.fromkeys(chars)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=PAD,
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    if words:
        tok.add_tokens(list(words))
    if path is not None:
        tok.save_pretrained(str(path))
    return tok


def build_tool_tokenizer():
    """The character tokenizer with the tool-call tags as single tokens and TOOL_CHAT_TEMPLATE (the tool
    demo's; `grpokit tiny-model --tools`): a tiny model whose prompts list the tools and whose answers call them."""
    tokenizer = build_char_tokenizer(words=TOOL_WORDS)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    path: str | Path | None = None,
    *,
    tokenizer=None,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_positions: int = 512,
    seed: int = 0,
):
    """A randomly initialised causal LM (Qwen2 architecture by default).

    When `path` is given, the model and the tokenizer are written there in
    Hugging Face format and can be reloaded with `from_pretrained(path)`.
    Returns `(model, tokenizer)`.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = tokenizer if tokenizer is not None else build_char_tokenizer()
    config = AutoConfig.for_model(
        arch,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if path is not None:
        from grpokit.models.loading import no_progress_bars

        Path(path).mkdir(parents=True, exist_ok=True)
        with no_progress_bars():
            model.save_pretrained(str(path))
        tokenizer.save_pretrained(str(path))
    return model, tokenizer

"""Build the benchmark models locally: a ~32k BPE tokenizer and random-init tiny Qwen2 models.

The tokenizer is a byte-level BPE trained on Python's standard-library sources,
so the vocabulary (and with it the output projection and the log-softmax) costs
what a real model's would. Nothing is downloaded. Results are cached under
``bench/out/models`` and rebuilt only when missing.

    .venv/bin/python bench/build_models.py        # builds tokenizer, S and M models
    .venv/bin/python bench/build_models.py L      # also L: Qwen2.5-0.5B's architecture (2 GB on disk)

L is Qwen2.5-0.5B's architecture exactly (hidden 896, intermediate 4864, 24 layers, 14 attention heads,
2 KV heads, q/k/v biases, tied embeddings, RoPE theta 1e6, RMSNorm eps 1e-6, vocabulary 151,936),
random init. It uses the same 32k BPE tokenizer as S and M, with the model's vocabulary padded to
151,936 (the ids above 32k are never sampled often enough to matter, but the output projection and
the log-softmax over 151,936 entries cost what Qwen's do).
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out" / "models"
VOCAB = 32000
SIZES = {  # name -> (hidden, layers, heads, kv heads)
    "S": (64, 2, 4, 2),
    "M": (256, 6, 4, 2),
}
# Qwen2.5-0.5B's config.json, less what does not change the cost (random init instead of its weights)
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=32768, use_sliding_window=False)
LARGE = {"L": QWEN25_05B}
PROMPT_TOKENS = 32  # every prompt is cut to this many tokens (before the chat-free raw text)
NUM_PROMPTS = 512


def stdlib_files(limit_bytes: int = 24_000_000) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    out, total = [], 0
    for p in files:
        size = p.stat().st_size
        if total + size > limit_bytes:
            break
        out.append(str(p))
        total += size
    return out


def build_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train(stdlib_files(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                  padding_side="left")
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(path))
    return tok


def build_prompts(tok, path: Path) -> list[dict]:
    """Prompts: stdlib source snippets of exactly PROMPT_TOKENS tokens (re-encoding is checked)."""
    if path.is_file():
        return json.loads(path.read_text())
    rng = random.Random(0)
    files = stdlib_files(4_000_000)
    rows = []
    while len(rows) < NUM_PROMPTS:
        text = Path(rng.choice(files)).read_text(encoding="utf-8", errors="ignore")
        ids = tok(text[:4000], add_special_tokens=False)["input_ids"]
        if len(ids) < 200:
            continue
        start = rng.randrange(0, len(ids) - PROMPT_TOKENS)
        prompt = tok.decode(ids[start:start + PROMPT_TOKENS])
        if len(tok(prompt, add_special_tokens=False)["input_ids"]) == PROMPT_TOKENS:
            rows.append({"prompt": prompt})
    path.write_text(json.dumps(rows))
    return rows


def build_large(path: Path, tok, spec: dict) -> None:
    """A random-init Qwen2 model with `spec`'s config (the vocabulary padded past the tokenizer's)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    assert spec["vocab_size"] >= len(tok)
    config = AutoConfig.for_model("qwen2", **spec, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))


def build_all(large: tuple[str, ...] = ()) -> dict[str, str]:
    from transformers import AutoTokenizer

    from grpokit.models.tiny import build_tiny_model

    tok = build_tokenizer(OUT / "tokenizer")
    paths = {}
    for name, (hidden, layers, heads, kv) in SIZES.items():
        path = OUT / name
        if not (path / "config.json").is_file():
            build_tiny_model(path, tokenizer=tok, hidden_size=hidden, num_layers=layers, num_heads=heads,
                             num_kv_heads=kv, max_positions=1024, seed=0)
        paths[name] = str(path)
    for name in large:
        path = OUT / name
        if not (path / "config.json").is_file():
            build_large(path, tok, LARGE[name])
        paths[name] = str(path)
    # Prompts are cut with the tokenizer both trainers load (AutoTokenizer on the model folder picks the
    # Qwen2 tokenizer class, whose pre-tokenizer differs from the training one), so all have the same length.
    build_prompts(AutoTokenizer.from_pretrained(paths["M"]), OUT / "prompts.json")
    return paths


def count_params(path: str) -> dict:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    h, L, v, i = c.hidden_size, c.num_hidden_layers, c.vocab_size, c.intermediate_size
    hd = h // c.num_attention_heads
    attn = h * h * 2 + h * (c.num_key_value_heads * hd) * 2  # q, o and k, v projections
    mlp = 3 * h * i
    return {"hidden": h, "layers": L, "vocab": v, "heads": c.num_attention_heads, "head_dim": hd,
            "non_embedding": L * (attn + mlp), "embedding": v * h, "total": L * (attn + mlp) + v * h}


if __name__ == "__main__":
    import sys

    for name, p in build_all(tuple(sys.argv[1:])).items():
        print(name, p, count_params(p))

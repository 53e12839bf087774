"""Build the benchmark models locally: a ~32k BPE tokenizer and random-init tiny Qwen2 models.

The tokenizer is a byte-level BPE trained on Python's standard-library sources,
so the vocabulary (and with it the output projection and the log-softmax) costs
what a real model's would. Nothing is downloaded. Results are cached under
``bench/out/models`` and rebuilt only when missing.

    .venv/bin/python bench/build_models.py        # builds tokenizer, S and M models
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


def build_all() -> dict[str, str]:
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
    for name, p in build_all().items():
        print(name, p, count_params(p))

"""`grpokit explain`: the per-token ratio worked example by machine — one answer's per-token probabilities and ratios.

For a prompt x and an answer y = (y_1 … y_T) scored by two checkpoints (old =
the policy that sampled, new = after the update), print for every step t

- the next-token probability table π_old(· | x, y<t) and π_new(· | x, y<t)
  (the top tokens of either model, the chosen token always included);
- the token ratio r_t = π_new(y_t | x, y<t) / π_old(y_t | x, y<t), flagged when it
  leaves the trust region [1 − ε, 1 + ε_high] (and, with an advantage, whether
  the clipped objective stops the gradient there);

and for the whole answer the sequence ratio Π r_t = π_new(y | x) / π_old(y | x)
(worked example: 1.2 × 1.1667 × 1.5 = 2.1 = 0.252 / 0.12) and GSPO's length-normalised
ratio exp(mean_t log r_t). Probabilities are taken at `temperature`, as training
scores them. The prompt and the answer are tokenized separately, as the trainer
sees [prompt ‖ completion]; `--chat` renders the prompt as one user message
through the tokenizer's chat template.

`build_last_token_model` writes a Hugging Face folder whose next-token
distribution is any table you give it (depending on the last token only): the
way to reproduce the worked example's hand calculation from the command line, and the
fixture of its test.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from grpokit.errors import ExplainError, keywords_moved_into


@torch.no_grad()
def next_token_logprobs(model, prompt_ids: list[int], answer_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities [T, V] of every next token at each answer position."""
    ids = torch.tensor([prompt_ids + answer_ids], device=model.device)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1: -1].float()  # [T, V]
    return (logits / temperature).log_softmax(-1)


@dataclasses.dataclass(frozen=True)
class TrustRegion:
    """The clipped objective's trust region [1 - epsilon, 1 + epsilon_high] for the token ratio (a run's
    `algorithm.epsilon` and `algorithm.epsilon_high`; `epsilon_high` None: `epsilon` on both sides)."""

    epsilon: float = 0.2
    epsilon_high: float | None = None

    @property
    def upper_epsilon(self) -> float:
        return self.epsilon_high or self.epsilon

    @property
    def bounds(self) -> tuple[float, float]:
        """(low, high): a ratio outside them is flagged, and with an advantage may take the clipped branch."""
        return 1 - self.epsilon, 1 + self.upper_epsilon


@keywords_moved_into("trust_region", TrustRegion, "grpokit.observe.explain")
def explain(old_model, new_model, tokenizer, prompt: str, answer: str, *, chat: bool = False,
            temperature: float = 1.0, top_k: int = 5, trust_region: TrustRegion | None = None,
            advantage: float | None = None) -> dict:
    """Per-token tables and ratios of `answer` after `prompt` under the old and the new model (a JSON-able dict).
    `trust_region` (`TrustRegion`, its defaults when None) flags the ratios outside it; with the answer's
    `advantage`, the tokens where the clipped objective takes the clipped branch are marked too."""
    from grpokit.data.prompts import render_prompt

    text = render_prompt(tokenizer, [{"role": "user", "content": prompt}] if chat else prompt)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    if not prompt_ids:
        raise ExplainError("the prompt tokenizes to nothing; give a non-empty --prompt")
    if not answer_ids:
        raise ExplainError("the answer tokenizes to nothing; give a non-empty --answer")
    if old_model.config.vocab_size != new_model.config.vocab_size:
        raise ExplainError(f"the checkpoints have different vocabularies ({old_model.config.vocab_size} vs "
                           f"{new_model.config.vocab_size} tokens); compare two checkpoints of one model")
    old = next_token_logprobs(old_model, prompt_ids, answer_ids, temperature).cpu()  # [T, V]
    new = next_token_logprobs(new_model, prompt_ids, answer_ids, temperature).cpu()  # [T, V]
    trust_region = trust_region or TrustRegion()
    low, high = trust_region.bounds
    piece = lambda i: tokenizer.decode([i])  # noqa: E731
    steps, context = [], [piece(i) for i in prompt_ids]
    for t, token_id in enumerate(answer_ids):
        lp_old, lp_new = old[t, token_id].item(), new[t, token_id].item()
        ratio = math.exp(lp_new - lp_old)
        top = set(old[t].topk(min(top_k, old.shape[1])).indices.tolist())
        top |= set(new[t].topk(min(top_k, new.shape[1])).indices.tolist())
        shown = sorted({i for i in top if max(old[t, i], new[t, i]).exp() >= 1e-4} | {token_id})  # vocab order
        steps.append({
            "t": t + 1, "token": piece(token_id), "token_id": token_id, "context": "".join(context),
            "p_old": math.exp(lp_old), "p_new": math.exp(lp_new), "ratio": ratio, "log_ratio": lp_new - lp_old,
            "outside_trust_region": ratio < low - 1e-6 or ratio > high + 1e-6,
            "clipped": _clipped(ratio, advantage, low, high),
            "table": [{"token": piece(i), "token_id": i, "p_old": old[t, i].exp().item(),
                       "p_new": new[t, i].exp().item(), "chosen": i == token_id} for i in shown],
        })
        context.append(piece(token_id))
    lp_old_sum = sum(math.log(s["p_old"]) for s in steps)
    log_ratio = sum(s["log_ratio"] for s in steps)
    return {
        "prompt": text, "answer": answer, "prompt_tokens": [piece(i) for i in prompt_ids],
        "temperature": temperature, "epsilon": trust_region.epsilon, "epsilon_high": trust_region.upper_epsilon,
        "advantage": advantage, "trust_region": [low, high], "steps": steps,
        "sequence": {"p_old": math.exp(lp_old_sum), "p_new": math.exp(lp_old_sum + log_ratio),
                     "log_ratio": log_ratio, "ratio": math.exp(log_ratio),
                     "gspo_ratio": math.exp(log_ratio / len(steps))},
    }


def _clipped(ratio: float, advantage: float | None, low: float, high: float) -> bool | None:
    """Whether min(r·A, clip(r)·A) takes the clipped branch (no gradient for this token); None without A."""
    if advantage is None:
        return None
    return (advantage > 0 and ratio > high + 1e-6) or (advantage < 0 and ratio < low - 1e-6)


def format_explanation(result: dict) -> str:
    """The tables as the per-token ratio worked example writes them, as plain text."""
    steps, seq = result["steps"], result["sequence"]
    q = lambda s: repr(s)  # noqa: E731  (quotes make spaces and newlines visible)
    out = [f"prompt {q(result['prompt'])} ({len(result['prompt_tokens'])} tokens) → answer {q(result['answer'])} "
           f"({len(steps)} tokens), temperature {result['temperature']:g}", ""]
    width = max(8, *(len(q(r["token"])) + 2 for s in steps for r in s["table"]))
    for s in steps:
        out.append(f"step {s['t']}: context {q(_tail(s['context']))} → y{s['t']} = {q(s['token'])}")
        out.append(f"  {'token':<{width}} {'π_old':>8} {'π_new':>8}")
        for r in s["table"]:
            mark = " ◀" if r["chosen"] else ""
            out.append(f"  {q(r['token']) + mark:<{width}} {r['p_old']:>8.4f} {r['p_new']:>8.4f}")
        out.append(f"  {'sum shown':<{width}} {sum(r['p_old'] for r in s['table']):>8.4f} "
                   f"{sum(r['p_new'] for r in s['table']):>8.4f}")
        out.append("")
    low, high = result["trust_region"]
    out.append("per-token ratios  r_t = π_new(y_t | x, y<t) / π_old(y_t | x, y<t)")
    out.append(f"  {'t':>3}  {'token':<{width}} {'π_old':>8} {'π_new':>8} {'r_t':>8}")
    for s in steps:
        note = f"outside [{low:g}, {high:g}]" if s["outside_trust_region"] else ""
        if s["clipped"]:
            note += f"; clipped for A = {result['advantage']:+g}: no gradient"
        out.append(f"  {s['t']:>3}  {q(s['token']):<{width}} {s['p_old']:>8.4f} {s['p_new']:>8.4f} "
                   f"{s['ratio']:>8.4f}  {note}".rstrip())
    product = " × ".join(f"{s['ratio']:.4f}".rstrip("0").rstrip(".") for s in steps) if len(steps) <= 8 else "Π r_t"
    out.append("")
    out.append(f"sequence: π_old(y|x) = {_p(seq['p_old'])}, π_new(y|x) = {_p(seq['p_new'])}")
    out.append(f"sequence ratio = {product} = {seq['ratio']:.4f}  (= {_p(seq['p_new'])} / {_p(seq['p_old'])})")
    out.append(f"GSPO length-normalised ratio = exp(mean log r_t) = {seq['gspo_ratio']:.4f}")
    return "\n".join(out)


def _p(p: float) -> str:
    return f"{p:.4g}" if p >= 1e-4 else f"{p:.3e}"


def _tail(text: str, n: int = 40) -> str:
    return text if len(text) <= n else "…" + text[-(n - 1):]


def explain_checkpoints(old: str | Path, new: str | Path, prompt: str, answer: str, *, dtype: str = "float32",
                        device: str = "auto", **kwargs) -> dict:
    """`explain` on two model folders; the tokenizer comes from `old`."""
    from grpokit.models.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(old)
    old_model = load_model(old, dtype=dtype, device=device).eval()
    new_model = load_model(new, dtype=dtype, device=device).eval()
    return explain(old_model, new_model, tokenizer, prompt, answer, **kwargs)


def build_last_token_model(path: str | Path, table: dict[str, dict[str, float]], alphabet: str):
    """A Qwen2-architecture model folder whose next-token distribution is `table[last token][token]`.

    One decoder layer with zero attention and MLP outputs leaves each position's
    hidden state equal to its token's embedding (one-hot); the final RMSNorm
    scales it by a known factor k; the untied head then holds log-probabilities / k.
    Tokens missing from a row get probability ~1e-13; unlisted contexts are uniform.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpokit.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer(alphabet=alphabet)
    V = len(tokenizer)
    H = V + V % 2  # RoPE wants an even head size
    config = AutoConfig.for_model(
        "qwen2", vocab_size=V, hidden_size=H, intermediate_size=2, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=H, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config)
    vocab = tokenizer.get_vocab()
    k = 1.0 / math.sqrt(1.0 / H + config.rms_norm_eps)  # RMSNorm of a one-hot vector of size 1
    head = torch.zeros(V, H, dtype=torch.float64)
    for last, row in table.items():
        column = torch.full((V,), -30.0, dtype=torch.float64)
        for token, p in row.items():
            column[vocab[token]] = math.log(p)
        head[:, vocab[last]] = column / k
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        model.get_input_embeddings().weight.copy_(torch.eye(V, H))
        model.get_output_embeddings().weight.copy_(head.float())
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return model, tokenizer

"""A short supervised warm start (the cold-start stage before RL).

GRPO can only reinforce answers the model already samples sometimes: a random or
base model that never produces a well-formed answer gets all-equal rewards and
no signal. `sft` teaches the answer format (and some of the task) from
(prompt, target) pairs: cross-entropy on the target tokens and the EOS only, the
prompt tokens masked out.
"""

from __future__ import annotations

import math
import random
from functools import lru_cache
from typing import Callable, Sequence, Union

import torch

from grpokit.data.files import load_prompts
from grpokit.errors import DataError, SetupError
from grpokit.tasks import cli_task


def collate(tokenizer, pairs: Sequence[tuple[Prompt, Target]], encode: Callable[[str], list[int]] | None = None
            ) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels` (-100 on prompt, padding and
    untrained segments). `encode` (text -> ids) may memoise the tokenizer."""
    encode = encode or (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    seqs, labels = [], []
    for prompt, target, *_ in pairs:
        p = list(encode(prompt)) if isinstance(prompt, str) else list(prompt)
        ids, trained = [], []
        for segment, train in _segments(tokenizer, target, encode):
            ids += segment
            trained += [train] * len(segment)
        seqs.append(p + ids)
        labels.append([-100] * len(p) + [t if keep else -100 for t, keep in zip(ids, trained)])
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([s + [pad] * (width - len(s)) for s in seqs]),  # [B, L]
        "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs]),  # [B, L]
        "labels": torch.tensor([s + [-100] * (width - len(s)) for s in labels]),  # [B, L]
    }


# A target: a string (tokenized, EOS appended, all trained), or segments of token ids, each trained
# or not (a multi-turn answer: the model's turns trained, tool results only context). Segments are
# taken as given: the caller writes the end-of-turn tokens.
Target = Union[str, Sequence[tuple[Sequence[int], bool]]]
# A prompt: text (tokenized), or token ids already rendered (a vision-language prompt, its image tokens expanded
# by the processor; the pair's third item is then its images, a one-row `models.media.RowMedia`).
Prompt = Union[str, Sequence[int]]


UNTIL_WINDOW = 20  # steps averaged for `sft(until_loss=...)`: one batch's loss is noisy


def _segments(tokenizer, target: Target, encode: Callable[[str], list[int]]) -> list[tuple[list[int], bool]]:
    if isinstance(target, str):
        return [(list(encode(target)) + [tokenizer.eos_token_id], True)]
    return [(list(ids), bool(train)) for ids, train in target]


def sft(
    model,
    tokenizer,
    sample_pair: Callable[[random.Random], tuple[Prompt, Target] | tuple[Prompt, Target, object]],
    *,
    steps: int,
    batch_size: int = 64,
    learning_rate: float = 1e-3,
    warmup_steps: int = 50,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    until_loss: float | None = None,
    decay: bool = True,
) -> list[float]:
    """Train `model` in place for `steps` AdamW steps (cosine schedule) on pairs drawn by
    `sample_pair(rng)`; returns the loss of every step. A vision-language model's pairs are
    (prompt ids, target, RowMedia of that one prompt): the pixels go into the forward with the ids.

    `until_loss`: stop early once the mean loss of the last `UNTIL_WINDOW` steps is below it (`steps` is then a
    cap). Some skills arrive abruptly after a plateau whose length varies with the seed (the vision demo's model
    learns to look at step 500 on one seed, 1100 on another): a fixed step count ends some runs before it.
    `decay=False` keeps the rate constant after the warm-up (no cosine decay): with `until_loss`, a skill that
    arrives late still meets the full rate."""
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"sft: {name} must be an integer >= 1, got {value!r}")
    for name, value in (("learning_rate", learning_rate), ("until_loss", until_loss)):
        if (name == "learning_rate" or value is not None) and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not value > 0):
            raise ValueError(f"sft: {name} must be a finite number > 0, got {value!r}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = list(model.parameters())
    # one fused kernel for the whole update where torch has it (CPU, CUDA): 1.2 ms instead of 4 on the demo's model
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16) for p in params)
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.01, betas=(0.9, 0.98), fused=fused)
    # the pairs repeat (a task has a few thousand prompts): each text is tokenized once
    encode = lru_cache(maxsize=1 << 16)(lambda text: tuple(tokenizer(text, add_special_tokens=False)["input_ids"]))

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if not decay:
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    losses = []
    for step in range(steps):
        pairs = [sample_pair(rng) for _ in range(batch_size)]
        batch = {k: v.to(model.device) for k, v in collate(tokenizer, pairs, encode).items()}
        if len(pairs[0]) > 2:  # images: the rows' pixels, laid out as the processor lays out a batch
            from grpokit.models.media import RowMedia

            batch |= RowMedia.concat([pair[2] for pair in pairs], [1] * len(pairs)).model_inputs(batch["input_ids"])
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1, losses[-1])
        recent = losses[-UNTIL_WINDOW:]
        if until_loss is not None and len(recent) == UNTIL_WINDOW and sum(recent) / UNTIL_WINDOW < until_loss:
            break
    model.eval()
    return losses


def sft_pair_sampler(*, task, task_args, data, prompt_column, completion_column):
    """A `rng -> (prompt, target)` sampler for `grpokit sft` from a task or a file."""
    if bool(task) == bool(data):
        raise SetupError("give exactly one of --task NAME or --data FILE")
    if task:
        t = cli_task(task, task_args)
        rows = t.generate(5000, seed=0, split="train")
        return lambda rng: (lambda row: (row["prompt"], t.sft_target(row, rng)))(rng.choice(rows))
    rows = load_prompts(data, prompt_column=prompt_column)
    missing = [i + 1 for i, r in enumerate(rows) if not isinstance(r.get(completion_column), str)]
    if missing:
        raise DataError(f"{data}: row {missing[0]} has no string {completion_column!r} column (the SFT target); "
                        "add it or pass --completion-column")
    if any(not isinstance(r["prompt"], str) for r in rows):
        raise DataError(f"{data}: sft takes plain-string prompts")
    return lambda rng: (lambda row: (row["prompt"], row[completion_column]))(rng.choice(rows))

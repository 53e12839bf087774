"""Prompts in use: chat templates, the columns reward functions receive, a resumable stream of batches."""

from __future__ import annotations

import random
from typing import Iterable, Iterator

from grpokit.errors import DataError


def render_prompt(tokenizer, prompt: str | list[dict], *, tools: list[dict] | None = None,
                  **template_kwargs) -> str:
    """The text the model continues: a string unchanged, messages through the chat template. With
    `tools` (their JSON schemas) a string becomes one user message: the tools reach the model only
    through the chat template."""
    if tools:
        template_kwargs["tools"] = tools
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"conversational prompts (lists of messages) need a chat template, but the tokenizer "
                        f"{type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '') or 'unnamed'}) "
                        f"has none; set tokenizer.chat_template or give plain-string prompts")
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **template_kwargs)


def columns_of(rows: list[dict], *, repeat: int = 1, exclude: Iterable[str] = ("prompt",)) -> dict[str, list]:
    """Every non-prompt column as a list (None where a row lacks it), each value repeated `repeat` times.

    With `repeat=G` the columns line up with the B*G completions of a generation
    batch laid out prompt by prompt, as reward functions receive them.
    """
    skip = set(exclude)
    keys = list(dict.fromkeys(k for row in rows for k in row if k not in skip))
    return {k: [row.get(k) for row in rows for _ in range(repeat)] for k in keys}


class PromptStream:
    """An endless stream of prompt batches, reshuffled each epoch, that can be checkpointed.

    Epoch e visits the rows in a permutation drawn from (seed, e) alone, so the
    order does not depend on how the stream got there. A batch that runs past
    the end of an epoch continues into the next one: every batch is full and no
    row is skipped. `state_dict()` / `load_state_dict()` hold (epoch, index), and `replay`: rows handed out
    before the stream goes on, first to last (streaming groups' prompts in flight at a checkpoint: a resumed
    run samples them again; rollout/streaming.py).
    """

    def __init__(self, rows: list[dict], batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if not rows:
            raise DataError("PromptStream needs at least one row")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.rows, self.batch_size, self.seed, self.shuffle = list(rows), batch_size, seed, shuffle
        self.epoch, self.index = 0, 0
        self.replay: list = []
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_row(self):
        """One row: the next to replay, else the stream's next (streaming groups take prompts one by one)."""
        if self.replay:
            return self.replay.pop(0)
        if self.index == len(self.rows):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        self.index += 1
        return self.rows[self._order[self.index - 1]]

    def next_batch(self) -> list[dict]:
        if self.replay:
            return [self.next_row() for _ in range(self.batch_size)]
        batch = []
        while len(batch) < self.batch_size:
            if self.index == len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(self.batch_size - len(batch), len(self.rows) - self.index)
            batch.extend(self.rows[j] for j in self._order[self.index: self.index + take])
            self.index += take
        return batch

    def __iter__(self) -> Iterator[list[dict]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_rows": len(self.rows),
                 "batch_size": self.batch_size, "shuffle": self.shuffle}
        return {**state, "replay": list(self.replay)} if self.replay else state

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("num_rows", len(self.rows)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume the prompt stream: the checkpoint has {key}={state[key]!r} but "
                                 f"this run has {mine!r}; resume with the same data and seed")
        if not 0 <= state["index"] <= len(self.rows) or state["epoch"] < 0:
            raise ValueError(f"cannot resume the prompt stream: bad position {state!r}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.replay = list(state.get("replay", ()))
        self._order = self._permutation(self.epoch)


def prompt_batches(rows: list[dict], batch_size: int, *, seed: int, epoch_shuffle: bool = True) -> PromptStream:
    """A `PromptStream` over `rows` (iterate it, or call `next_batch()`)."""
    return PromptStream(rows, batch_size, seed=seed, shuffle=epoch_shuffle)

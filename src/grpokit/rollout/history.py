"""Conversations as the chat template renders them (`tools.history = "split"`), for templates that rewrite history.

    history = ConversationHistory(tokenizer, prompts, schemas)      # one prompt and tool list per answer
    ids = history.render(i, messages)       # answer i's prompt + its turns so far + the next assistant header

By default (`tools.history = "append"`) a multi-turn answer is one sequence: the next turn continues the
tokens the model sampled, with the tool results appended (rollout/multiturn.py), as TRL's GRPOTrainer does.
Some chat templates render earlier turns differently once the conversation goes on: Qwen3-style templates
drop earlier turns' `<think>` reasoning, a summarising agent edits its context. Appending then trains the
model on contexts the template never shows it. With `"split"` every turn after a tool call starts from the
template's rendering of the whole conversation, as a chat server would show it:

- where that rendering starts with the tokens of the current training row (its prompt and everything
  appended since), its tail (the tool results and the next assistant header) is appended: the answer stays
  one row, token for token the row `"append"` gives with a template that renders tool results consistently;
- where it does not, the answer *forks*: the row ends with the turn just sampled, and the rendering becomes
  the prompt of a new row from which the next turn is sampled (TRL's AsyncGRPOTrainer forks as well,
  `fork_threshold_tokens`; SkyRL and prime-rl train every turn as its own sample).

An assistant turn is rendered as the message `{"role": "assistant", "content": text}`, text being what the
model wrote (special tokens kept, tool calls included, the closing end-of-turn token left to the template),
and each tool result as `{"role": "tool", "name": ..., "content": ...}`: the messages the reward functions
see. The rendering is tokenized as prompts are (`tokenizer(text, add_special_tokens=False)`), so a
tokenizer that splits the model's own text differently when re-encoding it also forks; that costs a prefill,
never correctness. How the rows are trained: training/split_rows.py.
"""

from __future__ import annotations

from typing import Sequence

from grpokit.data.prompts import render_prompt


class ConversationHistory:
    """Renders answer i's whole conversation: its prompt (a string or messages, as the data row gave it,
    with an environment's `reset` text already added), its messages so far, its tools' schemas."""

    def __init__(self, tokenizer, prompts: Sequence, schemas: Sequence[list[dict] | None]):
        if len(prompts) != len(schemas):
            raise ValueError(f"{len(prompts)} prompts and {len(schemas)} tool lists: one of each per answer")
        self.tokenizer, self.prompts, self.schemas = tokenizer, list(prompts), list(schemas)

    def __len__(self) -> int:
        return len(self.prompts)

    def render(self, i: int, messages: list[dict]) -> list[int]:
        """Token ids of answer i's conversation with `messages` after its prompt, ending in the header of
        the next assistant turn (`add_generation_prompt`)."""
        prompt = self.prompts[i]
        conversation = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)) + messages
        text = render_prompt(self.tokenizer, conversation, tools=self.schemas[i] or None)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def repeat(self, G: int) -> "ConversationHistory":
        """One entry per answer when the G answers to a prompt share it."""
        return type(self)(self.tokenizer, [p for p in self.prompts for _ in range(G)],
                          [s for s in self.schemas for _ in range(G)])


def conversation_history(tokenizer, rows: list[dict], G: int, toolbox, environments) -> ConversationHistory:
    """Each answer's prompt and tool schemas (N = len(rows) * G), as the batch about to be sampled has them."""
    if environments is not None:  # reset's text is in each answer's prompt; each row shows its environment's tools
        per_answer = [row for row in rows for _ in range(G)]
        return ConversationHistory(tokenizer, environments.answer_prompts,
                                   [environments.schemas_for(row) for row in per_answer])
    schemas = None if toolbox is None else toolbox.schemas
    return ConversationHistory(tokenizer, [row["prompt"] for row in rows], [schemas] * len(rows)).repeat(G)


def assistant_message(tokenizer, turn: list[int], ended: bool) -> dict:
    """One sampled turn as the message the template renders: its text with special tokens kept, less the
    end-of-turn token that closed it (`ended`) when that is a special token (the template writes its own)."""
    special = set(getattr(tokenizer, "all_special_ids", ())) | {tokenizer.eos_token_id}
    if ended and turn and turn[-1] in special:
        turn = turn[:-1]
    return {"role": "assistant", "content": tokenizer.decode(turn, skip_special_tokens=False)}


def continues(rendered: Sequence[int], current: Sequence[int]) -> bool:
    """Whether the rendering starts with the current row's tokens (its prompt and its completion so far)."""
    return len(rendered) >= len(current) and list(rendered[:len(current)]) == list(current)

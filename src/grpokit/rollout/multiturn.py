"""Multi-turn rollouts with tool calls, in one KV cache.

    request = RolloutRequest(prompt_ids, G, SamplingParams(256, eos_token_ids, pad_token_id), tools=toolbox)
    rollout, stats = sample_conversations(model, request, tokenizer=tokenizer, max_tool_turns=8)

Each of the N = B*G rows generates an assistant turn; a turn ends at an end-of-turn token (EOS).
When it called tools (`tools.call_parser`), the calls run (all rows' calls of that step at
once, in threads, each bounded by the tools' `timeout_s`), the chat template renders the results
and the header of the next assistant turn (`tools.tool_suffix_ids`), and those tokens are
appended to that row in the same KV cache: the conversation is never prefilled again and what the
policy sampled is never decoded and re-encoded, so the token ids it is trained on are the ones it
sampled. Rows whose turn ended without a call leave the batch, as in the single-turn sampler.

One forward per step serves every row: a row that continues feeds its sampled token, a row that
got tool results feeds them (r tokens); the step's input is [n, R] with R the longest, shorter
rows padded with masked *holes*. Positions count only real tokens, so a hole changes nothing: the
compacted sequence [prompt | completion] without holes gets the same logits in the trainer's
recompute (checked by the tests against a full re-prefill).

`rollout.max_new_tokens` caps all completion tokens of an answer: the sampled ones and the tool
results. A tool result that does not fit (with room for one more token) is not appended; the
answer then ends there, marked truncated, like an answer that runs out of tokens mid-turn.
`max_tool_turns` (TRL's `max_tool_calling_iterations`) bounds the turns whose calls are run; the
turn after the last allowed one ends the answer even if it calls a tool again.

The returned `Rollout` has `tool_mask` [N, T]: 1 on tool-result tokens (context the policy did not
choose, log-prob 0 here), which the trainer removes from the loss, the KL, the entropy, the clip
statistics and the token counts.

With `history` (`tools.history = "split"`, rollout/history.py) the tool results are not rendered alone:
the chat template renders the whole conversation, and where that no longer continues the row's tokens the
answer forks: that row of the KV cache is masked out and refilled with the rendering (positions from 0),
and `Rollout.forks` records where the new training row begins. The budget then bounds each row: its prompt
beyond the first one plus its completion stays within `max_new_tokens`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from grpokit.models.forward import position_ids_from_mask
from grpokit.models.media import PromptImages, RowMedia
from grpokit.rollout.batch import Forks, Rollout, left_pad, rollout_from_tokens
from grpokit.rollout.decode import Decoder, DecodeSpeed
from grpokit.rollout.environments import TurnLog
from grpokit.rollout.history import assistant_message, continues
from grpokit.rollout.request import RolloutRequest
from grpokit.rollout.sampling import sample_tokens
from grpokit.rollout.tool_output import ENGINE_NO_IMAGES, SPLIT_NO_IMAGES, TEXT_NO_IMAGES
from grpokit.rollout.tools import ToolBox, ToolCall, ToolResult, call_parser, run_calls, tool_suffix_ids
from grpokit.rollout.vision import ToolImages, UnshowableImages, suppressed_tokens


def _tool_messages(results: list[ToolResult]) -> list[dict]:
    """The results as the logged conversation (and a rendered history) holds them: text."""
    return [{"role": "tool", "name": r.name, "content": r.content} for r in results]


@dataclass
class ToolStats:
    """What the tools did in one batch of rollouts; per answer [N] lists, group by group."""

    calls: list[int]  # tool calls made
    failures: list[int]  # calls whose result was an error
    turns: list[int]  # assistant turns
    conversations: list[list[dict]]  # the completion as messages: assistant turns and tool results
    seconds: float = 0.0  # wall time spent waiting for tools
    per_tool: Counter = field(default_factory=Counter)  # calls by tool name


def sample_conversations(
    model, request: RolloutRequest, *, tokenizer, max_tool_turns: int = 8, speed: DecodeSpeed = DecodeSpeed(),
    parse_calls: Callable[..., list[ToolCall]] | None = None,
    render_results: Callable[[list[ToolResult]], list[int]] | None = None,
) -> tuple[Rollout, ToolStats]:
    """Sample `request.group_size` multi-turn answers per prompt; see the module docstring. `request.tools` is one
    tool box for every answer, or one per answer (N, group by group: environments' own methods); the answers are
    drawn with `request.sampling`'s budget, end-of-turn tokens, temperature, top-p and top-k (its stop strings and
    `ignore_eos` are not read: a turn ends at an end-of-turn token) and `request.generator`'s noise. Of `speed`,
    the token sampler and the layer loop are used.

    `parse_calls(text, prefix=..., tools=...)` (text of one turn with its special tokens, the
    conversation before it, the tools' schemas -> calls; default: `tools.call_parser`) and
    `render_results` (results -> suffix token ids, default: the chat template) are the model-format hooks;
    `request.history` (one entry per answer) renders whole conversations instead, forking where they are rewritten.

    A vision-language model (rollout/vision.py): `request.media` (one row per prompt) holds the prompts' images, and
    a `render_results` of `vision.ToolImages` shows the model the images tool results hold (without it a result
    with images is a failed call: the model reads text only)."""
    if request.tools is None:
        raise ValueError("sample_conversations needs tools: RolloutRequest(..., tools=ToolBox([...]))")
    render = render_results or (lambda results: tool_suffix_ids(tokenizer, results))
    history, media, sampling = request.history, request.media, request.sampling
    if history is not None and media is not None and any(r is not None for r in media.rows):
        raise ValueError("tools.history = \"split\" re-renders conversations, which cannot carry images yet; use "
                         "tools.history = \"append\" with image rows")
    if media is None and history is None and isinstance(render, ToolImages):  # a VLM with text prompts
        media = RowMedia(render.family, (None,) * len(request.prompt_ids), render.image_token_id)
    device = model.device
    eos = torch.as_tensor(list(sampling.eos_token_ids), dtype=torch.long, device=device)
    if not eos.numel():
        raise ValueError("multi-turn sampling needs an end-of-turn token: eos_token_ids is empty")
    was_training = model.training
    model.eval()
    draw = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                generator=request.generator, sampler=speed.sampler)
    if media is not None:
        draw["suppress"] = suppressed_tokens(model, device)  # image placeholders: never drawn
    answers = _Answers(request, tokenizer, max_tool_turns, parse_calls, render)
    try:
        with torch.inference_mode():
            _loop(model, answers, eos=eos, draw=draw, media=media, layer_loop=speed.layer_loop)
    finally:
        model.train(was_training)
    # built outside inference mode: the trainer indexes its differentiable log-probs with these tensors
    G = request.group_size
    rollout = answers.rollout(model.device)
    rows = () if media is None else tuple(PromptImages.join([media.rows[i // G], *answers.images[i]])
                                          for i in range(len(answers.images)))
    if any(r is not None for r in rows):  # each answer's images: its prompt's, then its tool results'
        rollout = dataclasses.replace(rollout, media=RowMedia(media.family, rows, media.image_token_id))
    return rollout, answers.stats


class _Answers:
    """The N answers being written, whatever samples them: tokens, log-probs, tool flags, where the
    current turn started, truncation, and what the tools did. One home for the rules both samplers
    share: when a turn's calls run, the budget, what a result that does not fit does."""

    def __init__(self, request: RolloutRequest, tokenizer, max_tool_turns: int, parse_calls, render,
                 no_images: str = TEXT_NO_IMAGES):
        prompt_ids, G, history = request.prompt_ids, request.group_size, request.history
        budget, tools, N = request.sampling.max_new_tokens, request.tools, request.num_answers
        self.prompt_ids, self.G, self.pad_id = prompt_ids, G, request.sampling.pad_token_id
        self.tokens: list[list[int]] = [[] for _ in range(N)]
        self.logps: list[list[float]] = [[] for _ in range(N)]
        self.is_tool: list[list[int]] = [[] for _ in range(N)]
        self.turn_start, self.truncated = [0] * N, [False] * N
        self.stats = ToolStats([0] * N, [0] * N, [1] * N, [[] for _ in range(N)])
        self.budget, self.tokenizer, self.tools, self.max_tool_turns = budget, tokenizer, tools, max_tool_turns
        self.parse_calls, self.render = parse_calls or call_parser(tokenizer), render
        self.turns = TurnLog([self._box(i) for i in range(N)])
        # tools.history = "split": each answer's current training row (its prompt, where it starts in tokens[i]),
        # the rows begun so far (start, prompt), the messages the template renders, the rows just forked
        self.history = history
        self.contexts = [list(prompt_ids[i // G]) for i in range(N)]
        self.row_start = [0] * N
        self.forks: list[list[tuple[int, list[int]]]] = [[] for _ in range(N)]
        self.messages: list[list[dict]] = [[] for _ in range(N)]
        self.fresh: set[int] = set()
        self.images: list[list[PromptImages]] = [[] for _ in range(N)]  # the images of each answer's tool results
        self.feed_images: dict[int, PromptImages] = {}  # answer -> the images of the result it feeds next
        # why the results' images cannot be shown (their calls then fail saying so), or None where they are
        self.no_images = SPLIT_NO_IMAGES if history is not None else render.no_images \
            if isinstance(render, ToolImages) else no_images

    def used(self, i: int) -> int:
        """Answer i's share of the budget: its current row's completion and what its prompt adds to the first."""
        return len(self.contexts[i]) - len(self.prompt_ids[i // self.G]) + len(self.tokens[i]) - self.row_start[i]

    def context(self, i: int) -> list[int]:
        """What answer i's next token is sampled from: its current row's prompt and completion so far."""
        return self.contexts[i] + self.tokens[i][self.row_start[i]:]

    def _box(self, i: int) -> ToolBox:
        return self.tools if isinstance(self.tools, ToolBox) else self.tools[i]

    def add(self, i: int, tokens: list[int], logps: list[float]) -> None:
        """Sampled tokens of answer i."""
        self.tokens[i] += tokens
        self.logps[i] += logps
        self.is_tool[i] += [0] * len(tokens)
        self.turns.token_turn[i] += [self.stats.turns[i] - 1] * len(tokens)

    def end_turn(self, i: int, ended: bool, final: bool = False) -> list[ToolCall] | None:
        """After answer i's latest tokens: the calls to run when its turn `ended` with calls it may still
        make; else None. A turn that stops (ended, out of budget, or `final`: the sampler will not go
        on) is recorded as a message; one that stops without an end-of-turn token is truncated."""
        if not ended and not final and self.used(i) < self.budget:
            return None
        turn = self.tokens[i][self.turn_start[i]:]
        self.stats.conversations[i].append({"role": "assistant",
                                            "content": self.tokenizer.decode(turn, skip_special_tokens=True)})
        if self.history is not None:
            self.messages[i].append(assistant_message(self.tokenizer, turn, ended))
        if not ended:
            self.truncated[i] = True
            return None
        box = self.tools if isinstance(self.tools, ToolBox) else self.tools[i]
        before = self.contexts[i] + self.tokens[i][self.row_start[i]:self.turn_start[i]]
        # special tokens kept: some formats close a call with one (Llama 3.1's <|eot_id|>)
        calls = self.parse_calls(self.tokenizer.decode(turn), prefix=self.tokenizer.decode(before), tools=box.schemas)
        return calls if calls and self.stats.turns[i] <= self.max_tool_turns else None

    def run_tools(self, waiting: list[tuple[int, list[ToolCall]]]) -> list[list[int] | None]:
        """Run the calls of the answers `waiting` and append each one's results (the tokens the chat
        template renders); per answer those tokens, or None when they do not fit (it ends, truncated)."""
        boxes = [self.tools if isinstance(self.tools, ToolBox) else self.tools[i] for i, _ in waiting]
        t0 = time.perf_counter()
        per_answer = run_calls([[(box, c) for c in calls] for box, (_, calls) in zip(boxes, waiting)])
        self.stats.seconds += time.perf_counter() - t0
        if self.no_images:  # images this sampler cannot show: failed calls saying why
            per_answer = [[r.unshown(self.no_images) for r in results] for results in per_answer]
        suffixes = []
        for box, (i, calls), results in zip(boxes, waiting, per_answer):
            messages = _tool_messages(results)
            try:
                suffix, fork, images = self._next_context(i, results, messages)
            except UnshowableImages as e:  # the processor refused an image: those results fail instead
                results = [r.unshown(str(e)) for r in results]
                messages = _tool_messages(results)
                suffix, fork, images = self._next_context(i, results, messages)
            self.turns.ran(i, results)  # the turn's calls took effect: its step reward
            self.stats.calls[i] += len(calls)
            self.stats.failures[i] += sum(r.failed for r in results)
            self.stats.per_tool.update(r.name if r.name in box.functions else "unknown" for r in results)
            if suffix is None:  # no room for the results and one more token
                self.truncated[i] = True
                suffixes.append(None)
                continue
            self.stats.conversations[i].extend(messages)
            if fork:  # the rendering is the prompt of a new training row; the cache must be refilled with it
                self.forks[i].append((len(self.tokens[i]), suffix))
                self.contexts[i], self.row_start[i] = suffix, len(self.tokens[i])
                self.fresh.add(i)
            else:
                if images is not None:
                    self.images[i].append(images)
                    self.feed_images[i] = images
                self.tokens[i] += suffix
                self.logps[i] += [0.0] * len(suffix)
                self.is_tool[i] += [1] * len(suffix)
                self.turns.token_turn[i] += [-1] * len(suffix)
            self.turn_start[i] = len(self.tokens[i])
            self.stats.turns[i] += 1
            self.turns.starts(i)  # the state the next turn starts from
            suffixes.append(suffix)
        return suffixes

    def _next_context(self, i: int, results: list[ToolResult], messages: list[dict]
                      ) -> tuple[list[int] | None, bool, PromptImages | None]:
        """After answer i's tool results: (the tokens to append, False, their images), or with `history` where the
        template's rendering does not continue the row (the rendering, True: a fork); (None, _, _) when that leaves
        no room within the budget for one more token."""
        images = None
        if self.history is None:
            suffix, fork = self.render(results), False
            if isinstance(self.render, ToolImages):
                suffix, images = suffix
        else:
            self.messages[i] += messages
            rendered, current = self.history.render(i, self.messages[i]), self.context(i)
            fork = not continues(rendered, current)
            suffix = rendered if fork else rendered[len(current):]
        grown = len(suffix) - len(self.prompt_ids[i // self.G]) if fork else self.used(i) + len(suffix)
        return (suffix if grown < self.budget else None), fork, images

    def rollout(self, device) -> Rollout:
        rollout = _to_rollout(self.prompt_ids, self.tokens, self.logps, self.is_tool, self.truncated, self.G,
                              self.pad_id, device)
        forks = None if self.history is None else Forks(tuple(tuple(s for s, _ in f) for f in self.forks),
                                                        tuple(tuple(tuple(p) for _, p in f) for f in self.forks))
        return dataclasses.replace(rollout, turns=self.turns.tensors(self.stats.turns, rollout.completion_ids.shape[1],
                                                                     device), forks=forks)


def _loop(model, answers: _Answers, *, eos: Tensor, draw: dict, media: RowMedia | None, layer_loop: bool) -> None:
    """The decode loop: writes `answers` (its request's prompts, group size, budget), each token drawn by
    `sample_tokens(logits, **draw)`, a turn ending at one of `eos` [E]."""
    G, budget, pad_id = answers.G, answers.budget, answers.pad_id
    ids, mask = left_pad(answers.prompt_ids, pad_id, model.device)  # [B, P]
    step = Decoder(model, capacity=ids.shape[1] + budget, media=media,  # grows if holes need more room
                   layer_loop=layer_loop)
    positions = position_ids_from_mask(mask)  # [B, P]
    logits = step(ids, mask, positions).repeat_interleave(G, 0)  # [N, V]: B prompts prefilled once
    step.repeat_rows(G)
    mask = mask.repeat_interleave(G, 0)  # [N, P+...]: 0 on left padding and on holes
    next_pos = positions[:, -1].repeat_interleave(G) + 1  # [N] position of each row's next real token
    active = list(range(logits.shape[0]))  # original row ids, in cache order
    while active:
        tok, lp = sample_tokens(logits, **draw)  # [n]
        ended = torch.isin(tok, eos).tolist()
        feed: list[list[int]] = []  # per kept row, the tokens to run next
        keep: list[int] = []  # cache rows that continue
        waiting: list[tuple[int, list[ToolCall]]] = []  # (row, calls)
        rows_of: dict[int, tuple[int, int]] = {}  # row -> (cache row, its end token)
        for j, (row, t, p, end) in enumerate(zip(active, tok.tolist(), lp.tolist(), ended)):
            answers.add(row, [t], [p])
            calls = answers.end_turn(row, end)
            if calls:
                waiting.append((row, calls))
                rows_of[row] = (j, t)
            elif not end and not answers.truncated[row]:
                keep.append(j)
                feed.append([t])
        for (row, _), suffix in zip(waiting, answers.run_tools(waiting) if waiting else []):
            if suffix is not None:
                j, end_token = rows_of[row]
                keep.append(j)  # the cache has not seen the turn's end token yet; a fork refills the whole row
                feed.append(suffix if row in answers.fresh else [end_token, *suffix])
        if not keep:
            break
        order = sorted(range(len(keep)), key=lambda k: keep[k])  # keep the cache's row order
        keep, feed = [keep[k] for k in order], [feed[k] for k in order]
        keep_t = torch.tensor(keep, device=mask.device)
        if len(keep) < len(active):
            step.select_rows(keep_t)
        active, mask, next_pos = [active[j] for j in keep], mask[keep_t], next_pos[keep_t]
        for k in [k for k, row in enumerate(active) if row in answers.fresh]:  # forked: what it saw is masked out
            mask[k], next_pos[k] = 0, 0
        answers.fresh.clear()
        mask = _compact(step, mask)
        images = [answers.feed_images.pop(row, None) for row in active] if answers.feed_images else None
        logits, mask, next_pos = _feed(step, feed, mask, next_pos, pad_id, images)


def _compact(step: Decoder, mask: Tensor, slack: float = 2.0) -> Tensor:
    """Drop masked positions from the cache once they outnumber the real ones (`slack` x the longest
    row): holes from tool steps would otherwise make every later step attend over them. Each row
    keeps its real positions in order, left-padded to the longest; the mask follows."""
    width = int(mask.sum(-1).max())
    if mask.shape[1] <= slack * width:
        return mask
    columns = torch.argsort(mask, dim=1, stable=True)[:, -width:]  # [n, W] holes first, then real, in order
    step.keep_columns(columns)
    return mask.gather(1, columns)


def converse(request: RolloutRequest, *, tokenizer, max_tool_turns: int,
             generate_turns: Callable[[list[list[int]], list[int]], list[tuple[list[int], list[float]]]], device,
             parse_calls: Callable[..., list[ToolCall]] | None = None,
             render_results: Callable[[list[ToolResult]], list[int]] | None = None) -> tuple[Rollout, ToolStats]:
    """Multi-turn answers turn by turn, for an engine that cannot append to its own cache (vLLM, whose
    prefix cache makes the repeated conversation cheap): `generate_turns(contexts, max_tokens)` samples
    one turn (ending at an end-of-turn token, kept) for each token-id context, returning its tokens and
    their log-probs. Same rules as `sample_conversations`: the same budget (`request.sampling.max_new_tokens`),
    turn limit, tool faults, truncation and `tool_mask`; the next turn's context is the prompt plus everything so far
    (with `request.history`: the current row's prompt, the conversation as the template rendered it where it last
    forked). The request's tools, end-of-turn tokens and pad token are read; `generate_turns` samples as it will.
    The rollout's tensors go to `device`."""
    if request.tools is None:
        raise ValueError("converse needs tools: RolloutRequest(..., tools=ToolBox([...]))")
    render = render_results or (lambda results: tool_suffix_ids(tokenizer, results))
    eos, budget = set(request.sampling.eos_token_ids), request.sampling.max_new_tokens
    answers = _Answers(request, tokenizer, max_tool_turns, parse_calls, render, no_images=ENGINE_NO_IMAGES)
    pending = list(range(request.num_answers))
    while pending:
        turns = generate_turns([answers.context(i) for i in pending], [budget - answers.used(i) for i in pending])
        waiting = []
        for i, (turn, turn_logps) in zip(pending, turns):
            answers.add(i, turn, turn_logps)
            calls = answers.end_turn(i, bool(turn) and turn[-1] in eos, final=True)  # the engine's turn is over
            if calls:
                waiting.append((i, calls))
        suffixes = answers.run_tools(waiting) if waiting else []
        pending = [i for (i, _), suffix in zip(waiting, suffixes) if suffix is not None]
    return answers.rollout(device), answers.stats


def _feed(step: Decoder, feed: list[list[int]], mask: Tensor, next_pos: Tensor, pad_id: int, images=None):
    """Run each row's next tokens (one sampled token, or a tool result, with `images` its images) in one forward
    [n, R]; rows shorter than R are padded with masked holes. Returns each row's logits after its last real
    token [n, V], the grown mask and the next positions."""
    n, R = len(feed), max(len(f) for f in feed)
    ids = torch.full((n, R), pad_id, dtype=torch.long, device=mask.device)  # [n, R]
    real = torch.zeros((n, R), dtype=mask.dtype, device=mask.device)  # [n, R]
    for k, f in enumerate(feed):
        ids[k, :len(f)] = torch.tensor(f, dtype=torch.long)
        real[k, :len(f)] = 1
    offsets = (real.cumsum(-1) - 1).clamp(min=0)  # [n, R] holes repeat the last real position
    mask = torch.cat([mask, real], dim=1)  # [n, past+R]
    if R == 1 and images is None:  # one sampled token per row: the decoder's one-token step (its layer loop)
        return step(ids, mask, next_pos[:, None]), mask, next_pos + 1
    logits = step.all_logits(ids, mask, next_pos[:, None] + offsets, images=images)  # [n, R, V]
    last = real.sum(-1) - 1  # [n]
    return logits[torch.arange(n, device=mask.device), last], mask, next_pos + real.sum(-1)


def _to_rollout(prompt_ids, tokens, logps, is_tool, truncated, G, pad_id, device) -> Rollout:
    """The compacted rollout: completions right-padded, no holes; `tool_mask` 1 on tool-result tokens."""
    rollout = rollout_from_tokens(prompt_ids, tokens, logps, truncated, group_size=G, pad_token_id=pad_id,
                                  device=device)
    tool_mask = torch.zeros_like(rollout.completion_mask)  # [N, T]
    for i, flags in enumerate(is_tool):
        tool_mask[i, :len(flags)] = torch.tensor(flags, dtype=tool_mask.dtype)
    return Rollout(**{**rollout.__dict__, "tool_mask": tool_mask})


def check_full_attention(model_config) -> None:
    """Multi-turn sampling pads tool results with masked positions; attention that is not plain full
    attention (sliding windows, linear or recurrent layers) would count them, so it is refused."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layers = DynamicCache(config=model_config).layers
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
        raise ValueError(f"tools: multi-turn rollouts need plain full attention in every layer, and this model has "
                         f"{', '.join(kinds) or 'no cache layers'}; use a model without sliding-window or linear "
                         "attention (or turn sliding_window off in its config.json)")

"""Streaming groups (partial rollouts, `rollout.partial_rollouts`): the built-in sampler as a pool of groups in
progress whose freed decode rows are refilled with new prompts' answers as answers end (continuous batching).

    pool = GroupPool(model, sampling, G, next_prompt, rows=B*G, tokenizer=tok, generator=g)
    groups = pool.take(B, version)       # decode until B groups are complete; the rest stay in the pool
    rollout = groups_rollout(groups, G, pad_token_id)     # N = B*G answers, token_version per token

Answer lengths are heavy-tailed: `decode.sample_groups` runs its batch until the longest answer ends, so its
last decode steps read every weight for a few rows. Here, whenever G rows are free, the next prompt is taken,
prefilled once (its G answers share the prefill, as in decode.py) and its G rows join the decode batch. The
KV cache stays exact for full attention with explicit per-row positions: each row's cached positions are kept
right-aligned (left padding, mask 0), so a join pads the narrower side on the left, and the columns no row
needs any more (the left padding of rows that have left) are cut at every join, which keeps the cache within
one prompt plus `max_new_tokens` of the longest row's need.

`take(count, version)` returns the first `count` groups to complete. The answers still decoding stay in the
pool with their KV cache and their tokens so far; the caller updates the weights in place and the next `take`
continues them under the new `version`. Every token records the version that sampled it (the version of the
weights whose logits it was drawn from: a token drawn at the end of one `take` is fed to the model by the next),
so an answer may span versions. A group is handed on only once all its G answers end. A group whose first
tokens (its oldest) would lag the weights by more than `max_staleness` versions is dropped and its prompt
restarted from scratch. `in_flight()` lists the prompts taken but not handed on, for a checkpoint: a resumed
run samples them again with its weights.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from grpokit.errors import SetupError
from grpokit.models.forward import position_ids_from_mask
from grpokit.rollout.batch import Rollout, left_pad
from grpokit.rollout.decode import Decoder, DecodeSpeed, _stop_string_hits
from grpokit.rollout.request import SamplingParams
from grpokit.rollout.sampling import sample_tokens


@dataclass(eq=False)  # a group is itself: compared by identity
class Group:
    """One prompt's G answers: `answers[g]` is (tokens [t], logprobs [t], versions [t], ended) once answer g
    ends (ended: an end token or stop string, not the budget), else None."""

    item: object  # what `next_prompt` named the prompt by (the training row's index)
    prompt: list[int]
    order: int  # when it was taken: a checkpoint replays in-flight prompts in this order
    version: int  # the version of its first tokens, the oldest of all its tokens
    answers: list = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(a is not None for a in self.answers)


def _set_cache(layer, keys: Tensor, values: Tensor, capacity: int) -> None:
    """Put keys, values [n, h, W, d] into a cache layer: a preallocated one gets buffers of `capacity` positions."""
    if getattr(layer, "preallocated", False):
        layer.k_buf = keys.new_empty(*keys.shape[:2], capacity, keys.shape[-1])  # [n, h, C, d]
        layer.v_buf = values.new_empty(*values.shape[:2], capacity, values.shape[-1])  # [n, h, C, d]
        layer.k_buf[:, :, :keys.shape[2]], layer.v_buf[:, :, :values.shape[2]] = keys, values
        layer.length, layer.is_initialized, layer.device = keys.shape[2], True, keys.device
        layer._views()
    else:
        layer.keys, layer.values, layer.is_initialized, layer.device = keys, values, True, keys.device


def _left_pad_to(x: Tensor, width: int, dim: int) -> Tensor:
    """x padded with zeros on the left of `dim` to `width` entries (masked positions: never looked at)."""
    pad = [0, 0] * (x.dim() - 1 - dim) + [width - x.shape[dim], 0]
    return torch.nn.functional.pad(x, pad)


class GroupPool:
    """Groups in progress on up to `rows` decode rows (see the module docstring). `next_prompt()` gives the next
    (item, token ids), or None when there are no more prompts."""

    def __init__(self, model, sampling: SamplingParams, group_size: int, next_prompt: Callable[[], tuple | None], *,
                 rows: int, tokenizer=None, speed: DecodeSpeed = DecodeSpeed(), generator=None,
                 max_staleness: int | None = None):
        if rows < group_size:
            raise ValueError(f"a pool of {rows} rows cannot hold one group of {group_size} answers")
        self.model, self.sampling, self.G, self.next_prompt, self.rows = model, sampling, group_size, next_prompt, rows
        self.tokenizer, self.speed, self.max_staleness = tokenizer, speed, max_staleness
        s = sampling
        self.draw = dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, generator=generator,
                         sampler=speed.sampler)
        eos = None if s.ignore_eos or not s.eos_token_ids else torch.as_tensor(s.eos_token_ids, dtype=torch.long)
        self.eos = None if eos is None else eos.to(model.device)  # [E]
        self.window = max((len(x.encode()) for x in s.stop_strings), default=0) + 2
        self.layers = None  # the kept cache layers (None: no rows decoding)
        self.groups: list[Group] = []  # in progress, in take order
        self.ready: deque[Group] = deque()  # complete, not yet handed on
        self.restart: deque[tuple[int, object, list[int]]] = deque()  # (order, item, ids): dropped, to sample again
        self.taken = self.restarted = 0
        self.decode_rows: list[int] = []  # rows sampled at each decode step of the last `take`
        self._rows_state(None)

    def _rows_state(self, n: int | None) -> None:
        """Per decode row [n]: its group and answer, cache mask [n, L], next position, the token sampled but not
        yet fed to the model, and its answer so far: tokens, log-probs, versions [n, T] and length."""
        device, T = self.model.device, self.sampling.max_new_tokens
        self.owner: list[Group] = []
        self.member: list[int] = []
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)  # [n, L]
        self.next_pos = self.pending = self.length = torch.zeros(0, dtype=torch.long, device=device)  # [n]
        self.tokens = torch.zeros((0, T), dtype=torch.long, device=device)  # [n, T]
        self.logps = torch.zeros((0, T), dtype=torch.float32, device=device)  # [n, T]
        self.versions = torch.zeros((0, T), dtype=torch.long, device=device)  # [n, T]

    def in_flight(self, handed: list[Group] = ()) -> list:
        """The items taken and not handed on (decoding, complete but waiting, or to restart), with the groups
        `handed` on but not trained yet, in take order."""
        held = [(g.order, g.item) for g in [*handed, *self.groups, *self.ready]] + \
            [(o, i) for o, i, _ in self.restart]
        return [item for _, item in sorted(held, key=lambda x: x[0])]

    def take(self, count: int, version: int) -> list[Group]:
        """Decode until `count` groups are complete (fewer only when the prompts ran out) and hand on the first
        `count`; `version` names the weights the model holds now."""
        self.decode_rows = []
        self._drop_stale(version)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                # the layer loop packs the current weights: a new one each call, on the kept cache layers
                self.step = Decoder(self.model, capacity=1 if self.speed.preallocate_kv_cache else None,
                                    layer_loop=self.speed.layer_loop)
                if self.layers is not None:
                    self.step.cache.layers = self.layers
                while len(self.ready) < count and self._decode_step(version):
                    pass
        finally:
            self.model.train(was_training)
        return [self.ready.popleft() for _ in range(min(count, len(self.ready)))]

    def _drop_stale(self, version: int) -> None:
        """Groups whose first tokens lag `version` by more than max_staleness: their rows leave, their prompts
        are sampled again from scratch (first, in take order)."""
        if self.max_staleness is None:
            return
        stale = [g for g in [*self.groups, *self.ready] if version - g.version > self.max_staleness]
        if not stale:
            return
        self.restarted += len(stale)
        self.ready = deque(g for g in self.ready if g not in stale)
        self.groups = [g for g in self.groups if g not in stale]
        self.restart.extendleft(sorted([(g.order, g.item, g.prompt) for g in stale], key=lambda x: -x[0]))
        keep = torch.tensor([g not in stale for g in self.owner], dtype=torch.bool, device=self.model.device)
        self._keep_rows(keep)

    def _keep_rows(self, keep: Tensor) -> None:
        """Only the decode rows `keep` [n] (bool) stay: in the cache and in every per-row record."""
        if bool(keep.all()):
            return
        idx = keep.nonzero()[:, 0]  # [n_keep]
        if len(idx) == 0:
            self.layers = None
            self._rows_state(None)
            return
        for layer in self.layers:
            layer.batch_select_indices(idx)
        self.owner = [self.owner[i] for i in idx.tolist()]
        self.member = [self.member[i] for i in idx.tolist()]
        for name in ("mask", "next_pos", "pending", "length", "tokens", "logps", "versions"):
            setattr(self, name, getattr(self, name)[idx])

    def _next(self) -> tuple[int, object, list[int]] | None:
        if self.restart:
            return self.restart.popleft()
        got = self.next_prompt()
        if got is None:
            return None
        self.taken += 1
        return (self.taken, *got)

    def _decode_step(self, version: int) -> bool:
        """Feed the pending tokens, start new groups on the free rows, sample one token per row, retire the rows
        that ended. False when there is nothing left to decode."""
        logits = []
        if len(self.owner):  # the running rows: their last sampled token goes in, one new cache column
            self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.owner), 1))], dim=1)  # [n, L+1]
            logits.append(self.step(self.pending[:, None], self.mask, self.next_pos[:, None]))  # [n, V]
            self.next_pos = self.next_pos + 1
        starts = []
        while len(self.owner) + self.G * (len(starts) + 1) <= self.rows and (got := self._next()) is not None:
            starts.append(got)
        if starts:
            logits.append(self._join(starts, version))  # [k*G, V]
        if not logits:
            return False
        tok, lp = sample_tokens(torch.cat(logits), **self.draw)  # [n]
        n = len(tok)
        self.decode_rows.append(n)
        rows = torch.arange(n, device=tok.device)
        self.tokens[rows, self.length] = tok
        self.logps[rows, self.length] = lp
        self.versions[rows, self.length] = version
        self.length = self.length + 1
        self.pending = tok
        ended = torch.isin(tok, self.eos) if self.eos is not None else torch.zeros_like(tok, dtype=torch.bool)
        if self.sampling.stop_strings:  # a group's rows share their length: one check per length
            for t in self.length.unique().tolist():
                at = (self.length == t).nonzero()[:, 0]
                ended[at] |= _stop_string_hits(self.tokens, at, t - 1, self.tokenizer, self.sampling.stop_strings,
                                               self.window)
        done = ended | (self.length >= self.sampling.max_new_tokens)  # [n]
        for i in done.nonzero()[:, 0].tolist():
            g, t = self.owner[i], int(self.length[i])
            g.answers[self.member[i]] = (self.tokens[i, :t].clone(), self.logps[i, :t].clone(),
                                         self.versions[i, :t].clone(), bool(ended[i]))
            if g.complete:
                self.groups.remove(g)
                self.ready.append(g)
        self._keep_rows(~done)
        return True

    def _join(self, starts: list[tuple[int, object, list[int]]], version: int) -> Tensor:
        """Prefill the new prompts [k, P] once, repeat each to its G rows and append them to the decode batch:
        the running rows' cache cut to the columns they use, the narrower side left-padded. Their first
        tokens' logits [k*G, V]."""
        G, T = self.G, self.sampling.max_new_tokens
        ids, mask = left_pad([p for _, _, p in starts], self.sampling.pad_token_id, self.model.device)  # [k, P]
        positions = position_ids_from_mask(mask)  # [k, P]
        prefill = Decoder(self.model, layer_loop=False)  # plain layers: keys and values [k, h, P, d]
        logits = prefill(ids, mask, positions).repeat_interleave(G, 0)  # [k*G, V]
        prefill.repeat_rows(G)
        new_mask = mask.repeat_interleave(G, 0)  # [k*G, P]
        n = len(self.owner)
        used = int(self.mask.sum(-1).max()) if n else 0  # every row's columns are right-aligned
        width = max(used, ids.shape[1])
        if self.layers is None:  # the decoder's own layers (preallocated unless asked otherwise), filled below
            self.layers = self.step.cache.layers
        for layer, fresh in zip(self.layers, prefill.cache.layers):
            parts = [] if not n else [(layer.keys[:, :, layer.keys.shape[2] - used:],
                                       layer.values[:, :, layer.values.shape[2] - used:])]
            parts.append((fresh.keys, fresh.values))
            keys = torch.cat([_left_pad_to(k, width, 2) for k, _ in parts])  # [n+k*G, h, W, d]
            values = torch.cat([_left_pad_to(v, width, 2) for _, v in parts])  # [n+k*G, h, W, d]
            _set_cache(layer, keys, values, width + T)
        old_mask = self.mask[:, self.mask.shape[1] - used:]  # [n, used]
        self.mask = torch.cat([_left_pad_to(old_mask, width, 1), _left_pad_to(new_mask, width, 1)])  # [n+k*G, W]
        self.next_pos = torch.cat([self.next_pos, (positions[:, -1] + 1).repeat_interleave(G)])
        self.pending = torch.cat([self.pending, self.pending.new_zeros(len(starts) * G)])
        self.length = torch.cat([self.length, self.length.new_zeros(len(starts) * G)])
        for name in ("tokens", "logps", "versions"):
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, old.new_zeros((len(starts) * G, T))]))
        for order, item, prompt in starts:
            group = Group(item, prompt, order, version, [None] * G)
            self.groups.append(group)
            self.owner += [group] * G
            self.member += list(range(G))
        return logits


def groups_rollout(groups: list[Group], group_size: int, pad_token_id: int) -> Rollout:
    """The answers of complete `groups` as a `Rollout` (rows group by group), with each token's version
    [N, T] (-1 on padding) and each answer's oldest version [N]."""
    answers = [a for g in groups for a in g.answers]
    device = answers[0][0].device
    ids, mask = left_pad([g.prompt for g in groups], pad_token_id, device)  # [B, P]
    width = max(1, max(len(a[0]) for a in answers))
    n = len(answers)
    tokens = torch.full((n, width), pad_token_id, dtype=torch.long, device=device)  # [N, T]
    logps = torch.zeros((n, width), dtype=torch.float32, device=device)  # [N, T]
    versions = torch.full((n, width), -1, dtype=torch.long, device=device)  # [N, T]
    for i, (tok, lp, ver, _) in enumerate(answers):
        tokens[i, :len(tok)], logps[i, :len(tok)], versions[i, :len(tok)] = tok, lp, ver
    lengths = torch.tensor([len(a[0]) for a in answers], device=device)  # [N]
    completion_mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()  # [N, T]
    return Rollout(prompt_ids=ids.repeat_interleave(group_size, 0), prompt_mask=mask.repeat_interleave(group_size, 0),
                   completion_ids=tokens, completion_mask=completion_mask, logprobs=logps,
                   truncated=torch.tensor([not a[3] for a in answers], dtype=torch.bool, device=device),
                   policy_version=versions.masked_fill(versions < 0, torch.iinfo(torch.long).max).amin(-1),
                   token_version=versions)


def check_full_attention(model_config, field_name: str) -> None:
    """The pool left-pads rows inside one KV cache: attention that is not plain full attention in every layer
    (sliding windows, linear or recurrent layers) would count the padding, so it is refused, naming the field."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    kinds = sorted({type(layer).__name__ for layer in DynamicCache(config=model_config).layers
                    if type(layer) is not DynamicLayer})
    if kinds:
        raise SetupError(f"{field_name}: needs plain full attention in every layer, and this model has "
                         f"{', '.join(kinds)}; set {field_name} = false or use a model without sliding-window or "
                         "linear attention")


def mean_rows_waiting(lengths: Tensor) -> float:
    """The mean rows per decode step of a batch that waits for its longest answer (decode.sample_groups): at
    step t the rows whose answer is longer than t; `lengths` [N] the answers' lengths."""
    steps = torch.arange(int(lengths.max()), device=lengths.device)  # [T]
    return float((lengths[None, :] > steps[:, None]).sum(-1).double().mean())

"""The policy update of one step: old / reference log-probs, then μ passes of clipped-surrogate steps.

    batch = score_old_and_ref(config, policy, batch)      # old_logp only when needed, ref_logp when β > 0
    batch, stats = with_is_weights(config, policy, batch)   # only with algorithm.is_correction
    metrics = optimize(config, policy, batch)              # μ × minibatches × micro-batches

Each function returns what it computed (a new `GenerationBatch`, metrics) instead of filling in the
batch; only `optimize` changes state, the policy's weights and optimizer.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from grpokit.algorithms.mismatch import importance_correction
from grpokit.algorithms.objectives import Accumulation, LossSpec, adapt_entropy_coef, high_entropy_mask, policy_loss
from grpokit.config.schema import Config
from grpokit.models.forward import ForwardOptions, completion_logprobs
from grpokit.models.parallel import global_sum, reduce_gradients, world_size
from grpokit.models.prompt_forward import distinct_prompts
from grpokit.training.generate import GenerationBatch
from grpokit.training.optimizer import AdamWInBackward
from grpokit.training.setup import Policy


@torch.no_grad()
def score_old_and_ref(config: Config, policy: Policy, batch: GenerationBatch) -> GenerationBatch:
    """The batch with the log-probs the loss needs before any update: the old policy's (only when an
    update precedes some minibatch: μ > 1 or several minibatches) and the reference model's (β > 0)."""
    old = ref = None
    if config.needs_old_logprobs:
        mode = config.algorithm.old_logprobs
        if mode == "sampler":  # the rollout's own log-probs: the same policy, no extra pass
            old = batch.rollout.logprobs
        elif mode == "recompute" or config.minibatch_size < len(batch.advantages):
            old = _score(config, policy.model, batch, policy)
        # "first_pass" with one minibatch: optimize() keeps the first pass's log-probs (no update precedes them)
    if policy.ref_model is not None:
        ref = _score(config, policy.ref_model, batch, policy)
    return dataclasses.replace(batch, old_logp=old, ref_logp=ref)


def _score(config: Config, model, batch: GenerationBatch, policy: Policy) -> torch.Tensor:
    r, out = batch.rollout, []
    options = ForwardOptions.from_train(config.train, linear_head=policy.linear_head,
                                        packed=policy.packs_sequences(batch))
    for rows in torch.arange(batch.num_rows).split(config.micro_batch_size):
        logp, _ = completion_logprobs(model, r.prompt_ids[rows], r.prompt_mask[rows], r.completion_ids[rows],
                                      r.completion_mask[rows], temperature=config.rollout.temperature,
                                      media=None if r.media is None else r.media.select(rows),  # each row's images
                                      options=options)
        out.append(logp)
    return torch.cat(out)  # [N, T]


def with_is_weights(config: Config, policy: Policy, batch: GenerationBatch) -> tuple[GenerationBatch, dict]:
    """The sampler-trainer mismatch correction (`algorithm.is_correction`, algorithms/mismatch.py): per-token
    or per-answer weights from exp(trainer - sampler), truncated or masked into [is_cap_min, is_cap_max],
    with the trainer's log-probs before the update (the old ones when the trainer computed them, else a
    no-grad pass; never the sampler's own, which algorithm.old_logprobs = "sampler" would reuse)."""
    algo = config.algorithm
    own = batch.old_logp is not None and batch.old_logp is not batch.rollout.logprobs
    with torch.no_grad():
        trainer_logp = batch.old_logp if own else _score(config, policy.model, batch, policy)
    weights, stats = importance_correction(trainer_logp, batch.rollout.logprobs, batch.loss_mask,
                                           algo.is_correction, cap_max=algo.is_cap_max or None,
                                           cap_min=algo.is_cap_min or None)
    # old_logprobs = "sampler" reused the sampler's log-probs as the old policy's; with a sampler that is not
    # the trainer that would count the mismatch twice (in the ratio and in these weights): the trainer's own
    # log-probs, computed above at no extra cost, are the old ones (as TRL's)
    old = trainer_logp if batch.old_logp is batch.rollout.logprobs else batch.old_logp
    return dataclasses.replace(batch, is_weight=weights, old_logp=old), stats


def loss_spec(config: Config) -> LossSpec:
    """The loss's options as `config.algorithm` sets them, built once per update (the entropy
    coefficient is the configured one; the adaptive controller's steps replace it).

    Each field of `LossSpec` is the `[algorithm]` field of its name, with the config's 0 for "off" read as None
    where that is LossSpec's default (delta, off_policy_mask_threshold), except two: dr_grpo's normaliser is
    `rollout.max_new_tokens`, and epsilon_high the config's resolved value (`clip_high`: epsilon when 0; with
    cispo `cispo_cap`, the cap on the weight, an epsilon_high below 1 read the earlier way)."""
    algo = config.algorithm
    values = {"max_completion_length": config.rollout.max_new_tokens,
              "epsilon_high": algo.cispo_cap if algo.loss_type == "cispo" else algo.clip_high}
    for field in dataclasses.fields(LossSpec):
        if field.name not in values:
            value = getattr(algo, field.name)
            values[field.name] = (value or None) if field.default is None else value
    return LossSpec(**values)


def optimize(config: Config, policy: Policy, batch: GenerationBatch) -> dict:
    """μ passes over the batch; each pass is split into minibatches (one optimizer step
    each), each minibatch into micro-batches (gradient accumulation). Returns the metrics. The passes
    after the first score against the batch's old log-probs, or (`old_logprobs = "first_pass"`) the
    first pass's own."""
    algo, model, spec = config.algorithm, policy.model, loss_spec(config)
    N = len(batch.advantages)
    sums: dict[str, float] = {}
    grad_norms, losses, skipped = [], [], 0
    old = batch.old_logp
    # old_logprobs = "first_pass": the first pass runs on-policy (ratio 1) and its log-probs become the old ones
    first_logp = torch.zeros(batch.loss_mask.shape, device=batch.loss_mask.device) \
        if config.needs_old_logprobs and old is None else None
    for iteration in range(algo.num_iterations):
        order = torch.randperm(N) if config.minibatch_size < N else torch.arange(N)
        for minibatch in order.split(config.minibatch_size):
            minibatch = batch.rows_of(minibatch)  # answers -> their training rows (tools.history = "split")
            policy.optimizer.zero_grad(set_to_none=True)
            micro_batches = micro_batches_of(config, batch, minibatch, policy.packs_sequences(batch))
            n_items = global_sum(batch.loss_mask[minibatch].sum()).clamp(min=1)  # dapo: minibatch tokens, all ranks
            loss, entropy_sum, entropy_tokens = 0.0, 0.0, 0.0
            step_spec = dataclasses.replace(spec, entropy_coef=_entropy_coef_now(algo, policy))
            for rows in micro_batches:
                micro_loss, stats, logp = _micro_step(config, step_spec, policy, batch, old, rows, n_items,
                                                      len(micro_batches))
                entropy_sum += stats.pop("_acting_entropy", 0.0)  # the controller's: over the tokens the bonus acts on
                entropy_tokens += stats.pop("_acting_tokens", 0.0)
                if first_logp is not None and iteration == 0:
                    first_logp[rows, :logp.shape[1]] = logp
                loss += micro_loss
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
            losses.append(loss)
            if isinstance(policy.optimizer, AdamWInBackward):  # the backward already updated each parameter
                norm, finite = policy.optimizer.finish_step()
            else:
                reduce_gradients(model, algo.sums_over_global_tokens)  # several processes: the whole batch's gradient
                norm = _clip_grad(model, config.train.max_grad_norm)
                finite = math.isfinite(norm)
            if finite:
                policy.optimizer.step()
                grad_norms.append(norm)
            else:  # a NaN/inf gradient must never reach the weights
                skipped += 1
            policy.scheduler.step()
            if algo.adaptive_entropy:  # steer the next step's coefficient by this step's token entropy (all ranks)
                entropy = global_sum(torch.tensor([entropy_sum, entropy_tokens], dtype=torch.float64))
                policy.last_entropy = float(entropy[0] / entropy[1].clamp(min=1))
                policy.entropy_coef = adapt_entropy_coef(
                    policy.entropy_coef, policy.last_entropy, target=algo.entropy_target,
                    delta=algo.entropy_coef_delta, low=algo.entropy_coef_min, high=algo.entropy_coef_max)
        if first_logp is not None and iteration == 0:
            old = first_logp
    tokens, entropy_tokens = sums.pop("_tokens"), sums.pop("_entropy_tokens")
    metrics = {k: v / max(tokens, 1) for k, v in sums.items()}  # all-masked batches report 0
    # entropy: over the answers that went through the model (all of them unless zero-advantage ones were skipped)
    metrics["entropy"] = sums["entropy"] / entropy_tokens if entropy_tokens else 0.0 if not tokens else float("nan")
    metrics["loss"] = sum(losses) / len(losses)
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics["skipped_updates"] = skipped
    if algo.entropy_coef > 0 or algo.adaptive_entropy:  # with the bonus on, TRL logs it and policy_loss
        metrics["entropy_coef"] = policy.entropy_coef  # (adaptive) the next step's, as TRL logs it
    return metrics


def micro_batches_of(config: Config, batch: GenerationBatch, rows: torch.Tensor,
                     packed: bool = False) -> list[torch.Tensor]:
    """The minibatch's rows split into micro-batches: in row order (`micro_batch_size` each), or (grouping
    "length") sorted by answer length so each micro-batch trims its padding to similar answers, where that
    computes less (`_ForwardCost`: sorting scatters a prompt's answers, which the shared prompt forward
    would run once) and the loss and its gradient are unchanged by it. `packed` (the answers run as one row
    without padding, models/packing.py): a micro-batch computes its answers' tokens whatever their lengths,
    so the row order (a prompt's answers together) is kept and only the token budget cuts it:

    - dapo, cispo and vespo divide every token by the minibatch's token count, so any split is exact: the
      answers that run a forward go into micro-batches of any size under a token budget
      (`token_budget_split`: many short answers together, a few long ones together), and the answers the
      zero-advantage skip leaves out into one micro-batch of their own (no forward runs on it). Not with an
      entropy term, with the AdamW step in the backward (one backward) or with FSDP (its forward gathers
      the weights with the other processes: every process must run as many micro-steps).
    - grpo, sapo, luspo and dr_grpo weigh each row by 1/(rows of its micro-batch): sorted, in micro-batches
      of the configured size (the rows of a short last micro-batch stay in it).
    - bnpo's per-micro-batch token count, the token_mean entropy bonus and the top-entropy quantile read the
      micro-batch's tokens: row order."""
    size, algo, train = config.micro_batch_size, config.algorithm, config.train
    in_row_order = list(rows.split(size))
    token_mean_bonus = (algo.entropy_coef > 0 or algo.adaptive_entropy) and algo.entropy_aggregation == "token_mean"
    if train.micro_batch_grouping == "rows" or len(rows) <= 1 or algo.loss_type == "bnpo" \
            or token_mean_bonus or algo.top_entropy_quantile < 1:
        return in_row_order
    r = batch.rollout
    cost = _ForwardCost(batch, rows, config, packed)
    if algo.sums_over_global_tokens and not algo.uses_entropy and not train.optimizer_in_backward \
            and not config.model.fsdp:
        moving = rows[cost.moving]  # the answers that run a forward (all but the zero-advantage skip's)
        idle = [rows[~cost.moving]] if not cost.moving.all() else []
        lengths = r.completion_mask[moving].sum(-1).clamp(min=1)  # [m]
        if not idle and bool(lengths.min() == lengths.max()) and cost(in_row_order) == cost.least(rows, size):
            return in_row_order  # answers of one length, row order at the least cost a split can have: no search
        # packed: a prompt's answers together (a shuffled minibatch scatters them); padded: longest first
        order = cost.prompt_of[moving].argsort(stable=True).to(rows.device) if packed else \
            lengths.argsort(descending=True, stable=True).to(rows.device)
        budget = size * (cost.prompt_width + int(r.completion_mask[rows].sum(-1).max()))  # the row-order maximum
        sizes = token_budget_split(lengths[order].tolist(), cost.prompt_ids(moving[order]), cost.prompt_width,
                                   budget, packed=packed)
        grouped = list(moving[order].split(sizes)) + idle
    else:
        if len(rows) <= size:
            return [rows]
        movable = len(rows) - len(rows) % size
        lengths = r.completion_mask[rows[:movable]].sum(-1)  # [movable]
        order = lengths.argsort(descending=True, stable=True).to(rows.device)
        grouped = list(torch.cat([rows[:movable][order], rows[movable:]]).split(size))
    return grouped if cost(grouped) < cost(in_row_order) else in_row_order


MICRO_STEP_OVERHEAD_TOKENS = 32  # what one more forward/backward costs beyond its tokens, in token rows


class _ForwardCost:
    """What a split of the minibatch's rows into micro-batches computes, in token rows: per micro-batch, its
    running rows x its longest answer (packed: the sum of their lengths), its distinct prompts x the prompt
    width (the shared prompt forward runs a prompt once per micro-batch; without it every row runs its own) and
    a fixed cost per micro-step."""

    def __init__(self, batch: GenerationBatch, rows: torch.Tensor, config: Config, packed: bool = False):
        r, n = batch.rollout, len(rows)
        self.packed = packed
        self.lengths, self.prompt_width = r.completion_mask.sum(-1), r.prompt_ids.shape[1]  # [N]
        self.moving = torch.ones(n, dtype=torch.bool, device=rows.device)  # [n]
        if config.skips_zero_advantage:
            adv = batch.loss_advantages(rows, batch.loss_mask.shape[1])  # [n] or [n, T]
            self.moving = (adv != 0).reshape(n, -1).any(-1).to(rows.device)
        self.runs = torch.zeros(len(self.lengths), dtype=torch.bool, device=rows.device)  # [N]
        self.runs[rows[self.moving]] = True
        shared = config.train.shared_prompt_forward and not config.train.gradient_checkpointing
        # [N] one id per distinct prompt (its ids and mask: the prompt forward's own grouping); unshared: each its own
        self.prompt_of = distinct_prompts(r.prompt_ids, r.prompt_mask)[0] if shared else torch.arange(len(self.lengths))

    def prompt_ids(self, rows: torch.Tensor) -> list[int]:
        return self.prompt_of[rows].tolist()

    def least(self, rows: torch.Tensor, size: int) -> int:
        """For answers of one length, all running: a lower bound on the cost of any split of `rows` into
        micro-batches of at most `size` rows (every row at that length, the fewest micro-steps, each distinct
        prompt once)."""
        return (len(rows) * int(self.lengths[rows].max()) + -(-len(rows) // size) * MICRO_STEP_OVERHEAD_TOKENS
                + len(set(self.prompt_ids(rows))) * self.prompt_width)

    def __call__(self, micro_batches: list[torch.Tensor]) -> int:
        total = 0
        for m in micro_batches:
            running = m[self.runs[m]]
            if len(running):
                answers = int(self.lengths[running].sum()) if self.packed else \
                    len(running) * int(self.lengths[m].max())
                total += answers + MICRO_STEP_OVERHEAD_TOKENS + len(set(self.prompt_ids(running))) * self.prompt_width
        return total


def token_budget_split(lengths: list[int], prompts: list[int], prompt_tokens: int, budget: int,
                       overhead: int = MICRO_STEP_OVERHEAD_TOKENS, packed: bool = False) -> list[int]:
    """Sizes of consecutive micro-batches over answers (`lengths`, with their prompts' ids), each holding at
    most `budget` tokens, that minimise the tokens computed plus `overhead` per micro-batch.

    Padded (the answers sorted longest first): a micro-batch computes, and holds, rows x (prompt + its longest
    answer). Packed (models/packing.py; any order, a prompt's answers together being cheapest): it computes the
    sum of its answers' lengths plus its distinct prompts once each, and holds the answers and, in every layer's
    attention, a copy of its prompt's keys per answer: the sum of (prompt + length) counts against the budget.

    An exact dynamic programme over the split points: best[j] is the least cost of the first j answers,
    relaxed from every i < j at once per i (numpy), so n answers cost O(n x largest micro-batch) in C."""
    n = len(lengths)
    last_seen: dict[int, int] = {}
    earlier = np.empty(n, dtype=np.int64)  # [n] the previous answer with the same prompt, -1 for none
    for k, p in enumerate(prompts):
        earlier[k] = last_seen.get(p, -1)
        last_seen[p] = k
    sizes_of = np.maximum(np.asarray(lengths, dtype=np.int64), 1)  # [n]
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(n + 1, dtype=np.int64)
    for i in range(n):  # micro-batches [i, j)
        if packed:
            window = slice(i, min(n, i + budget // (prompt_tokens + 1) + 1))  # no more rows can fit the budget
            answers = np.cumsum(sizes_of[window])  # [w] tokens of answers i .. i + k
            held = answers + np.arange(1, len(answers) + 1) * prompt_tokens  # [w]
            m = max(int(np.searchsorted(held, budget, side="right")), 1)  # rows the budget allows
            tokens = answers[:m] + np.cumsum(earlier[i:i + m] < i) * prompt_tokens  # [m] + distinct prompts
        else:  # answer i is the longest
            longest = sizes_of[i]
            m = min(n - i, max(budget // (prompt_tokens + longest), 1))
            distinct = np.cumsum(earlier[i:i + m] < i)  # [m]
            tokens = np.arange(1, m + 1) * longest + distinct * prompt_tokens
        cost = best[i] + tokens + overhead  # [m]
        better = cost < best[i + 1:i + m + 1]
        best[i + 1:i + m + 1][better] = cost[better]
        cut[i + 1:i + m + 1][better] = i
    sizes, j = [], n
    while j:
        sizes.append(int(j - cut[j]))
        j = int(cut[j])
    return sizes[::-1]


def _entropy_coef_now(algo, policy: Policy) -> float:
    """The entropy bonus's coefficient for this optimizer step: fixed, or (adaptive) the controller's
    coefficient while the last measured entropy is at or below the target, else 0 (TRL's rule)."""
    if not algo.adaptive_entropy:
        return algo.entropy_coef
    return policy.entropy_coef if policy.last_entropy <= algo.entropy_target else 0.0


def _micro_step(config: Config, spec: LossSpec, policy: Policy, batch: GenerationBatch, old_logp, rows, n_items,
                n_micro: int):
    """Forward + backward on one micro-batch; returns its share of the minibatch loss, token-weighted
    sums of its stats, and its log-probs [n, T] (detached).

    With β = 0 an answer whose advantage is 0 adds exactly 0 to the loss and to its gradient, so it
    is left out of the forward (`Config.skips_zero_advantage`); the loss is still evaluated on the full
    [n, T] layout (0 log-probs in those rows), so every normaliser stays what it was."""
    algo, r, train, model, linear_head = config.algorithm, batch.rollout, config.train, policy.model, policy.linear_head
    T = int(r.completion_mask[rows].sum(-1).max().clamp(min=1))  # trim padding columns of this micro-batch
    mask, adv = batch.loss_mask[rows, :T], batch.loss_advantages(rows, T)  # adv [n], or [n, T] per turn
    old = None if old_logp is None else old_logp[rows, :T]
    ref = None if batch.ref_logp is None else batch.ref_logp[rows, :T]
    weights = None if batch.is_weight is None else batch.is_weight[rows, :T]  # [n, T] or [n, 1]
    # the off-policy mask measures the drift from the sampler: its own log-probs (vLLM: not the trainer's)
    sampled = r.logprobs[rows, :T] if algo.off_policy_mask_threshold else None
    # dapo's minibatch token count; token_mean: one entropy mean per call, the global-token losses' calls add up
    accumulation = Accumulation(n_items, n_micro * world_size() if algo.sums_over_global_tokens else 1)

    def loss_of(logp, entropy=None):  # [n, T] -> this micro-batch's share of the minibatch loss, stats
        loss, stats = policy_loss(logp, old, adv, mask, spec=spec, ref_logp=ref, entropy=entropy, token_weights=weights,
                                  sampling_logp=sampled, accumulation=accumulation)
        if spec.entropy_coef > 0 or config.algorithm.adaptive_entropy:  # TRL's policy_loss, also where the
            stats.setdefault("policy_loss", loss.detach())  # adaptive gate is shut
        # a global-token normaliser already spans the minibatch; the others average the micro-batches
        return (loss if algo.sums_over_global_tokens else loss / n_micro), stats

    n = len(rows)
    # entropy options: a zero-advantage answer still has an entropy gradient, and its tokens count in the quantile
    keep = (adv != 0).reshape(n, -1).any(-1).nonzero()[:, 0] if config.skips_zero_advantage else torch.arange(n)
    keep = keep.to(mask.device)
    constant = old is None and algo.beta == 0  # on-policy, no KL: dLoss/dlogp does not depend on logp
    grad_fn = None
    # one-pass backward: the gradient must be per token (or constant), so no sequence term may read logp values
    if len(keep) and linear_head and train.fused_logprobs and train.fused_backward and not algo.uses_entropy and \
            (algo.per_token_loss or (constant and not algo.off_policy_mask_threshold)):
        grad_fn = _logp_grad_fn(loss_of, n, T, keep, constant)
    if len(keep):
        sel = rows if len(keep) == n else rows[keep.to(rows.device)]
        logp_kept, entropy = completion_logprobs(
            model, r.prompt_ids[sel], r.prompt_mask[sel], r.completion_ids[sel, :T], r.completion_mask[sel, :T],
            temperature=config.rollout.temperature, with_entropy=True, grad_fn=grad_fn,
            media=None if r.media is None else r.media.select(sel),
            options=ForwardOptions.from_train(train, linear_head=linear_head, packed=policy.packs_sequences(batch),
                                              backward=True))  # [k, T]
        logp = logp_kept if len(keep) == n else logp_kept.new_zeros(n, T).index_copy(0, keep, logp_kept)
    else:  # nothing carries a gradient: no model call at all
        logp = torch.zeros(n, T, device=mask.device)
    loss, stats = loss_of(logp, entropy if algo.uses_entropy else None)
    if logp.requires_grad:
        loss.backward()
    tokens = mask.sum().item()
    out = {k: float(v) * tokens for k, v in stats.items()}
    kept_mask = mask[keep]
    out["entropy"] = (entropy.detach() * kept_mask).sum().item() if len(keep) else 0.0
    out["_entropy_tokens"] = kept_mask.sum().item()
    out["_tokens"] = tokens
    if algo.adaptive_entropy:  # (every answer went through the model: uses_entropy turns the skip off)
        acting = mask if algo.top_entropy_quantile >= 1 else high_entropy_mask(entropy, mask, algo.top_entropy_quantile)
        out["_acting_entropy"] = (entropy.detach() * acting).sum().item()
        out["_acting_tokens"] = acting.sum().item()
    return loss.item(), out, logp.detach()


def _logp_grad_fn(loss_of, n: int, T: int, keep: torch.Tensor, constant: bool):
    """dLoss/dlogp for a chunk of the kept rows' flattened [k*T] log-probs (given by its offset, or by its
    entries' positions when the answers ran packed): the input of the fused head's one-pass backward. Valid
    because each loss here is a sum of per-token terms (or, when `constant`, has a gradient independent of
    logp); fused_logprobs checks it against autograd's."""
    k = len(keep)

    def grad_at(flat: torch.Tensor) -> torch.Tensor:  # [k*T] -> [k*T]
        with torch.enable_grad():
            logp = flat.new_zeros(n, T).index_copy(0, keep, flat.view(k, T)).requires_grad_()
            (g,) = torch.autograd.grad(loss_of(logp)[0], logp)
        return g.index_select(0, keep).reshape(-1)

    def where(lp: torch.Tensor, start) -> slice | torch.Tensor:  # a chunk's offset, or (packed) its flat positions
        return slice(start, start + len(lp)) if isinstance(start, int) else start

    if constant:
        g = grad_at(torch.zeros(k * T, device=keep.device))
        return lambda lp, start: g[where(lp, start)]
    bufs: dict = {}  # the kept rows' log-probs so far, in the head's dtype

    def per_chunk(lp: torch.Tensor, start) -> torch.Tensor:
        if lp.dtype not in bufs:
            bufs[lp.dtype] = lp.new_zeros(k * T)
        at, buf = where(lp, start), bufs[lp.dtype]
        buf[at] = lp
        return grad_at(buf)[at]

    return per_chunk


def _clip_grad(model, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    limit = max_norm if max_norm > 0 else float("inf")
    return float(torch.nn.utils.clip_grad_norm_(params, limit))

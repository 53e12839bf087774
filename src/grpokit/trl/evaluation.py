"""`GRPOTrainer.evaluate()` and `load_best_model_at_end`, on grpokit's evaluation and run folder.

`evaluate` scores a model on held-out rows and returns TRL's keys (what TRL's Trainer.evaluate returns
for a GRPO trainer): `eval_loss`, `eval_runtime`, `eval_samples_per_second`, `eval_steps_per_second`,
`eval_reward`, `eval_reward_std`, `eval_frac_reward_zero_std`, `eval_rewards/<name>/mean|std`,
`eval_completions/*`, `eval_entropy`, `eval_clip_ratio/*` (`eval_kl` with beta > 0), and grpokit's
`eval_accuracy` and `eval_pass@K`.

The answers are drawn once: num_generations_eval per prompt at the training temperature, with the
generator, seed (`seed`) and prompt batches of grpokit's own `training.evaluation.evaluate` (the one the
`[eval]` section runs during training), so they are the tokens that evaluation would draw.

- `eval_reward`, `eval_accuracy`, `eval_pass@K` are that evaluation's numbers, counted as it counts them
  (`eval_reward` is grpokit's eval/mean_reward, the mean total reward of the answers).
- The rest are TRL's evaluation on the same answers: per eval batch of `per_device_eval_batch_size`
  answers (whole groups), the group advantages, and the GRPO loss at ratio 1 (on-policy: no update
  happens during evaluation) with the KL to the reference when beta > 0 and the entropy bonus (TRL's
  prediction_step calls its compute_loss); each metric, `eval_loss` too, is the mean over the batches
  (NaN-skipping, as transformers' evaluation loop and TRL's log average them).
- `eval_num_tokens` is the trainer's count of input tokens seen in training (`state.num_input_tokens_seen`:
  TRL logs it unchanged in evaluation).
`best_checkpoint` is the checkpoint best.json names (`output.keep_best`), what transformers'
`load_best_model_at_end` loads at the end of training.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch


def best_checkpoint(run_dir: Path) -> tuple[Path, dict] | None:
    """The checkpoint best.json names, with best.json's record; None when there is none (no finite score)."""
    from grpokit.training.evaluation import BEST_FILE

    try:
        best = json.loads((Path(run_dir) / BEST_FILE).read_text(encoding="utf-8"))
        checkpoint = Path(run_dir) / best["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (checkpoint, best) if checkpoint.is_dir() else None


def run_evaluation(trainer, model, rows: list[dict], prefix: str) -> dict[str, float]:
    """grpokit's evaluation of `model` on `rows`, with TRL's metric names (`<prefix>_loss`, `<prefix>_reward`...)."""
    from grpokit.data.files import load_prompts
    from grpokit.errors import DataError
    from grpokit.rollout.request import SamplingParams
    from grpokit.training.evaluation import EvalSettings, ToolUse, eval_side
    from grpokit.training.rollout_setup import resolve_rewards
    from grpokit.training.setup import PreparedData, eval_max_new_tokens
    from grpokit.training.tool_setup import resolve_tools

    config, args = trainer.config, trainer._grpo_args
    try:
        rows = load_prompts(rows, prompt_column="prompt")
    except DataError as e:
        raise DataError(f"eval_dataset: {e}") from None
    data = PreparedData(rows, None)
    tools, environments = resolve_tools(config, trainer.tools, trainer.environment_factory)
    tokenizer, table, tool_images = _prompt_table(config, data, trainer.processing_class, model, tools, environments)
    specs, pool = resolve_rewards(config, data, trainer.reward_funcs, environments)
    samples = args.num_generations_eval or args.num_generations
    started, was_training = time.perf_counter(), model.training
    model.eval()
    sampling = SamplingParams(eval_max_new_tokens(config), tuple(table.eos_token_ids), tokenizer.pad_token_id,
                              args.temperature, args.top_p, args.top_k, tuple(config.rollout.stop_strings))
    side = eval_side(model, tokenizer, table, specs, EvalSettings(sampling, samples),
                     tool_use=ToolUse(tools, config.tools.max_calls, environments, config.tools.history, tool_images))
    try:
        batches, totals = _answer_metrics(trainer, model, side, seed=args.seed)
    finally:
        if pool is not None:
            pool.close()
    model.train(was_training)
    runtime = time.perf_counter() - started
    keys = dict.fromkeys(k for b in batches for k in b)  # TRL's log: each metric's mean over the eval batches
    metrics = {k: _mean([b.get(k, math.nan) for b in batches]) for k in keys}
    metrics.update(_scores(totals, config.eval.correct_threshold))
    metrics["num_tokens"] = float(trainer.state.num_input_tokens_seen)
    eval_batch = args.per_device_eval_batch_size * args.world_size
    speed = {"runtime": round(runtime, 4)}
    if runtime > 0:  # transformers' speed_metrics: rows and eval batches per second
        speed.update(samples_per_second=round(len(rows) / runtime, 3),
                     steps_per_second=round(math.ceil(len(rows) / eval_batch) / runtime, 3))
    ordered = {"loss": metrics.pop("loss"), **speed, **metrics}  # TRL's order
    return {f"{prefix}_{k}": v for k, v in ordered.items()}


def _prompt_table(config, data, tokenizer, model, tools, environments):
    """The eval rows' prompt table as training renders them (the tools' schemas; with environments each row's
    own), checked against the context with the evaluation's answer budget; rows with images are rendered by the
    model folder's processor (its tokenizer then decodes), as the evaluation during training does. Also the
    renderer of tool results with images (a vision-language model's, with tools)."""
    from grpokit.errors import DataError
    from grpokit.models.loading import check_model_folder, max_positions_of
    from grpokit.rollout.side import PromptTable
    from grpokit.rollout.vision import tool_images_for
    from grpokit.training import vision_setup
    from grpokit.training.setup import tokenize_prompts

    field = "eval.max_new_tokens" if config.eval.max_new_tokens else "rollout.max_new_tokens"
    vision = vision_setup.check_vision_inputs(config, data, check_model_folder(config.model.path),
                                              environments=environments is not None, tools=tools is not None)
    if environments is not None:
        try:
            environments.check_rows(data.rows)
        except ValueError as e:
            raise DataError(f"eval_dataset: {e}") from None
    if vision is not None and vision.images:  # (no environments: refused with images)
        tokenizer = vision_setup.vision_tokenizer(vision, config.model.path)
        table = PromptTable(data.rows, *vision_setup.tokenize_image_prompts(config, data, vision, tokenizer, tools,
                                                                            budget_field=field))
    else:
        max_positions = max_positions_of(config.model.path) if vision is None else \
            vision_setup.context_length(vision.model_config)
        if environments is not None:  # what reset returns is checked against it at each batch
            environments.max_positions = max_positions
        table = tokenize_prompts(config, data, tokenizer, max_positions, tools, environments, budget_field=field)
    return tokenizer, table, tool_images_for(model, config.model.path) if tools else None


def _scores(totals: torch.Tensor, correct_threshold: float) -> dict[str, float]:
    """grpokit's evaluation numbers of the total rewards [P, K] (training.evaluation.evaluate's rules): the
    mean reward of the graded answers, the share of answers reaching `correct_threshold`, pass@K."""
    from grpokit.training.evaluation import pass_at_k

    n, k = totals.shape
    correct = torch.nan_to_num(totals, nan=0.0) >= correct_threshold  # [P, K]
    graded = int((~torch.isnan(totals)).sum())
    return {"reward": float(torch.nansum(totals)) / graded if graded else math.nan,
            "accuracy": float(correct.sum()) / (n * k) if n else math.nan,
            f"pass@{k}": sum(pass_at_k(k, int(c), k) for c in correct.sum(-1)) / n if n else math.nan}


def _mean(values: list[float]) -> float:
    valid = [v for v in values if not math.isnan(v)]
    return sum(valid) / len(valid) if valid else math.nan


@torch.no_grad()
def _answer_metrics(trainer, model, side, *, seed: int, batch_prompts: int = 64) -> tuple[list[dict], torch.Tensor]:
    """The answers, drawn as grpokit's `evaluate` draws them (the same rollout side, generator, seed and prompt
    batches), scored per TRL eval batch; and their total rewards [P, K]."""
    G, generator = side.group_size, torch.Generator(device=model.device).manual_seed(seed)
    per_batch = max(1, trainer._grpo_args.per_device_eval_batch_size // G)  # prompts in one TRL eval batch
    out, totals = [], [torch.zeros(0, G)]
    for indices in side.batches(batch_prompts):
        draw = side.draw(indices, generator=generator, trainer_state=trainer.state)  # TRL passes its state here too
        totals.append(draw.total.view(-1, G).cpu())
        for first in range(0, len(indices), per_batch):
            answers = torch.arange(first * G, min(first + per_batch, len(indices)) * G)
            out.append(_batch_metrics(trainer, model, draw, answers, side.specs, G))
    return out, torch.cat(totals)


def _batch_metrics(trainer, model, draw, answers: torch.Tensor, specs, G: int) -> dict:
    """TRL's evaluation metrics of one eval batch of whole groups: rewards, lengths, the loss at ratio 1."""
    from grpokit.algorithms.advantages import decoupled_advantages, group_advantages
    from grpokit.algorithms.objectives import Accumulation, policy_loss
    from grpokit.models.forward import ForwardOptions, completion_logprobs, head_is_linear
    from grpokit.observe.metrics import completion_metrics, reward_summary
    from grpokit.rewards.core import reward_metrics
    from grpokit.training.update import loss_spec

    config, algo = trainer.config, trainer.config.algorithm
    r, total, per_fn = draw.rollout, draw.total[answers], draw.per_fn[answers]
    if config.rewards.aggregation == "normalize_then_sum":
        adv = decoupled_advantages(per_fn, [s.weight for s in specs], G, std=algo.std)
    else:
        adv = group_advantages(total, G, scale_rewards=algo.scale_rewards, std=algo.std,
                               estimator=algo.advantage_estimator)
    mask = r.action_mask[answers].clone()
    if algo.mask_truncated_completions:
        mask[r.truncated[answers]] = 0
    T = int(r.completion_mask[answers].sum(-1).max().clamp(min=1))
    mask = mask[:, :T]
    scored = (r.prompt_ids[answers], r.prompt_mask[answers], r.completion_ids[answers, :T],
              r.completion_mask[answers, :T])
    options = ForwardOptions(linear_head=head_is_linear(model))
    logp, entropy = completion_logprobs(model, *scored, temperature=config.rollout.temperature, with_entropy=True,
                                        options=options)
    reference = _reference(trainer, model) if algo.beta > 0 else None
    ref = completion_logprobs(reference, *scored, temperature=config.rollout.temperature,
                              options=options)[0] if reference is not None else None
    loss, stats = policy_loss(  # one eval batch, no accumulation: entropy_parts 1, as TRL
        logp, None, adv.to(logp.device), mask, spec=loss_spec(config), ref_logp=ref,
        entropy=entropy if algo.uses_entropy else None, accumulation=Accumulation(mask.sum().clamp(min=1)),
        sampling_logp=r.logprobs[answers, :T] if algo.off_policy_mask_threshold else None)
    maskf = mask.to(entropy.dtype)
    lengths = r.action_mask[answers].sum(-1).float()
    ended = lengths[~r.truncated[answers].to(lengths.device)]  # TRL's terminated lengths (0 when none ended)
    stats = {**stats, **_one_process_extremes(stats)}
    return {"loss": float(loss), **reward_summary(total, G), **reward_metrics(specs, per_fn),
            **completion_metrics(r.action_mask[answers], r.truncated[answers]),
            "completions/min_terminated_length": float(ended.min()) if len(ended) else 0.0,
            "completions/max_terminated_length": float(ended.max()) if len(ended) else 0.0,
            "entropy": float((entropy * maskf).sum() / maskf.sum().clamp(min=1)),
            **{k: float(v) for k, v in stats.items()}}


def _one_process_extremes(stats: dict) -> dict:
    """TRL's clip_ratio/low_min and high_max (the min / max over processes of each one's mean): every process
    evaluates all of the rows, so each is the mean itself."""
    pairs = (("clip_ratio/low_mean", "clip_ratio/low_min"), ("clip_ratio/high_mean", "clip_ratio/high_max"))
    return {extreme: stats[mean] for mean, extreme in pairs if mean in stats}


def _reference(trainer, model):
    """The KL reference of the evaluation's loss (beta > 0): the base with the adapters off under LoRA, else
    the initial weights (model.path), loaded once."""
    from grpokit.models.lora import AdapterDisabled, adapter_of

    if adapter_of(model) is not None:
        return AdapterDisabled(model)
    if getattr(trainer, "_eval_reference", None) is None:
        from grpokit.models.loading import load_model

        trainer._eval_reference = load_model(trainer.config.model.path, dtype=trainer.config.model.dtype,
                                             device=str(model.device)).eval().requires_grad_(False)
    return trainer._eval_reference

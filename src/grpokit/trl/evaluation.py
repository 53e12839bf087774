"""`GRPOTrainer.evaluate()` and `load_best_model_at_end`, on grpokit's evaluation and run folder.

`evaluate` scores a model on held-out rows with grpokit's own `training.evaluation.evaluate`, the one
the `[eval]` section runs during training, with the same settings the trainer's config gives it
(num_generations_eval answers per prompt at the training temperature, max_completion_length tokens),
and names the results as TRL's Trainer.evaluate names its metrics: `eval_reward` is the mean total
reward of the answers (grpokit's eval/mean_reward). `best_checkpoint` is the checkpoint best.json names
(`output.keep_best`), what transformers' `load_best_model_at_end` loads at the end of training.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from grpokit.errors import ConfigError


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
    """grpokit's evaluation of `model` on `rows`, with TRL's metric names (`<prefix>_reward`, ...)."""
    from grpokit.data.files import load_prompts
    from grpokit.errors import DataError
    from grpokit.models.loading import load_tokenizer, max_positions_of
    from grpokit.training.evaluation import evaluate
    from grpokit.training.setup import (
        PreparedData,
        eval_max_new_tokens,
        resolve_reward_specs,
        resolve_tools,
        tokenize_prompts,
    )

    config, args = trainer.config, trainer.args
    if trainer.environment_factory is not None:
        raise ConfigError("GRPOTrainer.evaluate: grpokit's evaluation does not run environment_factory's environments "
                          "yet; evaluate without them")
    try:
        rows = load_prompts(rows, prompt_column="prompt")
    except DataError as e:
        raise DataError(f"eval_dataset: {e}") from None
    tokenizer = load_tokenizer(config.model.path)
    tools, _ = resolve_tools(config, trainer.tools) if trainer.tools is not None else (None, None)
    budget = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout,
                                                                     max_new_tokens=eval_max_new_tokens(config)))
    table = tokenize_prompts(budget, PreparedData(rows, None), tokenizer, max_positions_of(config.model.path), tools)
    specs = resolve_reward_specs(config, None, trainer.reward_funcs)
    samples = args.num_generations_eval or args.num_generations
    started, was_training = time.perf_counter(), model.training
    result = evaluate(model, tokenizer, table.rows, table.ids, specs, samples_per_prompt=samples,
                      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                      max_new_tokens=eval_max_new_tokens(config),
                      correct_threshold=config.eval.correct_threshold, greedy=False, seed=args.seed,
                      stop_strings=config.rollout.stop_strings, tools=tools, max_tool_turns=config.tools.max_calls,
                      eos_token_ids=table.eos_token_ids)
    model.train(was_training)
    return {f"{prefix}_reward": result["mean_reward"], f"{prefix}_accuracy": result["accuracy"],
            f"{prefix}_pass@{samples}": result[f"pass@{samples}"],
            f"{prefix}_runtime": time.perf_counter() - started}

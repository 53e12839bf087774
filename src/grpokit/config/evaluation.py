"""The `[eval]` section: a held-out score while training (training/evaluation.py).

Sampled accuracy on prompts the policy never trains on is what a practitioner watches to
know whether the reward is being learned or gamed; `output.keep_best` keeps the checkpoint
where it peaked. Evaluation samples with the training model's own sampler (any engine).
"""

from __future__ import annotations

from dataclasses import dataclass

from grpokit.config.checks import check, check_fields

EVAL_METRICS = ("eval/accuracy", "eval/mean_reward", "eval/pass@K", "eval/greedy_accuracy")


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation during training: every `every` steps and after the last one, on held-out prompts."""

    every: int = 0  # evaluate after every K steps and after the last one; 0 = off
    # Held-out prompts: a JSONL / CSV / Parquet file, a saved datasets folder or a Hub dataset, with
    # data.prompt_column and the columns the rewards read; empty = the built-in task's eval split.
    path: str = ""
    name: str = ""  # the Hub dataset's config, as data.name
    split: str = ""  # the split of a Hub dataset or a saved datasets folder; empty = "test"
    num_prompts: int = 64  # the first N prompts (a task's eval split: N generated ones)
    samples_per_prompt: int = 4  # K answers per prompt: eval/accuracy averages them, eval/pass@K from them
    temperature: float = 1.0  # sampling temperature of the K answers (with rollout.top_p / top_k)
    greedy: bool = False  # also one greedy answer per prompt: eval/greedy_accuracy
    max_new_tokens: int = 0  # tokens per answer at most; 0 = rollout.max_new_tokens
    # An answer counts as correct (eval/accuracy, pass@K) when its total reward reaches this.
    correct_threshold: float = 1.0
    seed: int = 0  # the evaluation's own sampling seed (the training sampler is left untouched)

    def __post_init__(self):
        check_fields(self, "eval")
        check(self.every >= 0, "eval.every", "must be >= 0 (0 = no evaluation during training)")
        check(self.num_prompts >= 1, "eval.num_prompts", "must be >= 1")
        check(self.samples_per_prompt >= 1, "eval.samples_per_prompt", "must be >= 1")
        check(self.temperature > 0, "eval.temperature",
               "must be > 0 (set eval.greedy = true for one greedy answer per prompt)")
        check(self.max_new_tokens >= 0, "eval.max_new_tokens", "must be >= 0 (0 = rollout.max_new_tokens)")
        check(0 <= self.seed < 2**63, "eval.seed", "must be in [0, 2**63)")
        for key in ("name", "split"):
            check(not getattr(self, key) or bool(self.path), f"eval.{key}",
                   f"{getattr(self, key)!r} applies to eval.path (a Hub dataset); drop it or set eval.path")

    def metric_names(self) -> tuple[str, ...]:
        """What an evaluation logs."""
        names = ("eval/accuracy", "eval/mean_reward", f"eval/pass@{self.samples_per_prompt}")
        return names + (("eval/greedy_accuracy",) if self.greedy else ())


def check_eval(config) -> None:
    """The checks across sections: where held-out prompts come from, and what `output.keep_best` names."""
    e, keep = config.eval, config.output.keep_best
    if keep:
        check(bool(e.every), "output.keep_best", f"{keep!r} needs evaluation during training: set eval.every > 0")
        greedy = "; eval/greedy_accuracy needs eval.greedy = true" if keep == "eval/greedy_accuracy" else ""
        check(keep in e.metric_names(), "output.keep_best",
               f"got {keep!r}; with this [eval] section choose one of {', '.join(e.metric_names())}{greedy}")

"""Held-out evaluation: sampled accuracy, pass@k, greedy accuracy, mean reward; during training too.

Sampled accuracy (the mean correctness of answers drawn at the training
temperature) is what GRPO optimises; pass@k says how often the right answer is
within reach at all. A warm start with high pass@k and low pass@1 is where RL
helps most: it turns pass@k into pass@1.

`evaluate` scores a model on rows (the `grpokit eval` command and the demos call it);
`HeldOut` is the `[eval]` section's: prompts prepared before the model loads, scored
every `eval.every` steps, each process its share, the counts summed over processes.
`BestCheckpoint` remembers where `output.keep_best` peaked (best.json in the run folder).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import Callable, Sequence

import torch

from grpokit.config.schema import Config
from grpokit.errors import RewardError
from grpokit.models.fsdp import full_params_for_generation
from grpokit.models.media import RowMedia
from grpokit.models.parallel import global_sum
from grpokit.rewards.core import RewardSpec
from grpokit.rollout.engines import HFEngine
from grpokit.rollout.environments import Environments
from grpokit.rollout.request import SamplingParams
from grpokit.rollout.side import PromptTable, RolloutSide
from grpokit.rollout.tools import ToolBox
from grpokit.rollout.vision import tool_images_for
from grpokit.training.checkpoint import BEST_FILE
from grpokit.training.setup import eval_max_new_tokens


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass(frozen=True)
class EvalSettings:
    """How an evaluation draws and grades its answers: `samples_per_prompt` answers to each prompt, sampled as
    `sampling` says (the answer budget, temperature, top-p, top-k, stop strings, end tokens, pad token), an answer
    correct when its total reward reaches `correct_threshold`; with `greedy` also one answer per prompt at
    temperature 0. `seed` seeds the evaluation's noise; `batch_prompts` prompts are sampled at once; the reward
    functions receive the rows' `prompt_column` as `prompts`."""

    sampling: SamplingParams = SamplingParams(max_new_tokens=32)
    samples_per_prompt: int = 8
    correct_threshold: float = 1.0
    greedy: bool = True
    seed: int = 0
    batch_prompts: int = 64
    prompt_column: str = "prompt"


@dataclass(frozen=True)
class ToolUse:
    """An evaluation's multi-turn answers, as in training (`[tools]`): `tools` runs the calls (the prompts were
    rendered with its schemas), at most `max_tool_turns` turns of calls per answer (`tools.max_calls`). With
    `environments` (`tools` their tool box) each answer runs in its own instance, reset with its row; `history =
    "split"` (`tools.history`) samples each turn from the conversation as the template renders it; `tool_images`
    (`rollout.vision.ToolImages`) shows a vision-language model the images its tools return."""

    tools: ToolBox | None
    max_tool_turns: int = 8
    environments: Environments | None = None
    history: str = "append"
    tool_images: object = None


def eval_side(model, tokenizer, prompts: PromptTable, specs: Sequence[RewardSpec], settings: EvalSettings, *,
              tool_use: ToolUse | None = None) -> RolloutSide:
    """The rollout side (rollout/side.py) an evaluation draws with: the built-in sampler on `model` as it is
    now, `settings.samples_per_prompt` answers per prompt of `prompts` sampled as `settings.sampling` says, as in
    training (with `tool_use`: tools, environments, the split history, images) but with the evaluation's budget and
    temperature. Also the TRL drop-in's evaluate()'s."""
    t = tool_use or ToolUse(None)
    engine = HFEngine(model, tokenizer, tools=t.tools, max_tool_turns=t.max_tool_turns, packed_weights=False,
                      tool_images=t.tool_images)
    return RolloutSide(prompts, specs, engine, tokenizer, settings.sampling, settings.samples_per_prompt,
                       t.environments, t.history == "split", "eval.max_new_tokens", settings.prompt_column)


def greedy_side(side: RolloutSide) -> RolloutSide:
    """`side` drawing one answer per prompt at temperature 0 (greedy accuracy)."""
    return dataclasses.replace(side, group_size=1,
                               sampling=dataclasses.replace(side.sampling, temperature=0.0, top_p=1.0))


def _grade(side: RolloutSide, generator: torch.Generator, batch_prompts: int, trainer_state=None):
    """Total rewards [num_prompts, group_size] of the side's answers to every prompt, and with tools the calls
    and failed calls of every answer ([num_prompts * group_size] each)."""
    G, totals, calls, failures = side.group_size, [torch.zeros(0, side.group_size)], [], []
    for indices in side.batches(batch_prompts):
        draw = side.draw(indices, generator=generator, trainer_state=trainer_state)
        totals.append(draw.total.view(-1, G).cpu())
        if draw.tool_stats is not None:
            calls += draw.tool_stats.calls
            failures += draw.tool_stats.failures
    return torch.cat(totals), calls, failures  # [num_prompts, group_size], [N], [N]


def _no_reduce(counts: torch.Tensor) -> torch.Tensor:
    return counts


# `evaluate`'s keywords before it took `EvalSettings` and `ToolUse` (grpokit 0.x): still accepted, with a warning
_SETTINGS_KEYWORDS = ("samples_per_prompt", "correct_threshold", "greedy", "seed", "batch_prompts", "prompt_column")
_SAMPLING_KEYWORDS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_strings", "eos_token_ids")
_TOOL_KEYWORDS = ("tools", "max_tool_turns", "environments", "history", "tool_images")


def _settings_from_keywords(tokenizer, old: dict) -> tuple[EvalSettings, ToolUse | None]:
    """The settings the old spelling `evaluate(..., samples_per_prompt=8, temperature=1.0, max_new_tokens=32,
    tools=..., ...)` meant, its defaults included (the tokenizer's end token and pad token)."""
    unknown = sorted(set(old) - {*_SETTINGS_KEYWORDS, *_SAMPLING_KEYWORDS, *_TOOL_KEYWORDS})
    if unknown:
        raise TypeError(f"evaluate() got an unexpected keyword argument {unknown[0]!r}")
    eos = old.get("eos_token_ids")
    eos = list(eos) if eos is not None else [tokenizer.eos_token_id]
    sampling = SamplingParams(old.get("max_new_tokens", 32), tuple(eos), tokenizer.pad_token_id,
                              old.get("temperature", 1.0), old.get("top_p", 1.0), old.get("top_k", 0),
                              tuple(old.get("stop_strings", ())))
    settings = EvalSettings(sampling, **{k: old[k] for k in _SETTINGS_KEYWORDS if k in old})
    tools = {k: old[k] for k in _TOOL_KEYWORDS if k in old}
    return settings, ToolUse(**{"tools": None, **tools}) if tools else None


@torch.no_grad()
def evaluate(model, tokenizer, rows: Sequence[dict], prompt_ids: Sequence[Sequence[int]], specs: Sequence[RewardSpec],
             settings: EvalSettings = EvalSettings(), *, tool_use: ToolUse | None = None, media: RowMedia | None = None,
             reduce: Callable[[torch.Tensor], torch.Tensor] = _no_reduce, trainer_state=None, **deprecated) -> dict:
    """Metrics over `rows` (with their tokenized prompts), the answers drawn and graded as `settings` says: an
    answer is correct when its total reward reaches `settings.correct_threshold`; `settings.sampling`'s empty
    `eos_token_ids` (the default) means the tokenizer's end token, where it has one. With `tool_use` (the prompts
    rendered with its tools' schemas) answers are multi-turn conversations, as in training, and the result also has
    `tool_call_share` (answers that called a tool at least once) and `tool_failure_rate`
    (failed calls / calls) of the sampled answers. `reduce` sums the counts over processes
    (each evaluated its own share of the rows), so every process returns the whole set's metrics. `trainer_state`
    is what the reward functions receive as TRL's keyword of that name (the loop's: training/generate.py).
    `media` (`models.media.RowMedia`, one row per prompt of `rows`, or `training.vision_setup.PromptMedia`, which
    encodes each batch's rows when it is sampled): a vision-language model's images.

    The old spelling `evaluate(..., samples_per_prompt=8, temperature=1.0, max_new_tokens=32, tools=box,
    max_tool_turns=8, ...)` still works and warns (DeprecationWarning): pass `EvalSettings(SamplingParams(...),
    samples_per_prompt=...)` and `tool_use=ToolUse(box, max_tool_turns=8)`."""
    if deprecated:
        warnings.warn("evaluate(..., samples_per_prompt=..., temperature=..., max_new_tokens=..., tools=..., ...) is "
                      "deprecated: call evaluate(model, tokenizer, rows, prompt_ids, specs, EvalSettings("
                      "SamplingParams(max_new_tokens, eos_token_ids, pad_token_id, temperature, ...), "
                      "samples_per_prompt=...), "
                      "tool_use=ToolUse(tools, max_tool_turns=...))", DeprecationWarning, stacklevel=3)
        if settings != EvalSettings() or tool_use is not None:
            raise TypeError("evaluate(): give either settings= and tool_use= or the deprecated keywords "
                            f"({', '.join(sorted(deprecated))}), not both")
        settings, tool_use = _settings_from_keywords(tokenizer, deprecated)
    model.eval()
    generator = torch.Generator(device=model.device).manual_seed(settings.seed)
    eos = tuple(settings.sampling.eos_token_ids) or tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    settings = dataclasses.replace(settings, sampling=dataclasses.replace(settings.sampling, eos_token_ids=eos))
    side = eval_side(model, tokenizer, PromptTable(list(rows), [list(p) for p in prompt_ids], list(eos), media), specs,
                     settings, tool_use=tool_use)
    with full_params_for_generation(model):  # FSDP: gathered once, each process decodes its own share
        sampled, calls, failures = _grade(side, generator, settings.batch_prompts, trainer_state)  # [P, k]
        best = _grade(greedy_side(side), generator, settings.batch_prompts, trainer_state)[0] if settings.greedy \
            else torch.zeros(0, 1)  # [P, 1]
    k, threshold = settings.samples_per_prompt, settings.correct_threshold
    correct = torch.nan_to_num(sampled, nan=0.0) >= threshold  # [P, k]
    graded = ~torch.isnan(sampled)
    counts = torch.tensor([  # summed over processes: every metric is a ratio of two of these
        len(rows), correct.sum(), sum(pass_at_k(k, int(c), k) for c in correct.sum(-1)),
        torch.nansum(sampled), graded.sum(), (torch.nan_to_num(best, nan=0.0) >= threshold).sum(),
        sum(c > 0 for c in calls), len(calls), sum(failures), sum(calls)], dtype=torch.float64)
    n, right, passed, reward_sum, n_graded, greedy_right, calling, answers, failed, n_calls = \
        reduce(counts).tolist()
    result = {
        "num_prompts": int(n),
        "samples_per_prompt": k,
        "temperature": settings.sampling.temperature,
        "accuracy": right / (n * k) if n else math.nan,
        f"pass@{k}": passed / n if n else math.nan,
        "mean_reward": reward_sum / n_graded if n_graded else math.nan,
    }
    if tool_use is not None and tool_use.tools:
        result["tool_call_share"] = calling / answers if answers else 0.0
        result["tool_failure_rate"] = failed / n_calls if n_calls else 0.0
    if settings.greedy:
        result["greedy_accuracy"] = greedy_right / n if n else math.nan
    return result


@dataclass
class HeldOut:
    """The `[eval]` section's prompts (this process's share: setup.prepare_held_out) and how to score them."""

    prompts: PromptTable
    config: Config
    tools: ToolBox | None
    environments: Environments | None = None  # one instance per answer, reset with its row, as in training

    def due(self, step: int) -> bool:
        return step % self.config.eval.every == 0 or step == self.config.train.steps

    def run(self, model, tokenizer, specs: Sequence[RewardSpec], trainer_state=None) -> dict[str, float]:
        """`eval/...` metrics of the model as it is now (every process takes part)."""
        e, was_training = self.config.eval, model.training
        try:
            result = self._evaluate(model, tokenizer, specs, trainer_state)
        except RewardError as err:  # name the evaluation: the training data is not where it failed
            raise type(err)(f"evaluation during training ([eval], {e.path or 'the task eval split'}): {err}") from err
        model.train(was_training)
        skip = ("num_prompts", "samples_per_prompt", "temperature")
        return {f"eval/{k}": float(v) for k, v in result.items() if k not in skip}

    def _evaluate(self, model, tokenizer, specs: Sequence[RewardSpec], trainer_state=None) -> dict:
        c, e, p = self.config, self.config.eval, self.prompts
        sampling = SamplingParams(eval_max_new_tokens(c), tuple(p.eos_token_ids), tokenizer.pad_token_id,
                                  e.temperature, c.rollout.top_p, c.rollout.top_k, tuple(c.rollout.stop_strings))
        settings = EvalSettings(sampling, e.samples_per_prompt, e.correct_threshold, e.greedy, e.seed)
        tool_use = ToolUse(self.tools, c.tools.max_calls, self.environments, c.tools.history,
                           self._tool_images(model) if self.tools else None)
        # image rows: p.media is a vision_setup.PromptMedia, each batch's images encoded when it is sampled
        return evaluate(model, tokenizer, p.rows, p.ids, specs, settings, tool_use=tool_use, media=p.media,
                        reduce=global_sum, trainer_state=trainer_state)

    def _tool_images(self, model):
        """The renderer of tool results with images, built (and checked) at the first evaluation only."""
        if not hasattr(self, "_renderer"):
            self._renderer = tool_images_for(model, self.config.model.path)
        return self._renderer


class BestCheckpoint:
    """Where `output.keep_best`'s metric was highest: best.json = {metric, value, step, checkpoint,
    earlier: [records of other metrics]}.

    The checkpoint it names is never pruned by `output.keep_last`. A resume that changes or clears
    keep_best moves the record under "earlier" (training/run_folder.py), where its checkpoint stays kept;
    going back to that metric takes its record up again. A best.json naming a checkpoint that is gone
    (a crash between the save and this file) is forgotten: the next evaluation sets it."""

    def __init__(self, run_dir: Path, metric: str):
        self.path, self.metric = Path(run_dir) / BEST_FILE, metric
        self.step, self.value = None, -math.inf
        for saved in self._records():
            try:
                value = float(saved["value"])
                if saved.get("metric") == metric and math.isfinite(value) \
                        and (Path(run_dir) / str(saved["checkpoint"])).is_dir():
                    self.step, self.value = int(saved["step"]), value
                    break
            except (ValueError, KeyError, TypeError):
                continue  # damaged: the next evaluation writes a fresh one

    def _records(self) -> list[dict]:
        """best.json's records, the current one first; [] when there is none or it is damaged."""
        try:
            saved = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        if not isinstance(saved, dict):
            return []
        earlier = saved.get("earlier") if isinstance(saved.get("earlier"), list) else []
        return [r for r in ({k: v for k, v in saved.items() if k != "earlier"}, *earlier) if isinstance(r, dict)]

    def improves(self, metrics: dict) -> bool:
        value = metrics.get(self.metric)
        return value is not None and math.isfinite(value) and value > self.value

    def record(self, step: int, value: float, checkpoint: Path) -> None:
        self.step, self.value = step, value
        earlier = [r for r in self._records() if "checkpoint" in r and r.get("metric") != self.metric
                   and (self.path.parent / str(r["checkpoint"])).is_dir()]  # other metrics' bests stay kept
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"metric": self.metric, "value": value, "step": step, "checkpoint": checkpoint.name,
                                   **({"earlier": earlier} if earlier else {})}) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)

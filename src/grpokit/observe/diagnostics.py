"""Common GRPO mistakes, noticed from a run's own numbers.

A GRPO run can go quietly wrong in a few well-known ways; each one leaves a mark in
the metrics (docs/OBSERVABILITY.md lists them). This module
turns those marks into one plain message each — the figure that shows it and the
fix — printed at most once per run:

- `group_size` below 4: with two answers any score difference, even grader
  noise, becomes a full +1 / -1 advantage (static, from the config);
- `frac_reward_zero_std` high over a window: the prompts are too easy or too
  hard, so whole groups carry no signal (not when the reward rose to get there: groups
  that tie because the policy learned to solve them are the run succeeding);
- `clip_ratio/region_mean` high over a window: the updates keep hitting the
  trust region, usually a learning rate that is too large;
- `entropy` collapsing to a small fraction of its starting value while the reward does not
  rise (on a task with one right answer, entropy falls *because* the policy learns it:
  `grpokit demo --task tools` goes from 0.13 to 0.01 nats while its reward goes 0.28 -> 0.92);
- `completions/clipped_ratio` high over a window: most answers hit the length limit;
- a reward function whose `rewards/<fn>/std` stays near zero from the start:
  it never separates two answers, so it adds nothing to any advantage.

`Diagnostics` is pure bookkeeping over metric dicts (no torch, no model), so it
runs inside the trainer, over a finished run's `metrics.jsonl` (`grpokit
report`), and in tests on synthetic sequences. A "window" check looks at the mean
(median) of the last `window` steps, so one noisy step never fires it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Thresholds:
    """When each check fires. Defaults are deliberately conservative: a healthy run stays silent."""

    min_group_size: int = 4
    zero_std_frac: float = 0.5  # median frac_reward_zero_std over the window
    clip_region: float = 0.1  # median clip_ratio/region_mean over the window
    entropy_collapse: float = 0.2  # window median entropy below this share of the starting window's
    truncated_frac: float = 0.5  # median completions/clipped_ratio over the window
    reward_std_floor: float = 1e-6  # rewards/<fn>/std at or below this counts as "no spread"
    learned_rise: float = 0.1  # window median reward this far above the starting window's: the run is learning


def default_window(steps: int) -> int:
    """A window that fits the run: 3 steps for short runs, up to 10 for long ones."""
    return min(10, max(3, steps // 5))


class Diagnostics:
    """Feed it each step's metrics; it returns the messages that became true, each once per run."""

    def __init__(self, *, window: int = 10, max_new_tokens: int | None = None, dynamic_sampling: bool = False,
                 learning_rate: float | None = None, thresholds: Thresholds = Thresholds()):
        self.window = max(1, window)
        self.max_new_tokens = max_new_tokens
        self.dynamic_sampling = dynamic_sampling
        self.learning_rate = learning_rate
        self.t = thresholds
        self.fired: set[str] = set()
        self.recent: dict[str, deque] = {}
        self.entropy_start: list[float] = []
        self.reward_start: list[float] = []  # the first window's rewards: what "the reward rose" is measured from
        self.flat_rewards: dict[str, int] = {}  # reward name -> steps seen, all of them with ~zero std
        self.spread_rewards: set[str] = set()

    @classmethod
    def from_config(cls, config, thresholds: Thresholds = Thresholds()) -> "Diagnostics":
        return cls(window=default_window(config.train.steps), max_new_tokens=config.rollout.max_new_tokens,
                   dynamic_sampling=config.algorithm.dynamic_sampling, learning_rate=config.train.learning_rate,
                   thresholds=thresholds)

    # ---- static checks --------------------------------------------------------------

    def check_config(self, config) -> list[str]:
        """Problems visible before any step runs (the group size, questionable algorithm settings)."""
        return self._once(check_config(config, self.t))

    # ---- per-step checks ------------------------------------------------------------

    def update(self, step: int, metrics: dict) -> list[str]:
        """Record one step; return the messages that fire for the first time at this step."""
        for key in ("frac_reward_zero_std", "clip_ratio/region_mean", "entropy", "completions/clipped_ratio", "reward"):
            value = _number(metrics.get(key))
            if value is not None:
                self.recent.setdefault(key, deque(maxlen=self.window)).append(value)
        reward = _number(metrics.get("reward"))
        if reward is not None and len(self.reward_start) < self.window:
            self.reward_start.append(reward)
        found: list[tuple[str, str]] = []
        found += self._zero_std(step)
        found += self._clipping(step)
        found += self._entropy(step, _number(metrics.get("entropy")))
        found += self._length_limit(step)
        found += self._flat_rewards(step, metrics)
        return self._once(found)

    def _full(self, key: str) -> list[float] | None:
        values = self.recent.get(key)
        return list(values) if values is not None and len(values) == self.window else None

    def _reward_rose(self) -> bool:
        """Whether the reward over the last window is clearly above the first window's (by
        `learned_rise` of the larger of its magnitude and 1): the policy is learning."""
        now = self._full("reward")
        if now is None or len(self.reward_start) < self.window:
            return False
        start = _median(self.reward_start)
        return _median(now) - start >= self.t.learned_rise * max(1.0, abs(start))

    def _span(self, step: int) -> str:
        return f"steps {step - self.window + 1}-{step}" if self.window > 1 else f"step {step}"

    def _zero_std(self, step: int) -> list[tuple[str, str]]:
        values = self._full("frac_reward_zero_std")
        if values is None or _median(values) < self.t.zero_std_frac:
            return []
        rewards = self._full("reward")
        level = _median(rewards) if rewards else None
        if level is not None and level >= 0.5 and self._reward_rose():
            return []  # the groups tie because the policy now solves their prompts: success, not easy prompts
        why = ("too easy or too hard" if level is None else
               "mostly too easy (all answers right)" if level >= 0.5 else "mostly too hard (all answers wrong)")
        fix = ("dynamic sampling is on and keeps re-drawing, which costs rollouts: filter the prompt set by difficulty"
               if self.dynamic_sampling else
               "filter the prompt set by difficulty, or set algorithm.dynamic_sampling = true (DAPO) "
               "to drop zero-signal groups and draw more prompts")
        level_text = "" if level is None else f", mean reward {level:.2f}"
        return [("zero_std", f"frac_reward_zero_std = {_median(values):.2f} (median over {self._span(step)})"
                             f"{level_text}: in most groups every answer got the same score, so they give no gradient. "
                             f"The prompts are {why}. Fix: {fix}.")]

    def _clipping(self, step: int) -> list[tuple[str, str]]:
        values = self._full("clip_ratio/region_mean")
        if values is None or _median(values) < self.t.clip_region:
            return []
        lr = f" (now {self.learning_rate:g})" if self.learning_rate else ""
        return [("clip", f"clip_ratio/region_mean = {_median(values):.2f} (median over {self._span(step)}): "
                         f"{_median(values):.0%} of tokens sit outside the trust region, so each update keeps hitting "
                         f"the clip limit. This is usually a learning rate that is too large. "
                         f"Fix: lower train.learning_rate{lr}, e.g. by 2-10x, or take fewer passes "
                         f"(algorithm.num_iterations).")]

    def _entropy(self, step: int, value: float | None) -> list[tuple[str, str]]:
        if value is not None and len(self.entropy_start) < self.window:
            self.entropy_start.append(value)
        values = self._full("entropy")
        if values is None or len(self.entropy_start) < self.window:
            return []
        start, now = _median(self.entropy_start), _median(values)
        if start <= 0 or now >= self.t.entropy_collapse * start or self._reward_rose():
            return []  # a policy that commits to the answers it learned: entropy falls as the reward rises
        return [("entropy", f"entropy collapsed from {start:.3f} (first {self.window} steps) to {now:.3f} "
                            f"({now / start:.0%} of it) over {self._span(step)}: the policy samples nearly the same "
                            f"answer every time, so groups stop differing and learning stalls. Fix: lower "
                            f"train.learning_rate, raise algorithm.epsilon_high (clip-higher, 0.28 in DAPO), "
                            f"or add a KL penalty (algorithm.beta > 0).")]

    def _length_limit(self, step: int) -> list[tuple[str, str]]:
        values = self._full("completions/clipped_ratio")
        if values is None or _median(values) < self.t.truncated_frac:
            return []
        limit = f" = {self.max_new_tokens}" if self.max_new_tokens else ""
        return [("length", f"completions/clipped_ratio = {_median(values):.2f} (median over {self._span(step)}): "
                           f"most answers stop at the length limit (rollout.max_new_tokens{limit}) instead of "
                           f"finishing, and are graded cut off. Fix: raise rollout.max_new_tokens, add a length "
                           f"penalty (the soft_overlong_penalty reward), or set "
                           f"algorithm.mask_truncated_completions = true.")]

    def _flat_rewards(self, step: int, metrics: dict) -> list[tuple[str, str]]:
        found = []
        for key, raw in metrics.items():
            if not (key.startswith("rewards/") and key.endswith("/std")):
                continue
            name = key[len("rewards/"):-len("/std")]
            std = _number(raw)
            if std is None or name in self.spread_rewards:
                continue
            if std > self.t.reward_std_floor:
                self.spread_rewards.add(name)
                self.flat_rewards.pop(name, None)
                continue
            self.flat_rewards[name] = seen = self.flat_rewards.get(name, 0) + 1
            if seen >= self.window:
                mean = _number(metrics.get(f"rewards/{name}/mean"))
                value = "" if mean is None else f" (every answer scored {mean:g})"
                found.append((f"flat:{name}",
                              f"reward {name!r} has std {std:.2g} across answers in every one of the {seen} steps so "
                              f"far{value}: it never separates two answers, so it adds nothing to any advantage. "
                              f"Fix: check that the function matches the completions as the model writes them "
                              f"(TRL convention: completions, plus dataset columns as keyword arguments); if the "
                              f"model cannot earn it yet, warm-start with grpokit sft or use easier prompts; "
                              f"otherwise drop it from rewards.functions."))
        return found

    def _once(self, found: list[tuple[str, str]]) -> list[str]:
        out = []
        for key, message in found:
            if key not in self.fired:
                self.fired.add(key)
                out.append(f"diagnostic: {message}")
        return out


def check_config(config, thresholds: Thresholds = Thresholds()) -> list[tuple[str, str]]:
    """(key, message) for the static problems of a config: the group size, and the algorithm settings
    that run but are probably not what was meant (`AlgorithmConfig.warnings`)."""
    found = list(config.algorithm.warnings)
    G = config.rollout.group_size
    if G >= thresholds.min_group_size:
        return found
    example = ("with 2 answers the advantages are always +1 and -1 whatever the gap: a score difference of 0.01, "
               "grader noise, becomes a full +1 / -1 signal" if G == 2 else
               f"with {G} answers a tiny score difference still becomes a full-size advantage (about +1.41 / -0.71)")
    return found + [("group_size", f"rollout.group_size = {G}: {example}. "
                                   f"Fix: use 4-16 answers per prompt (8 is common); lower train.prompts_per_step "
                                   f"to keep the batch size.")]


def replay(rows: list[dict], config=None, *, window: int | None = None) -> list[tuple[int, str]]:
    """Run the diagnostics over a finished run's metrics rows: [(step, message)], static ones at step 0."""
    if config is not None:
        diagnostics = Diagnostics.from_config(config)
        if window is not None:
            diagnostics.window = window
        found = [(0, m) for m in diagnostics.check_config(config)]
    else:
        diagnostics = Diagnostics(window=window or default_window(len(rows)))
        found = []
    for row in rows:
        step = int(row.get("step", 0))
        found += [(step, m) for m in diagnostics.update(step, row)]
    return found


def _number(value) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError):  # an int past float's range
        return None
    return value if math.isfinite(value) else None


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

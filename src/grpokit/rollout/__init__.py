"""Sampling G answers per prompt, and grading them.

- `decode`: the built-in sampler (one prefill per prompt, a KV-cached decode loop).
- `sampling`: one token per row from logits (top-k / top-p, exact samplers).
- `engines`: the engine interface, `RolloutEngine` (`HFEngine`, and `vllm.VLLMEngine` behind the same calls).
- `batch`: the `Rollout` record every engine returns.
- `grading`: a `Draw` is a rollout with its rewards (and DAPO's dynamic-sampling filter).
- `side`: the rollout side, `RolloutSide.draw(prompt indices) -> Draw`: what training, both evaluations and
  the asynchronous workers sample and grade with.
"""

from grpokit.rollout.batch import Rollout, left_pad
from grpokit.rollout.decode import sample_groups

__all__ = ["Rollout", "left_pad", "sample_groups"]

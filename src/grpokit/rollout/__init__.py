"""Sampling G answers per prompt, and grading them.

- `decode`: the built-in sampler (one prefill per prompt, a KV-cached decode loop).
- `sampling`: one token per row from logits (top-k / top-p, exact samplers).
- `request`: what an engine is asked for and gives back: `RolloutRequest` in, `RolloutResult` out.
- `engines`: the engine interface, `RolloutEngine` (`HFEngine`, and `vllm.VLLMEngine` behind the same calls);
  `weights`: how the trainer's weights reach an engine (`build_publisher`).
- `batch`: the `Rollout` record in every result.
- `grading`: a `Draw` is a rollout with its rewards (and DAPO's dynamic-sampling filter).
- `side`: the rollout side, `RolloutSide.draw(prompt indices) -> Draw`: what training, both evaluations and
  the asynchronous workers sample and grade with.
"""

from grpokit.rollout.batch import Rollout, left_pad
from grpokit.rollout.decode import DecodeSpeed, sample_groups
from grpokit.rollout.request import RolloutRequest, RolloutResult, SamplingParams

__all__ = ["DecodeSpeed", "Rollout", "RolloutRequest", "RolloutResult", "SamplingParams", "left_pad", "sample_groups"]

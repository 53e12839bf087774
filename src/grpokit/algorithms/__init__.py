"""The math of GRPO: pure torch, no transformers, no config.

- `advantages`: rewards [B, G] -> group-relative advantages (GRPO, RLOO, REINFORCE++ baselines).
- `objectives`: the clipped policy loss of every variant, KL, entropy options, TIS weights.
- `logprobs`, `fused_logprobs`: per-token log-probs of the sampled tokens in bounded memory.
"""

from grpokit.algorithms.advantages import group_advantages
from grpokit.algorithms.logprobs import token_logprobs, token_logprobs_from_hidden
from grpokit.algorithms.objectives import LossSpec, policy_loss

__all__ = ["LossSpec", "group_advantages", "policy_loss", "token_logprobs", "token_logprobs_from_hidden"]

"""The math of GRPO: pure torch, no transformers; of the config only the variants' torch-free facts.

- `advantages`: rewards [B, G] -> group-relative advantages (GRPO, RLOO, REINFORCE++ baselines).
- `objectives`: the clipped policy loss of every variant, KL, entropy options, TIS weights; the names it
  implements (loss types and their parts, ratio levels) are config/variants.py's.
- `logprobs`, `fused_logprobs`: per-token log-probs of the sampled tokens in bounded memory.
"""

from grpokit.algorithms.advantages import group_advantages
from grpokit.algorithms.logprobs import token_logprobs, token_logprobs_from_hidden
from grpokit.algorithms.objectives import Accumulation, LossSpec, policy_loss

__all__ = ["Accumulation", "LossSpec", "group_advantages", "policy_loss", "token_logprobs",
           "token_logprobs_from_hidden"]

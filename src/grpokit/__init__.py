"""grpokit: GRPO and its variants for Hugging Face causal language models.

    import grpokit
    A = grpokit.group_advantages(rewards, group_size=8)            # pure math
    loss, stats = grpokit.policy_loss(logp, old_logp, A, mask)     # pure math
    grpokit.train(grpokit.load_config("examples/addition.toml"))   # the whole loop
"""

from .advantages import group_advantages
from .objectives import policy_loss, token_logprobs, token_logprobs_from_hidden

__version__ = "0.1.0"

__all__ = ["group_advantages", "policy_loss", "token_logprobs", "token_logprobs_from_hidden", "train",
           "load_config", "Config"]


def __getattr__(name):  # the loop and config pull in transformers: import them only when asked
    if name == "train":
        from .trainer import train

        return train
    if name in ("load_config", "Config"):
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module 'grpokit' has no attribute {name!r}")

"""grpokit: GRPO and its variants for Hugging Face causal language models.

    import grpokit
    A = grpokit.group_advantages(rewards, group_size=8)            # pure math
    loss, stats = grpokit.policy_loss(logp, old_logp, A, mask)     # pure math
    grpokit.train(grpokit.load_config("examples/addition.toml"))   # the whole loop
"""

__version__ = "0.1.0"

__all__ = ["group_advantages", "policy_loss", "token_logprobs", "token_logprobs_from_hidden", "train",
           "load_config", "Config"]


def __getattr__(name):  # nothing imports torch until it is used: `grpokit train` checks its config first
    if name == "group_advantages":
        from .advantages import group_advantages

        return group_advantages
    if name in ("policy_loss", "token_logprobs", "token_logprobs_from_hidden"):
        from . import objectives

        return getattr(objectives, name)
    if name == "train":
        from .trainer import train

        return train
    if name in ("load_config", "Config"):
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module 'grpokit' has no attribute {name!r}")

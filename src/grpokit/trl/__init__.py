"""A TRL drop-in: `from grpokit.trl import GRPOConfig, GRPOTrainer` in place of `from trl import ...`.

The same constructor arguments as TRL 1.16's `GRPOConfig` and `GRPOTrainer`, run by grpokit's loop, and
the same trainer object: `trainer.model` is the loaded module that `train()` trains in place, and the
state, the returned metrics and `evaluate()` carry TRL's keys (trl/trainer.py). Each TRL argument grpokit
supports maps onto its `Config` with the same meaning (trl/mapping.py); the few already satisfied or with
nothing to act on are accepted with a note (trl/accepted.py); each other is refused with one ConfigError
listing them, never ignored (trl/config.py). What maps to what, what is refused, and where defaults
differ: docs/TRL.md.
"""

from grpokit.trl.config import GRPOConfig
from grpokit.trl.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]

"""A TRL drop-in: `from grpokit.trl import GRPOConfig, GRPOTrainer` in place of `from trl import ...`.

The same constructor arguments as TRL 1.16's `GRPOConfig` and `GRPOTrainer`, run by grpokit's loop.
Each TRL argument grpokit supports maps onto its `Config` with the same meaning (trl/mapping.py); each
it does not is refused with one ConfigError listing them, never ignored (trl/config.py). What maps to
what, what is refused, and where defaults differ: docs/TRL.md.
"""

from grpokit.trl.config import GRPOConfig
from grpokit.trl.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]

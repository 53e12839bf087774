"""A TRL drop-in: `from grpokit.trl import GRPOConfig, GRPOTrainer` in place of `from trl import ...`.

The same constructor arguments as TRL 1.16's `GRPOConfig` and `GRPOTrainer`, run by grpokit's loop, and
the same trainer object: `trainer.model` is the loaded module that `train()` trains in place, and the
state, the returned metrics and `evaluate()` carry TRL's keys (trl/trainer.py). Each TRL argument grpokit
supports maps onto its `Config` with the same meaning (trl/mapping.py); the few already satisfied or with
nothing to act on are accepted with a note (trl/accepted.py); each other is refused with one ConfigError
listing them, never ignored (trl/config.py). What maps to what, what is refused, and where defaults
differ: docs/TRL.md.

TRL's asynchronous trainer, `AsyncGRPOConfig` / `AsyncGRPOTrainer` (trl/async_config.py, trl/async_trainer.py),
runs on the same machinery with grpokit's asynchronous rollout; it is also importable by TRL's own path,
`grpokit.trl.experimental.async_grpo`.
"""

from grpokit.trl.async_config import AsyncGRPOConfig
from grpokit.trl.async_trainer import AsyncGRPOTrainer
from grpokit.trl.config import GRPOConfig
from grpokit.trl.trainer import GRPOTrainer

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "GRPOConfig", "GRPOTrainer"]

"""TRL's import path for the asynchronous trainer, so a script changes only `trl` to `grpokit.trl`:

    from grpokit.trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
"""

from grpokit.trl.async_config import AsyncGRPOConfig
from grpokit.trl.async_trainer import AsyncGRPOTrainer

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer"]

"""`AsyncGRPOTrainer`: TRL 1.16's asynchronous GRPO trainer (`trl.experimental.async_grpo`), its signature and
its object, on GRPOTrainer's machinery and grpokit's asynchronous rollout.

    from grpokit.trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer   # was: from trl.experimental...
    trainer = AsyncGRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=accuracy_reward,
                               args=AsyncGRPOConfig(output_dir="out", max_steps=100), train_dataset=dataset)
    trainer.train()

TRL's trainer samples on a vLLM server while it trains; grpokit's samples in `rollout.workers` processes with
its built-in sampler (`rollout.mode = "async"`, training/rollout_source.py), each step's batch sampled with
weights at most `max_staleness` versions old, as in TRL. The reward functions, tools and environment factory
travel to those processes by pickle, as in TRL (module-level functions; a lambda is one error at start-up).

Everything after the constructor is GRPOTrainer's: `train()`, `trainer.model` trained in place, `state`,
`save_model()`, `accelerator` (trl/trainer.py). `trainer.args` is the AsyncGRPOConfig given; the GRPOConfig it
runs as (trl/async_config.py `as_grpo`) is `trainer._grpo_args`. Refused: `model` other than a name or folder
(TRL's takes a string only), `rollout_worker` and `weight_transfer` (grpokit's workers and weight channel are its
own), and GRPOTrainer's refusals (`callbacks`, `optimizers`).
"""

from __future__ import annotations

from grpokit.errors import ConfigError
from grpokit.trl.async_config import AsyncGRPOConfig, async_config, async_notes, epoch_steps
from grpokit.trl.trainer import GRPOTrainer


class AsyncGRPOTrainer(GRPOTrainer):
    """TRL 1.16's AsyncGRPOTrainer, run by grpokit's asynchronous rollout (see the module docstring)."""

    def __init__(self, model, reward_funcs=None, args: AsyncGRPOConfig | None = None, train_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None, tools=None,
                 environment_factory=None, rollout_worker=None, weight_transfer=None):
        refused = [name for name, value in (("rollout_worker", rollout_worker), ("weight_transfer", weight_transfer))
                   if value is not None]
        if refused:
            raise ConfigError(f"AsyncGRPOTrainer: {' and '.join(refused)}: grpokit's rollout workers and their weight "
                              "transfer are its own processes (rollout.workers), not TRL's protocols; leave "
                              f"{'it' if len(refused) == 1 else 'them'} unset")
        if not isinstance(model, str):
            raise ConfigError(f"AsyncGRPOTrainer: model must be a local folder or a Hub id, as TRL's async trainer "
                              f"takes it (it loads the model itself), not a {type(model).__name__}; save it with "
                              f"save_pretrained(folder) and pass the folder, or use GRPOTrainer")
        if args is None:
            args = AsyncGRPOConfig(output_dir=f"{model.split('/')[-1]}-AsyncGRPO")  # TRL's default
        if not isinstance(args, AsyncGRPOConfig):
            raise TypeError(f"args must be a grpokit.trl.AsyncGRPOConfig (same arguments as TRL's), got "
                            f"{type(args).__module__}.{type(args).__name__}")
        self._async_args = args
        super().__init__(model, reward_funcs, args=args.as_grpo(max_steps=epoch_steps(args, train_dataset)),
                         train_dataset=train_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config, tools=tools,
                         environment_factory=environment_factory)
        self.args = args  # what the user passed, as TRL's trainer.args; _grpo_args is what runs
        if self.accelerator.is_main_process:
            for note in async_notes(args):
                print(note, flush=True)

    def _config_for(self, args, **given):
        return async_config(self._async_args, super()._config_for(args, **given))

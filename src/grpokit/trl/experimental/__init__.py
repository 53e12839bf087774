"""`trl.experimental`'s import paths under grpokit.trl: `from grpokit.trl.experimental.async_grpo import ...`."""

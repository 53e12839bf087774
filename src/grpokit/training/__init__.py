"""Training: the loop that ties the stages together, and the run it leaves on disk.

- `loop`: `train(config)`: setup, then rollout -> grade -> advantages -> score -> optimize -> publish -> log -> save.
- `setup`: every check before the model loads; the policy, its optimizer and the engine.
- `generate`: one step's graded answers and their group-relative advantages.
- `update`: old / reference log-probs and μ passes of the clipped objective (its `LossSpec`: `loss_spec`).
- `checkpoint`: the checkpoint layout (plain, FSDP, LoRA) and exact resume.
- `run_folder`: the output folder: lock, overwrite, resume checks, run history.
- `safekeeping`: when a step is saved, what a failure leaves behind, when the run stops.
- `stopping`: signals, Ctrl-C, full disks and diverging runs, each one line saying how to continue.
"""

from grpokit.training.loop import train

__all__ = ["train"]

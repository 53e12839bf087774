"""grpokit: GRPO and its variants for Hugging Face causal language models.

    import grpokit
    A = grpokit.group_advantages(rewards, group_size=8)            # pure math
    loss, stats = grpokit.policy_loss(logp, old_logp, A, mask)     # pure math
    grpokit.train(grpokit.load_config("examples/addition.toml"))   # the whole loop

The folders follow the data flow, every import pointing down:

    config/      what to run (torch-free)          errors.py   every user-facing error
    algorithms/  the math: advantages, policy loss, log-probs (pure torch)
    data/        prompts in          rewards/  grading functions     tasks/  built-in tasks
    models/      loading, the training forward, LoRA, processes, FSDP2
    rollout/     sampling G answers per prompt, grading them
    observe/     metrics, logs, diagnostics, the HTML report, explain
    training/    setup, the loop, the update, checkpoints, the run folder
    cli.py demo.py sft.py evaluate.py   the entry points
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

__all__ = ["group_advantages", "policy_loss", "token_logprobs", "token_logprobs_from_hidden", "train",
           "load_config", "Config"]

_PUBLIC = {"group_advantages": "grpokit.algorithms", "policy_loss": "grpokit.algorithms",
           "token_logprobs": "grpokit.algorithms", "token_logprobs_from_hidden": "grpokit.algorithms",
           "train": "grpokit.training.loop", "load_config": "grpokit.config", "Config": "grpokit.config"}


def __getattr__(name):  # nothing imports torch until it is used: `grpokit train` checks its config first
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'grpokit' has no attribute {name!r}")


# Modules of the flat layout before the subpackages, for code that imported them: each old name is
# the module that now holds most of it (`grpokit.config`, `grpokit.rewards`, `grpokit.data`,
# `grpokit.tasks` are still packages with the same names in them).
_MOVED = {
    "grpokit.advantages": "grpokit.algorithms.advantages",
    "grpokit.objectives": "grpokit.algorithms.objectives",
    "grpokit.fused_logprobs": "grpokit.algorithms.fused_logprobs",
    "grpokit.presets": "grpokit.config.presets",
    "grpokit.modeling": "grpokit.models.loading",
    "grpokit.lora": "grpokit.models.lora",
    "grpokit.tiny": "grpokit.models.tiny",
    "grpokit.distributed": "grpokit.models.parallel",
    "grpokit.engines": "grpokit.rollout.engines",
    "grpokit.grading": "grpokit.rollout.grading",
    "grpokit.tracking": "grpokit.observe.tracking",
    "grpokit.diagnostics": "grpokit.observe.diagnostics",
    "grpokit.report": "grpokit.observe.report",
    "grpokit.explain": "grpokit.observe.explain",
    "grpokit.checkpoint": "grpokit.training.checkpoint",
    "grpokit.run_folder": "grpokit.training.run_folder",
    "grpokit.run_setup": "grpokit.training.setup",
    "grpokit.trainer": "grpokit.training.loop",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import grpokit.trainer` gives the module now at `grpokit.training.loop` (the same object)."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in _MOVED else None

    def create_module(self, spec):
        return importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module):  # already executed under its new name
        pass


sys.meta_path.append(_MovedModules())

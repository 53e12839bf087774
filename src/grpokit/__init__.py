"""grpokit: GRPO and its variants for Hugging Face causal language models.

    import grpokit
    A = grpokit.group_advantages(rewards, group_size=8)            # pure math
    loss, stats = grpokit.policy_loss(logp, old_logp, A, mask)     # pure math (options: grpokit.LossSpec)
    grpokit.train(grpokit.load_config("examples/addition.toml"))   # the whole loop

The folders follow the data flow, every import pointing down:

    config/      what to run (torch-free)          errors.py   every user-facing error
                                                   processes.py  every child process: start, beat, stop
                                                   exit_guard.py  user code cannot end the trainer's process
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
import warnings

__version__ = "0.1.0"

__all__ = ["LossSpec", "Accumulation", "group_advantages", "policy_loss", "token_logprobs",
           "token_logprobs_from_hidden", "train", "load_config", "Config"]

_PUBLIC = {"LossSpec": "grpokit.algorithms", "Accumulation": "grpokit.algorithms",
           "group_advantages": "grpokit.algorithms",
           "policy_loss": "grpokit.algorithms",
           "token_logprobs": "grpokit.algorithms", "token_logprobs_from_hidden": "grpokit.algorithms",
           "train": "grpokit.training.loop", "load_config": "grpokit.config", "Config": "grpokit.config"}


def __getattr__(name):  # nothing imports torch until it is used: `grpokit train` checks its config first
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'grpokit' has no attribute {name!r}")


# Modules of the flat layout before the subpackages, for code that imported them: importing one gives a
# small module that finds each old name in its new home (first listed first) and warns once that it
# moved. Functions whose signature changed with the move (the loop's internals) are found but take
# their new arguments; a class that is gone says where its job went (`_GONE`). `grpokit.config`,
# `grpokit.rewards`, `grpokit.data`, `grpokit.tasks` and `grpokit.rollout` are still packages with their old
# names in them.
_MOVED = {
    "grpokit.advantages": ("grpokit.algorithms.advantages",),
    "grpokit.objectives": ("grpokit.algorithms.objectives", "grpokit.algorithms.logprobs"),
    "grpokit.fused_logprobs": ("grpokit.algorithms.fused_logprobs",),
    "grpokit.presets": ("grpokit.config.presets", "grpokit.errors"),
    "grpokit.modeling": ("grpokit.models.loading", "grpokit.models.forward", "grpokit.errors"),
    "grpokit.lora": ("grpokit.models.lora",),
    "grpokit.tiny": ("grpokit.models.tiny",),
    "grpokit.allocator": ("grpokit.models.allocator",),
    "grpokit.distributed": ("grpokit.models.parallel", "grpokit.models.fsdp", "grpokit.observe.metrics",
                            "grpokit.training.checkpoint"),
    # the vLLM modules before they became one package (rollout/vllm/)
    "grpokit.rollout.vllm_server": ("grpokit.rollout.vllm.server", "grpokit.rollout.vllm.weights"),
    "grpokit.rollout.vllm_weights": ("grpokit.rollout.vllm.weights", "grpokit.models.weight_sync"),
    "grpokit.engines": ("grpokit.rollout.engines", "grpokit.rollout.engine_protocol", "grpokit.rollout.vllm",
                        "grpokit.rollout.batch", "grpokit.algorithms.objectives", "grpokit.algorithms.mismatch"),
    "grpokit.grading": ("grpokit.rollout.grading", "grpokit.observe.tracking"),
    "grpokit.tracking": ("grpokit.observe.tracking", "grpokit.observe.metrics", "grpokit.errors"),
    "grpokit.diagnostics": ("grpokit.observe.diagnostics",),
    "grpokit.report": ("grpokit.observe.report", "grpokit.observe.charts", "grpokit.errors"),
    "grpokit.explain": ("grpokit.observe.explain", "grpokit.errors"),
    "grpokit.checkpoint": ("grpokit.training.checkpoint", "grpokit.errors"),
    "grpokit.run_folder": ("grpokit.training.run_folder", "grpokit.observe.tracking", "grpokit.errors"),
    "grpokit.run_setup": ("grpokit.training.setup", "grpokit.training.rollout_setup", "grpokit.rollout.side",
                          "grpokit.models.loading", "grpokit.evaluate", "grpokit.sft", "grpokit.errors"),
    "grpokit.trainer": ("grpokit.training.loop", "grpokit.training.setup", "grpokit.training.rollout_setup",
                        "grpokit.rollout.side", "grpokit.training.generate", "grpokit.training.update",
                        "grpokit.training.stopping", "grpokit.errors"),
}
_RENAMED = {"positions_from_mask": "position_ids_from_mask"}  # two copies of one function became one
_GONE = {"VLLMServerEngine": "the server is a backend of grpokit.rollout.vllm.VLLMEngine now: "
                             "VLLMEngine(grpokit.rollout.vllm.server.ServerLLM.connect(VLLMOptions(server=url)))"}


class _MovedModule(importlib.abc.Loader):
    """Builds the stand-in module of an old path: `__getattr__` looks each name up in the new modules."""

    def create_module(self, spec):
        return None  # a plain new module object

    def exec_module(self, module):
        homes = _MOVED[module.__name__]
        warnings.warn(f"{module.__name__} moved to {homes[0]}; import from there", DeprecationWarning, stacklevel=2)

        def __getattr__(name):
            for home in homes:
                found = importlib.import_module(home)
                if hasattr(found, _RENAMED.get(name, name)):
                    return getattr(found, _RENAMED.get(name, name))
            if name in _GONE:  # an ImportError: `from module import name` shows it as it is
                raise ImportError(f"{module.__name__}.{name} is gone: {_GONE[name]}")
            raise AttributeError(f"{name!r} is not in {module.__name__} any more (it moved: see {', '.join(homes)})")

        module.__getattr__ = __getattr__


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, _MovedModule()) if fullname in _MOVED else None


sys.meta_path.append(_MovedFinder())

"""TRL 1.16's `reward_funcs` and `reward_processing_classes`, as the reward callables grpokit's `train` takes.

An entry of `reward_funcs` is, as in TRL:

- a callable with TRL's signature: passed to grpokit as it is;
- a string: a reward model (a sequence-classification model with one label). A local folder, or a Hub
  id (its snapshot in the Hugging Face cache, downloaded when online: grpokit's own model cache code,
  `models/loading.py`), loaded by grpokit's `load_reward_model` (its folder checks; TRL's scoring) in
  the dtype of `model_init_kwargs` (TRL loads reward models with them too; unset: the checkpoint's);
- a `PreTrainedModel` object (sequence classification, one label): wrapped in grpokit's `RewardModel`.

A reward model is named as TRL names it (`config._name_or_path.split("/")[-1]`: a Hub id's last part,
not its cache folder's commit hash), scores on the training device, and reads its text with
`reward_processing_classes[i]` when given, else its own tokenizer (a folder's; an object's from
`AutoTokenizer.from_pretrained(config._name_or_path)`, as TRL loads it), with TRL's fix-up: EOS pads
when the tokenizer has no pad token, and the model's pad_token_id is the tokenizer's (it scores the last
token that is not padding). `reward_processing_classes` is one per entry or a single one (TRL's rule);
an entry given for a callable is ignored, as TRL ignores it.

The models are loaded here, when the trainer is built, as TRL loads them, and not by grpokit's `train`
from a folder name: a given processing class, the dtype of `model_init_kwargs` and TRL's name of a Hub
id all need the loaded object, and `trainer.evaluate()` reuses it.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

from grpokit.errors import ConfigError


def environment_reward_names(environment_factory) -> list[str]:
    """The reward sources an `environment_factory` owns, by name, in the order grpokit's loop adds them after
    `reward_funcs` (rollout/environments.py `reward_specs`): each environment class with a `get_reward` method,
    named after the class (TRL's `reward_func_names`), then an adapted library's rubric functions. A factory
    that is not a class is called once to learn its class, as TRL and grpokit's loop probe it."""
    if environment_factory is None:
        return []
    factories = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
    classes = list(dict.fromkeys(f if inspect.isclass(f) else type(f()) for f in factories))
    names = [cls.__name__ for cls in classes if callable(getattr(cls, "get_reward", None))]
    return names + [spec.name for cls in classes for spec in getattr(cls, "grpokit_reward_specs", ())]


def reward_list(reward_funcs, environment_rewards: list[str]) -> list:
    """`reward_funcs` as a list, each entry checked for its kind (a folder's config.json read, a Hub id
    spelled as one); nothing is loaded or downloaded yet. It may be empty when an environment owns a reward
    (`environment_rewards`, its names), as in TRL."""
    funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) \
        else [reward_funcs]
    if not funcs and not environment_rewards:
        raise ConfigError("GRPOTrainer: No reward source provided (TRL's words): reward_funcs is required (a callable, "
                          "a reward model's folder or Hub id, or a list of them), unless an environment_factory's "
                          "environment defines get_reward()")
    from grpokit.rewards.reward_model import is_model_object

    for f in funcs:
        if isinstance(f, str):
            _check_name(f)
        elif not is_model_object(f) and not callable(f):
            raise ConfigError(f"reward_funcs: an entry of type {type(f).__name__} is not a reward function; give "
                              "a callable f(prompts, completions, **kwargs) -> list[float], a reward model's folder "
                              "or Hub id, or a PreTrainedModel")
    return funcs


def processing_classes(classes, n: int) -> list:
    """`reward_processing_classes` as one entry per reward function (TRL's rule: a list, or a single one)."""
    if classes is None:
        return [None] * n
    if not isinstance(classes, list):
        classes = [classes]
    if len(classes) != n:
        raise ConfigError(f"reward_processing_classes: {len(classes)} given for {n} reward functions (the numbers must "
                          "match, TRL's rule); give one per entry of reward_funcs (None where it is a function)")
    return list(classes)


def reward_callables(funcs: list, classes: list, *, dtype: str | None, device: str) -> list:
    """Each entry as a callable: reward models loaded (strings) or wrapped (objects) on `device`."""
    from grpokit.rewards.reward_model import is_model_object, reward_model_from_object

    out = []
    for i, (f, tokenizer) in enumerate(zip(funcs, classes)):
        if isinstance(f, str):
            out.append(_from_name(f, tokenizer, dtype, device))
        elif is_model_object(f):  # grpokit's shared wrapping, in TRL's argument names
            out.append(reward_model_from_object(f, tokenizer, device=device, field="reward_funcs",
                                                tokenizer_field=f"reward_processing_classes[{i}]",
                                                tokenizer_fix="pass its tokenizer", error=ConfigError))
        else:
            out.append(f)  # TRL ignores a processing class given for a function
    return out


def training_device(model_device: str) -> str:
    """Where the policy trains: grpokit's `model.device`, and under torchrun this process's own GPU."""
    from grpokit.models.loading import resolve_device

    device = resolve_device(model_device)
    if device.type == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return str(device)


def _check_name(ref: str) -> None:
    """A local folder that can be a reward model (RewardLoadError otherwise), or a Hub id's spelling."""
    from grpokit.data.hub import hub_id
    from grpokit.rewards.reward_model import check_reward_model_folder

    if Path(ref).is_dir():
        check_reward_model_folder(ref)
    elif hub_id(ref) is None:
        raise ConfigError(f"reward_funcs: {ref!r} is neither a local folder (nothing at {Path(ref).resolve()}) nor a "
                          "Hugging Face Hub id; give a reward model's folder or Hub id, or a callable")


def _local_folder(ref: str) -> str:
    """The folder a reward model's name means: a local folder, or a Hub id's snapshot in the Hugging Face
    cache (downloaded when online)."""
    from grpokit.models.loading import model_folder

    return ref if Path(ref).is_dir() else str(model_folder(ref, field="reward_funcs"))


def _from_name(ref: str, tokenizer, dtype: str | None, device: str):
    from grpokit.rewards.reward_model import load_reward_model, reward_model_name, wrap_reward_model

    reward_model = load_reward_model(_local_folder(ref), device=device, dtype=dtype)
    name = reward_model_name(ref, reward_model.__name__)
    if tokenizer is not None:
        return wrap_reward_model(reward_model.model, tokenizer, name=name, device=device,
                                 where="reward_processing_classes", error=ConfigError)
    reward_model.__name__ = name
    return reward_model

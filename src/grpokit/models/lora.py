"""LoRA through peft: train the adapters only; the KL reference is the base model with them off.

    [model]
    lora = {r = 16, alpha = 32, target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]}

`r` [8], `alpha` [16], `target_modules` ["all-linear": every linear layer but the output head].
Needs the `peft` extra (`pip install 'grpokit[peft]'`), imported only when `model.lora` is set.

- `apply_lora` injects LoRA layers into the Hugging Face model in place (`peft.get_peft_model`) and
  freezes everything else. The trainer keeps using that model object: its `base_model` is still the
  decoder, so scoring (and the fused log-prob head) is unchanged; the optimizer sees gradients only
  on the adapters. The peft wrapper is kept with the model (`adapter_of`).
- `AdapterDisabled(model)` is the KL reference: every call runs the same module under
  `peft_model.disable_adapter()`, so β > 0 costs no second copy of the weights (no reference model
  is loaded).
- Checkpoints: `checkpoint-N/` holds the merged model (base + scale·B·A per adapted layer, a plain
  Hugging Face folder for `AutoModelForCausalLM.from_pretrained` or vLLM) and `checkpoint-N/adapter/`
  (`PeftModel.from_pretrained(base, "checkpoint-N/adapter")`). The merge is computed on the side: the
  training weights are never merged and unmerged, so resuming stays exact. `--resume` loads the adapter
  (the layout is written and read by `training/checkpoint.py`; `merged_state_dict` computes the merge).
- LoRA dropout is not offered: the trainer keeps the model in eval mode (dropout off) so that the
  policy ratio is exactly 1 before the first update.
"""

from __future__ import annotations

import torch

LORA_KEYS = ("r", "alpha", "target_modules")

_ATTR = "_grpokit_adapter"  # the PeftModel wrapping a model, kept in its __dict__ (not a submodule)


def import_peft():
    try:
        import peft
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("model.lora needs the peft package: pip install 'grpokit[peft]'") from e
    return peft


def apply_lora(model, options: dict):
    """Inject LoRA adapters into `model` (in place); returns the same model, adapters trainable only."""
    peft = import_peft()
    target = options.get("target_modules") or "all-linear"
    config = peft.LoraConfig(r=int(options.get("r", 8)), lora_alpha=float(options.get("alpha", 16)),
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                             target_modules=target if isinstance(target, str) else list(target))
    was_training = model.training
    wrapper = peft.get_peft_model(model, config)
    inner = wrapper.get_base_model()  # the very model passed in, now with LoRA layers
    inner.train(was_training)
    inner.__dict__[_ATTR] = wrapper  # not registered as a submodule: no cycle in modules() / state_dict()
    return inner


def adapter_of(model):
    """The peft wrapper of a model given LoRA adapters by `apply_lora`, else None."""
    return getattr(model, "__dict__", {}).get(_ATTR)


def trainable_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total


class _Disabled:
    """A module whose every call runs with the adapters switched off."""

    def __init__(self, module, wrapper):
        self._module, self._wrapper = module, wrapper

    def __call__(self, *args, **kwargs):
        with self._wrapper.disable_adapter():
            return self._module(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


class AdapterDisabled(_Disabled):
    """The policy with its adapters off: the KL reference, sharing every weight with the policy.

    Behaves like the model for scoring (`model(...)`, `model.base_model(...)`,
    `model.get_output_embeddings()`, `.device`, `.config`)."""

    def __init__(self, model):
        wrapper = adapter_of(model)
        if wrapper is None:
            raise ValueError("AdapterDisabled needs a model with LoRA adapters (grpokit.models.lora.apply_lora)")
        super().__init__(model, wrapper)

    @property
    def base_model(self):
        return _Disabled(self._module.base_model, self._wrapper)

    def get_output_embeddings(self):
        head = self._module.get_output_embeddings()
        adapted = any(name.startswith("lora_") for name, _ in head.named_children())
        return _Disabled(head, self._wrapper) if adapted else head  # a plain head keeps the fused path


def merged_state_dict(wrapper) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged in (W + scale·B·A), Hugging Face names."""
    from peft.tuners.lora import LoraLayer

    inner = wrapper.get_base_model()
    deltas = {}
    with torch.no_grad():
        for name, module in inner.named_modules():
            if isinstance(module, LoraLayer):
                for adapter in module.active_adapters:
                    delta = module.get_delta_weight(adapter)
                    deltas[name] = delta if name not in deltas else deltas[name] + delta
        out = {}
        for key, value in inner.state_dict().items():
            if ".lora_" in key:
                continue
            clean = key.replace(".base_layer.", ".")
            owner, leaf = clean.rsplit(".", 1)
            if leaf == "weight" and owner in deltas:
                value = value + deltas[owner].to(value.dtype)
            out[clean] = value.detach()
    return out

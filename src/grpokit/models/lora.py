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
- `LoraReference(model)`: the same view, for a reference that moves toward the policy
  (`algorithm.ref_sync_every`): the base plus a low-rank delta of its own, mixed exactly (`mix`).
- Checkpoints: `checkpoint-N/` holds the merged model (base + scale·B·A per adapted layer, a plain
  Hugging Face folder for `AutoModelForCausalLM.from_pretrained` or vLLM) and `checkpoint-N/adapter/`
  (`PeftModel.from_pretrained(base, "checkpoint-N/adapter")`). The merge is computed on the side: the
  training weights are never merged and unmerged, so resuming stays exact. `--resume` loads the adapter
  (the layout is written and read by `training/checkpoint.py`; `merged_state_dict` computes the merge).
- LoRA dropout is not offered: the trainer keeps the model in eval mode (dropout off) so that the
  policy ratio is exactly 1 before the first update.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from grpokit.errors import SetupError
from grpokit.models.vision import outside_language_model

LORA_KEYS = ("r", "alpha", "target_modules")

ADAPTER_ATTR = "_grpokit_adapter"  # the PeftModel wrapping a model, kept in its __dict__ (not a submodule)


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
    exclude = outside_language_model(model)  # a vision-language model: adapters on its language model only
    config = peft.LoraConfig(r=int(options.get("r", 8)), lora_alpha=float(options.get("alpha", 16)),
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                             target_modules=target if isinstance(target, str) else list(target),
                             **({} if exclude is None else {"exclude_modules": exclude}))
    was_training = model.training
    wrapper = peft.get_peft_model(model, config)
    inner = wrapper.get_base_model()  # the very model passed in, now with LoRA layers
    inner.train(was_training)
    inner.__dict__[ADAPTER_ATTR] = wrapper  # not registered as a submodule: no cycle in modules() / state_dict()
    return inner


def adapter_of(model):
    """The peft wrapper of a model given LoRA adapters by `apply_lora`, else None."""
    return getattr(model, "__dict__", {}).get(ADAPTER_ATTR)


def check_given_model(model) -> None:
    """`train(model=...)` takes a transformers model, or one `apply_lora` adapted (the TRL drop-in's): a peft
    `PeftModel` as such has another forward (no `.model.last_hidden_state`) and its own adapter bookkeeping."""
    try:
        from peft import PeftModel
    except ImportError:  # without peft nobody can pass one
        return
    if isinstance(model, PeftModel):
        raise SetupError("train(model=...): a peft PeftModel is given; pass the model without adapters and set "
                         "model.lora (grpokit adds them), or give the PeftModel to grpokit.trl.GRPOTrainer(model=...), "
                         "which trains its own adapters")


def trainable_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total


class _Disabled:
    """A module whose every call runs with the adapters switched off (inside `context()`: by default
    the peft wrapper's `disable_adapter()`)."""

    def __init__(self, module, wrapper, context=None):
        self._module, self._wrapper = module, wrapper
        self._context = context or wrapper.disable_adapter

    def __call__(self, *args, **kwargs):
        with self._context():
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
        return _Disabled(self._module.base_model, self._wrapper, self._context)

    def get_output_embeddings(self):
        head = self._module.get_output_embeddings()
        adapted = any(name.startswith("lora_") for name, _ in head.named_children())
        return _Disabled(head, self._wrapper, self._context) if adapted else head  # a plain head keeps the fused path


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
    return _merged(inner, deltas)


def _merged(inner, deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`inner`'s base weights (no adapter tensors, Hugging Face names) plus `deltas` (module name ->
    a weight-shaped delta)."""
    with torch.no_grad():
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


def kept_blocks(alpha: float) -> int:
    """How many syncs' blocks a `LoraReference` keeps: block j (0 the newest) weighs α·(1 - α)^j, and
    the older ones, below 2^-24 of a new one (under float32's rounding), are dropped. α = 0.6: 19."""
    if alpha >= 1:
        return 1
    return max(1, math.ceil(math.log(2.0**-24) / math.log1p(-alpha)))


class LoraReference(AdapterDisabled):
    """The KL reference that moves toward the policy (`algorithm.ref_sync_every`, TR-DPO), with LoRA
    and without a copy of the model: the base weights plus a delta of its own on each adapted layer,
    added by forward hooks while the policy's adapters are off. Until the first `mix` it has no delta
    and is exactly `AdapterDisabled` (the base model).

    `mix(α)`: W + ΔW_ref <- α·(W + ΔW) + (1 - α)·(W + ΔW_ref), i.e. ΔW_ref <- α·ΔW + (1 - α)·ΔW_ref,
    exactly. The policy's ΔW = s·B·A (rank r, s = lora_alpha / r); ΔW_ref is kept as factors B_ref·A_ref
    with every weight folded into A_ref, so the mix is a concatenation: A_ref <- [α·s·A; (1 - α)·A_ref],
    B_ref <- [B, B_ref] (what peft's `add_weighted_adapter(combination_type="cat")` builds; mixing A and
    B separately would not give the weighted sum). The rank grows by r a sync, bounded two ways:
    - blocks older than `kept_blocks(α)` syncs (weight < 2^-24 of the newest) are dropped;
    - a layer whose factors would take as much room as its dense delta (k·(in + out) >= in·out) keeps
      ΔW_ref dense from then on (then ΔW_ref <- α·s·B·A + (1 - α)·ΔW_ref).
    Memory: r·(in + out) numbers per adapted layer per sync kept, never more than one dense delta.
    Only adapters on linear layers (peft's lora.Linear) are supported."""

    def __init__(self, model):
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer

        super().__init__(model)
        self._context = self._scoring
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
        for name, m in self.layers.items():
            if not isinstance(m, LoraLinear):
                raise SetupError(f"moving the reference (algorithm.ref_sync_every) supports LoRA on linear layers "
                                 f"only; {name} is a {type(m).__name__}: leave it out of model.lora.target_modules")
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (A_ref [k, in], B_ref [out, k])
        self.dense: dict[str, torch.Tensor] = {}  # name -> ΔW_ref [out, in]

    @contextmanager
    def _scoring(self):
        """The policy's adapters off, the reference's delta on (hooks only while scoring)."""
        hooks = [m.register_forward_hook(self._add_delta(name)) for name, m in self.layers.items()
                 if name in self.factors or name in self.dense]
        try:
            with self._wrapper.disable_adapter():
                yield
        finally:
            for h in hooks:
                h.remove()

    def _add_delta(self, name: str):
        def hook(module, args, out):
            if name in self.dense:
                d = self.dense[name]
                extra = F.linear(args[0].to(d.dtype), d)
            else:
                a, b = self.factors[name]
                extra = F.linear(F.linear(args[0].to(a.dtype), a), b)
            return out + extra.to(out.dtype)
        return hook

    @staticmethod
    def _policy_factors(layer) -> tuple[torch.Tensor, torch.Tensor]:
        """(s·A [r, in], B [out, r]) of the policy's active adapters: ΔW = B @ (s·A)."""
        names = [a for a in layer.active_adapters if a in layer.lora_A]
        a = torch.cat([layer.lora_A[n].weight * layer.scaling[n] for n in names])
        return a, torch.cat([layer.lora_B[n].weight for n in names], dim=1)

    @torch.no_grad()
    def mix(self, alpha: float) -> None:
        """ΔW_ref <- α·ΔW_policy + (1 - α)·ΔW_ref on every adapted layer (see the class)."""
        keep = kept_blocks(alpha)
        for name, layer in self.layers.items():
            a, b = self._policy_factors(layer)
            if name in self.dense:
                self.dense[name] = torch.addmm(self.dense[name], b, a, beta=1 - alpha, alpha=alpha)
                continue
            a, b = alpha * a, b.clone()
            if name in self.factors:
                a_ref, b_ref = self.factors[name]
                width = keep * a.shape[0]
                a = torch.cat([a, (1 - alpha) * a_ref])[:width]
                b = torch.cat([b, b_ref], dim=1)[:, :width].contiguous()
            (out_f, k), in_f = b.shape, a.shape[1]
            if k * (in_f + out_f) >= in_f * out_f:
                self.factors.pop(name, None)
                self.dense[name] = b @ a
            else:
                self.factors[name] = (a.contiguous(), b)

    def delta_state_dict(self) -> dict[str, torch.Tensor]:
        """The reference's delta, for a checkpoint: `<layer>.lora_A`/`.lora_B` (factors) or `<layer>.delta`."""
        out = {f"{name}.delta": d for name, d in self.dense.items()}
        for name, (a, b) in self.factors.items():
            out[f"{name}.lora_A"], out[f"{name}.lora_B"] = a, b
        return out

    def load_delta_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        factors, dense = {}, {}
        for key, value in state.items():
            name, leaf = key.rsplit(".", 1)
            if name not in self.layers or leaf not in ("lora_A", "lora_B", "delta"):
                raise ValueError(f"{key} is not a delta of this model's adapted layers (does model.lora match?)")
            value = value.to(next(self.layers[name].lora_A.parameters()).device)
            if leaf == "delta":
                dense[name] = value
            else:
                factors.setdefault(name, {})[leaf] = value
        self.factors = {name: (f["lora_A"], f["lora_B"]) for name, f in factors.items()}
        self.dense = dense

    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The reference's effective weights (W + ΔW_ref), Hugging Face names, as `merged_state_dict`."""
        deltas = {}
        for name, layer in self.layers.items():
            delta = self.dense.get(name)
            if name in self.factors:
                delta = self.factors[name][1] @ self.factors[name][0]
            if delta is not None:
                deltas[name] = delta.T if layer.fan_in_fan_out else delta
        return _merged(self._wrapper.get_base_model(), deltas)

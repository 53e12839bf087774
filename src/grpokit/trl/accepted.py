"""TRL arguments grpokit accepts although it has nothing they act on, or has them already, and the values
of them it still refuses.

- `use_liger_kernel=True`: Liger's fused linear GRPO loss exists to avoid materialising the [N, T, V]
  logits; for an output head that is a linear layer (most models) grpokit computes the log-probs from the
  hidden states in chunks of `train.logprob_chunk_size` rows and never builds them either, so it is
  already satisfied (a note says so; a head that is not linear, such as a soft-capped one, needs the
  logits, which the note says too). Liger's model kernels (RMSNorm, RoPE, SwiGLU) are not applied: the
  same math. TRL's refusals with it stand (trl/models.py): a peft adapter on `lm_head` (refused without it
  too, as TRL 1.16 does) and a prompt-learning peft config, each named.
- `dataloader_num_workers`, `_pin_memory`, `_persistent_workers`, `_prefetch_factor`: grpokit's loop reads
  no DataLoader (the prompts are tokenized once at start-up and held in memory): no effect on training, with a
  note; they apply to the loaders TRL's `get_train_dataloader()` / `get_eval_dataloader()` return
  (trl/loaders.py, which also forces `dataloader_num_workers = 0` for an iterable train set, as TRL).
- `accelerator_config`: grpokit does not run on Accelerate. The keys that only steer Accelerate's data
  loader (`dispatch_batches`, `even_batches`, `use_seedable_sampler`, `non_blocking`,
  `use_configured_state`) have nothing to act on; `split_batches=True` (the batch size would mean the
  global batch) and `gradient_accumulation_kwargs` would change the run, and are refused.
- `generation_kwargs`: grpokit's sampler is its own; stop strings (`stop_strings`, or vLLM's `stop`)
  become `rollout.stop_strings`, `do_sample=True` is what it does; any other key is refused (the sampling
  arguments are GRPOConfig's own: temperature, top_p, top_k, max_completion_length).
"""

from __future__ import annotations

import dataclasses

from grpokit.errors import ConfigError

GENERATION_KWARGS = ("stop_strings", "stop", "do_sample")  # what generation_kwargs may hold
# accelerator_config keys that change nothing in grpokit (it has no Accelerate data loader or wrapper)
ACCELERATOR_NO_OPS = ("dispatch_batches", "even_batches", "use_seedable_sampler", "non_blocking",
                      "use_configured_state")


def accelerator_options(value) -> dict:
    """accelerator_config as a dict (TrainingArguments takes a dict, a JSON file's path or an AcceleratorConfig)."""
    if value is None:
        return {}
    if isinstance(value, str):
        import json

        try:
            with open(value, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"accelerator_config={value!r}: not a readable JSON file ({e})") from None
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return dict(value)


def accepted_problems(c) -> list[str]:
    """The values of the accepted no-op fields that would change the run in TRL, which grpokit cannot honour."""
    problems = []
    kwargs = c.generation_kwargs or {}
    other = sorted(map(str, kwargs)) if not isinstance(kwargs, dict) else sorted(k for k in kwargs
                                                                                if k not in GENERATION_KWARGS)
    if not isinstance(kwargs, dict) or other or kwargs.get("do_sample", True) is not True:
        problems.append(f"generation_kwargs={c.generation_kwargs!r} (grpokit's sampler takes stop strings "
                        "('stop_strings', or vLLM's 'stop') and do_sample=True here; set temperature, top_p, top_k, "
                        "max_completion_length as GRPOConfig arguments; refused keys: "
                        f"{', '.join(other) or 'do_sample'})")
    options = accelerator_options(c.accelerator_config)
    changing = sorted(k for k, v in options.items() if k not in ACCELERATOR_NO_OPS and v not in (None, False, {}))
    if changing:
        problems.append(f"accelerator_config={c.accelerator_config!r} (grpokit does not run on Accelerate; "
                        f"{', '.join(changing)} would change the batches or the accumulation; the keys without effect "
                        f"here: {', '.join(ACCELERATOR_NO_OPS)})")
    if c.dataloader_num_workers < 0:
        problems.append(f"dataloader_num_workers={c.dataloader_num_workers} (must be >= 0)")
    return problems


def notes(c) -> list[str]:
    """What the trainer says once about accepted arguments that are already satisfied or have no effect."""
    out = []
    if c.use_liger_kernel:
        out.append("use_liger_kernel=True: already satisfied: for a model whose output head is a linear layer "
                   "grpokit computes the log-probs from the hidden states in chunks of rows and never builds the "
                   "[N, T, V] logits Liger's fused GRPO loss avoids (a non-linear head, e.g. soft-capped, needs "
                   "them); Liger's other kernels are not applied (the same math)")
    loader = [name for name, default in (("dataloader_num_workers", 0), ("dataloader_pin_memory", True),
                                         ("dataloader_persistent_workers", False), ("dataloader_prefetch_factor", None))
              if getattr(c, name) != default]
    if loader:
        out.append(f"{', '.join(loader)}: no effect on training: grpokit's loop reads no DataLoader (the prompts are "
                   "tokenized once at start-up and held in memory); they apply to the loaders "
                   "trainer.get_train_dataloader() and get_eval_dataloader() return")
    if accelerator_options(c.accelerator_config):
        out.append("accelerator_config: no effect: grpokit does not run on Accelerate (its data loader options do not "
                   "apply to grpokit's prompt stream)")
    return out

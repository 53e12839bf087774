"""Checkpoints: a Hugging Face model folder plus the trainer state, written atomically.

`RUN_DIR/checkpoint-<step>/` holds `config.json`, safetensors weights and the
tokenizer (loadable by `AutoModelForCausalLM.from_pretrained`) and
`trainer_state.pt` (optimizer, scheduler, RNG states, step, data position) and
`grpokit_config.toml` (the config that wrote it: a resume is checked against it).
Each checkpoint is written into a hidden temporary folder and renamed into
place, so a crash mid-save leaves the previous checkpoint untouched.

The whole layout lives here: a plain model is saved as it is; under FSDP the full weights
and optimizer state are gathered first (every rank takes part, rank 0 writes); with LoRA the
folder holds the merged model (loadable as a plain one) plus `adapter/`, and a resume loads
the adapter alone into the frozen base. Once the KL reference has moved toward the policy
(`algorithm.ref_sync_every`, training/reference.py), `reference/weights.safetensors` holds it: the
reference's parameters (Hugging Face names), or with LoRA its own delta (`LoraReference`).
"""

from __future__ import annotations

import json
import pickle
import random
import re
import shutil
import tomllib
import zipfile
from pathlib import Path

import numpy as np
import torch

from grpokit.errors import CheckpointError, ModelLoadError, SetupError
from grpokit.models.fsdp import full_state_dict, is_fsdp, load_optimizer_state, optimizer_state
from grpokit.models.loading import check_model_folder, no_progress_bars
from grpokit.models.lora import LoraReference, adapter_of, import_peft, merged_state_dict
from grpokit.models.parallel import gather_states, local_state
from grpokit.training.reference import resharded

_NAME = re.compile(r"^checkpoint-(\d+)$")


CHECKPOINT_CONFIG = "grpokit_config.toml"
PREFIX, TMP_PREFIX = "checkpoint-", ".tmp-checkpoint-"  # a finished checkpoint; one being written
ADAPTER_DIR = "adapter"  # with LoRA: the adapter alone, beside the merged model
REFERENCE_DIR, REFERENCE_FILE = "reference", "weights.safetensors"  # a moved KL reference (algorithm.ref_sync_every)
BEST_FILE = "best.json"  # output.keep_best's record (training/evaluation.BestCheckpoint)


def earlier_bests(run_dir: Path) -> set[str]:
    """The checkpoints best.json keeps under "earlier": the bests of metrics that earlier segments kept
    (a resume changed or cleared `output.keep_best`). They are never pruned: only the user deletes them."""
    try:
        earlier = json.loads((Path(run_dir) / BEST_FILE).read_text(encoding="utf-8")).get("earlier", [])
        return {str(r["checkpoint"]) for r in earlier if isinstance(r, dict) and "checkpoint" in r}
    except (OSError, ValueError, AttributeError, TypeError):
        return set()


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `run_dir`, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def checkpoint_step(checkpoint: Path) -> int:
    return int(_NAME.match(checkpoint.name).group(1))


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, trainer_state: dict, keep_last: int,
                    config_text: str = "", resume_hint: str = "--resume", keep_step: int | None = None) -> Path:
    """Write `checkpoint-<step>` atomically, then drop all but the newest `keep_last` (and the one of
    `keep_step`: the best so far, `output.keep_best`; and the bests earlier segments kept: `earlier_bests`)."""
    final = run_dir / f"{PREFIX}{step}"
    tmp = run_dir / f"{TMP_PREFIX}{step}"
    for stale in run_dir.glob(f"{TMP_PREFIX}*"):  # left by a crash mid-save
        shutil.rmtree(stale, ignore_errors=True)
    trainer_state = dict(trainer_state)
    reference = trainer_state.pop("reference", None)  # its own file, not in the pickle
    try:
        with no_progress_bars():  # beside grpokit's own progress, on every save
            model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        torch.save(trainer_state, tmp / "trainer_state.pt")
        if reference is not None:
            from safetensors.torch import save_file

            (tmp / REFERENCE_DIR).mkdir()
            save_file(reference, str(tmp / REFERENCE_DIR / REFERENCE_FILE))
        (tmp / CHECKPOINT_CONFIG).write_text(config_text, encoding="utf-8")
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)  # the partial copy would only take more space
        reason = _write_failure(e, run_dir)
        if reason is None:  # not a failed write: a bug, keep its traceback
            raise
        kept = [c.name for c in list_checkpoints(run_dir)]
        raise CheckpointError(
            f"{run_dir}: could not write checkpoint-{step} ({reason}); "
            + (f"the earlier checkpoints are intact ({', '.join(kept)}); free space and continue with: {resume_hint}"
               if kept else "no earlier checkpoint exists; free space (or choose another output.dir) and start again")
        ) from e
    if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
        shutil.rmtree(final)
    tmp.rename(final)
    kept = earlier_bests(run_dir)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        if checkpoint_step(old) != keep_step and old.name not in kept:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _write_failure(error: Exception, run_dir: Path) -> str | None:
    """Why a save failed, if it failed to write: an OSError (disk full, quota, permissions), or the
    writers' own wrappers of one (torch.save's `[enforce fail at inline_container.cc]`, safetensors'
    `I/O error`), which hide the errno; then say how much room is left."""
    if isinstance(error, OSError):
        return error.strerror or str(error)
    text = str(error)
    if not any(s in text for s in ("inline_container", "I/O error", "file write failed", "No space left")):
        return None
    free = shutil.disk_usage(run_dir).free / 2**20
    return f"the write failed with {free:.0f} MiB free on that disk{'; it is full' if free < 64 else ''}"


def load_trainer_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / "trainer_state.pt", weights_only=False)


def checkpoint_damage(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot be resumed from (a missing or cut file: a crash or a full disk after the
    rename, a bad copy), or None. Cheap checks, no tensor read: the model folder's (config.json, the
    safetensors headers fit their files, tokenizer files), `trainer_state.pt` opens as the zip archive
    torch.save writes (a cut file has lost the directory at its end), and the recorded config parses."""
    try:
        check_model_folder(checkpoint, field="checkpoint")
    except ModelLoadError as e:  # "checkpoint '<path>': model.safetensors is truncated (...); <how to refetch>"
        what = str(e).removeprefix(f"checkpoint {str(checkpoint)!r}").removeprefix(":").strip()
        return re.split(r"[;:] (?:the download|re-download|repair the file|copy |add it|is it a)", what)[0]
    state = checkpoint / "trainer_state.pt"
    try:
        with zipfile.ZipFile(state) as archive:
            archive.namelist()
    except FileNotFoundError:
        return "trainer_state.pt is missing"
    except (OSError, zipfile.BadZipFile) as e:
        return f"trainer_state.pt is damaged ({e})"
    recorded = checkpoint / CHECKPOINT_CONFIG
    if recorded.exists():
        try:
            tomllib.loads(recorded.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            return f"{CHECKPOINT_CONFIG} is damaged ({e})"
    return None


class CheckpointWeights:
    """What `save_checkpoint` writes as the model: a Hugging Face folder (full weights gathered under
    FSDP; with LoRA the merged model plus `adapter/`). Build it on every rank (a collective under
    FSDP); only rank 0 calls `save_pretrained`."""

    def __init__(self, model):
        self.model, self.adapter = model, adapter_of(model)
        self.state_dict = full_state_dict(model) if self.adapter is None else None

    def save_pretrained(self, path: str) -> None:
        if self.adapter is not None:  # `path/` the merged model, `path/adapter/` the adapter alone
            self.adapter.save_pretrained(str(Path(path) / ADAPTER_DIR))
            self.adapter.get_base_model().save_pretrained(path, state_dict=merged_state_dict(self.adapter))
        elif self.state_dict is not None:
            self.model.save_pretrained(path, state_dict=self.state_dict)
        else:
            self.model.save_pretrained(path)


def load_checkpoint_weights(checkpoint: Path, model) -> None:
    """Restore a checkpoint's weights into `model` (plain, FSDP-sharded, or LoRA adapters only)."""
    from safetensors.torch import load_file

    if adapter_of(model) is not None:
        _load_adapter(adapter_of(model), checkpoint)
        return
    weights = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        weights.update(_intact(load_file(str(shard), device="cpu" if is_fsdp(model) else str(model.device)), shard))
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = model.state_dict().keys()
        weights = {k: v for k, v in weights.items() if k in full}
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    model.load_state_dict(weights, strict=False)  # tied weights may be stored once


class DamagedTensors(ValueError):
    """A weights file whose header is intact but whose tensor bytes are not (NaN, which no trained weight is)."""


def _intact(weights: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """`weights` as read from `path`, checked on the way (the tensors are read once, at resume, anyway): a NaN
    in any floating tensor means damaged bytes (a bad copy or disk), which sampling would only meet later as
    a traceback. The start-up check (`checkpoint_damage`) reads headers only, to stay cheap."""
    for name, tensor in weights.items():  # aminmax propagates NaN and is some 15x faster than isnan().any()
        if tensor.is_floating_point() and tensor.numel() and bool(torch.aminmax(tensor).min.isnan()):
            raise DamagedTensors(f"{path.name}: tensor {name!r} holds NaN values, so its bytes are damaged")
    return weights


def trainer_state(step: int, policy, sampling_generator: torch.Generator, stream) -> dict:
    """What a checkpoint holds beside the weights: optimizer (gathered under FSDP), schedule, every RNG,
    every process's sampling generator, the prompt stream's position (with `rollout.partial_rollouts` the
    prompts in flight too, as the stream's `replay`: a resumed run samples them again first, from scratch, with
    its weights; training/rollout_source.py StreamingRollouts). A collective under torchrun."""
    state = {"step": step, "optimizer": optimizer_state(policy.model, policy.optimizer),
             "scheduler": policy.scheduler.state_dict(), "rng": rng_state(),
             "sampler": gather_states(sampling_generator.get_state()), "stream": stream.state_dict(),
             "entropy": policy.entropy_state()}
    if policy.ref_moved:  # `save_checkpoint` writes it to reference/; before the first sync it is the initial model
        state["reference"] = _reference_weights(policy.ref_model)
    return state


def _reference_weights(ref) -> dict[str, torch.Tensor]:
    """The moved reference's tensors: LoRA, its delta; else its parameters (a tied weight once), gathered
    onto the CPU under FSDP (a collective). Rank 0 writes them (safetensors copies each to the CPU)."""
    if isinstance(ref, LoraReference):
        return {k: v.detach().contiguous() for k, v in ref.delta_state_dict().items()}
    full = full_state_dict(resharded(ref))
    return full if full is not None else {n: p.detach() for n, p in ref.named_parameters()}


def _load_reference(checkpoint: Path, policy) -> None:
    """A checkpoint's moved reference back into `policy.ref_model`; nothing when it has none (written
    before the first sync: the reference is the initial model, as built)."""
    folder = checkpoint / REFERENCE_DIR
    if not folder.is_dir():
        return
    ref = policy.ref_model
    if ref is None or (adapter_of(policy.model) is not None and not isinstance(ref, LoraReference)):
        raise SetupError(f"--resume: {folder} holds a moved KL reference, but this run has none that moves "
                         "(algorithm.beta, algorithm.ref_sync_every)")
    if isinstance(ref, LoraReference):
        from safetensors.torch import load_file

        try:
            ref.load_delta_state_dict(load_file(str(folder / REFERENCE_FILE)))
        except ValueError as e:
            raise SetupError(f"--resume: {folder}: {e}") from None
    else:
        load_checkpoint_weights(folder, ref)
    policy.ref_moved = True


def restore_checkpoint(checkpoint: Path, policy, sampling_generator: torch.Generator, stream) -> int:
    """Put a checkpoint back into the policy, optimizer, schedule, RNGs, sampling generator and stream; its step."""
    from safetensors import SafetensorError

    try:
        load_checkpoint_weights(checkpoint, policy.model)  # plain, FSDP-sharded, or the LoRA adapter alone
        state = load_trainer_state(checkpoint)
    except (OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError, SafetensorError) as e:
        if isinstance(e, SetupError):
            raise
        # damage the start-up check cannot see without reading every byte (garbage inside a file)
        why = " ".join(str(e).split())[:200]
        why = why if isinstance(e, DamagedTensors) else f"{type(e).__name__}: {why}"
        earlier = [c for c in list_checkpoints(checkpoint.parent) if checkpoint_step(c) < checkpoint_step(checkpoint)]
        fix = (f"move it out of {checkpoint.parent} and --resume again to continue from {earlier[-1].name}"
               if earlier else "it is the only checkpoint, so start again without --resume (output.overwrite = "
                               "true, or another output.dir)")
        raise CheckpointError(f"--resume: {checkpoint} cannot be read ({why}); it is damaged: {fix}") from None
    load_optimizer_state(policy.model, policy.optimizer, state["optimizer"])
    policy.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    policy.load_entropy_state(state.get("entropy"))
    _load_reference(checkpoint, policy)  # algorithm.ref_sync_every: the reference as it had moved
    sampling_generator.set_state(local_state(state["sampler"]))  # this process's generator (the key keeps its name)
    try:
        stream.load_state_dict(state["stream"])
    except ValueError as e:  # a different dataset or seed than the run being resumed
        raise SetupError(f"--resume from {checkpoint}: {e}") from e
    return int(state["step"])


def _load_adapter(wrapper, checkpoint: Path) -> None:
    """Load `checkpoint/adapter/` into the model's adapters (resume)."""
    from safetensors.torch import load_file

    peft = import_peft()
    folder = Path(checkpoint) / ADAPTER_DIR
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SetupError(f"--resume: {folder} holds no adapter weights; was this run trained without model.lora?")
    device = str(next(wrapper.parameters()).device)
    weights = {}
    for f in files:
        weights.update(_intact(load_file(str(f), device=device), f))
    result = peft.set_peft_model_state_dict(wrapper, weights)
    missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if missing:
        raise SetupError(f"--resume: the adapter in {folder} does not match model.lora (e.g. {missing[0]})")

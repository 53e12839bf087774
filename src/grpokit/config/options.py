"""Checks of the table-valued options, `rollout.vllm = {...}` and `model.lora = {...}`: each key's
type and range, with the field named in the error (their sections live in schema.py)."""

from __future__ import annotations

from grpokit.config.checks import _check, _checked, _installed, _one_of

# rollout.vllm options (rollout/vllm.VLLMEngine's keyword arguments): type, example
VLLM_OPTIONS = {"gpu_memory_utilization": (float, "0.3"), "enable_sleep_mode": (bool, "true"),
                "sync_bucket_mb": (float, "512"), "max_model_len": (int, "4096"), "enforce_eager": (bool, "true"),
                "dtype": (str, '"bfloat16"')}


def check_vllm(rollout) -> None:
    unknown = set(rollout.vllm) - set(VLLM_OPTIONS)
    _check(not unknown, "rollout.vllm",
           f"unknown option(s) {', '.join(sorted(map(str, unknown)))}; known: {', '.join(VLLM_OPTIONS)}")
    options = {k: _checked(f"rollout.vllm.{k}", VLLM_OPTIONS[k][0], v, VLLM_OPTIONS[k][1])
               for k, v in rollout.vllm.items()}
    object.__setattr__(rollout, "vllm", options)
    _check(0 < options.get("gpu_memory_utilization", 0.3) <= 1, "rollout.vllm.gpu_memory_utilization",
           "must be in (0, 1]: the share of the GPU's memory vLLM may take")
    _check(options.get("sync_bucket_mb", 512) > 0, "rollout.vllm.sync_bucket_mb", "must be > 0")
    _check(options.get("max_model_len", 1) >= 1, "rollout.vllm.max_model_len", "must be >= 1")
    _one_of(options.get("dtype", "auto"), ("auto", "float32", "bfloat16", "float16"), "rollout.vllm.dtype")


def check_lora(lora) -> None:
    _check(isinstance(lora, dict), "model.lora", "must be a table, e.g. {r = 8, alpha = 16}")
    unknown = set(lora) - {"r", "alpha", "target_modules"}
    _check(not unknown, "model.lora", f"unknown key(s) {', '.join(sorted(unknown))}; known: r, alpha, target_modules")
    _check(_checked("model.lora.r", int, lora.get("r", 8), "8") >= 1, "model.lora.r", "must be an integer >= 1")
    _check(_checked("model.lora.alpha", float, lora.get("alpha", 16), "16") > 0, "model.lora.alpha", "must be > 0")
    targets = lora.get("target_modules", "all-linear")
    if not isinstance(targets, str):
        _checked("model.lora.target_modules", tuple[str, ...], targets, '["q_proj", "v_proj"] or "all-linear"')
    _check(not lora or _installed("peft"), "model.lora", "needs the peft package: pip install 'grpokit[peft]'")

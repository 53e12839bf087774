"""TRL's own `tests/test_grpo_trainer.py`, run against grpokit's drop-in: how a TRL user's expectations fare.

Not part of the default suite: nothing here is collected unless GRPOKIT_TRL_UPSTREAM is set, and TRL's test files
are not in this repository (they are TRL's code): `bash tests/trl_upstream/fetch.sh` downloads them here first.

    GRPOKIT_TRL_UPSTREAM=dropin .venv/bin/python -m pytest -q tests/trl_upstream -k entropy   # the drop-in
    GRPOKIT_TRL_UPSTREAM=trl    .venv/bin/python -m pytest -q tests/trl_upstream -k entropy   # TRL itself

- `dropin`: `trl.GRPOTrainer` / `trl.GRPOConfig` are grpokit.trl's before TRL's test module imports them.
- Offline: the tests name Hub models (`trl-internal-testing/tiny-Qwen2ForCausalLM-2.5`, ...) and datasets
  (`trl-internal-testing/zen`). Nothing comes from a Hub here: the models in MODELS are built locally (random
  tiny models with grpokit.models.tiny's character tokenizer) into a Hugging Face cache of this session's own,
  under their Hub ids, so both TRL and grpokit resolve the ids as they would a downloaded snapshot; `load_dataset`
  gives the zen configs (standard / conversational prompt-only) built here. A test that names any other Hub model
  or dataset is skipped ("needs the Hub"), as are TRL's accelerator-only tests (their own markers).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

MODE = os.environ.get("GRPOKIT_TRL_UPSTREAM", "")
HERE = Path(__file__).parent
if MODE not in ("dropin", "trl") or not (HERE / "test_grpo_trainer.py").is_file():
    collect_ignore_glob = ["test_*.py", "testing_utils.py"]  # opt-in, and only once fetch.sh has run

# The session's own Hugging Face cache, set before huggingface_hub reads its environment
CACHE = Path(tempfile.mkdtemp(prefix="trl-upstream-hf-")) if MODE else None
if MODE and "huggingface_hub" not in sys.modules:
    os.environ.update(HF_HUB_CACHE=str(CACHE), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                      TRANSFORMERS_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1")

# Hub id -> (architecture, head): the tiny models built locally under these ids
MODELS = {
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": ("qwen2", "causal"),
    "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "classification"),
    "trl-internal-testing/tiny-Qwen3ForCausalLM": ("qwen3", "causal"),
    "trl-internal-testing/tiny-Qwen3ForSequenceClassification": ("qwen3", "classification"),
    "trl-internal-testing/tiny-LlamaForCausalLM-3.2": ("llama", "causal"),
    "trl-internal-testing/tiny-MistralForCausalLM-0.2": ("mistral", "causal"),
}
DATASETS = {"trl-internal-testing/zen": ("standard_prompt_only", "conversational_prompt_only")}
_HUB_NAME = re.compile(r"""["'](trl-internal-testing/[A-Za-z0-9._-]+)["']""")

# Prompts of our own, the shape of zen's: 17 training rows and 2 test rows
_PROMPTS = ["The sky is", "Water boils at", "A good test", "Small steps", "The quick fox", "Numbers add up",
            "Rivers flow to", "Code should be", "Errors never", "Simple is", "Clear names", "A list of",
            "Every loop", "The answer is", "One more time", "Plain text", "Short and"]
_TEST_PROMPTS = ["Trees grow", "Light travels"]


def _build_models(cache: Path) -> None:
    """Each MODELS entry as a snapshot of `cache`, in huggingface_hub's layout (refs/main -> snapshots/<hash>)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from grpokit.models.tiny import build_tiny_model

    for i, (repo, (arch, head)) in enumerate(MODELS.items()):
        root = cache / f"models--{repo.replace('/', '--')}"
        revision = f"{i + 1:040x}"
        snapshot = root / "snapshots" / revision
        model, tokenizer = build_tiny_model(snapshot, arch=arch, hidden_size=16, num_layers=2, num_heads=4,
                                            num_kv_heads=2, seed=i)
        if head == "classification":  # the same trunk with a one-label score head (TRL's tiny reward models)
            config = AutoConfig.from_pretrained(snapshot, num_labels=1)
            config.architectures = None
            torch.manual_seed(i)
            AutoModelForSequenceClassification.from_config(config).save_pretrained(snapshot)
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / "main").write_text(revision)


def _zen(path, name=None, split=None, streaming=False, **kwargs):
    """`datasets.load_dataset` for the zen configs the tests read, built here; any other is a skip."""
    from datasets import Dataset, DatasetDict

    if path not in DATASETS or name not in DATASETS[path]:
        pytest.skip(f"needs the Hub: dataset {path} {name}")
    conversational = name == "conversational_prompt_only"

    def rows(prompts):
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] if conversational else p
                                             for p in prompts]})

    splits = DatasetDict(train=rows(_PROMPTS), test=rows(_TEST_PROMPTS))
    if streaming:
        splits = splits.to_iterable_dataset() if hasattr(splits, "to_iterable_dataset") else \
            type(splits)({k: v.to_iterable_dataset() for k, v in splits.items()})
    return splits if split is None else splits[split]


if MODE in ("dropin", "trl") and (HERE / "test_grpo_trainer.py").is_file():
    _build_models(CACHE)
    import trl
    import trl.import_utils as trl_imports

    if not hasattr(trl_imports, "is_joblib_available"):  # a testing_utils.py newer than the wheel asks for it
        trl_imports.is_joblib_available = lambda: importlib.util.find_spec("joblib") is not None
    if MODE == "dropin":
        import grpokit.trl

        trl.GRPOTrainer, trl.GRPOConfig = grpokit.trl.GRPOTrainer, grpokit.trl.GRPOConfig


def pytest_collection_modifyitems(config, items):
    """Skip the tests that name a Hub model or dataset not built here (they need the Hub)."""
    for item in items:
        if not str(item.fspath).startswith(str(HERE)):
            continue
        try:
            source = inspect.getsource(item.function)
        except (OSError, TypeError):
            continue
        missing = sorted({n for n in _HUB_NAME.findall(source) if n not in MODELS and n not in DATASETS})
        if missing:
            item.add_marker(pytest.mark.skip(reason=f"needs the Hub: {', '.join(missing)}"))


@pytest.fixture(autouse=True)
def _local_datasets(request, monkeypatch):
    """TRL's test module reads its datasets through `load_dataset`: the zen configs built here instead."""
    module = getattr(request, "module", None)
    if module is not None and hasattr(module, "load_dataset"):
        monkeypatch.setattr(module, "load_dataset", _zen)


@pytest.fixture(autouse=True)
def _cpu_configs(monkeypatch):
    """As TRL's own tests/conftest.py does without an accelerator: `use_cpu=True` on TRL's configs (they default
    `bf16` to True, which transformers refuses on a CPU). grpokit's GRPOConfig needs nothing: its device is "auto"."""
    if MODE != "trl":
        return
    from trl.trainer.base_config import _BaseConfig

    original = _BaseConfig.__post_init__

    def on_cpu(self):
        self.use_cpu = True
        original(self)

    monkeypatch.setattr(_BaseConfig, "__post_init__", on_cpu)

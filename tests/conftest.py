"""Shared fixtures and helpers.

Fixtures: a tiny local model folder, built once per test session. Helpers (plain functions, imported
by the test files with `from conftest import ...`: pytest puts this folder on sys.path): a reward with
signal on a random model, a small training config, and metrics rows with the wall-clock values dropped.
"""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from grpokit.config.schema import Config

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: one thread per worker (and per process a test starts)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("GRPOKIT_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow; run with GRPOKIT_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init tiny Qwen2 + character tokenizer saved in Hugging Face format."""
    from grpokit.models.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(path, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seed=0)
    return path


@pytest.fixture(scope="session")
def tool_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a chat template that renders tools and tool messages (grpokit.models.tiny's)."""
    import json
    import shutil

    from grpokit.models.tiny import TOOL_CHAT_TEMPLATE

    path = tmp_path_factory.mktemp("tool-model")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


# ---- helpers ---------------------------------------------------------------------------------------


def parity(completions, **kwargs):
    """A reward with signal on a random model: the share of even-valued characters in the answer."""
    return [sum(ord(ch) % 2 == 0 for ch in c) / max(1, len(c)) for c in completions]


# `parity` as source text, for reward files and scripts that run in another process.
PARITY_SOURCE = inspect.getsource(parity)


def make_config(model_dir, out, *, steps: int = 2, num_prompts: int = 64, prompts_per_step: int = 4,
                max_new_tokens: int = 5, learning_rate: float = 1e-3, model: dict | None = None,
                rollout: dict | None = None, algorithm: dict | None = None, train: dict | None = None,
                output: dict | None = None, eval: dict | None = None) -> Config:
    """A small run's `Config` on the addition task: 4 answers a prompt, console off. Each section's dict
    is merged over that section's defaults here (e.g. `train={"steps": 1}` wins over `steps`)."""
    from grpokit.config import schema

    return schema.Config(
        model=schema.ModelConfig(**{"path": str(model_dir), **(model or {})}),
        data=schema.DataConfig(task="addition", num_prompts=num_prompts),
        rollout=schema.RolloutConfig(**{"group_size": 4, "max_new_tokens": max_new_tokens, **(rollout or {})}),
        algorithm=schema.AlgorithmConfig(**(algorithm or {})),
        train=schema.TrainConfig(**{"steps": steps, "prompts_per_step": prompts_per_step,
                                    "learning_rate": learning_rate, **(train or {})}),
        output=schema.OutputConfig(**{"dir": str(out), "console": False, **(output or {})}),
        eval=schema.EvalConfig(**(eval or {})),
    )


WALL_CLOCK = ("time/", "tokens_per_sec")  # metrics that differ between identical runs by nature


def comparable(rows: list[dict]) -> list[dict]:
    """Metrics rows without their wall-clock values: what two runs that should match can be compared on."""
    return [{k: v for k, v in row.items() if not k.startswith(WALL_CLOCK)} for row in rows]

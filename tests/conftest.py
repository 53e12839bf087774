"""Shared fixtures: a tiny local model folder, built once per test session."""

from __future__ import annotations

import os

import pytest
import torch

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

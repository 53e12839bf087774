"""Hugging Face Hub names: `model.path = "org/name"`, `data.path = "org/name"` with `data.name` / `data.split`.

Nothing is downloaded: each test builds a Hub cache in its tmp folder, laid out as huggingface_hub
writes it (`models--org--name/{refs/main, snapshots/<commit>/<files>, blobs/<hash>}`, the same for
`datasets--org--name`), points HF_HOME / HF_HUB_CACHE / HF_DATASETS_CACHE there with HF_HUB_OFFLINE=1,
and loads the model and the dataset by name through grpokit's own code path (a training step, the
loader of `grpokit eval` / `sft`). The libraries read those variables when imported, so the fixture
sets their module constants as well as the environment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import make_config, parity
from grpokit.config.schema import DataConfig
from grpokit.data.files import load_prompts
from grpokit.data.hub import hub_id
from grpokit.errors import ConfigError, DataError, ModelLoadError
from grpokit.models.loading import check_model_folder, load_model_and_tokenizer, model_folder

MODEL, DATASET = "tiny-org/tiny-qwen", "tiny-org/sums"

README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train.jsonl
  - split: test
    path: main/test.jsonl
- config_name: other
  data_files:
  - split: train
    path: other/train.jsonl
---
# sums
"""


def _rows(kind: str, n: int) -> list[dict]:
    return [{"question": f"{i}+{i + 1}=", "answer": str(2 * i + 1), "kind": kind} for i in range(n)]


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


DATA_FILES = {"README.md": README.encode(), "main/train.jsonl": _jsonl(_rows("main-train", 8)),
              "main/test.jsonl": _jsonl(_rows("main-test", 6)), "other/train.jsonl": _jsonl(_rows("other", 5))}


def put_in_hub_cache(cache: Path, repo: str, files: dict[str, bytes], *, kind: str = "models") -> Path:
    """`files` as huggingface_hub caches a repo: blobs named by their hash, the snapshot's files
    relative symlinks to them, refs/main the commit; returns the snapshot folder."""
    storage = cache / f"{kind}--{repo.replace('/', '--')}"
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    for name, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return snapshot


def folder_files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty, offline Hugging Face cache in tmp_path; returns its hub folder (HF_HUB_CACHE)."""
    import datasets
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    cache, data_cache = home / "hub", home / "datasets"
    cache.mkdir(parents=True)
    for name, value in {"HF_HOME": home, "HF_HUB_CACHE": cache, "HF_DATASETS_CACHE": data_cache,
                        "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for name, value in {"HF_CACHE_HOME": str(home), "HF_DATASETS_CACHE": data_cache,
                        "HF_MODULES_CACHE": home / "modules", "DOWNLOADED_DATASETS_PATH": data_cache / "downloads",
                        "EXTRACTED_DATASETS_PATH": data_cache / "downloads" / "extracted",
                        "HF_HUB_OFFLINE": True, "HF_DATASETS_OFFLINE": True}.items():
        monkeypatch.setattr(datasets.config, name, value)
    monkeypatch.chdir(tmp_path)  # relative names start here: no local folder called tiny-org/
    return cache


@pytest.fixture
def cached(hub, tiny_model_dir):
    """The tiny model and the sums dataset in the offline cache, as `hf download` leaves them."""
    put_in_hub_cache(hub, MODEL, folder_files(tiny_model_dir))
    put_in_hub_cache(hub, DATASET, DATA_FILES, kind="datasets")
    return hub


def test_a_run_trains_a_hub_model_on_a_hub_dataset_offline_and_resumes(cached, tmp_path):
    cfg = make_config(MODEL, tmp_path / "run", steps=1)
    cfg = dataclasses.replace(cfg, data=DataConfig(path=DATASET, name="main", split="test", prompt_column="question"))
    from grpokit.training.loop import train

    run = train(cfg, reward_functions=[parity])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    recorded = (run / "config.toml").read_text()
    for line in (f'path = "{MODEL}"', f'path = "{DATASET}"', 'name = "main"', 'split = "test"'):
        assert line in recorded  # the names as given, not made absolute as local paths are
    more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2))
    train(more, reward_functions=[parity], resume=True)  # the same names and fields: resume accepts them
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_prompts_come_from_the_config_and_split_asked_for(cached):
    from grpokit.training.setup import prepare_data

    cfg = make_config(MODEL, "run")
    data = prepare_data(dataclasses.replace(cfg, data=DataConfig(path=DATASET, name="main", split="test",
                                                                 prompt_column="question")))
    assert [r["prompt"] for r in data.rows] == [r["question"] for r in _rows("main-test", 6)]
    assert {r["kind"] for r in data.rows} == {"main-test"}  # the other columns reach the reward functions
    train_rows = load_prompts(DATASET, name="main", prompt_column="question")  # split defaults to train
    assert {r["kind"] for r in train_rows} == {"main-train"} and len(train_rows) == 8
    assert {r["kind"] for r in load_prompts(DATASET, name="other", prompt_column="question")} == {"other"}
    with pytest.raises(DataError, match=r"data\.path 'tiny-org/sums' \(data\.name 'main'\): .*validation.*"
                                        r"set data\.split"):
        load_prompts(DATASET, name="main", split="validation", prompt_column="question")
    with pytest.raises(DataError, match=r"data\.path 'tiny-org/sums'.*nope.*set data\.name"):
        load_prompts(DATASET, name="nope", prompt_column="question")


def test_eval_and_sft_load_a_model_by_hub_id(cached):
    model, tokenizer = load_model_and_tokenizer(MODEL, device="cpu", field="--model")
    snapshot = model_folder(MODEL)
    assert snapshot.parent.parent == cached / "models--tiny-org--tiny-qwen"
    assert check_model_folder(MODEL) == snapshot
    assert model.config.model_type == "qwen2" and tokenizer.decode(tokenizer("12+3=")["input_ids"]) == "12+3="


def test_a_local_folder_of_the_same_name_wins(cached, tiny_model_dir, tmp_path):
    local = tmp_path / MODEL
    shutil.copytree(tiny_model_dir, local)
    assert model_folder(MODEL) == Path(MODEL)  # the local folder, not the cache
    assert hub_id(MODEL) is None and hub_id(DATASET) == DATASET


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_a_model_missing_from_the_cache_is_one_line_saying_how_to_fetch_it(hub):
    with pytest.raises(ModelLoadError) as e:
        load_model_and_tokenizer("Qwen/Qwen2.5-0.5B-Instruct", field="--model")
    text = _one_line(e)
    for part in ("--model 'Qwen/Qwen2.5-0.5B-Instruct' is not a local folder", "not in the cache " + str(hub),
                 "HF_HUB_OFFLINE=1", "`hf download Qwen/Qwen2.5-0.5B-Instruct`", "unset HF_HUB_OFFLINE"):
        assert part in text, (part, text)
    from grpokit.training.loop import train

    with pytest.raises(ModelLoadError, match=r"^model\.path 'tiny-org/absent' is not a local folder .*hf download "
                                             r"tiny-org/absent`"):
        train(make_config("tiny-org/absent", "run"), reward_functions=[parity])


def test_a_dataset_missing_from_the_cache_is_one_line_saying_how_to_fetch_it(hub):
    with pytest.raises(DataError) as e:
        load_prompts("openai/gsm8k", name="main")
    text = _one_line(e)
    for part in ("data.path 'openai/gsm8k' is not a local file or folder", "Hub dataset it is not in the cache",
                 "`hf download openai/gsm8k --repo-type dataset`", "unset HF_HUB_OFFLINE"):
        assert part in text, (part, text)


def test_a_damaged_cached_model_names_the_file_and_how_to_fetch_it_again(hub, tiny_model_dir):
    files = {k: v for k, v in folder_files(tiny_model_dir).items() if not k.endswith(".safetensors")}
    put_in_hub_cache(hub, MODEL, files)
    with pytest.raises(ModelLoadError) as e:
        check_model_folder(MODEL)
    text = _one_line(e)
    assert "has no weights file" in text and f"`hf download {MODEL}` fetches it again" in text


def test_typos_of_local_paths_keep_clear_errors(hub, tmp_path):
    (tmp_path / "runs").mkdir()
    for path in ("./runs/tiny-sftt", "runs/a/tiny", str(tmp_path / "runs" / "tiny-sftt")):  # no repo id
        assert hub_id(path) is None
        with pytest.raises(ModelLoadError, match=r"model\.path .* is not a folder; give a local Hugging Face "
                                                 r"model folder .* or a Hugging Face Hub id"):
            check_model_folder(path)
    with pytest.raises(ModelLoadError) as e:  # reads as a repo id too: the line says both, and the likely typo
        check_model_folder("runs/tiny-sftt")
    assert "is not a local folder (nothing at " in _one_line(e) and "exists: a typo?" in str(e.value)
    with pytest.raises(DataError, match=r"prompts\.jsonl: file not found .*fix the path"):
        load_prompts("data/prompts.jsonl")


def test_data_name_and_split_are_checked_with_the_config():
    assert DataConfig(path=DATASET, name="main", split="test").name == "main"
    assert DataConfig(path="saved-folder", split="test").split == "test"  # a save_to_disk DatasetDict's split
    with pytest.raises(ConfigError, match=r"^data\.name: 'main' applies to data\.path .*not to data\.task"):
        DataConfig(task="addition", name="main")
    with pytest.raises(ConfigError, match=r"^data\.split: 'test': data\.path 'p\.jsonl' is a file"):
        DataConfig(path="p.jsonl", split="test")
    with pytest.raises(ConfigError, match=r"data\.name"):
        DataConfig(path=DATASET, name=3)
    with pytest.raises(DataError, match=r"data\.name 'main' picks a config of a Hugging Face Hub dataset"):
        load_prompts([{"prompt": "1+1="}], name="main")


def test_without_network_the_line_says_the_hub_could_not_be_reached(hub, monkeypatch):
    """HF_HUB_OFFLINE unset, the Hub unreachable (an endpoint nothing listens on): the same one line,
    with the network as the cause."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setattr(datasets.config, name, False)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ModelLoadError) as e:
        check_model_folder("tiny-org/absent", field="--model")
    assert "--model 'tiny-org/absent' is not a local folder" in _one_line(e)
    assert "the Hub could not be reached" in str(e.value) and "`hf download tiny-org/absent`" in str(e.value)
    with pytest.raises(DataError) as e:
        load_prompts("tiny-org/absent-data")
    assert "data.path 'tiny-org/absent-data' is not a local file or folder" in _one_line(e)
    assert "the Hub could not be reached" in str(e.value)

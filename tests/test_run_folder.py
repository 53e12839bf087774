"""run_folder: what a start does with what it finds in output.dir, checked without training (fast)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from grpokit.config.loading import to_toml
from grpokit.config.schema import Config, DataConfig, ModelConfig, OutputConfig
from grpokit.errors import RunFolderError
from grpokit.observe.tracking import append_jsonl, read_jsonl
from grpokit.training.checkpoint import CHECKPOINT_CONFIG
from grpokit.training.run_folder import RunFolderLock, prepare_run_folder, with_resolved_paths


def config(model: Path, run: Path, **output) -> Config:
    return Config(model=ModelConfig(path=str(model)), data=DataConfig(task="addition"),
                  output=OutputConfig(dir=str(run), console=False, **output))


def fake_run(run: Path, cfg: Config, steps=(1, 2)) -> None:
    """A run folder as a finished run leaves it (checkpoints with their recorded config, logs)."""
    for step in steps:
        ckpt = run / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        (ckpt / "config.json").write_text('{"model_type": "qwen2"}')
        save_file({"w": torch.zeros(4)}, str(ckpt / "model.safetensors"))
        (ckpt / "tokenizer.json").write_text("{}")
        torch.save({"step": step}, ckpt / "trainer_state.pt")
        (ckpt / CHECKPOINT_CONFIG).write_text(to_toml(with_resolved_paths(cfg)))
    (run / "config.toml").write_text(to_toml(cfg))
    append_jsonl(run / "metrics.jsonl", [{"step": s} for s in steps])


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    return folder


def test_overwrite_refuses_to_remove_the_model_it_would_train(tmp_path, model):
    run = tmp_path / "run"
    fake_run(run, config(model, run))
    inside = config(run / "checkpoint-2", run, overwrite=True)
    with pytest.raises(RunFolderError, match=r"model.path .*checkpoint-2.* output.overwrite = true would remove"):
        prepare_run_folder(inside, resume=False)
    assert (run / "checkpoint-2" / "model.safetensors").is_file() and (run / "checkpoint-1").is_dir()


def test_resume_compares_paths_by_what_they_name(tmp_path, model, monkeypatch):
    run = tmp_path / "run"
    fake_run(run, config(model, run))
    monkeypatch.chdir(tmp_path)
    for spelling in (str(model) + "/", "model", "./model/../model"):  # the same folder, spelled otherwise
        assert prepare_run_folder(config(Path(spelling), run, keep_last=3), resume=True).resume_step == 2
    other = tmp_path / "elsewhere"
    (other / "model").mkdir(parents=True)
    monkeypatch.chdir(other)  # the same relative words, another folder
    with pytest.raises(RunFolderError, match="model.path"):
        prepare_run_folder(config(Path("model"), run), resume=True)


def test_a_field_missing_from_an_older_checkpoint_counts_as_its_default(tmp_path, model):
    run = tmp_path / "run"
    cfg = config(model, run)
    fake_run(run, cfg)
    recorded = run / "checkpoint-2" / CHECKPOINT_CONFIG
    recorded.write_text("\n".join(line for line in recorded.read_text().splitlines()
                                  if not line.startswith(("tis_cap", "timeout_s"))))
    assert prepare_run_folder(cfg, resume=True).changes == {}


def _as_written_before_is_correction(recorded: Path, **algorithm) -> None:
    """Rewrite a checkpoint's config as a release before `algorithm.is_correction` wrote it."""
    lines = [line for line in recorded.read_text().splitlines()
             if not line.startswith(("is_correction", "is_cap_", "tis_cap", *algorithm))]
    at = lines.index("[algorithm]") + 1
    recorded.write_text("\n".join(lines[:at] + [f"{k} = {v!r}" for k, v in algorithm.items()] + lines[at:]))


def test_a_run_that_used_tis_cap_resumes_with_either_spelling(tmp_path, model):
    from grpokit.config.schema import AlgorithmConfig

    run = tmp_path / "run"
    fake_run(run, config(model, run))
    _as_written_before_is_correction(run / "checkpoint-2" / CHECKPOINT_CONFIG, tis_cap=2.0)
    for algorithm in (AlgorithmConfig(tis_cap=2.0), AlgorithmConfig(is_correction="token_truncate", is_cap_max=2.0)):
        cfg = Config(model=ModelConfig(path=str(model)), data=DataConfig(task="addition"), algorithm=algorithm,
                     output=OutputConfig(dir=str(run), console=False))
        assert prepare_run_folder(cfg, resume=True).changes == {}
    with pytest.raises(RunFolderError, match="algorithm.is_cap_max: 2.0 -> 3.0"):
        prepare_run_folder(Config(model=ModelConfig(path=str(model)), data=DataConfig(task="addition"),
                                  algorithm=AlgorithmConfig(is_correction="token_truncate"),
                                  output=OutputConfig(dir=str(run), console=False)), resume=True)


def test_an_older_cispo_run_resumes_only_with_the_same_cap(tmp_path, model):
    # before epsilon_high became the cap itself, cispo's epsilon_high = 4.0 meant a cap of 5.0
    from grpokit.config.schema import AlgorithmConfig

    run = tmp_path / "run"
    fake_run(run, config(model, run))
    _as_written_before_is_correction(run / "checkpoint-2" / CHECKPOINT_CONFIG, loss_type="cispo", epsilon_high=4.0)

    def resume(epsilon_high):
        cfg = Config(model=ModelConfig(path=str(model)), data=DataConfig(task="addition"),
                     algorithm=AlgorithmConfig(loss_type="cispo", epsilon_high=epsilon_high),
                     output=OutputConfig(dir=str(run), console=False))
        return prepare_run_folder(cfg, resume=True)

    assert resume(5.0).changes == {}  # the same cap, in today's spelling
    with pytest.raises(RunFolderError, match="algorithm.epsilon_high: 5.0 -> 4.0"):
        resume(4.0)  # the old number would silently cap at 4: refused, naming the cap the run had


@pytest.mark.parametrize("written", [0.5, 1.5])
def test_a_cispo_run_resumes_with_the_cap_in_either_spelling(tmp_path, model, written):
    # epsilon_high = 0.5 is read the old way (a cap of 1.5), and its start-up note says to write 1.5
    from grpokit.config.schema import AlgorithmConfig

    def cfg(epsilon_high):
        return Config(model=ModelConfig(path=str(model)), data=DataConfig(task="addition"),
                      algorithm=AlgorithmConfig(loss_type="cispo", epsilon_high=epsilon_high),
                      output=OutputConfig(dir=str(tmp_path / "run"), console=False))

    fake_run(tmp_path / "run", cfg(written))
    for same in (0.5, 1.5):
        assert prepare_run_folder(cfg(same), resume=True).changes == {}
    with pytest.raises(RunFolderError, match="algorithm.epsilon_high: 1.5 -> 2.0"):
        prepare_run_folder(cfg(2.0), resume=True)


def test_a_config_toml_that_no_run_wrote_is_not_taken_for_a_run(tmp_path, model):
    run = tmp_path / "here"
    run.mkdir()
    (run / "config.toml").write_text("# my own config\n")
    with pytest.raises(RunFolderError, match="holds a config.toml that no grpokit run wrote"):
        prepare_run_folder(config(model, run), resume=False)
    assert (run / "config.toml").read_text() == "# my own config\n"


def test_overwrite_removes_an_async_runs_timeline(tmp_path, model):
    """Issue 43 point 6: timeline.jsonl was kept (a sync run over an async folder reported the old timeline) or
    appended to (12 -> 24 rows)."""
    run = tmp_path / "run"
    fake_run(run, config(model, run))
    span = {"step": 1, "process": "trainer", "phase": "train", "start": 0.0, "end": 1.0}
    append_jsonl(run / "timeline.jsonl", [span])
    folder = prepare_run_folder(config(model, run, overwrite=True), resume=False)
    assert not (run / "timeline.jsonl").exists()
    assert "timeline.jsonl" in folder.notes[0], folder.notes


def test_overwrite_that_cannot_remove_a_file_is_one_error(tmp_path, model, monkeypatch):
    run = tmp_path / "run"
    fake_run(run, config(model, run))

    def denied(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("grpokit.training.run_folder.shutil.rmtree", denied)
    with pytest.raises(RunFolderError, match=r"could not remove .*checkpoint-1 \(Permission denied\)"):
        prepare_run_folder(config(model, run, overwrite=True), resume=False)


def test_an_append_after_a_cut_line_drops_the_cut_line_first(tmp_path):
    log = tmp_path / "config_history.jsonl"
    append_jsonl(log, [{"step": 1}])
    with open(log, "a") as f:
        f.write('{"step": 2, "cha')  # a kill inside a write
    append_jsonl(log, [{"step": 3}])
    assert read_jsonl(log) == [{"step": 1}, {"step": 3}]


def test_the_lock_falls_back_to_a_file_where_directories_cannot_be_locked(tmp_path, monkeypatch):
    """NFS emulates flock with POSIX locks, which refuse a read-only directory descriptor (EBADF)."""
    import fcntl

    def no_dir_flock(fd, op):
        raise OSError(9, "Bad file descriptor")

    monkeypatch.setattr(fcntl, "flock", no_dir_flock)
    first, second = RunFolderLock(tmp_path, "first"), RunFolderLock(tmp_path, "second")
    first.acquire()
    first.announce()
    assert first.on_file
    # POSIX locks belong to the process: a second lock from this same process would succeed, so ask a child
    pid = os.fork()
    if pid == 0:
        try:
            second.acquire()
            os._exit(1)
        except RunFolderError as e:
            os._exit(0 if "in use by another grpokit run" in str(e) and f"pid {os.getppid()}" in str(e) else 2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    first.release()


def test_a_device_this_machine_lacks_is_a_user_error():
    import torch

    from grpokit.errors import ModelLoadError
    from grpokit.models.loading import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ModelLoadError, match=r"model.device 'cuda:0': this machine has no such device"):
        resolve_device("cuda:0")
    with pytest.raises(ModelLoadError, match="is not a device name"):
        resolve_device("gpu")
    assert resolve_device("cpu").type == "cpu"


def test_resume_with_overwrite_set_continues_and_says_overwrite_is_ignored(tmp_path, model):
    run = tmp_path / "run"
    fake_run(run, config(model, run))
    folder = prepare_run_folder(config(model, run, overwrite=True), resume=True)
    assert folder.resume_step == 2
    assert folder.notes == ["--resume: output.overwrite = true is ignored; the run continues"]
    assert (run / "checkpoint-2").is_dir() and (run / "metrics.jsonl").is_file()


def _cut(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


@pytest.mark.parametrize("damage, why", [
    (lambda c: (c / "trainer_state.pt").unlink(), "trainer_state.pt is missing"),
    (lambda c: _cut(c / "trainer_state.pt", 100), "trainer_state.pt is damaged"),
    (lambda c: _cut(c / "model.safetensors", 60), "model.safetensors is"),
    (lambda c: (c / "model.safetensors").write_bytes(b"\xff" * 1000), "model.safetensors is damaged"),
    (lambda c: (c / "config.json").unlink(), "has no config.json"),
    (lambda c: (c / CHECKPOINT_CONFIG).write_text("[train\nsteps = "), f"{CHECKPOINT_CONFIG} is damaged"),
])
def test_resume_from_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, model, damage, why):
    run = tmp_path / "run"
    fake_run(run, config(model, run), steps=(1, 2, 3))
    damage(run / "checkpoint-3")
    kept = {p.name: p.read_bytes() for p in (run / "checkpoint-3").iterdir()}
    folder = prepare_run_folder(config(model, run), resume=True)
    assert folder.resume_step == 2
    (note,) = folder.notes
    assert why in note and "checkpoint-3" in note and "resuming from checkpoint-2" in note, note
    aside = run / "damaged-checkpoints" / "checkpoint-3"
    assert str(aside) in note
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == kept  # moved, nothing lost
    assert [p.name for p in sorted(run.glob("checkpoint-*"))] == ["checkpoint-1", "checkpoint-2"]


def test_resume_with_every_checkpoint_damaged_is_one_error_naming_the_file_and_moves_nothing(tmp_path, model):
    run = tmp_path / "run"
    fake_run(run, config(model, run), steps=(1, 2))
    for step in (1, 2):
        (run / f"checkpoint-{step}" / "trainer_state.pt").unlink()
    with pytest.raises(RunFolderError, match=r"checkpoint-2 is damaged \(trainer_state.pt is missing\) and no "
                                             r"earlier checkpoint is intact.*without --resume"):
        prepare_run_folder(config(model, run), resume=True)
    assert (run / "checkpoint-2").is_dir() and not (run / "damaged-checkpoints").exists()


def test_a_refused_resume_does_not_move_a_damaged_checkpoint(tmp_path, model):
    run = tmp_path / "run"
    fake_run(run, config(model, run), steps=(1, 2))
    (run / "checkpoint-2" / "trainer_state.pt").unlink()
    changed = Config(model=ModelConfig(path=str(model)), data=DataConfig(task="addition", seed=9),
                     output=OutputConfig(dir=str(run), console=False))
    with pytest.raises(RunFolderError, match="data.seed"):
        prepare_run_folder(changed, resume=True)
    assert (run / "checkpoint-2").is_dir() and not (run / "damaged-checkpoints").exists()


def test_resume_may_change_the_thread_count(tmp_path, model):
    """A speed knob, as the refusal's own message says: it used to be refused."""
    import dataclasses

    run = tmp_path / "run"
    cfg = config(model, run)
    fake_run(run, cfg)
    threads = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_threads=1))
    assert prepare_run_folder(threads, resume=True).changes == {"train.num_threads": [0, 1]}

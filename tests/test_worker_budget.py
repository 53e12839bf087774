"""Issue 43.8: `rollout.workers` and `rollout.worker_threads` bounded by the machine (training/worker_budget.py).
`workers = 16` on 2 cores started 16 processes of ~400 MB, 13 of which never sampled; `workers = 1000` was
accepted. Now workers the memory cannot hold are refused before anything loads or starts, and workers past
the cores are said in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from grpokit.cli import main
from grpokit.models.threads import usable_cores
from grpokit.training import rollout_source


def _async_toml(tmp_path: Path, model_dir: Path, **rollout) -> Path:
    extra = "".join(f"{k} = {v}\n" for k, v in rollout.items())
    path = tmp_path / "async.toml"
    path.write_text(f'[model]\npath = "{model_dir}"\n[data]\ntask = "addition"\nnum_prompts = 8\n'
                    f'[rollout]\nmode = "async"\ngroup_size = 2\nmax_new_tokens = 3\n{extra}'
                    f'[train]\nsteps = 1\nprompts_per_step = 2\n[output]\ndir = "{tmp_path / "run"}"\n'
                    'console = false\n')
    return path


def _children() -> list[int]:
    """Live (not zombie) child processes of this one."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split() if entry.name.isdigit() else None
        except OSError:
            continue
        if fields and int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def test_workers_the_memory_cannot_hold_are_refused_before_anything_starts(tiny_model_dir, tmp_path, monkeypatch,
                                                                          capsys):
    """4 workers of at least 300 MiB each on a machine with 1 GiB available: one error naming the field and a
    count that fits (3), exit 2, before the model loads or any worker starts."""
    children = set(_children())  # an earlier test in this process may have left one (multiprocessing's tracker)
    monkeypatch.setattr(rollout_source, "available_memory", lambda: 2**30, raising=False)
    loaded = []
    monkeypatch.setattr("grpokit.training.loop.build_run", lambda *a, **k: loaded.append(1) or 1 / 0)
    code = main(["train", str(_async_toml(tmp_path, tiny_model_dir, workers=4))])
    err = capsys.readouterr().err
    assert code == 2, err[-500:]
    errors = [line for line in err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: rollout.workers: 4 workers need at least 1.2 GiB"), err
    assert "1.0 GiB available" in errors[0] and "set rollout.workers = 3 or fewer" in errors[0], errors
    assert not loaded and set(_children()) <= children and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_workers_past_the_cores_are_said_in_one_line(tiny_model_dir, tmp_path):
    """1 worker of (cores + 1) torch threads: the run goes on, with one warning naming both fields. (Through
    the CLI in a process of its own: an async run in this one leaves multiprocessing's resource tracker as a
    child of the test process, which later tests that count children would see.)"""
    cores = len(usable_cores())
    toml = _async_toml(tmp_path, tiny_model_dir, workers=1, worker_threads=cores + 1)
    done = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(toml)], capture_output=True, text=True,
                          timeout=300)
    out = done.stdout
    assert done.returncode == 0, out[-500:] + done.stderr[-1500:]
    warnings = [line for line in out.splitlines() if line.startswith("warning: rollout.workers")]
    assert warnings == [f"warning: rollout.workers = 1 x {cores + 1} torch thread(s) each = {cores + 1} threads on "
                        f"{cores} usable cores: they take turns, so the extra ones add memory and start-up time, not "
                        f"speed; keep rollout.workers x rollout.worker_threads <= {cores}"], out[-800:]
    assert (tmp_path / "run" / "checkpoint-1").is_dir()


def test_the_weights_are_counted_once_beside_a_consolidated_copy(tiny_model_dir, tmp_path):
    """A folder with the shards transformers loads and a consolidated copy beside them (some repositories ship
    both) holds one model's parameters, not two (the review of issue 43.8)."""
    import shutil

    from grpokit.training.worker_budget import parameter_count

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    once = parameter_count(folder)
    shutil.copy(folder / "model.safetensors", folder / "consolidated.safetensors")
    assert once and parameter_count(folder) == once

"""Observability: TensorBoard and wandb sinks, the HTML run report (checked in headless Chromium), and the
diagnostics printed by a real training run."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import types
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from grpokit.cli import main
from grpokit.config.loading import to_toml
from grpokit.config.schema import (
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    OutputConfig,
    RolloutConfig,
    TrainConfig,
)
from grpokit.errors import ConfigError
from grpokit.observe.charts import svg_chart
from grpokit.observe.report import build_report
from grpokit.observe.tracking import MetricsWriter, read_metrics
from grpokit.training.loop import train

ARTIFACTS = Path(__file__).parent / "artifacts"
SEED_001 = [0.8, 0.3, 0.6, 0.3]  # seed 001's group: mean 0.5, std ≈ 0.212, A = +1.41 −0.94 +0.47 −0.94


def synthetic_run(path: Path, steps: int = 30) -> Path:
    """A run folder written by hand: config.toml, metrics.jsonl, completions.jsonl with seed 001's group."""
    path.mkdir(parents=True)
    config = Config(model=ModelConfig(path="models/tiny"), data=DataConfig(task="addition"),
                    rollout=RolloutConfig(group_size=4), train=TrainConfig(steps=steps, prompts_per_step=2))
    (path / "config.toml").write_text(to_toml(config))
    with open(path / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({
                "step": s, "reward": 0.2 + 0.02 * s, "reward_std": 0.3, "rewards/addition/mean": 0.2 + 0.02 * s,
                "rewards/addition/std": 0.4, "rewards/format/mean": 0.5, "rewards/format/std": 0.5,
                "frac_reward_zero_std": 0.2, "entropy": 1.5 - 0.01 * s, "clip_ratio/low_mean": 0.0,
                "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0, "completions/mean_length": 5.0,
                "completions/min_length": 2.0, "completions/max_length": 8.0, "completions/clipped_ratio": 0.9,
                "completions/mean_terminated_length": 4.0, "grad_norm": None if s == 3 else 0.5, "loss": 0.01,
                "learning_rate": 1e-6, "time/step": 1.0, "tokens_per_sec": 200.0 + s}) + "\n")
    with open(path / "completions.jsonl", "w") as f:
        for s in (10, 20, 30):
            for g, scores in enumerate([SEED_001, [1.0, 1.0, 1.0, 1.0]]):
                mean = sum(scores) / 4
                std = (sum((x - mean) ** 2 for x in scores) / 4) ** 0.5
                for i, r in enumerate(scores):
                    f.write(json.dumps({"step": s, "prompt": f"{g}+{s}=", "completion": f"answer <{i}>",
                                        "rewards": {"addition": r, "format": 1.0}, "reward": r,
                                        "advantage": (r - mean) / (std + 1e-4)}) + "\n")
    return path


def images(page: str) -> list[str]:
    return [base64.b64decode(m).decode() for m in re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', page)]


def test_report_is_self_contained_with_every_curve_and_seed_001_table(tmp_path):
    run = synthetic_run(tmp_path / "run")
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing loaded from outside the file
    svgs = images(page)
    assert len(svgs) == 12  # the 13 fixed charts but kl (beta = 0), and no metric left over
    for svg in svgs:
        root = ET.fromstring(svg)
        assert root.tag.endswith("svg") and root.findall(".//{http://www.w3.org/2000/svg}polyline")
    titles = [ET.fromstring(s).find("{http://www.w3.org/2000/svg}text").text for s in svgs]
    assert "Reward (total and per function)" in titles and "Clip ratios" in titles
    assert "rewards/format/mean" in svgs[0] and "rewards/addition/mean" in svgs[0]
    assert "algorithm.beta = 0" in page  # the KL chart explains why it is empty
    # seed 001's table: score, minus the mean, divided by the std = advantage
    for cell in ("0.8", "+0.30", "−0.20", "+0.10", "+1.41", "−0.94", "+0.47", "mean = 0.5", "std ≈ 0.212"):
        assert f">{cell}<" in page or cell in page, cell
    assert "all equal: no signal" in page  # the all-correct group
    assert "answer &lt;0&gt;" in page  # completions are escaped
    assert "completions/clipped_ratio = 0.90" in page  # diagnostics replayed into the page
    assert page.count("<h3>step ") == 3 and "2 of 2 groups (1 with no signal)" in page


def test_report_without_completions_says_how_to_get_them(tmp_path):
    run = synthetic_run(tmp_path / "run")
    (run / "completions.jsonl").unlink()
    out = build_report(run, tmp_path / "elsewhere" / "r.html")
    assert "output.completions_every" in out.read_text()


def test_report_on_a_folder_without_metrics_is_a_user_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_chart_handles_gaps_single_points_and_flat_series():
    svg = svg_chart("t", {"a": [(1, 1.0), (2, None), (3, 2.0), (4, 2.5)], "b": [(1, 5.0)], "c": [(1, 0.0), (2, 0.0)]})
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f".//{ns}polyline")) == 2 and len(root.findall(f".//{ns}circle")) == 2


def with_history(run: Path) -> Path:
    """Add config_history.jsonl: a start at step 0, then a resume from step 20 that changed two fields."""
    config = tomllib.loads((run / "config.toml").read_text())
    segments = [
        {"start_step": 0, "time": "2024-05-01 10:00:00", "command": "grpokit train run.toml", "changes": {},
         "config": config},
        {"start_step": 20, "time": "2024-05-02 09:30:00",
         "command": "grpokit train run.toml --resume --set 'output.keep_last=2' <b>x</b>",
         "changes": {"output.keep_last": [None, 2], "train.steps": [20, 30]}, "config": config},
    ]
    (run / "config_history.jsonl").write_text("".join(json.dumps(s) + "\n" for s in segments))
    return run


def test_report_lists_run_segments_and_what_each_resume_changed(tmp_path):
    run = with_history(synthetic_run(tmp_path / "run"))
    page = build_report(run).read_text()
    assert "<h2>Run segments</h2>" in page
    section = page.split("<h2>Run segments</h2>")[1].split("<h2>")[0]
    rows = re.findall(r"<tr>(.*?)</tr>", section)
    assert len(rows) == 3  # the header and one row per segment
    assert "from scratch" in rows[1] and "2024-05-01 10:00:00" in rows[1] and "grpokit train run.toml" in rows[1]
    assert "resumed from step 20" in rows[2] and "2024-05-02 09:30:00" in rows[2]
    assert "<code>train.steps</code>: 20 → 30" in rows[2]
    assert "<code>output.keep_last</code>: (unset) → 2" in rows[2]
    assert "&lt;b&gt;x&lt;/b&gt;" in rows[2] and "<b>x</b>" not in page  # the command is escaped
    assert "--set &#x27;output.keep_last=2&#x27;" in rows[2]
    svgs = images(page)  # the resume is marked on every chart, at step 20
    assert all(svg.count('class="resume"') == 1 and "resumed from step 20" in svg for svg in svgs)
    for svg in svgs:
        ET.fromstring(svg)  # still well-formed


def test_report_of_a_run_without_config_history_has_no_segments_section(tmp_path):
    run = synthetic_run(tmp_path / "run")  # an older run folder: no config_history.jsonl
    page = build_report(run).read_text()
    assert "Run segments" not in page and 'class="segments"' not in page
    assert not any('class="resume"' in svg for svg in images(page))
    assert len(images(page)) == 12


def test_report_skips_a_metrics_line_cut_mid_write(tmp_path, capsys):
    run = synthetic_run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 31, "reward": 0.')  # the process died mid-write: no newline
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "30 (last step 30)" in page  # 30 steps logged: the cut row is not one
    assert "error" not in capsys.readouterr().err


def test_report_on_a_damaged_metrics_line_is_one_error_naming_file_and_line(tmp_path, capsys):
    run = synthetic_run(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[4] = '{"step": 5, "reward": \n'  # a bad line in the middle, not a cut last line
    (run / "metrics.jsonl").write_text("".join(lines))
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert str(run / "metrics.jsonl") in err[0] and "line 5" in err[0]
    assert not (run / "report.html").exists()


def find_chromium() -> str | None:
    """Debian's chromium (/usr/bin/chromium, what scripts/ensure_chromium.sh installs) or another Chromium/Chrome."""
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
    return next((p for p in map(shutil.which, names) if p), None)


def chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    # --no-sandbox: Chromium refuses to run as root (CI) with its sandbox; --disable-dev-shm-usage: a
    # container's /dev/shm is often 64 MB, too small for the renderer
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}"]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=120)


def test_report_loads_in_headless_chromium_with_every_image(tmp_path):
    binary = find_chromium()
    if binary is None:
        why = "no chromium binary on PATH (apt-get install chromium) to render the report"
        if os.environ.get("GRPOKIT_REQUIRE_BROWSER") == "1":  # set by scripts/test.sh once chromium is there
            pytest.fail(why + "; GRPOKIT_REQUIRE_BROWSER=1")
        pytest.skip(why)
    run = synthetic_run(tmp_path / "run")
    page = build_report(run)
    n_images = page.read_text().count("<img ")
    probe = tmp_path / "probe.html"  # the report plus a script that marks how many images decoded
    probe.write_text(page.read_text().replace("</body>", """<script>
        const imgs = [...document.images];
        const loaded = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
        document.body.dataset.imagesLoaded = loaded + "/" + imgs.length;
        </script></body>"""))
    dom = chromium(binary, tmp_path / "profile", "--dump-dom", probe.as_uri())
    assert f'data-images-loaded="{n_images}/{n_images}"' in dom.stdout, dom.stderr[-2000:]
    shot = tmp_path / "report.png"
    r = chromium(binary, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,2000", page.as_uri())
    assert shot.is_file(), r.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1200
    assert len(png) > 30_000  # a blank page compresses to a few kB
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "report.png")


def test_a_real_run_writes_tensorboard_completions_and_prints_diagnostics(tiny_model_dir, tmp_path, capsys):
    """G = 3 and a random model: the group-size warning at the start, zero-std groups after a window;
    every metric in metrics.jsonl is also a TensorBoard scalar; the report shows the sampled groups."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = Config(
        model=ModelConfig(path=str(tiny_model_dir)), data=DataConfig(task="addition", num_prompts=32),
        rollout=RolloutConfig(group_size=3, max_new_tokens=4), algorithm=AlgorithmConfig(),
        # every answer is wrong, so every advantage is 0: keep those answers in the forward pass so
        # that entropy is measured (the zero-advantage fast path leaves it unmeasured: null)
        train=TrainConfig(steps=3, prompts_per_step=2, learning_rate=1e-3, skip_zero_advantage=False),
        output=OutputConfig(dir=str(tmp_path / "run"), console=False, tensorboard=True, completions_every=1))
    run = train(config)
    printed = capsys.readouterr().out
    assert printed.count("diagnostic: rollout.group_size = 3") == 1
    assert printed.count("diagnostic: frac_reward_zero_std") == 1  # random model: every answer wrong
    rows = read_metrics(run)
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    tags = set(events.Tags()["scalars"])
    for key in rows[0]:
        if key != "step" and rows[0][key] is not None:
            assert key in tags, key
    assert [e.step for e in events.Scalars("reward")] == [1, 2, 3]
    assert events.Scalars("entropy")[-1].value == pytest.approx(rows[-1]["entropy"], rel=1e-5)
    completions = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert len(completions) == 3 * 2 * 3
    assert {"prompt", "completion", "rewards", "reward", "advantage"} <= set(completions[0])
    assert main(["report", str(run), "--groups", "2"]) == 0
    page = (run / "report.html").read_text()
    assert page.count('<table class="seed">') == 3 * 2 and "rollout.group_size = 3" in page


def test_wandb_sink_logs_every_step_when_asked(tmp_path, monkeypatch):
    calls = []
    fake_run = types.SimpleNamespace(log=lambda data, step: calls.append(("log", step, data)),
                                     finish=lambda: calls.append(("finish",)))
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or fake_run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    (tmp_path / "config.toml").write_text('[train]\nsteps = 2\n')
    writer = MetricsWriter(tmp_path, wandb=True)
    writer.write(1, {"reward": 0.5, "kl": float("nan")})
    writer.close()
    assert calls[0][0] == "init" and calls[0][1]["config"] == {"train": {"steps": 2}}
    assert calls[1] == ("log", 1, {"reward": 0.5}) and calls[2] == ("finish",)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_without_the_package_is_a_config_error():
    with pytest.raises(ConfigError, match="output.wandb: needs the wandb package"):
        OutputConfig(wandb=True)


def _append(name: str, text: str):
    return lambda run: open(run / name, "a").write(text)


DAMAGED_RUN_FOLDERS = {  # what a crash, a bad copy or a hand edit leaves; each must give a report (or one error)
    "metrics rows that are not objects": (_append("metrics.jsonl", '[1, 2]\n5\n"x"\nnull\n'), "metrics.jsonl: 4 of"),
    "metrics rows without an integer step": (_append("metrics.jsonl", '{"step": "x"}\n{"reward": 2}\n'),
                                             "metrics.jsonl: 2 of"),
    "completions with a bad line in the middle": (
        lambda run: (run / "completions.jsonl").write_text('{"a\n' + (run / "completions.jsonl").read_text()),
        "completions.jsonl: line 1 is not valid JSON"),
    "completions rows that are not objects": (_append("completions.jsonl", "[1]\n3\n"), "completions.jsonl: 2 of"),
    "completions fields of the wrong type": (_append("completions.jsonl", json.dumps(
        {"step": 30, "reward": "a", "rewards": [1], "conversation": [1, {"role": 5, "name": [1]}], "prompt": None,
         "advantage": "z"}) + "\n"), None),
    "config.toml that is not TOML": (lambda run: (run / "config.toml").write_text("[train\nsteps="),
                                     "config.toml cannot be read"),
    "config.toml that is not UTF-8": (lambda run: (run / "config.toml").write_bytes(b"\xff\xfe\x00"),
                                      "config.toml cannot be read"),
    "config tables that are values": (lambda run: (run / "config.toml").write_text('model = 5\nalgorithm = "x"\n'),
                                      "model, algorithm are not a [table]"),
    "a group size that is not a positive integer": (
        lambda run: (run / "config.toml").write_text('[rollout]\ngroup_size = "four"\n'
                                                     '[algorithm]\nscale_rewards = [1]'),
        "rollout.group_size = 'four' is not a positive integer"),
    "config_history.jsonl with a bad line": (
        lambda run: (run / "config_history.jsonl").write_text('{"x\n{"start_step": 1}\n'),
        "config_history.jsonl: line 1 is not valid JSON"),
}


@pytest.mark.parametrize("case", DAMAGED_RUN_FOLDERS)
def test_report_on_a_damaged_run_folder_skips_the_damaged_part_and_says_so(tmp_path, capsys, case):
    damage, note = DAMAGED_RUN_FOLDERS[case]
    run = synthetic_run(tmp_path / "run")
    damage(run)
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr()
    assert "error" not in out.err and "Traceback" not in out.err
    page = (run / "report.html").read_text()
    assert "30 (last step 30)" in page  # the intact steps are all there
    if note:
        assert f"note: {run}" in out.out and note in out.out, out.out  # said on the console and on the page
        assert html_escape(note) in page


def html_escape(text: str) -> str:
    import html

    return html.escape(text)


def test_report_on_metrics_without_a_step_row_is_one_error(tmp_path, capsys):
    run = synthetic_run(tmp_path / "run")
    (run / "metrics.jsonl").write_text("[]\n")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "holds no step rows" in err[0], err


@pytest.mark.parametrize("where", ["missing-parent", "under-a-file"])
def test_report_out_where_it_cannot_be_written_is_one_error(tmp_path, capsys, where):
    run = synthetic_run(tmp_path / "run")
    out = Path("/proc/no-such-dir/report.html") if where == "missing-parent" else run / "metrics.jsonl" / "r.html"
    assert main(["report", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out") and "choose another place" in err[0], err

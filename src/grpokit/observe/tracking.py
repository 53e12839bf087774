"""Where a run's numbers go: `metrics.jsonl`, TensorBoard (optional), the console.

Metric names follow TRL where the meaning is the same.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from grpokit.errors import DamagedLogError


class MetricsWriter:
    """One JSON object per step in `metrics.jsonl`; TensorBoard scalars and wandb when asked for."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = False, append: bool = False, wandb: bool = False):
        self.path = run_dir / "metrics.jsonl"
        if not append:
            self.path.write_text("", encoding="utf-8")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` extra

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        self.wandb = _start_wandb(run_dir) if wandb else None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: finite_or_none(v) for k, v in metrics.items()}}
        append_jsonl(self.path, [row])
        if self.tb is not None:
            for key, value in metrics.items():
                if value is not None and math.isfinite(value):
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(run_dir: Path):
    """A wandb run named after the run folder, with the resolved config (imported only when asked for)."""
    import tomllib

    import wandb

    config_path = run_dir / "config.toml"
    config = tomllib.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    return wandb.init(project="grpokit", name=run_dir.name, dir=str(run_dir), config=config)


def finite_or_none(value):
    value = float(value)
    return value if math.isfinite(value) else None


def append_jsonl(path: Path, rows: list[dict]) -> None:
    """Append rows to a JSONL log in one write; if the write fails (disk full, quota) the file is cut
    back to where it was, so a log never ends in half a line, and the OSError goes on (the trainer
    turns it into one error line naming the newest checkpoint)."""
    data = "".join(json.dumps(row) + "\n" for row in rows).encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # a line cut by a crash (an older version): drop it
            tail = os.pread(fd, min(size, 1 << 20), max(0, size - (1 << 20)))
            size = max(0, size - len(tail)) + tail.rfind(b"\n") + 1
            os.ftruncate(fd, size)
        try:
            written = os.write(fd, data)
            if written != len(data):  # a short write: the disk filled up mid-way
                raise OSError(28, os.strerror(28))
        except OSError as e:
            os.ftruncate(fd, size)
            e.filename = e.filename or str(path)
            raise
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL log. A last line cut short (no newline: the process died mid-write under an
    older version, or the file was copied while written) is dropped: its step is the one being redone.
    Any other unreadable line is an error naming the file and the line."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):  # the last line, without its newline: cut off mid-write
                break
            raise DamagedLogError(f"{path}: line {number} is not valid JSON ({e.msg}); the file is damaged: "
                                "delete that line (or the file) and try again") from None
    return rows


def drop_rows_after(path: Path, step: int) -> None:
    """Keep only rows of steps <= `step` in a JSONL log (atomically): on resume, the steps a crash
    cut off after the last checkpoint are run again and must not appear twice."""
    if not path.is_file():
        return
    kept = [row for row in read_jsonl(path) if row["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in kept), encoding="utf-8")
    tmp.replace(path)


def read_metrics(run_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


class ConsoleProgress:
    """A live rich progress bar: step, reward, kl, entropy, tokens/s and ETA."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True):
        self.progress = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
        self.progress.start()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if self.progress is None:
            return
        info = (f"reward {metrics['reward']:.3f}  kl {metrics.get('kl', 0.0):.4f}  "
                f"entropy {metrics['entropy']:.3f}  {metrics['tokens_per_sec']:.0f} tok/s")
        self.progress.update(self.task, completed=step, info=info)

    def print(self, message: str) -> None:
        if self.progress is not None:
            self.progress.console.print(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def write_completions(run_dir: Path, step: int, draw, advantages: torch.Tensor, specs) -> None:
    """Append this step's answers to `completions.jsonl`: prompt, completion, each reward, advantage;
    multi-turn answers also as their messages ("conversation": assistant turns and tool results); answers to
    prompts with images also name them ("images": [{"sha256", "path" where the data gave a file}]), and each
    image's thumbnail is kept in `RUN_DIR/images/`."""
    d = draw
    rows = [{"step": step, "prompt": d.prompts[i], "completion": d.texts[i],
             "rewards": {s.name: finite_or_none(d.per_fn[i, j].item()) for j, s in enumerate(specs)},
             "reward": finite_or_none(d.total[i].item()), "advantage": advantages[i].item()}
            for i in range(d.size)]
    if d.conversations is not None:
        for row, conversation in zip(rows, d.conversations):
            row["conversation"] = conversation
    media = getattr(getattr(d, "rollout", None), "media", None)  # [N] vision-language rows' images
    if media is not None:
        for row, prompt_images in zip(rows, media.rows):
            refs = () if prompt_images is None else prompt_images.sources
            row["images"] = [ref.record() for ref in refs]
            save_thumbnails(run_dir, refs)
    append_jsonl(run_dir / "completions.jsonl", rows)


THUMBNAILS = "images"  # RUN_DIR/images/<sha256>.png: one small PNG per distinct image the logs name
THUMBNAIL_PIXELS = 96  # the longer side, at most


def save_thumbnails(run_dir: Path, refs) -> None:
    """A small PNG of each image (`data.images.ImageRef`) not saved yet, named by its hash: the report shows it
    beside the answers, and completions.jsonl stays text (an image the data repeats is written once)."""
    folder = run_dir / THUMBNAILS
    for ref in refs:
        path = folder / f"{ref.sha256}.png"
        if path.is_file():
            continue
        folder.mkdir(exist_ok=True)
        thumbnail = ref.image.copy()
        thumbnail.thumbnail((THUMBNAIL_PIXELS, THUMBNAIL_PIXELS))
        tmp = path.with_name(f".{path.name}.tmp")
        thumbnail.save(tmp, format="PNG")
        tmp.replace(path)


HISTORY = "config_history.jsonl"


def read_history(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / HISTORY
    return read_jsonl(path) if path.is_file() else []

"""What each process did when, in an asynchronous run: timeline.jsonl drawn as lanes of bars (SVG).

training/rollout_source.py appends one row per span: {"step", "process", "phase", "start", "end"} with
wall-clock times (time.time(), comparable across processes): the workers' "sample" (sampling and
grading one step's batch), the trainer's "wait" (for a batch), "train" (from taking a batch to
publishing its update) and "weight sync". Overlapping bars in two lanes are the overlap async buys.
"""

from __future__ import annotations

import html
import math

PHASE_COLORS = {"sample": "#2ca02c", "train": "#1f77b4", "wait": "#d62728", "weight sync": "#ff7f0e"}


def valid_spans(rows: list) -> list[dict]:
    """The rows that are spans (a hand-edited or cut-off file: the rest is left out)."""
    def ok(r) -> bool:
        return (isinstance(r, dict) and isinstance(r.get("process"), str) and isinstance(r.get("phase"), str)
                and all(isinstance(r.get(k), (int, float)) and math.isfinite(r[k]) for k in ("start", "end"))
                and r["end"] >= r["start"])
    return [r for r in rows if ok(r)]


def timeline_svg(rows: list[dict], *, last_steps: int = 8, width: int = 1040) -> str | None:
    """The spans of the last `last_steps` steps as one lane per process; None when there are none."""
    spans = valid_spans(rows)
    steps = sorted({r.get("step") for r in spans if isinstance(r.get("step"), int)})
    keep = set(steps[-last_steps:])
    spans = [r for r in spans if r.get("step") in keep]
    if not spans:
        return None
    lanes = sorted({r["process"] for r in spans}, key=lambda p: (p != "trainer", p))
    t0, t1 = min(r["start"] for r in spans), max(r["end"] for r in spans)
    left, right, top, lane_h = 80, 14, 40, 26
    height = top + lane_h * len(lanes) + 34
    sx = lambda t: left + (t - t0) / max(t1 - t0, 1e-9) * (width - left - right)  # noqa: E731
    e = html.escape
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="15" font-size="13" font-weight="bold">what each process did, steps '
           f'{min(keep)}-{max(keep)} ({t1 - t0:.2f} s)</text>']
    x = left
    for phase, color in PHASE_COLORS.items():
        out.append(f'<rect x="{x}" y="23" width="10" height="10" fill="{color}"/>'
                   f'<text x="{x + 14}" y="32">{e(phase)}</text>')
        x += 24 + 6.2 * len(phase)
    for i, lane in enumerate(lanes):
        y = top + i * lane_h
        out.append(f'<text x="{left - 6}" y="{y + 16}" text-anchor="end">{e(lane)}</text>')
        for r in (r for r in spans if r["process"] == lane):
            x0, x1 = sx(r["start"]), sx(r["end"])
            color = PHASE_COLORS.get(r["phase"], "#7f7f7f")
            out.append(f'<rect x="{x0:.1f}" y="{y + 4}" width="{max(x1 - x0, 0.8):.1f}" height="{lane_h - 8}" '
                       f'fill="{color}"><title>{e(lane)}: {e(r["phase"])}, step {r.get("step")}, '
                       f'{r["end"] - r["start"]:.3f} s</title></rect>')
    y = top + lane_h * len(lanes) + 14
    out.append(f'<text x="{left}" y="{y}">0 s</text><text x="{width - right}" y="{y}" text-anchor="end">'
               f'{t1 - t0:.2f} s</text></svg>')
    return "".join(out)

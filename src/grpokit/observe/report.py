"""`grpokit report RUN_DIR`: one self-contained HTML page that shows what a run did.

The page reads only the run folder — `metrics.jsonl`, `config.toml`, and when
present `config_history.jsonl` and (`output.completions_every = K`) `completions.jsonl`
— and has:

- the run's segments (one start, then one per `--resume`): the step each
  continued from, when, the command, and what the resume changed;
- the diagnostics (`grpokit.observe.diagnostics`) replayed over the whole run;
- curves: reward overall and per reward function, reward_std,
  frac_reward_zero_std, kl, entropy, clip ratios, lengths, the share of answers
  cut at the length limit, throughput and time per step, loss, grad norm,
  learning rate, and any other metric the run logged; a dashed vertical line
  marks the step each resume continued from;
- sampled groups laid out like the group-relative advantage worked example: each answer, its score, minus
  the group mean, divided by the std = the advantage the trainer used; with images, their thumbnails
  (`RUN_DIR/images/`, named by hash in `completions.jsonl`) beside the answers.

Curves are drawn as SVG by this module (no plotting dependency) and embedded as
base64 `data:` images, so the one HTML file is the whole report: it can be
mailed, attached to an issue or opened offline.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from grpokit.errors import ReportError
from grpokit.observe.charts import data_uri, finite_value, matching_keys, svg_chart
from grpokit.observe.diagnostics import replay
from grpokit.observe.run_logs import load_run, read_log
from grpokit.observe.timeline import timeline_svg
from grpokit.observe.tracking import THUMBNAILS

CHARTS = [  # (title, metric names; "*" matches one reward function name)
    ("Reward (total and per function)", ["reward", "rewards/*/mean"]),
    ("Reward std (within groups; per function over the batch)", ["reward_std", "rewards/*/std"]),
    ("Held-out evaluation ([eval])", ["eval/*"]),
    ("Share of groups with zero reward std", ["frac_reward_zero_std"]),
    ("KL to the reference model", ["kl"]),
    ("Entropy (nats per token)", ["entropy"]),
    ("Clip ratios", ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]),
    ("Sampler-trainer mismatch", ["sampling/logprob_gap_mean", "sampling/is_ratio_mean", "sampling/is_masked_share",
                                  "sampling/is_truncated_share", "off_policy/masked_share"]),
    ("Completion length (tokens)", ["completions/mean_length", "completions/min_length", "completions/max_length",
                                    "completions/mean_terminated_length"]),
    ("Share of answers cut at max_new_tokens", ["completions/clipped_ratio"]),
    ("Throughput (completion tokens per second)", ["tokens_per_sec"]),
    ("Time per step (s)", ["time/step", "time/rollout", "time/reward", "time/train"]),
    ("Loss", ["loss"]),
    ("Gradient norm (before clipping)", ["grad_norm"]),
    ("Learning rate", ["learning_rate"]),
]


WHY_MISSING = {"kl": "not logged: algorithm.beta = 0, so no reference model was loaded and no KL computed",
               "eval/*": "not logged: no evaluation during training (set eval.every > 0 in an [eval] section)"}

SPARSE = ("eval/",)  # logged on some steps only: their charts join the steps that have them


BLANK = '<td class="note"></td>'  # the last column holds notes (mean, std) beside the table


def resume_steps(history: list[dict]) -> list[int]:
    """The step each resume continued from (every segment but the first)."""
    return [h["start_step"] for h in history[1:]
            if isinstance(h.get("start_step"), (int, float)) and not isinstance(h.get("start_step"), bool)]


def chart_images(metrics: list[dict], markers: list[float] = ()) -> list[tuple[str, str | None, str]]:
    """(title, SVG or None, note) for every chart: the fixed list first, then any metric left over;
    `markers` (resume steps) are drawn on each."""
    keys = list(dict.fromkeys(k for row in metrics for k in row if k != "step"))
    steps = [row.get("step", i + 1) for i, row in enumerate(metrics)]
    used: set[str] = set()
    out = []

    def series_of(names):
        return {n: [(s, finite_value(row.get(n))) for s, row in zip(steps, metrics)
                    if not n.startswith(SPARSE) or n in row] for n in names}

    for title, patterns in CHARTS:
        names = [k for p in patterns for k in matching_keys(p, keys)]
        used.update(names)
        if names:
            out.append((title, svg_chart(title, series_of(names), markers=markers), ""))
        else:
            out.append((title, None, WHY_MISSING.get(patterns[0], "not logged by this run")))
    for name in keys:
        if name not in used and any(finite_value(row.get(name)) is not None for row in metrics):
            out.append((name, svg_chart(name, series_of([name]), markers=markers), ""))
    return out


def split_groups(rows: list[dict], group_size: int | None) -> dict[int, list[list[dict]]]:
    """completions.jsonl rows → {step: [group, ...]}; rows are written group by group."""
    by_step: dict[int, list[dict]] = {}
    for row in rows:
        by_step.setdefault(int(row.get("step", 0)), []).append(row)
    out = {}
    for step, step_rows in by_step.items():
        if group_size:
            out[step] = [step_rows[i:i + group_size] for i in range(0, len(step_rows), group_size)]
        else:  # no config: consecutive answers to the same prompt form a group
            groups: list[list[dict]] = []
            for row in step_rows:
                if groups and groups[-1][0].get("prompt") == row.get("prompt"):
                    groups[-1].append(row)
                else:
                    groups.append([row])
            out[step] = groups
    return out


def _prompt_text(prompt) -> str:
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict))
    return str(prompt)


def _signed(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:+.{digits}f}".replace("-", "−")


def group_table(group: list[dict], *, std_kind: str = "population", scale: str = "group",
                images_dir: Path | None = None) -> str:
    """One group as the group-relative advantage worked example lays it out: answers as columns;
    score, − mean, ÷ std = advantage as rows; the prompt's images (their thumbnails in `images_dir`) beside."""
    e = html.escape
    scores = [finite_value(r.get("reward")) for r in group]
    valid = [s for s in scores if s is not None]
    mean = sum(valid) / len(valid) if valid else None
    dof = 1 if std_kind == "sample" else 0
    std = (math.sqrt(sum((s - mean) ** 2 for s in valid) / (len(valid) - dof))
           if valid and len(valid) > dof else None)
    fn_names = list(dict.fromkeys(k for r in group for k in _rewards(r)))
    label = {"group": "÷ std = advantage", "batch": "÷ batch std = advantage",
             "none": "advantage (no ÷ std, Dr. GRPO)"}.get(scale, "advantage")
    head = "".join(f"<th>{i + 1}</th>" for i in range(len(group)))
    rows = [f"<tr><th>answer</th>{head}{BLANK}</tr>",
            "<tr><th>completion</th>" + "".join(
                f'<td class="text" title="{e(str(r.get("completion", "")))}">'
                f'{e(_clip(str(r.get("completion", ""))))}</td>'
                for r in group) + BLANK + "</tr>"]
    if len(fn_names) > 1:  # the score is their weighted sum; show each
        for name in fn_names:
            cells = "".join(f"<td>{_num(_rewards(r).get(name))}</td>" for r in group)
            rows.append(f'<tr class="fn"><th>{e(name)}</th>{cells}{BLANK}</tr>')
    rows.append("<tr><th>score</th>" + "".join(f"<td>{_num(s)}</td>" for s in scores) + BLANK + "</tr>")
    rows.append("<tr><th>− mean</th>" + "".join(
        f"<td>{_signed(None if s is None or mean is None else s - mean)}</td>" for s in scores)
        + f"<td class=\"note\">mean = {_num(mean)}</td></tr>")
    cells = []
    for r in group:
        a = finite_value(r.get("advantage"))
        cls = "" if a is None or abs(a) < 1e-9 else (' class="pos"' if a > 0 else ' class="neg"')
        cells.append(f"<td{cls}>{_signed(a)}</td>")
    note = f"std ≈ {_num(std)}" + (" (sample)" if dof else "") if scale != "none" else ""
    if std is not None and std == 0:
        note += " — all equal: no signal"
    rows.append(f"<tr><th>{label}</th>{''.join(cells)}<td class=\"note\">{note}</td></tr>")
    prompt = _prompt_text(group[0].get("prompt", ""))
    table = f'<table class="seed">{"".join(rows)}</table>'
    images = _thumbnails(group[0].get("images"), images_dir)
    if images:
        table = f'<div class="beside">{images}{table}</div>'
    return (f'<div class="group"><div class="prompt">prompt: <code>{e(_clip(prompt, 300))}</code></div>'
            f'{table}{_conversations(group)}</div>')


def _thumbnails(records, images_dir: Path | None) -> str:
    """The prompt's images as `<img>` thumbnails (base64, so the page stays one file), each titled with its hash
    and path; an image whose thumbnail is not in the run folder is its name in a box. Records that are not
    {"sha256": 16 hex digits} (a damaged row) are left out: a name never reaches a file path unchecked."""
    if not isinstance(records, list):
        return ""
    e, parts = html.escape, []
    for record in records:
        sha = record.get("sha256") if isinstance(record, dict) else None
        if not (isinstance(sha, str) and len(sha) == 16 and all(c in "0123456789abcdef" for c in sha)):
            continue
        path = record.get("path")
        title = e(f"sha256 {sha}" + (f", {path}" if isinstance(path, str) else ""))
        file = None if images_dir is None else images_dir / f"{sha}.png"
        if file is not None and file.is_file():
            uri = "data:image/png;base64," + base64.b64encode(file.read_bytes()).decode("ascii")
            parts.append(f'<img class="thumb" alt="image {sha}" title="{title}" src="{uri}">')
        else:
            parts.append(f'<div class="thumb missing-thumb" title="{title}">image {sha}<br>(no thumbnail)</div>')
    return f'<div class="thumbs">{"".join(parts)}</div>' if parts else ""


def _conversations(group: list[dict]) -> str:
    """Multi-turn answers turn by turn: the model's turns and the tool results (not the model's own
    tokens) set apart."""
    def turns_of(r: dict) -> list[dict]:  # a hand-edited or damaged row: what is not a turn is left out
        turns = r.get("conversation")
        return [m for m in turns if isinstance(m, dict)] if isinstance(turns, list) else []

    if not any(turns_of(r) for r in group):
        return ""
    e = lambda v: html.escape(str(v))  # noqa: E731
    answers = []
    for i, r in enumerate(group):
        turns = "".join(f'<div class="turn {"tool" if m.get("role") == "tool" else "assistant"}">'
                        f'{e(m.get("role", ""))}{" " + e(m["name"]) if m.get("name") else ""}: '
                        f'{e(_clip(str(m.get("content", "")), 300))}</div>' for m in turns_of(r))
        answers.append(f"<p>answer {i + 1}</p>{turns}")
    return f'<details class="conversations"><summary>conversations (tool results in orange)</summary>' \
           f'{"".join(answers)}</details>'


def _rewards(row: dict) -> dict:
    rewards = row.get("rewards")
    return rewards if isinstance(rewards, dict) else {}


def _num(v) -> str:
    v = finite_value(v)
    return "—" if v is None else f"{v:.3g}" if abs(v) < 1000 else f"{v:.4g}"


def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def pick_steps(steps: list[int], n: int) -> list[int]:
    """Up to n steps spread over the run, always the first and the last."""
    if len(steps) <= n:
        return steps
    return sorted({steps[round(i * (len(steps) - 1) / (n - 1))] for i in range(n)}) if n > 1 else [steps[-1]]


CSS = """
body { font-family: Helvetica, Arial, sans-serif; margin: 24px; color: #222; max-width: 1150px; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
.charts { display: flex; flex-wrap: wrap; gap: 10px; }
.charts figure { margin: 0; } .charts img { border: 1px solid #eee; }
.missing { width: 520px; min-height: 60px; align-self: flex-start; border: 1px dashed #ccc; color: #777;
           padding: 8px; font-size: 13px; box-sizing: border-box; }
table.kv td, table.kv th { padding: 2px 10px 2px 0; text-align: left; font-size: 13px; }
.diag { background: #fff6e0; border-left: 4px solid #e0a000; padding: 8px 12px; margin: 6px 0; font-size: 13px; }
.ok { background: #eef8ee; border-left: 4px solid #3a3; padding: 8px 12px; font-size: 13px; }
.group { margin: 10px 0 18px; overflow-x: auto; }
.prompt { font-size: 13px; margin-bottom: 4px; } code { white-space: pre-wrap; }
table.seed { border-collapse: collapse; font-size: 13px; }
table.seed th, table.seed td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
table.seed th:first-child { text-align: left; background: #f6f6f6; }
table.seed td.text { font-family: monospace; text-align: left; max-width: 220px; white-space: pre-wrap; }
table.seed td.pos { background: #e3f4e3; } table.seed td.neg { background: #fbe4e4; }
table.seed td.note { border: none; color: #666; text-align: left; }
table.seed tr.fn th, table.seed tr.fn td { color: #666; }
details.conversations { font-size: 13px; margin-top: 4px; } .turn { margin: 2px 0; padding: 2px 6px;
  font-family: monospace; white-space: pre-wrap; } .turn.assistant { border-left: 3px solid #1f77b4; }
.turn.tool { border-left: 3px solid #ff7f0e; background: #fff5e8; color: #664400; }
.beside { display: flex; gap: 10px; align-items: flex-start; }
.thumbs { display: flex; flex-direction: column; gap: 4px; }
img.thumb { width: 96px; image-rendering: pixelated; border: 1px solid #ccc; }
.missing-thumb { width: 96px; font-size: 11px; color: #777; border: 1px dashed #ccc; padding: 4px; }
table.segments { border-collapse: collapse; font-size: 13px; }
table.segments th, table.segments td { border: 1px solid #ddd; padding: 3px 8px; text-align: left;
                                       vertical-align: top; }
table.segments th { background: #f6f6f6; } table.segments td.cmd { font-family: monospace; max-width: 420px; }
"""


def build_report(run_dir: str | Path, out: str | Path | None = None, *, groups_per_step: int = 4,
                 max_steps: int = 3) -> Path:
    """Write the HTML report of `run_dir` (default `RUN_DIR/report.html`); returns its path."""
    run = load_run(run_dir)
    out = Path(out) if out is not None else run["dir"] / "report.html"
    if out.is_dir():
        raise ReportError(f"--out {str(out)!r} is a folder; give the HTML file to write, e.g. {out / 'report.html'}")
    e = html.escape
    metrics = run["metrics"]
    parts = [f"<h1>grpokit run report: {e(str(run['dir']))}</h1>", _summary(run)]
    parts += [f'<div class="diag"><b>left out</b>: {e(note)}</div>' for note in run["notes"]]
    if run["history"]:  # older run folders have no config_history.jsonl: no section
        parts += ["<h2>Run segments</h2>", _segments_section(run["history"])]

    found = replay(metrics, run["config"])
    parts.append("<h2>Diagnostics</h2>")
    if found:
        parts += [f'<div class="diag"><b>{"config" if s == 0 else f"step {s}"}</b>: '
                  f'{e(m.removeprefix("diagnostic: "))}</div>' for s, m in found]
    else:
        parts.append('<div class="ok">No diagnostic fired: none of the common GRPO mistakes shows in '
                     'these metrics.</div>')

    parts.append("<h2>Curves</h2>")
    markers = resume_steps(run["history"])
    if markers:
        parts.append("<p>Dashed vertical lines: the step each resume continued from.</p>")
    parts.append('<div class="charts">')
    for title, svg, note in chart_images(metrics, markers):
        if svg is None:
            parts.append(f'<div class="missing"><b>{e(title)}</b><br>{e(note)}</div>')
        else:
            parts.append(f'<figure><img alt="{e(title)}" src="{data_uri(svg)}"></figure>')
    parts.append("</div>")

    timeline = timeline_svg(read_log(run["dir"] / "timeline.jsonl", run["notes"]))  # asynchronous rollout only
    if timeline is not None:
        parts += ["<h2>Timeline</h2>", "<p>Asynchronous rollout: what the trainer and each rollout worker did "
                  "when (hover a bar for its step and length).</p>", f'<figure><img alt="timeline" '
                  f'src="{data_uri(timeline)}"></figure>']

    parts.append("<h2>Sampled groups</h2>")
    parts.append(_groups_section(run, groups_per_step, max_steps))
    page = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>grpokit report: '
            f'{e(run["dir"].name)}</title><style>{CSS}</style></head><body>{"".join(parts)}</body></html>')
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page, encoding="utf-8")
    except OSError as e:
        raise ReportError(f"--out {str(out)!r} cannot be written ({e.strerror or e}"
                          f"{f': {e.filename}' if e.filename and str(e.filename) != str(out) else ''}); choose "
                          "another place") from None
    for note in run["notes"]:
        print(f"note: {note}", flush=True)
    return out


def _summary(run: dict) -> str:
    raw, metrics = run["raw_config"], run["metrics"]
    get = lambda section, key: raw.get(section, {}).get(key, "?")  # noqa: E731
    first, last = metrics[0], metrics[-1]
    rows = [
        ("model", get("model", "path")),
        ("data", get("data", "task") or get("data", "path")),
        ("steps logged", f"{len(metrics)} (last step {last.get('step')})"),
        ("prompts × group size", f"B = {get('train', 'prompts_per_step')}, G = {get('rollout', 'group_size')}"),
        ("algorithm", f"loss_type = {get('algorithm', 'loss_type')}, β = {get('algorithm', 'beta')}, "
                      f"ε = {get('algorithm', 'epsilon')}, μ = {get('algorithm', 'num_iterations')}, "
                      f"scale_rewards = {get('algorithm', 'scale_rewards')}"),
        ("learning rate", get("train", "learning_rate")),
        ("max_new_tokens", get("rollout", "max_new_tokens")),
        ("reward, first → last step", f"{_num(first.get('reward'))} → {_num(last.get('reward'))}"),
        ("entropy, first → last step", f"{_num(first.get('entropy'))} → {_num(last.get('entropy'))}"),
    ]
    return '<table class="kv">' + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                                           for k, v in rows) + "</table>"


def _show(value) -> str:
    return "(unset)" if value is None else json.dumps(value, ensure_ascii=False)


def _segments_section(history: list[dict]) -> str:
    """One row per segment: where it started, when, the command, and what it changed from the one before."""
    e = html.escape
    rows = ["<tr><th>#</th><th>started</th><th>when</th><th>command</th>"
            "<th>changed from the previous segment</th></tr>"]
    for i, seg in enumerate(history):
        step = seg.get("start_step", "?")
        started = "from scratch" if i == 0 and not step else f"resumed from step {step}"
        changes = seg.get("changes") or {}
        if i == 0:
            changed = "— (first segment)"
        elif not isinstance(changes, dict) or not changes:
            changed = "nothing"
        else:
            changed = "<br>".join(
                f"<code>{e(str(k))}</code>: {e(_show(v[0]))} → {e(_show(v[1]))}"
                if isinstance(v, (list, tuple)) and len(v) == 2 else f"<code>{e(str(k))}</code>: {e(_show(v))}"
                for k, v in changes.items())
        command = seg.get("command")
        rows.append(f"<tr><td>{i + 1}</td><td>{e(started)}</td><td>{e(str(seg.get('time', '?')))}</td>"
                    f'<td class="cmd">{e(str(command)) if command else "—"}</td><td>{changed}</td></tr>')
    return f'<table class="segments">{"".join(rows)}</table>'


def _groups_section(run: dict, groups_per_step: int, max_steps: int) -> str:
    if not run["completions"]:
        return ('<p>No sampled answers in this run folder. Set <code>output.completions_every = K</code> to '
                'write them to <code>completions.jsonl</code> every K steps.</p>')
    algo = run["raw_config"].get("algorithm", {})
    G = run["raw_config"].get("rollout", {}).get("group_size")
    by_step = split_groups(run["completions"], G)
    parts = ["<p>Sampled groups, laid out like the group-relative advantage worked example: a score means "
             "something only next to the other answers to the same prompt. Each answer's advantage is its "
             "score minus the group mean, divided by the group std; every token of the answer gets it. "
             "Green: pushed up; red: pushed down.</p>"]
    for step in pick_steps(sorted(by_step), max_steps):
        groups = by_step[step]
        flat = [len({r.get("reward") for r in g}) <= 1 for g in groups]  # every answer scored the same
        shown = sorted(range(len(groups)), key=lambda i: flat[i])[:groups_per_step]  # groups with signal first
        parts.append(f"<h3>step {step}: {len(shown)} of {len(groups)} groups ({sum(flat)} with no signal)</h3>")
        parts += [group_table(groups[i], std_kind=str(algo.get("std", "population")),
                              scale=str(algo.get("scale_rewards", "group")), images_dir=run["dir"] / THUMBNAILS)
                  for i in sorted(shown)]
    return "".join(parts)

"""Line charts as self-contained SVG (no plotting library): ticks, smoothing, gaps, resume markers."""

from __future__ import annotations

import base64
import html
import math

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def _nice_ticks(lo: float, hi: float, n: int = 5) -> tuple[list[float], float]:
    raw = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]
    return [0.0 if abs(t) < step * 1e-6 else t for t in ticks], step


def _tick_labels(ticks: list[float], step: float) -> list[str]:
    """Labels with just enough digits to tell neighbouring ticks apart."""
    e_step = math.floor(math.log10(step))
    extra = 1 if round(step / 10 ** e_step, 6) == 2.5 else 0
    big = max(abs(t) for t in ticks) if ticks else 0.0
    if big >= 1e5 or 0 < big < 1e-3:
        digits = max(0, math.floor(math.log10(big)) - e_step + extra)
        return [f"{t:.{digits}e}" for t in ticks]
    return [f"{t:.{max(0, extra - e_step)}f}" for t in ticks]


def _smooth(values: list[float], span: int) -> list[float]:
    alpha, out, acc = 2 / (span + 1), [], None
    for v in values:
        acc = v if acc is None else alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def svg_chart(title: str, series: dict[str, list[tuple[float, float | None]]], width: int = 520,
              height: int = 230, markers: list[float] = ()) -> str:
    """A line chart of named (step, value) series as a standalone SVG document; None values leave gaps.
    `markers`: steps marked by a dashed vertical line (the resumes), when inside the plotted steps."""
    left, right, bottom = 62, 14, 32
    legend, x, y = [], left, 33  # (name, x, y) laid out in rows that fit the width
    for name in series:
        item = 22 + 6.2 * len(name)
        if x + item > width - right and x > left:
            x, y = left, y + 15
        legend.append((name, x, y))
        x += item
    top = y + 11
    pts = [(x, y) for s in series.values() for x, y in s if y is not None and math.isfinite(y)]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = (min(xs), max(xs)) if xs else (0, 1)
    y0, y1 = (min(ys), max(ys)) if ys else (0, 1)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    pw, ph = width - left - right, height - top - bottom
    sx = lambda x: left + (x - x0) / (x1 - x0) * pw  # noqa: E731
    sy = lambda y: top + (1 - (y - y0) / (y1 - y0)) * ph  # noqa: E731
    e = html.escape
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="15" font-size="13" font-weight="bold">{e(title)}</text>']
    ticks, step = _nice_ticks(y0, y1)
    for t, label in zip(ticks, _tick_labels(ticks, step)):
        y = sy(t)
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{left - 5}" y="{y + 4:.1f}" text-anchor="end" fill="#555">{label}</text>')
    for t in _nice_ticks(x0, x1, 6)[0]:
        if abs(t - round(t)) < 1e-9:
            x = sx(t)
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + ph}" y2="{top + ph + 4}" stroke="#555"/>')
            out.append(f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle" fill="#555">{int(round(t))}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    out.append(f'<text x="{left + pw}" y="{height - 3}" text-anchor="end" fill="#555">step</text>')
    for m in markers:
        if x0 <= m <= x1:
            x = sx(m)
            out.append(f'<line class="resume" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + ph}" stroke="#888" '
                       f'stroke-dasharray="4,3"><title>resumed from step {m:g}</title></line>')
    for i, ((name, data), (_, lx, ly)) in enumerate(zip(series.items(), legend)):
        color = COLORS[i % len(COLORS)]
        out.append(f'<rect x="{lx:.0f}" y="{ly - 9}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{lx + 14:.0f}" y="{ly}">{e(name)}</text>')
        values = [y if y is not None and math.isfinite(y) else None for _, y in data]
        raw_opacity = 1.0
        if len([v for v in values if v is not None]) > 40:  # long runs: faint raw curve + smoothed line
            raw_opacity = 0.3
            smooth_in = [v for v in values if v is not None]
            smoothed = iter(_smooth(smooth_in, max(3, len(smooth_in) // 20)))
            out += _polylines([(x, next(smoothed) if v is not None else None) for (x, _), v in zip(data, values)],
                              sx, sy, color, 1.0)
        out += _polylines([(x, v) for (x, _), v in zip(data, values)], sx, sy, color, raw_opacity)
    out.append("</svg>")
    return "\n".join(out)


def _polylines(data, sx, sy, color: str, opacity: float) -> list[str]:
    segments, current = [], []
    for x, y in data:
        if y is None:
            if current:
                segments.append(current)
            current = []
        else:
            current.append((sx(x), sy(y)))
    if current:
        segments.append(current)
    out = []
    for seg in segments:
        if len(seg) == 1:
            out.append(f'<circle cx="{seg[0][0]:.1f}" cy="{seg[0][1]:.1f}" r="2.5" fill="{color}" '
                       f'fill-opacity="{opacity}"/>')
        else:
            points = " ".join(f"{x:.1f},{y:.1f}" for x, y in seg)
            out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.6" '
                       f'stroke-opacity="{opacity}"/>')
    return out


def matching_keys(pattern: str, keys: list[str]) -> list[str]:
    if "*" not in pattern:
        return [pattern] if pattern in keys else []
    head, tail = pattern.split("*")
    return [k for k in keys if k.startswith(head) and k.endswith(tail) and "/" not in k[len(head):-len(tail)]]


def finite_value(v) -> float | None:
    """A plottable number: finite, and with room for the chart's arithmetic (a range of +-1e308 overflows)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        v = float(v)  # an int past float's range: OverflowError
    except OverflowError:
        return None
    return v if math.isfinite(v) and abs(v) <= 1e300 else None


def data_uri(svg: str) -> str:
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode("utf-8")).decode("ascii")

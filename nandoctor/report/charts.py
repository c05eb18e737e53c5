"""Inline SVG line charts: no JavaScript, no network, readable when the HTML is opened from a CI
artifact. Non-finite points are not drawn; the step where a probe failed is marked instead."""
from __future__ import annotations

import math
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i / n for i in range(n + 1)]


def _step_ticks(lo: int, hi: int, n: int = 5) -> list[int]:
    """Whole-number steps for the x axis."""
    stride = max(1, math.ceil((hi - lo) / n))
    return list(range(int(lo), int(hi) + 1, stride))


def line_chart(series: list[dict], title: str, log_y: bool = False, mark_step: int | None = None,
               mark_label: str = "", width: int = 420, height: int = 180) -> str:
    """series: [{'label', 'points': [(x, y)], 'dashed': bool}]. Returns one <svg> element."""
    pad_l, pad_r, pad_t, pad_b = 52, 10, 22, 26
    finite = [(x, y) for s in series for x, y in s["points"]
              if y is not None and math.isfinite(y) and (y > 0 or not log_y)]
    xs = [x for s in series for x, _ in s["points"]] + ([mark_step] if mark_step is not None else [])
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">',
             f'<title>{escape(title)}</title>',
             f'<text x="{pad_l}" y="14" font-size="12" font-weight="bold">{escape(title)}</text>']
    if not finite or not xs:
        parts.append(f'<text x="{pad_l}" y="{height // 2}" font-size="12" fill="#888">no finite values</text></svg>')
        return "".join(parts)
    tf = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    y_lo, y_hi = min(tf(y) for _, y in finite), max(tf(y) for _, y in finite)
    if y_hi - y_lo < 1e-9:
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
    x_lo, x_hi = min(xs), max(max(xs), min(xs) + 1)
    w, h = width - pad_l - pad_r, height - pad_t - pad_b

    def px(x):
        return pad_l + (x - x_lo) / (x_hi - x_lo) * w

    def py(v):
        return pad_t + h - (v - y_lo) / (y_hi - y_lo) * h

    parts.append(f'<rect x="{pad_l}" y="{pad_t}" width="{w}" height="{h}" fill="none" stroke="#ccc"/>')
    for t in _ticks(y_lo, y_hi):
        shown = 10 ** t if log_y else t
        parts.append(f'<text x="{pad_l - 4}" y="{py(t) + 4:.1f}" font-size="10" text-anchor="end">{shown:.3g}</text>')
        parts.append(f'<line x1="{pad_l}" x2="{pad_l + w}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#eee"/>')
    for t in _step_ticks(x_lo, x_hi):
        parts.append(f'<text x="{px(t):.1f}" y="{height - 8}" font-size="10" text-anchor="middle">{t}</text>')
    for i, s in enumerate(series):
        pts = [(px(x), py(tf(y))) for x, y in s["points"] if y is not None and math.isfinite(y) and (y > 0 or not log_y)]
        color = s.get("color") or PALETTE[i % len(PALETTE)]
        dash = ' stroke-dasharray="4 3"' if s.get("dashed") else ""
        if len(pts) > 1:
            d = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            parts.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="1.5"{dash}><title>{escape(s["label"])}</title></polyline>')
        for x, y in pts[:1] if len(pts) > 1 else pts:
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>')
    if mark_step is not None:
        x = px(mark_step)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{pad_t}" y2="{pad_t + h}" stroke="#d62728" stroke-width="2"/>')
        parts.append(f'<text x="{min(x + 3, width - 60):.1f}" y="{pad_t + 12}" font-size="10" fill="#d62728">{escape(mark_label)}</text>')
    legend_x = pad_l + 8 * len(title) + 12  # the legend runs along the title line, clear of the curves
    for i, s in enumerate(series[:6]):
        color = s.get("color") or PALETTE[i % len(PALETTE)]
        parts.append(f'<text x="{legend_x}" y="14" font-size="9" fill="{color}">{escape(s["label"])}</text>')
        legend_x += 6 * len(s["label"]) + 14
    parts.append("</svg>")
    return "".join(parts)

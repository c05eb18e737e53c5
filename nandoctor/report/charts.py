"""Inline SVG line charts: no JavaScript, no network, readable when the HTML is opened from a CI
artifact. Non-finite points are not drawn; the step where a probe failed is marked instead. The
legend sits under the plot and wraps, so every label is shown whole.

Any value may arrive: a diverging run's loss of 1e300, an int too large for a float, a subnormal.
The y axis is laid out in a space where arithmetic cannot overflow (log10 for a log axis; values
divided by a power of ten for a linear one) and its ticks are labelled from that space."""

from __future__ import annotations

import math
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
CHAR_W = 0.6  # a sans-serif character's width, in font sizes, with margin: legends are laid out from it
LEGEND_FONT, LEGEND_ROW = 10, 14


LINEAR_SAFE = 1e100  # a linear axis whose largest |value| is outside [1/this, this] is drawn in units of a power of ten


def as_float(y) -> float | None:
    """y as a float: an int too large for one is +-inf (it cannot be drawn on a float axis)."""
    if y is None:
        return None
    try:
        return float(y)
    except OverflowError:
        return math.inf if y > 0 else -math.inf


def _plotted(y, log_y: bool) -> float | None:
    """Where y sits on the axis (log10 of it on a log axis), or None when it cannot be drawn."""
    if y is None:
        return None
    if log_y:
        if isinstance(y, int) and y > 0:
            return math.log10(y)  # exact for ints beyond float range too
        y = as_float(y)
        return math.log10(y) if math.isfinite(y) and y > 0 else None
    y = as_float(y)
    return y if math.isfinite(y) else None


def _finite(y, log_y: bool) -> bool:
    return _plotted(y, log_y) is not None


def nice_step(span: float, n: int) -> float:
    """A round tick spacing (1, 2, 2.5 or 5 times a power of ten) giving about n intervals."""
    raw = span / n
    power = 10.0 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def nice_ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    """Round ticks covering [lo, hi]: the first at or below lo, the last at or above hi. For a range
    that round ticks cannot cover in floats (zero, subnormal or overflowing span), its two ends."""
    span = hi - lo
    step = nice_step(span, n) if math.isfinite(span) and span > 0 else 0.0
    if not (math.isfinite(step) and step > 0):
        return [lo, hi]
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    ticks = [float(f"{k * step:.12g}") for k in range(first, last + 1)]
    return ticks if len(ticks) > 1 and all(math.isfinite(t) for t in ticks) else [lo, hi]


def log_ticks(lo: float, hi: float) -> list[float]:
    """Ticks in log10 space: whole decades, or 1-2-5 within a decade or two."""
    decades = list(range(math.floor(lo), math.ceil(hi) + 1))
    if len(decades) > 3:
        return [float(d) for d in decades]
    marks = [d + math.log10(m) for d in decades for m in (1, 2, 5)]
    inside = [t for t in marks if lo - 1e-9 <= t <= hi + 1e-9]
    if len(inside) >= 2:
        return inside
    return [t for t in marks if t < lo - 1e-9][-1:] + inside + [t for t in marks if t > hi + 1e-9][:1]


def fmt_tick(v: float, step: float) -> str:
    """As many decimals as the tick spacing needs, no more."""
    if v == 0:
        return "0"
    if not (math.isfinite(v) and math.isfinite(step)) or step < 1e-3 or abs(v) >= 1e5:
        return f"{v:.1e}"
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step < 1 else 0
    decimals += 1 if step * 10**decimals % 1 else 0  # 2.5, 0.25
    return f"{v:.{decimals}f}"


def fmt_log_tick(t: float) -> str:
    """The label of a log-axis tick at log10 value t, computed without leaving log space."""
    if -300 < t < 300:
        value = float(f"{10**t:.6g}")  # 10 ** log10(5) is 4.999...
        return fmt_tick(value, value)
    decade = math.floor(t + 1e-9)
    return f"{float(f'{10 ** (t - decade):.2g}'):g}e{decade:+d}"


def fmt_scaled_tick(t: float, step: float, power: int) -> str:
    """The label of a linear tick t drawn in units of 10**power."""
    if power == 0 or t == 0:
        return fmt_tick(t, step)
    return f"{t:.3g}e{power:+d}"


def _linear_power(values: list[float]) -> int:
    """The power of ten a linear axis is drawn in units of: 0, unless its values are so large that
    their differences overflow or so small that their spacing underflows."""
    biggest = max(abs(v) for v in values)
    if biggest == 0 or 1 / LINEAR_SAFE <= biggest <= LINEAR_SAFE:
        return 0
    return max(math.floor(math.log10(biggest)), -307)  # 10.0 ** -308 and below lose precision, then reach 0


def _step_ticks(lo: int, hi: int, n: int = 5) -> list[int]:
    """Whole-number steps for the x axis, at a round stride."""
    stride = max(1, int(nice_step(max(hi - lo, 1), n)))
    return list(range(int(lo) - int(lo) % stride, int(hi) + 1, stride))


def _same(a, b, tolerance: float) -> bool:
    a, b = _plotted(a, False), _plotted(b, False)
    if a is None or b is None:
        return a is None and b is None
    return abs(a / 2 - b / 2) <= tolerance / 2  # halves: the difference of two huge values stays finite


def coincident_groups(series: list[dict], tolerance: float) -> list[list[int]]:
    """Indices of series drawn over one another: the same steps, every finite value within
    `tolerance`. A curve that differs by less than a pixel is the same curve to a reader."""
    groups: list[list[int]] = []
    for i, s in enumerate(series):
        pts = dict(s["points"])
        for g in groups:
            other = dict(series[g[0]]["points"])
            if set(pts) == set(other) and all(_same(pts[x], other[x], tolerance) for x in pts):
                g.append(i)
                break
        else:
            groups.append([i])
    return groups


def _legend_rows(labels: list[str], width: int, x0: int) -> list[list[tuple[int, str, int]]]:
    """Lay the legend out in rows that fit `width`: [(entry index, text line, x)] per row. An entry
    longer than a row is broken at its spaces over several rows."""
    rows, row, x = [], [], x0
    char = CHAR_W * LEGEND_FONT
    for i, text in enumerate(labels):
        need = 22 + char * len(text)
        if row and x + need > width:
            rows.append(row)
            row, x = [], x0
        if x0 + need <= width:
            row.append((i, text, x))
            x += need + 12
            continue
        words, line = text.split(" "), ""
        for word in words:  # too long for any row: wrap it, one row per line
            if line and x0 + 22 + char * len(line + " " + word) > width:
                row.append((i, line, x0))
                rows.append(row)
                row, line = [], ""
                i = -1  # continuation lines carry no swatch
            line = f"{line} {word}".strip()
        row.append((i, line, x0))
        x = x0 + 22 + char * len(line) + 12
    if row:
        rows.append(row)
    return rows


def line_chart(
    series: list[dict],
    title: str,
    log_y: bool = False,
    mark_step: int | None = None,
    mark_label: str = "",
    width: int = 420,
    height: int = 180,
    x_label: str = "step",
) -> str:
    """series: [{'label', 'points': [(x, y)], 'dashed': bool, 'color', 'fail_step': int, 'fail_label': str}];
    a series with a fail_step gets a cross at that step on the top edge; x_label names the whole-number x
    axis. Returns one <svg> element, `height` for the plot plus the legend's rows."""
    pad_l, pad_r, pad_t, pad_b = 52, 12, 22, 26
    finite = [(x, _plotted(y, log_y)) for s in series for x, y in s["points"] if _finite(y, log_y)]
    xs = [x for s in series for x, _ in s["points"]] + [
        s["fail_step"] for s in series if s.get("fail_step") is not None
    ]
    xs += [mark_step] if mark_step is not None else []
    legend = _legend_rows([s["label"] for s in series], width - pad_r, pad_l) if finite and xs else []
    total = height + LEGEND_ROW * len(legend)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total}" '
        f'viewBox="0 0 {width} {total}" role="img">',
        f"<title>{escape(title)}</title>",
        f'<text x="{pad_l}" y="14" font-size="12" font-weight="bold">{escape(title)}</text>',
    ]
    if not finite or not xs:
        parts.append(f'<text x="{pad_l}" y="{height // 2}" font-size="12" fill="#888">no finite values</text></svg>')
        return "".join(parts)
    power = 0 if log_y else _linear_power([y for _, y in finite])
    unit = 10.0**power  # a normal float for any power a finite value has

    def tf(y):  # the value in the y axis' space
        v = _plotted(y, log_y)
        return v / unit if power else v

    lo, hi = min(v / unit for _, v in finite), max(v / unit for _, v in finite)
    if hi - lo < 1e-9:
        pad = 0.5 if log_y or power or abs(lo) * 0.05 < 1e-9 else abs(lo) * 0.05
        lo, hi = lo - pad, hi + pad
    ticks = log_ticks(lo, hi) if log_y else nice_ticks(lo, hi)
    y_lo, y_hi = min(ticks[0], lo), max(ticks[-1], hi)
    x_lo, x_hi = min(xs), max(max(xs), min(xs) + 1)
    w, h = width - pad_l - pad_r, height - pad_t - pad_b

    def px(x):
        return pad_l + (x - x_lo) / (x_hi - x_lo) * w

    def py(v):
        return pad_t + h - (v - y_lo) / (y_hi - y_lo) * h

    parts.append(f'<rect x="{pad_l}" y="{pad_t}" width="{w}" height="{h}" fill="none" stroke="#ccc"/>')
    for t in ticks:
        shown = fmt_log_tick(t) if log_y else fmt_scaled_tick(t, ticks[1] - ticks[0] if len(ticks) > 1 else 1.0, power)
        parts.append(f'<text x="{pad_l - 4}" y="{py(t) + 4:.1f}" font-size="10" text-anchor="end">{shown}</text>')
        parts.append(f'<line x1="{pad_l}" x2="{pad_l + w}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#eee"/>')
    for t in _step_ticks(x_lo, x_hi):
        if t >= x_lo:
            parts.append(f'<text x="{px(t):.1f}" y="{height - 8}" font-size="10" text-anchor="middle">{t}</text>')
    parts.append(
        f'<text x="{pad_l - 12}" y="{height - 8}" font-size="10" text-anchor="end" fill="#888">{escape(x_label)}</text>'
    )
    colors = [s.get("color") or PALETTE[i % len(PALETTE)] for i, s in enumerate(series)]
    for s, color in zip(series, colors):
        pts = [(px(x), py(tf(y))) for x, y in s["points"] if _finite(y, log_y)]
        dash = ' stroke-dasharray="4 3"' if s.get("dashed") else ""
        tip = f"<title>{escape(s['label'])}</title>"
        if len(pts) > 1:
            d = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            parts.append(
                f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="1.5"{dash}>{tip}</polyline>'
            )
        parts.append(
            f'<circle cx="{pts[0][0]:.1f}" cy="{pts[0][1]:.1f}" r="2.5" fill="{color}">{tip}</circle>' if pts else ""
        )
        if s.get("fail_step") is not None:
            x, y = px(s["fail_step"]), pad_t + 6
            if pts:
                parts.append(
                    f'<line x1="{pts[-1][0]:.1f}" y1="{pts[-1][1]:.1f}" x2="{x:.1f}" y2="{y}" '
                    f'stroke="{color}" stroke-dasharray="2 2"/>'
                )
            parts.append(
                f'<text x="{x:.1f}" y="{y + 4}" font-size="13" font-weight="bold" text-anchor="middle" fill="{color}">'
                f"×<title>{escape(s.get('fail_label') or s['label'])}</title></text>"
            )
    if mark_step is not None:
        x = px(mark_step)
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{pad_t}" y2="{pad_t + h}" stroke="#d62728" stroke-width="2"/>'
        )
        anchor = "end" if x > pad_l + w / 2 else "start"
        parts.append(
            f'<text x="{x + (-3 if anchor == "end" else 3):.1f}" y="{pad_t + 12}" font-size="10" fill="#d62728" '
            f'text-anchor="{anchor}">{escape(mark_label)}</text>'
        )
    for r, row in enumerate(legend):
        y = height + LEGEND_ROW * r + 2
        for i, text, x in row:
            if i >= 0:
                s = series[i]
                dash = ' stroke-dasharray="4 3"' if s.get("dashed") else ""
                parts.append(
                    f'<line x1="{x}" x2="{x + 16}" y1="{y - 4}" y2="{y - 4}" '
                    f'stroke="{colors[i]}" stroke-width="2"{dash}/>'
                )
            parts.append(f'<text x="{x + 22}" y="{y}" font-size="{LEGEND_FONT}" fill="#333">{escape(text)}</text>')
    parts.append("</svg>")
    return "".join(parts)

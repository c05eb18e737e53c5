"""The mixture-of-experts section: per probe of an MoE model, whether the load-balancing loss was in
the trained loss (its weight and last value), the router's dtype, the share of step 0's token -> expert
choices that differ from the fp32 reference's, and per router layer the tokens each expert got at step 0
and at the last step (experts with none, the largest share, the router's entropy). A table in Markdown,
a heat map (inline SVG) in HTML. What is judged (the expert-collapse verdict, the router findings) is
decided in analysis/ and knowledge/; this module only shows it."""

from __future__ import annotations

from html import escape

from ..analysis.outcomes import ProbeOutcome, RunAnalysis
from .formatting import label

CELL_W, CELL_H, LABEL_W = 14, 14, 190  # heat-map geometry (px)
LEGEND_H = 2 * CELL_H + 8  # the scale under the rows
LEGEND_STEPS = (0.0, 0.25, 0.5, 0.75, 1.0)  # tokens as a share of the row's busiest expert


def moe_outcomes(a: RunAnalysis) -> list[ProbeOutcome]:
    return [o for o in a.outcomes if o.record.moe]


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _aux(o: ProbeOutcome) -> str:
    m = o.record.moe
    if not m.get("aux_loss_on"):
        return "off"
    last = next((s.aux_loss for s in reversed(o.record.steps) if s.aux_loss is not None), None)
    return f"on (coef {m.get('aux_loss_coef')}, last {last:.4g})" if last is not None else "on (not in the loss)"


def _last_step_load(o: ProbeOutcome) -> str:
    """The busiest router layer at the last measured step: 'step 7: 3 of 32 idle, largest share 21.9%'
    (the most experts with no token and the largest share over the layers)."""
    last = [layer.get("step_last") or layer.get("step_0") or {} for layer in o.record.moe.get("layers") or []]
    last = [at for at in last if at.get("rows")]
    if not last:
        return "-"
    idle = max(at.get("no_token") or 0 for at in last)
    share = max((at["largest_share"] for at in last if at.get("largest_share") is not None), default=None)
    return f"step {last[0].get('step')}: {idle} of {o.record.moe.get('experts')} idle, largest share {_share(share)}"


def probe_rows(a: RunAnalysis) -> list[dict]:
    """One row per MoE probe: its routing setup and what it measured (the terminal, report.md and
    report.html show these rows)."""
    return [
        {
            "config": label(o),
            "verdict": o.verdict.name,
            "experts": f"top-{o.record.moe.get('top_k')} of {o.record.moe.get('experts')}",
            "load-balancing loss": _aux(o),
            "router dtype": o.record.moe.get("router_dtype") or "-",
            "step-0 choices vs fp32": _share(o.route_flips),
            "expert load, worst layer": _last_step_load(o),
        }
        for o in moe_outcomes(a)
    ]


def layer_rows(o: ProbeOutcome) -> list[dict]:
    """One row per router layer and measured step of a probe: tokens per expert and their summary."""
    rows = []
    for layer in o.record.moe.get("layers") or []:
        for key in ("step_0", "step_last"):
            at = layer.get(key) or {}
            if not at.get("rows"):
                continue
            rows.append(
                {
                    "layer": layer["layer"],
                    "step": at.get("step"),
                    "tokens per expert": " ".join(str(c) for c in at.get("tokens") or []),
                    "experts with no token": at.get("no_token"),
                    "largest share": _share(at.get("largest_share")),
                    "router entropy (nats)": "-" if at.get("entropy") is None else f"{at['entropy']:.3f}",
                }
            )
    return rows


def _fill(share: float) -> str:
    shade = round(255 * (1 - share))
    return f"rgb({shade},{shade},255)"


def _legend(y: int) -> list[str]:
    """The heat map's scale: a swatch per share of the row's busiest expert, and the red edge of an expert
    with no token."""
    parts = [f'<text x="0" y="{y + CELL_H - 3}" font-size="11">tokens, share of the row\'s busiest</text>']
    for i, share in enumerate(LEGEND_STEPS):
        x = LABEL_W + i * 3 * CELL_W
        parts.append(
            f'<rect x="{x}" y="{y}" width="{CELL_W - 1}" height="{CELL_H - 1}" fill="{_fill(share)}" '
            f'stroke="#999999"/><text x="{x + CELL_W + 2}" y="{y + CELL_H - 3}" font-size="10">{share:.0%}</text>'
        )
    y += CELL_H + 4
    parts.append(
        f'<rect x="{LABEL_W}" y="{y}" width="{CELL_W - 1}" height="{CELL_H - 1}" fill="{_fill(0.0)}" '
        f'stroke="#c62828"/><text x="{LABEL_W + CELL_W + 2}" y="{y + CELL_H - 3}" font-size="10">no token</text>'
    )
    return parts


def heat_map(o: ProbeOutcome) -> str:
    """An inline SVG: a row per router layer and measured step, a column per expert, darker for more
    tokens (each row scaled to its busiest expert); an expert with no token is drawn white with a red edge.
    A scale under the rows says what the shades and the red edge mean."""
    rows = [
        (f"layer {layer['layer']} step {at.get('step')}", at.get("tokens") or [])
        for layer in o.record.moe.get("layers") or []
        for at in (layer.get("step_0") or {}, layer.get("step_last") or {})
        if at.get("rows")
    ]
    if not rows:
        return ""
    experts = max(len(t) for _, t in rows)
    width = LABEL_W + max(experts * CELL_W, len(LEGEND_STEPS) * 3 * CELL_W) + 4
    height = len(rows) * CELL_H + 4 + LEGEND_H
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="expert load of {escape(label(o))}">'
    ]
    for i, (name, tokens) in enumerate(rows):
        y = 2 + i * CELL_H
        parts.append(f'<text x="0" y="{y + CELL_H - 3}" font-size="11">{escape(name)}</text>')
        top = max(tokens) or 1
        for e, count in enumerate(tokens):
            x = LABEL_W + e * CELL_W
            edge = ' stroke="#c62828"' if count == 0 else ' stroke="#ffffff"'
            parts.append(
                f'<rect x="{x}" y="{y}" width="{CELL_W - 1}" height="{CELL_H - 1}" '
                f'fill="{_fill(count / top)}"{edge}><title>expert {e}: {count} tokens</title></rect>'
            )
    parts += _legend(2 + len(rows) * CELL_H + 6)
    parts.append("</svg>")
    return "".join(parts)


INTRO = (
    "Routing of each mixture-of-experts probe, measured on its timed steps: the tokens each expert got per "
    "router layer at step 0 and at the last step (each token counts once per expert of its top-k), how many "
    "experts got none, the largest share of a layer's tokens one expert took, and the mean entropy of the "
    "router's softmax. `step-0 choices vs fp32`: the share of step 0's token -> expert choices that differ "
    "from the fp32 reference's (same weights, same batch)."
)


def moe_markdown(a: RunAnalysis, table) -> list[str]:
    outcomes = moe_outcomes(a)
    if not outcomes:
        return []
    parts = ["## Mixture of experts", "", INTRO, "", table(probe_rows(a)), ""]
    for o in outcomes:
        parts += [f"### Expert load: {label(o)}", "", table(layer_rows(o)), ""]
    return parts


def moe_context(a: RunAnalysis) -> dict | None:
    """The HTML template's section, or None without an MoE probe."""
    outcomes = moe_outcomes(a)
    if not outcomes:
        return None
    return {
        "intro": INTRO.replace("`", ""),
        "rows": probe_rows(a),
        "maps": [{"config": label(o), "svg": heat_map(o)} for o in outcomes],
    }


def moe_facts(o: ProbeOutcome) -> dict | None:
    """One probe's routing as data (summary.json): the record's figures without step 0's choices, and
    the share of them that differ from the fp32 reference's."""
    if not o.record.moe:
        return None
    return {**{k: v for k, v in o.record.moe.items() if k != "step0_choices"}, "route_flips": o.route_flips}

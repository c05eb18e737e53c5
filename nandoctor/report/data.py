"""The Data section: what the probes trained on. The synthetic stream says so in one sentence; the
user's rows show what was read (file, kind of rows, tokenizer, options), the rows scanned, the length
and supervised-token histograms (inline SVG in HTML, tables in Markdown and the terminal), which
special tokens are targets, the lint's findings with their figures, and the rows each batch (and,
when the probes' records carry their stream, each probe) trained on; the setup checks each probe
measured at step 0 with their figures, and the trainable groups that got no gradient. Shared by the
doctor's terminal output and the run reports."""

from __future__ import annotations

import math
from html import escape

from ..analysis.verdicts import setup_judged, starved_groups
from ..runmeta import RunMeta

BAR = "#1f77b4"


def source_sentence(source: dict | None, recipe: dict | None = None) -> str:
    """One sentence on where the data came from (the lint's `source`, or the recipe's data section)."""
    if source and source.get("source") == "file":
        return (
            f"Your rows: {source['path']} ({source['rows']} {source['kind'].replace('_', ' + ')} rows), tokenized with "
            f"{source['tokenizer'] or 'no tokenizer (pre-tokenized ids)'}; max_length {source['max_length']} "
            f"(truncation {source['truncation_side']}), labels by {source['labels']}"
            f"{_on_template(source.get('labels_template'))}, "
            f"padding {source['padding_side']}, packing {source['packing']}, "
            f"pad id {source['pad_id']} ({source['pad']})."
        )
    data = (recipe or {}).get("data") or {}
    if data.get("source") == "file":  # a run that read the user's rows without storing the lint's section
        return (
            f"Your rows: {data['path']}, tokenized with {data.get('tokenizer') or 'the checkpoint tokenizer'}; "
            f"max_length {data.get('max_length') or 'seq_len'}, labels by {data.get('labels', 'pad_id')}, "
            f"packing {data.get('packing', 'none')}."
        )
    return (
        f"The synthetic stream: {data.get('batches', 4)} distinct batches of random 8-token motifs repeated "
        f"(pad_fraction {data.get('pad_fraction', 0.0)}), drawn from the seed; not your data. Pass --data PATH "
        "to probe your own rows (docs/data.md)."
    )


def _on_template(name: str | None) -> str:
    return f" (following TRL's training template for {name}, which SFTTrainer swaps in)" if name else ""


def histogram_rows(hist: dict, name: str) -> list[dict]:
    edges, counts = hist["edges"], hist["counts"]
    last = len(counts) - 1
    return [{name: f"{edges[i]}-{edges[i + 1] - (0 if i == last else 1)}", "rows": c} for i, c in enumerate(counts)]


def histogram_svg(hist: dict, title: str, width: int = 380, height: int = 150) -> str:
    """An inline SVG bar chart of a histogram: bars with their counts, the bin edges under them."""
    counts, edges = hist["counts"], hist["edges"]
    left, bottom, top = 8, 28, 22
    plot_w, plot_h = width - 2 * left, height - bottom - top
    peak = max(counts) or 1
    bar = plot_w / max(1, len(counts))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
        f'<text x="{left}" y="14" font-size="12" font-weight="bold">{escape(title)}</text>',
    ]
    for i, c in enumerate(counts):
        h = plot_h * c / peak
        x, y = left + i * bar, top + plot_h - h
        rect = f'x="{x + 1:.1f}" y="{y:.1f}" width="{bar - 2:.1f}" height="{h:.1f}"'
        parts.append(f'<rect {rect} fill="{BAR}"><title>{c}</title></rect>')
        if c:
            parts.append(f'<text x="{x + bar / 2:.1f}" y="{y - 2:.1f}" font-size="9" text-anchor="middle">{c}</text>')
    for i, anchor in ((0, "start"), (len(edges) // 2, "middle"), (len(edges) - 1, "end")):
        x = left + i * bar  # the outer labels end at the plot's edges, inside the chart (never clipped)
        parts.append(f'<text x="{x:.1f}" y="{height - 8}" font-size="10" text-anchor="{anchor}">{edges[i]}</text>')
    parts.append("</svg>")
    return "".join(parts)


def batch_rows(batches: list[dict], shown: int = 8) -> list[dict]:
    """One row per batch: its kind, its rows (the first `shown`), tokens, padding and loss terms."""
    return [
        {
            "batch": i,
            "kind": b["kind"],
            "rows": ", ".join(map(str, b["rows"][:shown]))
            + (f" (+{len(b['rows']) - shown})" if len(b["rows"]) > shown else ""),
            "tokens": b["tokens"],
            "padded": b["padded"],
            "supervised": b["supervised"],
        }
        for i, b in enumerate(batches)
    ]


def probe_rows(outcomes) -> list[dict]:
    """The rows each probe trained on, for records that carry their stream (`record.data`): one row per
    batch, the probes that trained on the same batches together (a grid's cells share the seed's rows)."""
    by_rows: dict[tuple, list[str]] = {}
    for o in outcomes:
        data = getattr(o.record, "data", None) or {}
        batches = tuple((b["kind"], tuple(b["rows"])) for b in data.get("batches") or [] if b.get("rows"))
        if batches:
            by_rows.setdefault(batches, []).append(o.record.probe_id)
    return [
        {"probe": ", ".join(probes), "kind": kind, "rows": ", ".join(map(str, rows))}
        for batches, probes in by_rows.items()
        for kind, rows in batches
    ]


def probe_groups(outcomes) -> list[dict]:
    """probe_rows grouped: the probes that trained on the same batches, named once, with those batches."""
    groups: dict[str, list[dict]] = {}
    for r in probe_rows(outcomes):
        groups.setdefault(r["probe"], []).append({"kind": r["kind"], "rows": r["rows"]})
    return [{"probes": probes, "batches": batches} for probes, batches in groups.items()]


def trained_as_listed(groups: list[dict], batches: list[dict] | None) -> str | None:
    """One sentence when every probe trained on the very batches the data section lists (a grid's
    cells share the seed's rows): the rows need no second table."""
    if len(groups) != 1 or not batches:
        return None
    listed = [{"kind": b["kind"], "rows": ", ".join(map(str, b["rows"]))} for b in batches]
    if groups[0]["batches"] != listed:
        return None
    probes = groups[0]["probes"].split(", ")
    return f"Every probe ({len(probes)}: {', '.join(probes)}) trained on the batches above, row for row."


def fig(x, digits: int = 3) -> str:
    """A measured figure as text, whatever it is: a number to `digits` significant digits, a non-finite
    float as Python writes it (nan, inf), '-' when absent."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return "-" if x is None else str(x)
    try:
        x = float(x)
    except OverflowError:  # an int beyond a float's range
        x = math.inf if x > 0 else -math.inf
    return f"{x:.{digits}g}" if math.isfinite(x) else repr(x)


def setup_check_rows(outcomes) -> list[dict]:
    """The step-0 setup checks each probe measured on its own model (record.setup_checks), one row per
    check with its figures and whether it passed (the judge's decision, verdicts.setup_judged)."""
    out = []
    for o in outcomes:
        c = getattr(o.record, "setup_checks", None) or {}
        judged = setup_judged(c)
        if judged["packing_leaks"] is not None:
            out.append(
                {
                    "probe": o.record.probe_id,
                    "check": "packing isolation",
                    "figure": f"max logit difference {fig(c.get('packing_max_logit_diff'))} to each of "
                    f"{fig(c.get('packing_segments'))} segments run alone ({c.get('packing_cause') or 'as collated'}); "
                    f"bound {fig(judged['packing_bound'], 2)} (the segments alone move "
                    f"by {fig(c.get('packing_floor'))} against fp32)",
                    "result": "leaks" if judged["packing_leaks"] else "isolated",
                }
            )
        if judged["accumulation_misweighted"] is not None:
            out.append(
                {
                    "probe": o.record.probe_id,
                    "check": "accumulation",
                    "figure": f"relative difference {fig(c.get('accumulation_error'))} to the full batch's gradient "
                    f"over {fig(c.get('accumulation_steps'))} micro-batches ({c.get('accumulation_targets', '-')} "
                    f"loss terms), loss_normalization={c.get('loss_normalization', '-')}; cosine "
                    f"{fig(c.get('accumulation_cosine'), 4)}, norm ratio {fig(c.get('accumulation_norm_ratio'), 4)}; "
                    f"bound {fig(judged['accumulation_bound'], 2)}",
                    "result": "misweighted" if judged["accumulation_misweighted"] else "as the full batch",
                }
            )
    return out


def starved_rows(outcomes) -> list[dict]:
    """The trainable groups of each probe that got no gradient at any step (Step.groups), with what
    they hold (record.trainable_groups)."""
    out = []
    for o in outcomes:
        steps = getattr(o.record, "steps", None) or []
        recorded = [s for s in steps if s.groups is not None]
        for g in starved_groups(steps):
            held = (getattr(o.record, "trainable_groups", None) or {}).get(g) or {}
            out.append(
                {
                    "probe": o.record.probe_id,
                    "group": g,
                    "tensors": held.get("tensors", "-"),
                    "first": held.get("first", "-"),
                    "steps without a gradient": f"all {len(recorded)}",
                }
            )
    return out


def finding_lines(findings: list[dict]) -> list[str]:
    return [f"[{f['severity']}] {f['id']}: {f['figure']}" for f in findings if f.get("figure")]


def finding_items(findings: list[dict]) -> list[dict]:
    """Each finding with a figure as its line, its severity and its fix (report.html shows them together)."""
    return [
        {"line": line, "severity": f["severity"], "fix": f.get("fix") or "-"}
        for line, f in zip(finding_lines(findings), [f for f in findings if f.get("figure")])
    ]


def data_text(section: dict) -> list[str]:
    """What `nandoctor doctor --data` prints before its findings."""
    from tabulate import tabulate

    out = ["Data", source_sentence(section["source"])]
    out.append(
        f"{section['rows']} rows scanned, {section['tokens']} tokens kept; {section['rows_truncated']} rows truncated "
        f"({section['tokens_cut']} tokens cut); {section['rows_without_supervised']} rows with no supervised token"
    )
    for key, name in (("length", "tokens per row"), ("supervised", "supervised tokens per row")):
        out += ["", tabulate(histogram_rows(section["histograms"][key], name), headers="keys")]
    out += ["", "Special tokens (as content / as a target):"]
    out += [f"  {s['token']} (id {s['id']}): {s['content']} / {s['targets']}" for s in section["special_tokens"]]
    out += [
        "",
        "Batches a probe trains on (rows of the data set):",
        tabulate(batch_rows(section["batches"]), headers="keys"),
    ]
    measured = section.get("measured") or {}
    if measured.get("measured_on"):
        out.append(f"Measured on {measured['measured_on']}.")
    if measured.get("no_loss"):
        out.append(f"Not measured (the checks that train on the loss): {measured['no_loss']}.")
    return out + [""]


def data_markdown(meta: RunMeta | dict, outcomes, table) -> list[str]:
    """The '## Data' section of report.md, as lines; `table` renders rows as a Markdown table."""
    meta = RunMeta.of(meta)
    section = meta.data
    parts = ["## Data", "", source_sentence((section or {}).get("source"), meta.recipe), ""]
    if section:
        parts += [
            f"{section['rows']} rows scanned, {section['tokens']} tokens kept, {section['rows_truncated']} truncated, "
            f"{section['rows_without_supervised']} with no supervised token.",
            "",
            table(histogram_rows(section["histograms"]["length"], "tokens per row")),
            "",
            table(histogram_rows(section["histograms"]["supervised"], "supervised tokens per row")),
            "",
        ]
        parts += [f"- {f['line']} Fix: {f['fix']}" for f in finding_items(section.get("findings") or [])]
        if section.get("special_tokens"):
            special = [
                {"token": t["token"], "id": t["id"], "as content": t["content"], "as a target": t["targets"]}
                for t in section["special_tokens"]
            ]
            parts += ["", "Special tokens:", "", table(special)]
        parts += ["", "Batches the probes train on:", "", table(batch_rows(section["batches"])), ""]
    trained = probe_rows(outcomes)
    if trained:
        parts += ["Rows each probe trained on:", "", table(trained), ""]
    checks = setup_check_rows(outcomes)
    if checks:
        parts += ["Setup checks each probe measured at step 0, on its own model:", "", table(checks), ""]
    starved = starved_rows(outcomes)
    if starved:
        parts += ["Trainable groups that got no gradient at any step:", "", table(starved), ""]
    return parts


def data_html(meta: RunMeta, outcomes) -> dict:
    """The template's context for the Data section."""
    section = meta.data
    groups = probe_groups(outcomes)
    context = {
        "sentence": source_sentence((section or {}).get("source"), meta.recipe),
        "probe_groups": groups,
        "trained_as_listed": trained_as_listed(groups, (section or {}).get("batches")),
        "checks": setup_check_rows(outcomes),
        "starved": starved_rows(outcomes),
    }
    if section:
        context.update(
            summary=f"{section['rows']} rows scanned, {section['tokens']} tokens kept, {section['rows_truncated']} "
            f"truncated, {section['rows_without_supervised']} with no supervised token.",
            svgs=[
                histogram_svg(section["histograms"]["length"], "tokens per row"),
                histogram_svg(section["histograms"]["supervised"], "supervised tokens per row"),
            ],
            findings=finding_items(section.get("findings") or []),
            special=section.get("special_tokens") or [],
            batches=batch_rows(section["batches"]),
        )
    return context

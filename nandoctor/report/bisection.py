"""Rows and sentences of a `bisect` run (its bisect.json), shared by the terminal, Markdown, HTML and
JUnit renderers so that they agree."""

from __future__ import annotations

from ..cells import AXES, Cell

PHASE_TEXT = {
    "confirm-target": "confirm the target fails",
    "confirm-baseline": "confirm the baseline passes",
    "ddmin": "ddmin: try a subset",
    "rerun": "rerun the failure",
    "minimality": "remove one culprit factor",
    "revert": "target, culprits reverted",
    "recommend": "candidate recommendation",
    "between": "a value between baseline and target",
}


def _value(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


def factor_text(b: dict, names: list[str]) -> str:
    """The target's values of some factors: 'dtype=bf16-pure, optimizer.lr=2e-05'."""
    return ", ".join(f"{n}={_value(b['factors'][n][1])}" for n in names) or "none (the baseline)"


def config_text(config: dict) -> str:
    cell = Cell.of(config).id
    return " ".join([cell] + [f"{k}={_value(v)}" for k, v in config.items() if k not in AXES])


def probe_line(done: int, record) -> str:
    """A probe has finished. Its verdict waits for the fp32 reference of its recipe variant (drift),
    so the verdicts are printed with the bisection step, not here."""
    wall = record.wall_s
    took = f"{wall:.1f}s" if wall is not None else "-"
    return f"  [{done:>3}] probe finished in {took:>7}: {record.probe_id}"


def describe_step(step: dict) -> str:
    """One line per bisection step, printed as the bisection goes. "Bisection step" everywhere: a bare
    "step" in nandoctor means a training step."""
    extra = " (data-dependent)" if step["data_dependent"] else ""
    verdicts = "/".join(sorted(set(step["verdicts"])))
    applied = ", ".join(step["factors"] + [f"{k}={v}" for k, v in (step.get("between") or {}).items()]) or "baseline"
    return (
        f"  bisection step {step['index']:>2} {step['phase']:<16} {step['outcome']:<10} {verdicts}{extra}  [{applied}]"
    )


def culprit_kind(c: dict) -> str:
    kind = "single factor" if len(c["factors"]) == 1 else f"interaction of {len(c['factors'])} factors"
    return kind + (", data-dependent" if c["data_dependent"] else "")


def evidence_verdicts(b: dict, c: dict) -> str:
    return "/".join(sorted(set(b["path"][c["evidence"]]["verdicts"])))


def headline_lines(b: dict | None) -> list[str]:
    if b is None:
        return ["The bisection did not finish: no bisect.json in this run directory."]
    lines = [f"Bisection: {b['message']}."]
    for c in b["culprits"]:
        lines.append(f"Culprit ({culprit_kind(c)}): {factor_text(b, c['factors'])} -> {evidence_verdicts(b, c)}")
    for i in b["flaky"]:
        step = b["path"][i]
        lines.append(
            f"Flaky, not used as a culprit: {factor_text(b, step['factors'])} "
            f"(verdicts {', '.join(step['verdicts'])} on identical reruns)"
        )
    rec = b.get("recommendation")
    lines.append(
        f"Recommended: {config_text(rec['config'])} (stable at bisection step {b['recommended_step']})"
        if rec
        else "No configuration tried held up as stable."
    )
    k = len(b["factors"])
    lines.append(
        f"Probes: {b['probes']} probe processes over {b['configurations']} configurations for {k} "
        f"factor(s); every mix of these factors is 2^{k} = {b['full_grid']} configurations."
    )
    return lines


def factor_rows(b: dict) -> list[dict]:
    culprits = {f for c in b["culprits"] for f in c["factors"]}
    return [
        {"factor": n, "baseline": _value(g), "target": _value(t), "culprit": "yes" if n in culprits else ""}
        for n, (g, t) in b["factors"].items()
    ]


def path_rows(b: dict) -> list[dict]:
    return [
        {
            "bisection step": s["index"],
            "tried": PHASE_TEXT.get(s["phase"], s["phase"]),
            "target factors applied": factor_text(b, s["factors"])
            + "".join(f", {k}={_value(v)} (between)" for k, v in (s.get("between") or {}).items()),
            "outcome": s["outcome"] + (" (data-dependent)" if s["data_dependent"] else ""),
            "verdicts": ", ".join(s["verdicts"]),
            "probes": "; ".join(s["probe_ids"]),
        }
        for s in b["path"]
    ]


def culprit_rows(b: dict) -> list[dict]:
    return [
        {
            "culprit": factor_text(b, c["factors"]),
            "kind": culprit_kind(c),
            "verdict": evidence_verdicts(b, c),
            "fails alone (bisection step)": c["evidence"],
            "passes without each factor (bisection steps)": ", ".join(map(str, c["minimality"])),
        }
        for c in b["culprits"]
    ]


def recommendation_lines(b: dict) -> list[str]:
    rec = b.get("recommendation")
    if not rec:
        return []
    return [rec["command"], *rec["python"]]

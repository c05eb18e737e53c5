"""The RL section (objective=grpo, docs/rl.md): per probe, how far the rollout's log-probs of the
sampled tokens were from the training path's (rollout_mismatch, as the probe measured it), and what its
steps' reward and entropy did. A table in report.md, one short line per probe in the terminal, the
table and a chart of the mean |dlogp| at each completion position (per_position) in report.html. No
verdict is made here: the figures are shown as measured."""

from __future__ import annotations

from ..analysis.outcomes import ProbeOutcome, RunAnalysis
from ..thresholds import THRESHOLDS
from .charts import line_chart
from .formatting import label

READING = (
    "Each step sampled completions through the rollout engine (`{engine}`: KV cache, inference mode, the "
    "cell's precision) and scored the same tokens teacher-forced through the training path. dlogp is a "
    "sampled token's training log-prob minus its rollout log-prob; k3 KL estimates KL(rollout || training); the "
    "sequence ratio is exp(sum of dlogp) over a completion, and masked is the share of completions TRL's "
    "default sequence mask (ratio above {cap:g}) drops. Over all timed steps' tokens; docs/rl.md says how to read them."
)


def rl_outcomes(a: RunAnalysis) -> list[ProbeOutcome]:
    return [o for o in a.outcomes if o.record.rollout_mismatch]


def engine_names(a: RunAnalysis) -> str:
    """The rollout engines the probes ran, by name (vllm, generate)."""
    return ", ".join(dict.fromkeys(o.record.rollout_mismatch.get("engine", "?") for o in rl_outcomes(a)))


def engine_notes(a: RunAnalysis) -> list[str]:
    """Which engine sampled, with which attention, and why that engine (a stand-in says what it stands in
    for): one line per distinct engine and reason."""
    seen = dict.fromkeys(
        (m.get("engine", "?"), m.get("engine_attn", "?"), m.get("engine_why"))
        for m in (o.record.rollout_mismatch for o in rl_outcomes(a))
    )
    return [f"Rollout engine: `{e}`, attention {attn}" + (f" ({why})." if why else ".") for e, attn, why in seen]


def _num(x, spec: str = ".2e") -> str:
    return "-" if not isinstance(x, (int, float)) else format(x, spec)


def _last(o: ProbeOutcome, name: str):
    return next((getattr(s, name) for s in reversed(o.record.steps) if getattr(s, name) is not None), None)


def rl_rows(a: RunAnalysis) -> list[dict]:
    """One row per probe that measured its rollouts' mismatch."""
    rows = []
    for o in rl_outcomes(a):
        m = o.record.rollout_mismatch
        ratio = m.get("ratio") or {}
        first = next((s.reward for s in o.record.steps if s.reward is not None), None)
        rows.append(
            {
                "config": label(o),
                "verdict": o.verdict.name,
                "mean abs dlogp": _num(m.get("logp_diff_mean")),
                "max abs dlogp": _num(m.get("logp_diff_max")),
                "k3 KL": _num(m.get("k3_kl")),
                "sequence ratio p10-p90": f"{_num(ratio.get('p10'), '.4f')}-{_num(ratio.get('p90'), '.4f')}",
                "min-max": f"{_num(ratio.get('min'), '.4f')}-{_num(ratio.get('max'), '.4f')}",
                "masked": _num(m.get("masked_share"), ".1%"),
                "reward": f"{_num(first, '.3f')} -> {_num(_last(o, 'reward'), '.3f')}",
                "entropy": _num(_last(o, "entropy"), ".3f"),
                **_experts(m),
            }
        )
    return rows


def _experts(m: dict) -> dict:
    """A mixture of experts' column: the share of completion tokens whose top-k experts differ between
    rollout and training, its worst layer's; nothing for a dense model."""
    experts = m.get("expert_disagreement")
    if not experts:
        return {}
    known = [s for s in experts.get("per_layer") or [] if isinstance(s, (int, float))]
    return {"experts differ (worst layer)": _num(max(known), ".1%") if known else "-"}


def rl_markdown(a: RunAnalysis) -> list[str]:
    """report.md's section: what was measured, and the table (figures as written: 7.47e-04, not 0.000747)."""
    from tabulate import tabulate

    outcomes = rl_outcomes(a)
    if not outcomes:
        return []
    m = outcomes[0].record.rollout_mismatch
    reading = READING.format(engine=engine_names(a), cap=THRESHOLDS.mask_cap(m.get("mask_cap")))
    return [
        "## RL: rollout vs training log-probs",
        "",
        reading,
        "",
        *engine_notes(a),
        "",
        tabulate(rl_rows(a), headers="keys", tablefmt="github", disable_numparse=True),
        "",
    ]


def rl_lines(a: RunAnalysis) -> list[str]:
    """The terminal's lines: one per probe, its mean |dlogp| and sequence-ratio range."""
    rows = rl_rows(a)
    if not rows:
        return []
    engine = engine_names(a)
    width = max(len(r["config"]) for r in rows)
    return ["", f"rollout ({engine}) vs training log-probs:"] + [
        f"  {r['config']:<{width}}  mean |dlogp| {r['mean abs dlogp']}  k3 KL {r['k3 KL']}  "
        f"sequence ratio {r['min-max']}  masked {r['masked']}"
        + (f"  experts differ {r['experts differ (worst layer)']}" if "experts differ (worst layer)" in r else "")
        for r in rows
    ]


def position_chart(a: RunAnalysis) -> str:
    """The mean |dlogp| at each completion position, one curve per probe, on a log axis (fp32's 1e-7 and
    bf16's 1e-3 on one chart; a position whose mean is 0 is not drawn); "" when no probe measured it."""
    series = [
        {"label": label(o), "points": list(enumerate(o.record.rollout_mismatch.get("per_position") or []))}
        for o in rl_outcomes(a)
    ]
    series = [s for s in series if s["points"]]
    if not series:
        return ""
    title = "mean |dlogp| at each completion position (0: the first sampled token)"
    return line_chart(series, title, log_y=True, width=1060, height=260, x_label="token")


def rl_html(a: RunAnalysis) -> dict | None:
    """report.html's section: the reading, the per-probe table and the per-position chart; None without
    a GRPO probe."""
    outcomes = rl_outcomes(a)
    if not outcomes:
        return None
    m = outcomes[0].record.rollout_mismatch
    reading = READING.format(engine=engine_names(a), cap=THRESHOLDS.mask_cap(m.get("mask_cap")))
    reading = " ".join([reading, *engine_notes(a)]).replace("`", "")
    return {"intro": reading, "rows": rl_rows(a), "svg": position_chart(a)}

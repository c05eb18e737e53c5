"""Property-based tests (hypothesis) of the pure layers: renderers, verdicts and ranking are fed any float
sequence a run can produce (1e300 and -1e300, inf, -inf, nan, zeros, negatives, subnormals, ints beyond
float range, one point, constant series, long series). Records are real ProbeRecords analysed the way a
run is; nothing is patched. The profile (tests/conftest.py) is derandomized: the same examples every run."""

import json
import math
import xml.etree.ElementTree as ET

import pandas as pd
from conftest import strict_json
from hypothesis import given
from hypothesis import strategies as st
from recorded import twin_meta

from nandoctor.analysis.outcomes import analyze_records, ranked_table
from nandoctor.analysis.ranking import rank
from nandoctor.analysis.verdicts import NONFINITE, STABLE, numeric_verdict
from nandoctor.cells import Cell
from nandoctor.record import ProbeRecord, Step
from nandoctor.report.charts import line_chart
from nandoctor.report.html import render_html
from nandoctor.report.junit import render_junit
from nandoctor.report.markdown import render_markdown
from nandoctor.report.matrix import matrix_panels
from nandoctor.report.summary import render_summary
from nandoctor.report.terminal import render_terminal

EDGES = [
    1e300,
    -1e300,
    1.7976931348623157e308,
    5e-324,
    -5e-324,
    0.0,
    -0.0,
    math.inf,
    -math.inf,
    math.nan,
    10**400,
    -(10**400),
    6.9,
    -3.0,
    1.0,
]
# Any float, an int beyond float range, and the edges above often enough that every example meets them.
values = st.one_of(
    st.sampled_from(EDGES),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**400), max_value=10**400),
)
finite = st.one_of(
    st.sampled_from([1e300, -1e300, 5e-324, 0.0, -3.0, 6.9]), st.floats(allow_nan=False, allow_infinity=False)
)
# One point, short curves, constant curves, and long curves (a long run's worth of steps).
series = st.one_of(
    st.lists(values, min_size=1, max_size=12),
    st.builds(lambda v, n: [v] * n, values, st.integers(1, 40)),
    st.builds(
        lambda head, v, n: head + [v] * n, st.lists(values, min_size=1, max_size=4), values, st.integers(200, 1000)
    ),
)
maybe = st.one_of(st.none(), values)
CELLS = [Cell("fp32", "eager"), Cell("fp32", "sdpa"), Cell("bf16-amp", "sdpa")]


@st.composite
def records(draw, cells=CELLS):
    """One real ProbeRecord per cell (the fp32/eager reference first), each with drawn loss, grad-norm,
    scale, time and rate series and drawn totals."""
    out = []
    for cell in cells:
        loss = draw(series)
        n = len(loss)
        grad = draw(st.one_of(st.builds(lambda v, n=n: [v] * n, values), st.lists(values, min_size=n, max_size=n)))
        scale, rate, time_s = draw(maybe), draw(maybe), draw(maybe)
        steps = [
            Step(
                i,
                loss_value,
                g,
                skipped=draw(st.booleans()) if i < 3 else False,
                scale=scale,
                time_s=time_s,
                tokens=256,
                tokens_per_s=rate,
            )
            for i, (loss_value, g) in enumerate(zip(loss, grad))
        ]
        out.append(
            ProbeRecord(
                cell.id,
                cell,
                "ok",
                steps=steps,
                recipe={"name": "tiny-llama"},
                wall_s=draw(maybe),
                peak_memory_bytes=draw(st.one_of(st.none(), st.integers(0, 2**62))),
                optimizer_state_bytes=draw(st.one_of(st.none(), st.integers(0, 2**62))),
            )
        )
    return out


def test_a_time_beyond_a_floats_range_is_inf_in_the_probe_table():
    """The int a hand-written or corrupted record can hold where a time belongs is +-inf from the
    record on, so the table's time column is all floats (a pandas that infers a column mixing floats
    with such an int raises OverflowError)."""
    recs = [
        ProbeRecord(c.id, c, "ok", steps=[Step(0, 2.0, 1.0, tokens=256)], recipe={"name": "tiny-llama"}, wall_s=w)
        for c, w in zip(CELLS, (None, 1e300, 10**400))
    ]
    assert recs[2].wall_s == math.inf
    walls = analyze_records(twin_meta(len(recs)), recs).table["wall_s"].tolist()
    assert walls[1:] == [1e300, math.inf] and all(isinstance(w, float) for w in walls[1:])


@given(records())
def test_every_renderer_returns_text_for_any_series(recs):
    a = analyze_records(twin_meta(len(recs)), recs)
    assert render_markdown(a).startswith("# nandoctor grid")
    assert "</html>" in render_html(a)
    ET.fromstring(render_junit(a).split("?>", 1)[1])
    summary = strict_json(json.dumps(render_summary(a), default=str))
    assert [p["probe_id"] for p in summary["probes"]] == [c.id for c in CELLS]
    assert "reports:" in render_terminal(a, "run")
    assert matrix_panels(a)
    csv = ranked_table(a).to_csv(index=False).splitlines()  # what `report --csv` writes
    assert csv[0].startswith("probe_id,") and csv[0].endswith(",rank") and len(csv) == 1 + len(CELLS)


@given(series, st.booleans(), st.one_of(st.none(), st.integers(0, 2000)))
def test_charts_draw_any_series(values_, log_y, mark):
    svg = line_chart(
        [
            {"label": "a", "points": list(enumerate(values_)), "fail_step": len(values_) - 1},
            {"label": "b", "points": [(i, 1.0) for i in range(3)]},
        ],
        "loss",
        log_y=log_y,
        mark_step=mark,
    )
    assert svg.startswith("<svg") and "nan" not in svg.lower().replace("nandoctor", "")


@given(
    st.lists(st.tuples(finite, finite), min_size=1, max_size=30),
    st.one_of(st.none(), st.lists(finite, min_size=1, max_size=30)),
)
def test_a_finite_series_is_never_nonfinite(pairs, reference):
    steps = [Step(i, loss, g) for i, (loss, g) in enumerate(pairs)]
    ref = [Step(i, loss, 1.0) for i, loss in enumerate(reference)] if reference else None
    assert numeric_verdict(steps, ref).name != NONFINITE


@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=30), st.data())
def test_a_series_with_a_nonfinite_value_is_never_stable(pairs, data):
    at = data.draw(st.integers(0, len(pairs) - 1))
    bad = data.draw(st.sampled_from([math.inf, -math.inf, math.nan]))
    which = data.draw(st.sampled_from(["loss", "grad_norm"]))
    steps = [Step(i, loss, g) for i, (loss, g) in enumerate(pairs)]
    setattr(steps[at], which, bad)
    assert numeric_verdict(steps, None).name != STABLE
    assert numeric_verdict(steps, [Step(i, 6.9, 1.0) for i in range(len(pairs))]).name != STABLE


@given(st.lists(finite, min_size=1, max_size=30), st.booleans())
def test_an_all_zero_gradient_series_is_never_stable(losses, with_reference):
    steps = [Step(i, loss, 0.0) for i, loss in enumerate(losses)]
    ref = [Step(i, 6.9 - 0.1 * i, 1.0) for i in range(len(losses))] if with_reference else None
    assert numeric_verdict(steps, ref).name != STABLE


@given(records(), st.randoms(use_true_random=False))
def test_verdicts_do_not_depend_on_the_order_probes_finished(recs, rng):
    shuffled = list(recs)
    rng.shuffle(shuffled)
    verdicts = {o.probe_id: (o.verdict.name, o.verdict.step) for o in analyze_records(twin_meta(3), recs).outcomes}
    again = {o.probe_id: (o.verdict.name, o.verdict.step) for o in analyze_records(twin_meta(3), shuffled).outcomes}
    assert verdicts == again


# -- ranking ---------------------------------------------------------------------------------------------

RANK_CELLS = [Cell(d, a) for d in ("fp32", "bf16-amp", "fp16-amp") for a in ("sdpa", "eager")]
rates = st.one_of(st.none(), st.sampled_from([0.0, 100.0, 101.0, 1e300, math.inf, math.nan]), st.floats(0, 1e6))
fidelities = st.one_of(st.none(), st.sampled_from([0.0, 0.004, 0.01, 1e300, math.inf, math.nan]), st.floats(0, 1))


def table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(
        rows,
        columns=[
            "probe_id",
            "dtype",
            "attn",
            "compile",
            "optimizer",
            "fidelity",
            "tokens_per_s",
            "tokens_per_s_q1",
            "tokens_per_s_q3",
            "peak_memory_bytes",
            "flags",
        ],
    )


@st.composite
def probe_rows(draw):
    cells = draw(st.lists(st.sampled_from(RANK_CELLS), min_size=1, max_size=len(RANK_CELLS), unique=True))
    rows = []
    for c in cells:
        median = draw(rates)
        spread = draw(st.one_of(st.none(), st.floats(0, 50)))
        q1, q3 = (None, None) if median is None or spread is None else (median - spread, median + spread)
        rows.append(
            {
                "probe_id": c.id,
                "dtype": c.dtype,
                "attn": c.attn,
                "compile": c.compile,
                "optimizer": c.optimizer,
                "fidelity": draw(fidelities),
                "tokens_per_s": median,
                "tokens_per_s_q1": q1,
                "tokens_per_s_q3": q3,
                "peak_memory_bytes": draw(st.one_of(st.none(), st.integers(0, 2**40))),
                "flags": draw(st.sampled_from(["", "", "rule-x"])),
            }
        )
    return rows


def known(f) -> bool:
    return f is not None and not math.isnan(f)


def test_unknown_fidelity_never_ranks_above_a_measured_one_the_reviewed_case():
    """fidelity None at 101 tok/s against fidelity 0.0 at 100 tok/s: main filled the unknown one with 0, put
    both in one bucket and one speed class, and the adoption order (fp32 before bf16-amp) ranked it first."""
    rows = [
        {
            "probe_id": "fp32/sdpa/off",
            "dtype": "fp32",
            "attn": "sdpa",
            "compile": "off",
            "optimizer": None,
            "fidelity": None,
            "tokens_per_s": 101.0,
            "tokens_per_s_q1": 101.0,
            "tokens_per_s_q3": 101.0,
            "peak_memory_bytes": 1,
            "flags": "",
        },
        {
            "probe_id": "bf16-amp/sdpa/off",
            "dtype": "bf16-amp",
            "attn": "sdpa",
            "compile": "off",
            "optimizer": None,
            "fidelity": 0.0,
            "tokens_per_s": 100.0,
            "tokens_per_s_q1": 100.0,
            "tokens_per_s_q3": 100.0,
            "peak_memory_bytes": 1,
            "flags": "",
        },
    ]
    assert list(rank(table(rows))["probe_id"]) == ["bf16-amp/sdpa/off", "fp32/sdpa/off"]
    # clearly faster, still unknown
    rows[0]["tokens_per_s"] = rows[0]["tokens_per_s_q1"] = rows[0]["tokens_per_s_q3"] = 1000.0
    assert list(rank(table(rows))["probe_id"]) == ["bf16-amp/sdpa/off", "fp32/sdpa/off"]


@given(probe_rows())
def test_unknown_fidelity_never_ranks_above_a_measured_one(rows):
    ranked = list(rank(table(rows))["fidelity"])
    first_unknown = next((i for i, f in enumerate(ranked) if not known(f)), len(ranked))
    assert all(not known(f) for f in ranked[first_unknown:]), ranked


@given(probe_rows(), st.randoms(use_true_random=False))
def test_the_ranking_is_a_total_order_whatever_the_row_order(rows, rng):
    shuffled = list(rows)
    rng.shuffle(shuffled)
    first, second = rank(table(rows)), rank(table(shuffled))
    assert sorted(first["probe_id"]) == sorted(r["probe_id"] for r in rows)  # every row ranked once
    assert list(first["probe_id"]) == list(second["probe_id"])
    assert list(first["speed_class"]) == list(second["speed_class"])

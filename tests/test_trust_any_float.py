"""Every renderer takes any float: a diverging run's 1e300, an int too large for a float, a subnormal,
inf, nan, negatives, a single point. Records are real ProbeRecords analysed the way a run is; the
renderers run unpatched. Fast: no training step runs."""

import itertools
import json
import math
import random
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

from conftest import strict_json
from recorded import twin_meta

from nandoctor.analysis.outcomes import analyze_records
from nandoctor.cells import Cell
from nandoctor.cli import main
from nandoctor.record import ProbeRecord, Step
from nandoctor.report.charts import line_chart
from nandoctor.report.failures import failure_classes, failure_line
from nandoctor.report.forensics import explain_text, fmt_fraction, fmt_ratio, fmt_value
from nandoctor.report.formatting import fmt_bytes, fmt_fidelity, fmt_loss, fmt_rate, headline
from nandoctor.report.html import render_html
from nandoctor.report.junit import render_junit
from nandoctor.report.markdown import render_markdown
from nandoctor.report.summary import render_summary
from nandoctor.report.terminal import render_terminal

LR30_RUN = (
    Path(__file__).parent / "fixtures" / "run-lr30"
)  # `grid --axis dtype=fp32 --axis attn=sdpa --set optimizer.lr=30`
PATHOLOGICAL = [
    1e300,
    -1e300,
    10**400,
    -(10**400),
    1.7976931348623157e308,
    1e-300,
    5e-324,
    -5e-324,
    math.inf,
    -math.inf,
    math.nan,
    -3.0,
    0.0,
    6.9,
    6.9 + 1e-15,
]


def record(cell: Cell, values: list, rng: random.Random) -> ProbeRecord:
    steps = [
        Step(
            i,
            loss,
            rng.choice(PATHOLOGICAL),
            scale=rng.choice([None, 65536.0, math.inf]),
            time_s=rng.choice([0.0, 1e-300, math.nan, 1.0]),
            tokens=256,
            tokens_per_s=rng.choice(PATHOLOGICAL),
            groups=rng.choice([None, {"adapter": rng.choice(PATHOLOGICAL + [None]), "rest": rng.choice(PATHOLOGICAL)}]),
        )
        for i, loss in enumerate(values)
    ]
    # the step-0 setup checks and the per-group accounting, every figure pathological too
    figures = (
        "packing_max_logit_diff",
        "packing_floor",
        "accumulation_error",
        "accumulation_floor",
        "accumulation_cosine",
        "accumulation_norm_ratio",
    )
    setup = {name: rng.choice(PATHOLOGICAL + [None]) for name in figures if rng.random() < 0.7}
    return ProbeRecord(
        cell.id,
        cell,
        "ok",
        steps=steps,
        recipe={"name": "tiny-llama"},
        wall_s=rng.choice([math.nan, 1e300, 2.0]),
        peak_memory_bytes=rng.choice([None, 2**62, 2**40]),
        optimizer_state_bytes=rng.choice([None, 2**62]),
        setup_checks={**setup, "loss_normalization": "micro_batch", "packing_segments": 2} if setup else None,
        trainable_groups={"adapter": {"tensors": 8, "elements": 10**400, "first": "lora_A"}},
        data={"batches": [{"kind": "first", "rows": [0, 1]}]},
    )


def runs(n: int = 30):
    """Runs of three probes (the fp32/eager reference among them): single points, flat curves and
    curves mixing every pathological value, drawn from a seeded generator."""
    rng = random.Random(0)
    shapes = (
        [[v] for v in PATHOLOGICAL]
        + [[v] * 4 for v in PATHOLOGICAL]
        + [list(pair) for pair in itertools.combinations(PATHOLOGICAL, 2)]
    )
    cells = [Cell("fp32", "eager"), Cell("fp32", "sdpa"), Cell("bf16-amp", "sdpa")]
    for _ in range(n):
        yield [
            record(
                c,
                rng.choice(shapes)
                if rng.random() < 0.5
                else [rng.choice(PATHOLOGICAL) for _ in range(rng.randint(1, 6))],
                rng,
            )
            for c in cells
        ]


def test_every_renderer_takes_any_float():
    for records in runs():
        a = analyze_records(twin_meta(len(records), "any-float", 10**400), records)
        assert render_markdown(a).startswith("# nandoctor grid")
        assert "</html>" in render_html(a)
        ET.fromstring(render_junit(a).split("?>", 1)[1])
        summary = strict_json(json.dumps(render_summary(a)))
        assert len(summary["probes"]) == 3
        assert "reports:" in render_terminal(a, "run")
        assert all(explain_text(o) for o in a.outcomes)
        assert all(failure_line(c) for c in failure_classes(a)) and headline(a)


def test_an_int_beyond_float_range_is_an_infinite_step_value():
    s = Step(0, 10**400, -(10**400))
    assert (s.loss, s.grad_norm) == (math.inf, -math.inf)


def test_formatters_take_any_float():
    for v in PATHOLOGICAL + [None]:
        for fmt in (fmt_bytes, fmt_fidelity, fmt_loss, fmt_rate, fmt_ratio, fmt_value, fmt_fraction):
            assert isinstance(fmt(v), str)


def test_charts_draw_any_series_without_a_non_finite_coordinate():
    rng = random.Random(0)
    curves = [list(v) for n in (1, 2) for v in itertools.product(PATHOLOGICAL[::2], repeat=n)]
    curves += [[rng.choice(PATHOLOGICAL) for _ in range(rng.randint(3, 8))] for _ in range(100)]
    for log_y in (False, True):
        for values in curves:
            svg = line_chart(
                [{"label": "a", "points": list(enumerate(values)), "fail_step": len(values)}],
                "loss",
                log_y=log_y,
                mark_step=0,
            )
            coordinates = re.findall(r'\b(?:x|y|x1|x2|y1|y2|cx|cy|points|height|viewBox)="([^"]*)"', svg)
            assert coordinates and not any(bad in c for c in coordinates for bad in ("nan", "inf")), (values, log_y)


def test_huge_losses_are_labelled_in_powers_of_ten():
    svg = line_chart([{"label": "lr=30", "points": [(0, 6.9), (1, 1e300), (2, 3e300)]}], "loss")
    assert "e+300" in svg
    svg = line_chart([{"label": "grad", "points": [(0, 1.0), (1, 10**400)]}], "grad-norm", log_y=True)
    assert "e+400" in svg  # an int beyond float range still has a log10


def test_report_of_the_lr30_run_writes_every_file(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(LR30_RUN, run)
    assert main(["report", str(run)]) == 1  # no stable configuration: lr=30 diverges every cell
    assert {"report.md", "report.html", "junit.xml", "summary.json"} <= {p.name for p in run.iterdir()}
    summary = strict_json((run / "summary.json").read_text())
    assert [p["verdict"] for p in summary["probes"]] == ["diverged", "nonfinite"]
    stats = summary["probes"][1]["forensics"]["origin"]["stats"]  # the overflowed gradient, as strings float() reads
    assert (stats["min"], stats["max"]) == ("-Infinity", "Infinity") and float(stats["min"]) == -math.inf
    assert "<svg" in (run / "report.html").read_text()


def test_verdicts_take_any_float():
    """numeric_verdict over seeded random curves of pathological values, against a reference or not."""
    from nandoctor.analysis.verdicts import numeric_verdict

    rng = random.Random(0)
    for _ in range(2000):
        steps = [Step(i, rng.choice(PATHOLOGICAL), rng.choice(PATHOLOGICAL)) for i in range(rng.randint(1, 7))]
        reference = (
            [Step(i, rng.choice(PATHOLOGICAL), 1.0) for i in range(rng.randint(1, 7))] if rng.random() < 0.5 else None
        )
        assert numeric_verdict(steps, reference).reason

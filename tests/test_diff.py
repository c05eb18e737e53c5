"""The comparison of a run with a baseline (analysis/diff.py) on probe records: which cells regressed,
how curves and step-0 values compare within their dtype's tolerance, and what the renderers make of it.
Pure: no torch, no processes (except the one CLI test of bad input)."""

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

from recorded import TWIN_PLAN

from nandoctor.analysis.diff import (
    BIT_IDENTICAL,
    CHANGED,
    NOW_UNSUPPORTED,
    PARTED,
    SAME,
    WITHIN_TOLERANCE,
    compare_curves,
    compare_runs,
    golden_tolerance,
    throughput_noise,
)
from nandoctor.analysis.outcomes import analyze, analyze_records
from nandoctor.cells import Cell
from nandoctor.config import Recipe, recipe_to_dict, set_field
from nandoctor.record import ProbeRecord, Step, Throughput
from nandoctor.report.diff import (
    curve_text,
    render_diff_html,
    render_diff_markdown,
    render_diff_summary,
    render_diff_terminal,
)
from nandoctor.report.junit import render_junit

FIXTURE = Path(__file__).parent / "fixtures" / "run-before-issue-9"
ENV = {
    "torch": "2.13.0+cpu",
    "transformers": "5.23.0",
    "peft": "0.21.2",
    "cuda": None,
    "cudnn": None,
    "gpus": [],
    "python": "3.11.7",
    "cpu_model": "AMD EPYC",
    "nccl": None,
}
PLAN = {**TWIN_PLAN, "shape": {}}


def falling(n=8, start=8.3, rate=0.1, tokens_per_s=1000.0):
    return [Step(i, start - rate * i, 1.0, tokens_per_s=tokens_per_s) for i in range(n)]


def record(cell: str, steps, recipe=None, status="ok", **kw) -> ProbeRecord:
    c = Cell.parse(cell)
    return ProbeRecord(c.id, c, status, steps=steps, recipe=recipe_to_dict(recipe or Recipe()), **kw)


def run(records, recipe=None, env=None, kind="grid"):
    meta = {
        "kind": kind,
        "run_id": kind,
        "recipe": recipe_to_dict(recipe or Recipe()),
        "env": env or ENV,
        "model_plan": PLAN,
        "steps": 8,
        "seed": 0,
        "created": "now",
        "planned": len(records),
    }
    return analyze_records(meta, records)


def grid(bf16_steps, recipe=None, env=None):
    """fp32 reference + bf16-pure, the bf16 curve given."""
    return run(
        [record("fp32/eager/off", falling(), recipe), record("bf16-pure/sdpa/off", bf16_steps, recipe)], recipe, env
    )


def test_a_run_diffed_with_itself_is_no_change_and_exits_0():
    d = compare_runs(analyze(FIXTURE), analyze(FIXTURE))
    assert d.unchanged and d.exit_code == 0 and not d.regressions
    assert {c.curve.status for c in d.cells} == {BIT_IDENTICAL}
    assert render_diff_terminal(d).splitlines()[-1].startswith("No change: 4 cell(s)")


def test_a_stable_cell_that_drifts_regresses_and_the_differing_setting_is_named():
    slow = set_field(Recipe(), "optimizer.lr", "2e-5")
    before = grid(falling())
    after = grid(
        [Step(i, 8.3 + 0.03 * (i % 4), 1.0) for i in range(8)], slow
    )  # bf16 stalls (its updates round away): the loss only moves with the batch
    d = compare_runs(before, after)
    assert [c.probe_id for c in d.regressions] == ["bf16-pure/sdpa/off"]
    assert d.regressions[0].verdicts == "stable -> drift" and d.exit_code == 1
    assert [(s.name, s.before, s.after) for s in d.settings] == [("recipe.optimizer.lr", "0.001", "2e-05")]
    assert after.exit_code == 0  # the plain grid is fine: a drifting cell is a finding, not an error
    after.comparison = d
    assert after.exit_code == 1


def test_regressed_cells_are_failed_junit_cases_and_the_others_pass():
    after = grid([Step(i, 8.3 + 0.03 * (i % 4), 1.0) for i in range(8)])
    after.comparison = compare_runs(grid(falling()), after)
    suite = ET.fromstring(render_junit(after))
    cases = {c.get("name"): c for c in suite if c.get("classname") == "nandoctor.baseline"}
    assert set(cases) == {"fp32/eager/off", "bf16-pure/sdpa/off"}
    assert cases["bf16-pure/sdpa/off"].find("failure").get("type") == "regressed"
    assert cases["fp32/eager/off"].find("failure") is None
    assert (
        int(suite.get("tests")) == 4 and int(suite.get("failures")) == 2
    )  # the drift probe's own case + its regression


def test_a_new_crash_regresses_even_from_a_failing_cell():
    nan = [Step(0, 8.3, 1.0), Step(1, math.nan, math.nan)]
    crashed = record(
        "bf16-pure/sdpa/off", [], status="error", error={"type": "RuntimeError", "message": "boom", "traceback": ""}
    )
    d = compare_runs(grid(nan), run([record("fp32/eager/off", falling()), crashed]))
    assert d.regressions[0].probe_id == "bf16-pure/sdpa/off" and d.regressions[0].verdicts == "nonfinite -> crash"


def test_one_failure_turning_into_another_is_a_change_not_a_regression():
    nan = [Step(0, 8.3, 1.0), Step(1, math.nan, math.nan)]
    zero = [Step(0, 8.3, 1.0), Step(1, 0.0, 1.0)]
    d = compare_runs(grid(nan), grid(zero))
    assert [c.change for c in d.cells if c.probe_id == "bf16-pure/sdpa/off"] == [CHANGED] and d.exit_code == 0


def test_a_cell_the_device_no_longer_runs_is_reported_not_regressed():
    gone = record("bf16-pure/sdpa/off", [], status="unsupported", reason="bf16 needs a GPU with bf16 support")
    d = compare_runs(grid(falling()), run([record("fp32/eager/off", falling()), gone]))
    assert [c.change for c in d.cells if c.probe_id == "bf16-pure/sdpa/off"] == [NOW_UNSUPPORTED] and d.exit_code == 0


def test_fidelity_worse_by_more_than_one_ranking_bucket_regresses_within_it_does_not():
    base = grid(falling())
    near = grid([Step(s.step, s.loss * 1.004, 1.0) for s in falling()])  # 0.4% off fp32: inside the 0.5-point bucket
    far = grid([Step(s.step, s.loss * 1.007, 1.0) for s in falling()])
    assert compare_runs(base, near).exit_code == 0
    d = compare_runs(base, far)
    assert d.regressions[0].probe_id == "bf16-pure/sdpa/off" and "fidelity" in d.regressions[0].why


def test_curves_compare_bit_identical_within_the_dtype_tolerance_or_parted():
    base = falling()
    assert compare_curves(base, base, 1e-5).status == BIT_IDENTICAL
    nudged = [Step(s.step, s.loss * (1 + 1e-6 * (s.step >= 3)), 1.0) for s in base]
    within = compare_curves(base, nudged, 1e-5)
    assert (within.status, within.first_difference, within.parted_at) == (WITHIN_TOLERANCE, 3, None)
    apart = compare_curves(base, [Step(s.step, s.loss + 0.01 * (s.step >= 5), 1.0) for s in base], 1e-5)
    assert (apart.status, apart.parted_at) == (PARTED, 5)


def test_curves_of_probes_that_trained_on_different_thread_counts_say_so():
    """A probe on a busy host trains on the cores left free (child/threads.py); its loss's last digits
    follow the thread count, which the curve comparison names beside the difference."""
    nudged = [Step(s.step, s.loss * (1 + 1e-7 * (s.step >= 3)), 1.0, tokens_per_s=1000.0) for s in falling()]

    def probes(steps, threads):
        cells = ("fp32/eager/off", "fp32/sdpa/off")
        return run([record(c, steps, cpu_threads={"torch": threads, "planned": 2}) for c in cells])

    d = compare_runs(probes(falling(), 2), probes(nudged, 1))
    cell = next(c for c in d.cells if c.probe_id == "fp32/sdpa/off")
    assert cell.threads == (2, 1) and cell.curve.status == WITHIN_TOLERANCE
    assert curve_text(cell).endswith("; trained on 2 -> 1 CPU threads)")
    same = next(c for c in compare_runs(probes(falling(), 2), probes(nudged, 2)).cells if c.probe_id == cell.probe_id)
    assert same.threads is None and "threads" not in curve_text(same)


def test_the_golden_tolerance_follows_the_matmul_dtype():
    fp32, bf16, fp16, tf32 = (
        golden_tolerance(record(c, []))
        for c in ("fp32/sdpa/off", "bf16-pure/sdpa/off", "fp16-amp/sdpa/off", "tf32/sdpa/off")
    )
    assert fp32 == (1e-5, 1e-5)
    assert bf16 == (2**-7, 4 * 2**-7) and fp16 == tf32 == (2**-10, 4 * 2**-10)


def step0(cell, loss, grad):
    return record(cell, [Step(0, loss, grad)])


def test_check_baseline_fails_a_step0_move_beyond_fp32_tolerance_that_bf16_tolerates():
    # bf16-pure/sdpa/off's step 0 as measured on this CPU with ATEN_CPU_CAPABILITY=AVX2, then =default:
    # the loss moved 1.7e-6 (relative), the grad-norm 0.6%
    for cell, moved in (("fp32/sdpa/off", True), ("bf16-pure/sdpa/off", False)):
        d = compare_runs(
            run([step0(cell, 8.308724403381348, 5.0)], kind="check"),
            run([step0(cell, 8.308710098266602, 5.03125)], kind="check"),
        )
        change = d.cells[0]
        assert [g.passed for g in change.golden] == [True, not moved]
        assert change.regressed is moved and d.exit_code == int(moved)


def test_check_against_a_grid_compares_only_the_checked_cell():
    d = compare_runs(grid(falling()), run([record("bf16-pure/sdpa/off", falling()[:1])], kind="check"))
    assert [c.probe_id for c in d.cells] == ["bf16-pure/sdpa/off"] and d.cells[0].change == SAME
    assert d.recommendation == (None, None)


def test_throughput_noise_is_measured_from_the_steps_else_the_default_band():
    steps = [Step(i, 8.0, 1.0, tokens_per_s=r) for i, r in enumerate([50.0, 100.0, 90.0, 110.0, 100.0, 95.0, 105.0])]
    assert 0.05 < throughput_noise(record("fp32/sdpa/off", steps)) < 0.2
    assert throughput_noise(record("fp32/sdpa/off", steps[:3])) is None
    measured = Throughput.of_rates([90.0, 100.0, 110.0, 100.0])  # a record that carries its steady-step spread
    assert throughput_noise(record("fp32/sdpa/off", steps[:3], throughput=measured)) == measured.spread
    quick, slow = grid(falling(3, tokens_per_s=1000.0)), grid(falling(3, tokens_per_s=500.0))  # 2 timed steps: too few
    c = next(c for c in compare_runs(quick, slow).cells if c.probe_id == "bf16-pure/sdpa/off")
    assert c.tokens_per_s.band == 0.10 and c.tokens_per_s.moved and c.tokens_per_s.change == -0.5


def test_environment_differences_and_facts_only_one_run_recorded():
    newer = {**ENV, "torch": "2.14.0+cu128", "cudnn": 91000, "nvml": {"driver": "580.1"}}
    d = compare_runs(grid(falling()), grid(falling(), env=newer))
    assert [(e.name, e.before, e.after) for e in d.environment] == [
        ("torch", "2.13.0+cpu", "2.14.0+cu128"),
        ("cuDNN", "-", "91000"),
    ]
    assert d.unrecorded == ["driver"] and not d.unchanged and d.exit_code == 0


def test_a_run_written_before_this_issue_diffs_with_one_written_today():
    old = analyze(FIXTURE)
    today = [ProbeRecord.from_dict(json.loads(json.dumps(r.record.to_dict()))) for r in old.outcomes]
    meta = {
        **old.meta.to_dict(),
        "recipe": recipe_to_dict(Recipe()),
        "baseline": None,
    }  # today's recipe has sections the old lacks
    d = compare_runs(old, analyze_records(meta, today))
    assert not d.settings and d.unchanged


def test_every_renderer_takes_non_finite_numbers():
    weird = [Step(0, 1e300, math.inf), Step(1, math.nan, math.nan)]
    d = compare_runs(grid(falling()), grid(weird))
    text = (
        render_diff_markdown(d)
        + render_diff_html(d)
        + render_diff_terminal(d)
        + json.dumps(render_diff_summary(d), default=str)
    )
    assert "bf16-pure/sdpa/off" in text and "<script" not in text and 'src="http' not in text  # self-contained HTML


def test_diff_of_a_missing_run_is_one_line_and_exit_2(cli, tmp_path):
    proc = cli("diff", FIXTURE, tmp_path / "nothing")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr


def test_check_against_a_baseline_without_its_cell_is_one_line_and_exit_2(cli):
    proc = cli("check", "--dtype", "bf16-amp", "--attn", "sdpa", "--baseline", FIXTURE)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "has no probe of bf16-amp/sdpa/off; it has fp32/eager/off" in proc.stderr

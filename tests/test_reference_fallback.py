"""No verdict without its reference: when the fp32/eager probe fails, drift is judged against another
fp32 probe that trained (and the reports name it), or the reports say first that drift was not judged,
and a probe whose fidelity is unknown is never recommended as if it were known."""

from __future__ import annotations

from recorded import meta

from nandoctor.analysis.run import analyze_records
from nandoctor.analysis.verdicts import DRIFT, OOM, STABLE, References
from nandoctor.cells import Cell
from nandoctor.config import Recipe, recipe_to_dict
from nandoctor.record import ProbeRecord, Step
from nandoctor.report.common import headline
from nandoctor.report.markdown import render_markdown
from nandoctor.report.summary import render_summary
from nandoctor.report.terminal import render_terminal

RECIPE = recipe_to_dict(Recipe(name="tiny-llama"))
FALLS = [6.93, 6.2, 5.1, 4.0, 3.1, 2.4, 1.9, 1.6]  # an fp32 curve learning the copy task
STALLS = [6.93, 6.9, 6.88, 6.87, 6.86, 6.86, 6.85, 6.85]  # bf16-pure: updates round away, it barely moves


def probe(cell: str, losses: list[float] | None, error: str | None = None) -> ProbeRecord:
    c = Cell.parse(cell)
    if error:
        failed = {"type": "OutOfMemoryError", "message": error, "traceback": "", "oom": True}
        return ProbeRecord(c.id, c, "error", seed=0, recipe=RECIPE, error=failed)
    steps = [Step(i, x, 1.0, time_s=0.1, tokens=64, tokens_per_s=640.0) for i, x in enumerate(losses)]
    return ProbeRecord(c.id, c, "ok", seed=0, recipe=RECIPE, steps=steps)


OOMED = probe("fp32/eager/off", None, "CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_stalled_bf16_pure_curve_is_drift_next_to_a_stable_reference():
    refs = References()
    for r in (probe("fp32/eager/off", FALLS), probe("bf16-pure/sdpa/off", STALLS)):
        refs.learn(r)
    assert refs.judge(probe("bf16-pure/sdpa/off", STALLS)).name == DRIFT


def test_another_fp32_probe_stands_in_when_the_reference_ran_out_of_memory():
    records = [OOMED, probe("fp32/sdpa/off", FALLS), probe("bf16-pure/sdpa/off", STALLS)]
    a = analyze_records(meta(), records)
    verdicts = {o.probe_id: o.verdict for o in a.outcomes}
    assert verdicts["fp32/eager/off"].name == OOM
    assert verdicts["bf16-pure/sdpa/off"].name == DRIFT
    assert "fp32 reference fp32/sdpa/off" in verdicts["bf16-pure/sdpa/off"].reason
    assert a.recommended.probe_id == "fp32/sdpa/off"
    said = headline(a)
    assert "against fp32/sdpa/off, standing in for the fp32 reference" in said[1]
    assert "fp32/eager/off ended oom" in said[1]


def test_with_no_fp32_probe_that_trained_drift_is_said_unjudged_first_in_every_report(tmp_path):
    a = analyze_records(meta(), [OOMED, probe("bf16-pure/sdpa/off", STALLS)])
    (stalled,) = [o for o in a.outcomes if o.probe_id == "bf16-pure/sdpa/off"]
    assert stalled.verdict.name == STABLE and stalled.fidelity is None
    assert a.recommended is stalled  # the only stable probe, but not silently:
    said = headline(a)
    assert said[0].startswith("Recommended: bf16-pure/sdpa/off (fidelity not judged: no fp32 reference")
    assert said[1].startswith("Drift was not judged: the fp32 reference fp32/eager/off ended oom")
    terminal = render_terminal(a, tmp_path).splitlines()
    assert any(line.startswith("Drift was not judged") for line in terminal[:5])
    markdown = render_markdown(a).splitlines()
    assert any(line.startswith("- Drift was not judged") for line in markdown[:8])
    summary = render_summary(a)
    assert summary["drift_judged"] is False
    assert summary["references"][0]["reference"] is None
    assert "out of memory" in summary["references"][0]["why"]

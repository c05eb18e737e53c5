"""No verdict without its reference: when the fp32/eager probe fails, drift is judged against another
fp32 probe that trained (and the reports name it), or the reports say first that drift was not judged,
and a probe whose fidelity is unknown is never recommended as if it were known."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import record_list, run_main
from recorded import FIXTURE, meta

from nandoctor.analysis.outcomes import analyze_records
from nandoctor.analysis.verdicts import DRIFT, OOM, STABLE, References
from nandoctor.cells import Cell
from nandoctor.config import Recipe, recipe_to_dict
from nandoctor.record import ProbeRecord, Step
from nandoctor.report.formatting import headline
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


def test_a_reference_that_finished_without_training_stably_is_stood_in_for():
    """A finished fp32/eager probe is a reference only if it trains stably on its own: one whose loss
    went NaN at step 3 finished all the same, and a curve judged against it would meet NaN at every
    step and pass; another fp32 probe that trained stands in."""
    refs = References()
    broke = probe("fp32/eager/off", FALLS[:3] + [float("nan")] + FALLS[4:])
    for r in (broke, probe("fp32/sdpa/off", FALLS), probe("bf16-pure/sdpa/off", STALLS)):
        refs.learn(r)
    ref = refs.reference(probe("bf16-pure/sdpa/off", STALLS))
    assert (ref.probe_id, ref.stands_in) == ("fp32/sdpa/off", True)
    assert "fp32/eager/off ended nonfinite at step 3" in ref.why
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
    assert any(line.startswith("Drift was not judged") for line in terminal[:7])  # after the model and twin lines
    markdown = render_markdown(a).splitlines()
    assert any(line.startswith("- Drift was not judged") for line in markdown[:10])
    summary = render_summary(a)
    assert summary["drift_judged"] is False
    assert summary["references"][0]["reference"] is None
    assert "out of memory" in summary["references"][0]["why"]


class RecordedSession:
    """What ProbeOracle asks of a Session: a device, and run(recipe, probes) -> their records. Each cell
    ends as `outcomes` says (a curve, or an out-of-memory error)."""

    def __init__(self, outcomes: dict):
        from nandoctor.env import collect_summary

        self.device, self.outcomes, self.ran = collect_summary(), outcomes, []

    def run(self, recipe, probes):
        self.ran += [p.probe_id for p in probes]
        out = []
        for p in probes:
            curve = self.outcomes[p.cell.id]
            r = probe(p.cell.id, *((None, curve) if isinstance(curve, str) else (curve,)))
            r.probe_id, r.recipe = p.probe_id, recipe_to_dict(p.recipe or Recipe(name="tiny-llama"))
            out.append(r)
        return out


def test_bisects_oracle_runs_an_fp32_stand_in_when_the_reference_ran_out_of_memory():
    from nandoctor.bisect.engine import Trial
    from nandoctor.bisect.factors import BASELINE_AXES
    from nandoctor.bisect.oracle import ProbeOracle

    session = RecordedSession(
        {"fp32/eager/off": "CUDA out of memory", "fp32/sdpa/off": FALLS, "bf16-pure/sdpa/off": STALLS}
    )
    oracle = ProbeOracle(session, Recipe(name="tiny-llama"))
    (run,) = oracle([Trial({**BASELINE_AXES, "dtype": "bf16-pure", "attn": "sdpa"})])
    assert session.ran == ["bf16-pure/sdpa/off", "fp32/eager/off", "fp32/sdpa/off"]
    assert run.verdict == DRIFT and run.failed


def test_bisects_oracle_without_any_fp32_probe_that_trained_says_nothing_was_judged():
    from nandoctor.bisect.engine import Trial
    from nandoctor.bisect.factors import BASELINE_AXES
    from nandoctor.bisect.oracle import ProbeOracle

    session = RecordedSession(
        {"fp32/eager/off": "CUDA out of memory", "fp32/sdpa/off": "CUDA out of memory", "bf16-pure/sdpa/off": STALLS}
    )
    oracle = ProbeOracle(session, Recipe(name="tiny-llama"))
    (run,) = oracle([Trial({**BASELINE_AXES, "dtype": "bf16-pure", "attn": "sdpa"})])
    assert run.verdict == STABLE
    (note,) = oracle.references.notes()
    assert note.probe_id is None and "fp32/eager/off ended oom" in note.sentence()


@pytest.mark.parametrize("failed", [("fp32/eager/off",), ("fp32/eager/off", "fp32/sdpa/off")])
def test_nandoctor_report_says_first_which_fp32_probe_judged_drift_or_that_none_did(tmp_path, failed):
    """A recorded run (fp32 and fp16-pure x eager and sdpa, 3 steps) whose fp32 probes ran out of memory,
    as an executor's memory limit records it: `nandoctor report` writes every report with the
    reference it used, or with the sentence that drift was not judged, in its first lines."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    records = record_list(run)
    oom = {"type": "OutOfMemoryError", "message": "CUDA out of memory. Tried to allocate 2.00 GiB", "oom": True}
    for r in records:
        if r["probe_id"] in failed:
            r.update(status="error", steps=[], error={**oom, "traceback": ""})
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = run_main("report", run)
    said = (
        "Drift was judged against fp32/sdpa/off, standing in for the fp32 reference: the fp32 reference "
        "fp32/eager/off ended oom"
        if len(failed) == 1
        else "Drift was not judged: the fp32 reference fp32/eager/off ended oom"
    )
    assert any(line.startswith(said) for line in proc.stdout.splitlines()[:6]), proc.stdout
    md = (run / "report.md").read_text().splitlines()
    assert any(line.startswith(f"- {said}") for line in md[:8])
    html = (run / "report.html").read_text()
    answer = html.split('id="recommendation">', 1)[1].split("</div>", 1)[0]
    assert said in answer
    summary = json.loads((run / "summary.json").read_text())
    assert summary["drift_judged"] is (len(failed) == 1)
    assert summary["references"][0]["reference"] == ("fp32/sdpa/off" if len(failed) == 1 else None)

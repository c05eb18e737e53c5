"""What `nandoctor diff` says must be true (issue 28, item 7): a probe the scheduler lost is no
regression, and "No change" is never said above a number that moved beyond its noise. Pure: records
in, a RunDiff and its renderings out."""

from test_diff import falling, record, run

from nandoctor.analysis.diff import NOT_COMPARED, compare_runs
from nandoctor.cells import Cell
from nandoctor.config import Recipe, recipe_to_dict
from nandoctor.record import ProbeRecord, Step
from nandoctor.report.diff import render_diff_markdown, render_diff_summary, render_diff_terminal

CELLS = ("fp32/eager/off", "fp32/sdpa/off", "bf16-amp/sdpa/off")


def lost(cell: str) -> ProbeRecord:
    c = Cell.parse(cell)
    why = "the scheduler lost this probe on 2 attempts (NODE_FAIL; NODE_FAIL)"
    return ProbeRecord(c.id, c, "lost", reason=why, recipe=recipe_to_dict(Recipe()))


def rated(rates) -> list[Step]:
    """The same falling loss curve at these per-step tokens/s."""
    return [Step(i, 8.3 - 0.1 * i, 1.0, tokens_per_s=r) for i, r in enumerate(rates)]


def test_a_probe_the_scheduler_lost_is_not_a_regression():
    before = run([record(c, falling()) for c in CELLS])
    after = run([record(c, falling()) for c in CELLS[:2]] + [lost(CELLS[2])])
    d = compare_runs(before, after)
    change = next(c for c in d.cells if c.probe_id == CELLS[2])
    assert change.change == NOT_COMPARED and not change.regressed
    assert d.exit_code == 0 and d.regressions == []
    assert "says nothing about the configuration" in change.why and "lost in this run" in change.why
    head = render_diff_terminal(d).splitlines()[-len(d.cells) :]
    assert not any(line.startswith("Regressed") for line in head)
    assert render_diff_summary(d)["regressed"] == []
    # and lost in the baseline, stable now: not a fix either, nothing was known before
    back = compare_runs(after, before)
    assert next(c for c in back.cells if c.probe_id == CELLS[2]).change == NOT_COMPARED and back.exit_code == 0


def test_no_change_is_never_said_above_a_number_that_moved_beyond_noise():
    # the figures: 9,032 -> 7,969 tokens/s on one of 3 cells, every loss curve bit-identical
    quiet = [1000, 9000, 9032, 9050, 9010, 9040, 9020, 9060]
    slower = [1000, 7950, 7969, 7990, 7940, 7980, 7960, 7970]
    before = run([record(c, rated(quiet)) for c in CELLS])
    after = run([record(c, rated(quiet)) for c in CELLS[:2]] + [record(CELLS[2], rated(slower))])
    d = compare_runs(before, after)
    text = render_diff_terminal(d)
    assert "No change" not in text and "(beyond noise)" in text
    assert [c.probe_id for c in d.moved] == [CELLS[2]] and d.unchanged and d.exit_code == 0  # same numerics
    said = [line for line in text.splitlines() if line.startswith("Beyond noise: ")]
    assert said == [f"Beyond noise: {CELLS[2]} tokens/s 9,032 -> 7,969 (-11.8%, noise ±0.44%)"]
    first = "No regression: 3 cell(s), same verdicts, every loss curve bit-identical."
    assert render_diff_markdown(d).splitlines()[4] == f"**{first}**"
    assert render_diff_summary(d)["moved"] == [CELLS[2]]

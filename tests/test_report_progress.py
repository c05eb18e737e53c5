"""What a grid prints while it goes (issue 29, item 5): the cells the device cannot run are one summary
line (how many, which axis values, why in short), not one line each; every probe that ran keeps its
line. On a CPU the Quickstart's default grid has 22 CUDA-only cells among its 42."""

import pytest
from conftest import run_cli

from nandoctor.analysis.verdicts import References
from nandoctor.cells import Cell
from nandoctor.cli.grid import GridProgress
from nandoctor.config import Recipe
from nandoctor.plan import plan_grid
from nandoctor.record import ProbeRecord, Step

CPU = {"device": "cpu", "cpu_count": 2, "gpus": []}


def records_of_the_default_grid() -> list[ProbeRecord]:
    """The default grid's cells on a CPU in plan order: the unsupported ones as the session records them
    (before any probe runs), then a stable probe for each other."""
    planned = plan_grid(Recipe(), CPU, None, {})
    unsupported = [
        ProbeRecord(p.probe_id, p.cell, "unsupported", reason=p.unsupported) for p in planned if p.unsupported
    ]
    ran = [
        ProbeRecord(p.probe_id, p.cell, "ok", steps=[Step(i, 8.0 - 0.1 * i, 1.0) for i in range(4)], wall_s=0.4)
        for p in planned
        if not p.unsupported
    ]
    return unsupported + ran


def test_the_cuda_only_cells_of_the_default_grid_are_one_line_and_every_probe_that_ran_has_its_own(capsys):
    records = records_of_the_default_grid()
    assert (len(records), sum(r.status == "unsupported" for r in records)) == (42, 22)
    printer, references = GridProgress(), References()
    for done, record in enumerate(records, 1):
        references.learn(record)
        printer.probe(done, len(records), record, references.judge(record))
    printer.flush()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 20
    assert lines[0] == (
        "[ 22/42] 22 cells not run, unsupported here (sdpa:efficient, sdpa:cudnn, flash_attention_2, tf32: "
        "CUDA only); report.md lists each with its reason"
    )
    assert all("unsupported" not in line for line in lines[1:]) and lines[1].startswith("[ 23/42] fp32/eager/off")


def test_other_reasons_are_said_in_short_beside_the_values_they_concern(capsys):
    printer, references = GridProgress(), References()
    planned = plan_grid(Recipe(), CPU, {"dtype": ["fp32", "tf32"], "attn": ["eager"]}, {})
    held = [ProbeRecord(p.probe_id, p.cell, "unsupported", reason=p.unsupported) for p in planned if p.unsupported]
    refused = ProbeRecord(
        "fp32/flash_attention_2/off",
        Cell("fp32", "flash_attention_2"),
        "unsupported",
        reason="flash_attention_2 needs the flash-attn package, which is not installed; pip install flash-attn",
    )
    for done, record in enumerate(held + [refused], 1):
        printer.probe(done, 3, record, references.judge(record))
    printer.flush()
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("[  2/3] 2 cells not run, unsupported here (")
    assert "(tf32/eager: tf32 is a CUDA matmul mode; " in line  # up to the first ';' of each reason
    assert "fp32/flash_attention_2: flash_attention_2 needs the flash-attn package, which is not installed)" in line


def test_cells_that_share_every_value_are_counted_once(capsys):
    """tf32 with two attentions: both cells share tf32, and so does every unsupported cell, so no value
    tells them apart; the line says the count and why once."""
    printer, references = GridProgress(), References()
    planned = plan_grid(Recipe(), CPU, {"dtype": ["fp32", "tf32"], "attn": ["sdpa", "sdpa:flash"]}, {})
    held = [ProbeRecord(p.probe_id, p.cell, "unsupported", reason=p.unsupported) for p in planned if p.unsupported]
    assert len(held) == 2
    for done, record in enumerate(held, 1):
        printer.probe(done, 5, record, references.judge(record))
    printer.flush()
    (line,) = capsys.readouterr().out.splitlines()
    assert line == "[  2/5] 2 cells not run, unsupported here (CUDA only); report.md lists each with its reason"


@pytest.mark.slow
def test_a_grid_on_this_cpu_prints_its_unsupported_cells_as_one_line(tmp_path):
    proc = run_cli(
        "grid",
        "--axis",
        "dtype=fp32,tf32",
        "--axis",
        "attn=eager,sdpa:cudnn",
        "--steps",
        "3",
        "--set",
        "retime_rounds=0",
        "--out",
        tmp_path / "run",
        on_cpu=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    progress = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert len(progress) == 2, proc.stdout
    assert progress[0].startswith("[  3/4] 3 cells not run, unsupported here (")
    assert progress[1].startswith("[  4/4] fp32/eager/off") and "stable" in progress[1]

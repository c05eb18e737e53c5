"""Two runs of the same small grid on this machine recommend the same configuration, one of them while
a busy loop per core loads the host (issue 16, section 3). Real probes through the CLI; the grid is
two fp32 attentions of equal fidelity, so speed decides and the leading cells are re-timed."""

import json
import subprocess
import sys

import pytest
from conftest import summary

from nandoctor.env import get_cpu_count

GRID = (
    "grid",
    "--axis",
    "dtype=fp32",
    "--axis",
    "attn=eager,sdpa",
    "--axis",
    "compile=off",
    "--steps",
    "4",
    "--set",
    "forensics_steps=0",
)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    from conftest import run_cli

    base = tmp_path_factory.mktemp("same-grid-twice")
    quiet = run_cli(*GRID, "--out", base / "first")
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(get_cpu_count())]
    try:
        loaded = run_cli(*GRID, "--out", base / "loaded")
    finally:
        for p in loops:
            p.kill()
            p.wait()
    return {"first": (quiet, base / "first"), "loaded": (loaded, base / "loaded")}


@pytest.mark.slow
def test_two_runs_of_one_grid_recommend_the_same_configuration_even_under_load(two_runs):
    for proc, _ in two_runs.values():
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, loaded = (summary(run) for _, run in two_runs.values())
    assert first["recommended"] == loaded["recommended"]


@pytest.mark.slow
def test_the_re_timing_keeps_to_its_budget_and_the_reports_say_what_it_did(two_runs):
    # Two 4-step probes train well under a second: 15% of that buys no 5-step rounds, so the re-timing
    # says it is over budget and the grid's probes decide (unless they already tell the cells apart).
    for proc, run in two_runs.values():
        assert [p["probe_id"] for p in summary(run)["probes"]] == ["fp32/eager/off", "fp32/sdpa/off"]
        if not (run / "retime.json").exists():
            assert "re-timing" not in proc.stdout
            continue
        timing = json.loads((run / "retime.json").read_text())
        assert (
            timing["stopped"] == "over budget" and timing["probes"] == [] and timing["estimate_s"] > timing["budget_s"]
        )
        assert f"not re-timing {', '.join(timing['cells'])}: 2 interleaved rounds would take about" in proc.stdout
        head = (run / "report.md").read_text().split("\n## ")[0]
        assert "were not re-timed back to back: 2 interleaved rounds would take about" in head
        assert summary(run)["timing"]["retimed"]["stopped"] == "over budget"


@pytest.mark.slow
def test_the_loaded_run_says_the_host_was_loaded_beside_the_recommendation(two_runs):
    _, run = two_runs["loaded"]
    assert summary(run)["timing"]["loaded"]
    head = (run / "report.md").read_text().split("\n## ")[0]  # the title block: the recommendation and its notes
    assert "The host was loaded while probes were timed" in head

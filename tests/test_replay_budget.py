"""The forensics replay is bounded in proportion to the probe (recipe forensics_share, issue 45 point 3):
on a CPU that emulates the cell's dtype a replay to the failure cost as much again as the timed probe.
It may always take forensics_min_s (default 10 s), since a tiny probe's replay costs more in fixed work
than its steps trained. A real fp32 probe made non-finite at step 1 by its learning rate replays to its
failure by default, also with a share of a hundredth of the timed steps' time, and stops after its first
step, saying so in the record and report.md, when the floor is 0 as well."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow
NAN_AT_STEP_1 = ("check", "--dtype", "fp32", "--attn", "eager", "--steps", "3", "--set", "optimizer.lr=1e30")


def forensics(run_dir) -> dict:
    record = json.loads((run_dir / "results.jsonl").read_text().splitlines()[0])
    assert record["first_nonfinite"]["step"] == 1
    return record["forensics"]


def test_the_replay_reaches_the_failure_by_default_and_stops_at_its_budget(tmp_path):
    full = run_cli(*NAN_AT_STEP_1, "--out", tmp_path / "full")
    assert full.returncode == 1, full.stdout + full.stderr
    f = forensics(tmp_path / "full")
    assert [s["step"] for s in f["steps"]] == [0, 1] and "budget" not in f

    floor = run_cli(*NAN_AT_STEP_1, "--set", "forensics_share=0.01", "--out", tmp_path / "floor")
    assert floor.returncode == 1, floor.stdout + floor.stderr
    f = forensics(tmp_path / "floor")
    assert [s["step"] for s in f["steps"]] == [0, 1] and "budget" not in f

    cut = run_cli(
        *NAN_AT_STEP_1, "--set", "forensics_share=0.01", "--set", "forensics_min_s=0", "--out", tmp_path / "cut"
    )
    assert cut.returncode == 1, cut.stdout + cut.stderr
    f = forensics(tmp_path / "cut")
    assert [s["step"] for s in f["steps"]] == [0] and f["budget"]["stopped_at"] == 0
    assert f["budget"]["share"] == 0.01 and f["budget"]["min_s"] == 0 and f["budget"]["seconds"] > 0
    said = "stopped after step 0: its budget (0.01x the timed steps' time, at least 0 s: "
    assert said in (tmp_path / "cut" / "report.md").read_text()


@pytest.mark.parametrize("setting", ["forensics_share=0", "forensics_min_s=-1"])
def test_a_budget_setting_out_of_range_is_one_line_and_exit_2(tmp_path, setting):
    proc = run_cli(*NAN_AT_STEP_1, "--set", setting, "--out", tmp_path / "run")
    name = setting.split("=")[0]
    assert proc.returncode == 2 and name in proc.stderr and "Traceback" not in proc.stderr

"""A compute dtype this CPU emulates is said, with its measured cost, before its first probe runs: the
matmul timing (env.get_cpu_matmul_cost), the line (capabilities.emulated_notes) shown costs on either side of
Thresholds.emulated_cost, and a real `check` that says it where this CPU emulates fp16 and not where it does
not."""

from __future__ import annotations

import pytest
from conftest import run_cli

from nandoctor.capabilities import emulated_notes
from nandoctor.cells import Cell
from nandoctor.thresholds import THRESHOLDS

CELLS = [Cell("fp32", "sdpa", "off"), Cell("fp16-amp", "sdpa", "off"), Cell("fp16-pure", "eager", "off")]
CELLS.append(Cell("bf16-amp", "sdpa", "off"))


def test_a_dtype_past_the_threshold_is_said_once_with_its_cost_and_its_cells():
    said: set = set()
    facts = {"device": "cpu", "cpu_matmul_cost": {"float16": 104.2, "bfloat16": 0.5}}
    lines = emulated_notes(facts, CELLS, said)
    assert len(lines) == 1 and lines[0].startswith("fp16 runs emulated on this CPU")
    assert "took 104x fp32's time" in lines[0] and "2 probe(s) (fp16-amp/sdpa/off, fp16-pure/eager/off)" in lines[0]
    assert said == {"float16"} and emulated_notes(facts, CELLS, said) == []  # once per run
    slow_bf16 = {"device": "cpu", "cpu_matmul_cost": {"float16": 1.0, "bfloat16": THRESHOLDS.emulated_cost + 0.1}}
    assert [line.split(":")[0] for line in emulated_notes(slow_bf16, CELLS, set())] == [
        "bf16 runs emulated on this CPU"
    ]
    at_bound = {"device": "cpu", "cpu_matmul_cost": {"float16": THRESHOLDS.emulated_cost}}
    assert emulated_notes(at_bound, CELLS, set()) == []
    assert emulated_notes({"device": "cuda"}, CELLS, set()) == []  # a GPU host measures nothing


def test_the_matmul_cost_is_measured_for_both_half_dtypes():
    from nandoctor.env import collect_doctor, get_cpu_matmul_cost

    cost = get_cpu_matmul_cost()
    assert set(cost) == {"bfloat16", "float16"} and all(v > 0 for v in cost.values())
    assert set(collect_doctor().cpu_matmul_cost) == {"bfloat16", "float16"}


@pytest.mark.slow
def test_check_says_before_its_probe_that_fp16_is_emulated_where_it_is(tmp_path):
    from nandoctor.env import get_cpu_matmul_cost

    emulated = get_cpu_matmul_cost()["float16"] > THRESHOLDS.emulated_cost
    proc = run_cli("check", "--dtype", "fp16-amp", "--attn", "sdpa", "--out", tmp_path / "run")
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("fp16 runs emulated on this CPU")]
    if not emulated:  # this CPU has fp16 units (within the 4x bound twice over, so timing noise cannot flip it)
        assert not said, proc.stdout
        return
    assert len(said) == 1, proc.stdout
    verdict = next(i for i, line in enumerate(lines) if line.startswith(("  ok", "  FAIL", "check ")))
    assert said[0] < verdict and "1 probe(s) (fp16-amp/sdpa/off)" in lines[said[0]]

"""Hardware is an axis (issue 18): --axis partition= (SLURM) / node_type= (Ray) probes every cell on
each kind of hardware, as its own probe with its own fp32 reference, ranking and recommendation.
Planning, validation and analysis here are pure, on hand-made records; the real two-partition SLURM
run is in test_executor_slurm.py."""

from dataclasses import replace

import pytest
from conftest import run_main

from nandoctor.analysis.outcomes import analyze_records, speed_buckets
from nandoctor.cells import Cell, parse_axis_flag
from nandoctor.config import Recipe
from nandoctor.errors import NandoctorError
from nandoctor.executors import ExecutorConfig, executor_config, with_hardware
from nandoctor.plan import plan_grid
from nandoctor.record import ProbeRecord, Step
from nandoctor.report.formatting import headline
from nandoctor.report.matrix import matrix_panels
from nandoctor.report.summary import render_summary

CPU = {"device": "cpu"}
GRID = {"dtype": ["fp32", "bf16-amp"], "attn": ["eager"], "compile": ["off"]}


def test_each_cell_is_planned_once_per_partition_with_a_reference_per_partition_first():
    probes = plan_grid(Recipe(), CPU, {**GRID, "partition": ["h100", "a100"]})
    assert [p.probe_id for p in probes] == [
        "fp32/eager/off@h100",
        "fp32/eager/off@a100",
        "bf16-amp/eager/off@h100",
        "bf16-amp/eager/off@a100",
    ]
    assert {p.cell.hardware for p in probes} == {"h100", "a100"}


def test_a_grid_without_a_hardware_axis_keeps_its_probe_ids_and_cell_dicts():
    probes = plan_grid(Recipe(), CPU, GRID)
    assert [p.probe_id for p in probes] == ["fp32/eager/off", "bf16-amp/eager/off"]
    assert probes[0].cell.to_dict() == {"dtype": "fp32", "attn": "eager", "compile": "off"}


def test_a_cell_on_hardware_reads_back_from_its_id_and_its_dict():
    cell = Cell("bf16-amp", "sdpa", "off", parallel="ddp", hardware="a100")
    assert cell.id == "bf16-amp/sdpa/off/ddp@a100"
    assert Cell.parse(cell.id) == cell == Cell(**cell.to_dict()) == Cell.of(cell.to_dict())
    assert cell.anywhere == Cell("bf16-amp", "sdpa", "off", parallel="ddp")


@pytest.mark.parametrize(
    "executor, axes, message",
    [
        ("local", {"partition": ["main"]}, "--axis partition names SLURM partitions: it needs --executor slurm"),
        (
            "ray",
            {"partition": ["main"]},
            "--axis partition names SLURM partitions: it needs --executor slurm; "
            "with --executor ray the hardware axis is node_type",
        ),
        (
            "slurm",
            {"node_type": ["big"]},
            "--axis node_type names Ray custom resources: it needs --executor ray; "
            "with --executor slurm the hardware axis is partition",
        ),
        (
            "slurm",
            {"partition": ["a"], "node_type": ["b"]},
            "--axis partition and --axis node_type: a grid has one hardware axis",
        ),
    ],
)
def test_a_hardware_axis_the_executor_cannot_place_is_refused(executor, axes, message):
    with pytest.raises(NandoctorError, match=message.replace("(", r"\(").replace(")", r"\)")):
        with_hardware(executor_config(executor), axes)


def test_the_hardware_axis_and_the_partition_option_together_are_refused():
    with pytest.raises(NandoctorError, match="pass one of them"):
        with_hardware(executor_config("slurm", ["partition=main"]), {"partition": ["spare"]})


def test_the_hardware_axis_becomes_the_executors_hardware():
    assert with_hardware(ExecutorConfig("slurm"), {"partition": ["main", "spare", "main"]}).hardware == (
        "main",
        "spare",
    )
    assert with_hardware(ExecutorConfig("ray"), {"node_type": ["big"]}).hardware == ("big",)
    assert with_hardware(ExecutorConfig("local"), GRID) == ExecutorConfig("local")


def test_a_hardware_name_with_a_separator_is_refused():
    with pytest.raises(NandoctorError, match="expected the SLURM partition names"):
        parse_axis_flag("partition=h100@x")


def test_partition_on_the_local_executor_is_one_line_and_exit_2():
    proc = run_main("grid", "--axis", "partition=main,spare", "--axis", "dtype=fp32", "--steps", "3")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "nandoctor: error: --axis partition names SLURM partitions: it needs --executor slurm"
    ]


def curve(losses, rate):
    return [Step(i, loss, 1.0, time_s=1.0 / rate, tokens=1, tokens_per_s=rate) for i, loss in enumerate(losses)]


def probe(cell: str, losses, rate=100.0):
    return ProbeRecord(
        cell,
        Cell.parse(cell),
        "ok",
        steps=curve(losses, rate),
        node="node-" + cell.split("@")[1],
        gpu={"h100": "NVIDIA H100 80GB HBM3", "a100": "NVIDIA A100-SXM4-40GB"}[cell.split("@")[1]],
    )


# The two kinds' fp32 curves differ by 10%: against its own kind's fp32, bf16 on a100 is faithful (0.1%);
# against h100's it would be 10% off.
H100_FP32, A100_FP32 = [8.0, 7.0, 6.0, 5.0], [8.8, 7.7, 6.6, 5.5]
RECORDS = [
    probe("fp32/eager/off@h100", H100_FP32, 100),
    probe("fp32/eager/off@a100", A100_FP32, 100),
    probe("bf16-amp/eager/off@h100", [8.0, 7.0, 6.0, 9e9], 500),  # diverges on h100 only
    probe("bf16-amp/eager/off@a100", [x * 1.001 for x in A100_FP32], 300),
]
META = {
    "kind": "grid",
    "seed": 0,
    "run_id": "r",
    "recipe": {"name": "tiny-llama"},
    "model_plan": {},
    "axes": {"partition": ["h100", "a100"]},
}


@pytest.fixture(scope="module")
def analysis():
    return analyze_records(META, RECORDS)


def test_fidelity_is_measured_against_the_fp32_reference_of_the_same_hardware(analysis):
    by_id = {o.probe_id: o for o in analysis.outcomes}
    assert by_id["bf16-amp/eager/off@a100"].fidelity == pytest.approx(0.001)
    assert by_id["fp32/eager/off@a100"].fidelity == 0.0
    assert by_id["bf16-amp/eager/off@h100"].verdict.name == "diverged"


def test_each_kind_of_hardware_gets_its_own_ranking_and_recommendation(analysis):
    assert analysis.hardware == ["h100", "a100"]
    assert [o.probe_id for o in analysis.ranking] == [
        "fp32/eager/off@h100",
        "bf16-amp/eager/off@a100",
        "fp32/eager/off@a100",
    ]
    assert analysis.recommended_on("h100").probe_id == "fp32/eager/off@h100"
    assert analysis.recommended_on("a100").probe_id == "bf16-amp/eager/off@a100"  # faster, within fp32's bucket
    assert speed_buckets(analysis) == [[o for o in analysis.ranking if o.record.cell.hardware == "a100"]]


def test_the_report_shows_a_panel_and_a_recommendation_per_kind_of_hardware(analysis):
    panels = matrix_panels(analysis)
    assert [p["caption"] for p in panels] == [
        "partition=h100 (ran on node-h100: NVIDIA H100 80GB HBM3), compile=off",
        "partition=a100 (ran on node-a100: NVIDIA A100-SXM4-40GB), compile=off",
    ]
    starred = [[c["probe_id"] for r in p["rows"] for c in r["cells"] if c and c["recommended"]] for p in panels]
    assert starred == [["fp32/eager/off@h100"], ["bf16-amp/eager/off@a100"]]
    lines = headline(analysis)
    assert lines[0].startswith("Recommended on h100: fp32/eager/off@h100 (fidelity 0.000%")
    assert lines[1].startswith("Recommended on a100: bf16-amp/eager/off@a100 (fidelity 0.100%")
    summary = render_summary(replace(analysis, meta={**META, "planned": 4}))
    assert summary["recommended_by_hardware"] == {"h100": "fp32/eager/off@h100", "a100": "bf16-amp/eager/off@a100"}
    assert {p["probe_id"]: p["gpu"] for p in summary["probes"]}["bf16-amp/eager/off@a100"] == "NVIDIA A100-SXM4-40GB"


# --- speed is compared within one kind of hardware only (issue 18) ----------------------------------
# On h100 fp32 eager and sdpa tie, and bf16 (2% off: a worse fidelity bucket) is 5x faster; on a100
# fp32 runs at 1000 tokens/s, faster than anything on h100, and its eager and sdpa tie too.
SPEED_RECORDS = [
    probe("fp32/eager/off@h100", H100_FP32, 100),
    probe("fp32/sdpa/off@h100", H100_FP32, 100),
    probe("bf16-amp/eager/off@h100", [x * 1.02 for x in H100_FP32], 500),
    probe("fp32/eager/off@a100", A100_FP32, 1000),
    probe("fp32/sdpa/off@a100", A100_FP32, 1000),
]


@pytest.fixture(scope="module")
def speeds():
    return analyze_records(META, SPEED_RECORDS)


def test_the_fastest_marker_is_per_kind_of_hardware(speeds):
    assert speeds.fastest_on("h100").probe_id == "bf16-amp/eager/off@h100"  # beyond the noise, in a worse bucket
    assert speeds.fastest_on("a100") is speeds.recommended_on(
        "a100"
    )  # faster than h100's cells, but not compared with them
    marked = [c["probe_id"] for p in matrix_panels(speeds) for r in p["rows"] for c in r["cells"] if c and c["fastest"]]
    assert marked == ["bf16-amp/eager/off@h100"]
    assert render_summary(replace(speeds, meta={**META, "planned": 5}))["fastest_by_hardware"] == {
        "h100": "bf16-amp/eager/off@h100",
        "a100": "fp32/sdpa/off@a100",
    }


def test_the_headline_says_the_fastest_and_the_speed_ties_per_kind_of_hardware(speeds):
    lines = headline(speeds)
    assert lines[:3] == [
        lines[0],
        "Fastest stable on h100: bf16-amp/eager/off@h100 (500 tokens/s, fidelity 2.000%)",
        lines[2],
    ]
    assert lines[0].startswith("Recommended on h100: fp32/sdpa/off@h100") and lines[2].startswith(
        "Recommended on a100: fp32/sdpa/off@a100"
    )
    tie = (
        "within their measured noise: {} comes first in the fixed tie order (the plainest, most robust configuration)."
    )
    assert [line.split(" Why each is a tie: ")[0] for line in lines[3:5]] == [
        "On h100, as fast as fp32/eager/off@h100 " + tie.format("fp32/sdpa/off@h100"),
        "On a100, as fast as fp32/eager/off@a100 " + tie.format("fp32/sdpa/off@a100"),
    ]
    assert not any(line.startswith("Fastest stable on a100") for line in lines)

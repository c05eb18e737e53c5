"""A recommendation that does not flip with machine load (issue 16, section 3): throughput measured on
steady steps with its spread, speed compared against that noise, ties broken by a fixed order, the
leading cells re-timed interleaved, and the host's load said. Pure logic on hand-made records."""

import subprocess
import sys

import pandas as pd
import pytest
import recorded

from nandoctor.analysis.outcomes import analyze_records, speed_candidates
from nandoctor.analysis.ranking import adoption_key, rank
from nandoctor.cells import Cell
from nandoctor.env import get_gpu_load, get_host_sample, host_load
from nandoctor.record import ProbeRecord, Step, Throughput, warmup_steps
from nandoctor.report import timing
from nandoctor.retime import interleaved

LOSSES = [8.0 - 0.1 * i for i in range(8)]


def steps(rates, losses=LOSSES):
    return [
        Step(i, loss, 1.0, time_s=1.0 / r, tokens=1, tokens_per_s=r) for i, (loss, r) in enumerate(zip(losses, rates))
    ]


def probe(cell: str, rates, probe_id=None, losses=LOSSES, host=None):
    return ProbeRecord(probe_id or cell, Cell.parse(cell), "ok", steps=steps(rates, losses), host_load=host)


def speed_row(cell: str, median, q1, q3, fidelity=0.0):
    dtype, attn, comp = cell.split("/")
    return {
        "id": cell,
        "dtype": dtype,
        "attn": attn,
        "compile": comp,
        "optimizer": "adamw",
        "fidelity": fidelity,
        "tokens_per_s": median,
        "tokens_per_s_q1": q1,
        "tokens_per_s_q3": q3,
        "peak_memory_bytes": 1,
        "flags": "",
    }


META = {"kind": "grid", "seed": 0}


def test_throughput_leaves_out_the_warmup_steps_and_keeps_the_spread():
    t = Throughput.of(steps([5, 30, 100, 90, 110, 100, 95, 105]))
    assert t.warmup == 2 and t.steps == 6
    assert t.median == 100 and t.low == 90 and t.high == 110 and 90 < t.q1 < 100 < t.q3 < 110


def test_warmup_never_takes_more_than_half_the_steps():
    assert warmup_steps([1, 2, 3, 4, 100, 100]) == 3
    assert warmup_steps([7.0]) == 0  # a single step is all there is


def test_re_timing_rounds_pool_their_steady_steps_so_the_spread_covers_the_rounds():
    t = Throughput.pooled([steps([10, 100, 100, 100]), steps([10, 50, 50, 50])])
    assert (t.steps, t.warmup, t.low, t.high) == (6, 2, 50, 100)


def test_cells_within_each_others_noise_tie_and_the_fixed_order_picks_the_same_one_whichever_measured_faster():
    run_a = pd.DataFrame([speed_row("fp32/eager/off", 1233, 700, 1400), speed_row("fp32/sdpa/off", 1000, 600, 1300)])
    run_b = pd.DataFrame([speed_row("fp32/eager/off", 800, 600, 1300), speed_row("fp32/sdpa/off", 1100, 700, 1400)])
    assert list(rank(run_a)["id"]) == list(rank(run_b)["id"]) == ["fp32/sdpa/off", "fp32/eager/off"]
    assert list(rank(run_a)["speed_class"]) == [0, 0]


def test_a_cell_faster_beyond_both_spreads_wins():
    table = pd.DataFrame([speed_row("fp32/sdpa/off", 100, 95, 105), speed_row("fp32/eager/off", 200, 190, 210)])
    ranked = rank(table)
    assert list(ranked["id"]) == ["fp32/eager/off", "fp32/sdpa/off"] and list(ranked["speed_class"]) == [0, 1]


def test_a_difference_under_the_margin_is_a_tie_even_when_the_spreads_do_not_overlap():
    table = pd.DataFrame([speed_row("fp32/eager/off", 103, 102.9, 103.1), speed_row("fp32/sdpa/off", 100, 99.9, 100.1)])
    assert list(rank(table)["id"]) == ["fp32/sdpa/off", "fp32/eager/off"]


def test_a_faster_cell_in_a_worse_fidelity_bucket_still_ranks_below():
    table = pd.DataFrame(
        [speed_row("bf16-amp/sdpa/off", 900, 890, 910, fidelity=0.02), speed_row("fp32/sdpa/off", 100, 95, 105)]
    )
    assert list(rank(table)["id"]) == ["fp32/sdpa/off", "bf16-amp/sdpa/off"]


def test_the_tie_order_puts_the_plainest_configuration_first():
    def order(*cells):
        return sorted(
            cells,
            key=lambda text: adoption_key(
                *(getattr(Cell.parse(text), axis) for axis in ("dtype", "attn", "compile", "optimizer"))
            ),
        )

    assert order("fp32/sdpa/inductor", "fp32/sdpa/off", "fp32/sdpa/aot_eager") == [
        "fp32/sdpa/off",
        "fp32/sdpa/aot_eager",
        "fp32/sdpa/inductor",
    ]
    assert order("bf16-pure/sdpa/off", "fp16-amp/sdpa/off", "bf16-amp/sdpa/off", "fp32/sdpa/off") == [
        "fp32/sdpa/off",
        "bf16-amp/sdpa/off",
        "fp16-amp/sdpa/off",
        "bf16-pure/sdpa/off",
    ]
    assert order("fp32/sdpa:math/off", "fp32/eager/off", "fp32/sdpa/off") == [
        "fp32/sdpa/off",
        "fp32/eager/off",
        "fp32/sdpa:math/off",
    ]
    assert order("fp32/sdpa/off/bnb-adamw8bit", "fp32/sdpa/off/adamw-fused", "fp32/sdpa/off") == [
        "fp32/sdpa/off",
        "fp32/sdpa/off/adamw-fused",
        "fp32/sdpa/off/bnb-adamw8bit",
    ]


def test_identical_reruns_of_a_configuration_are_ranked_once():
    records = [
        probe("fp32/eager/off", [50] * 8),
        probe("fp32/sdpa/off", [60] * 8),
        probe("fp32/sdpa/off", [60] * 8, probe_id="fp32/sdpa/off rerun1"),
    ]
    analysis = analyze_records(META, records)
    assert [o.probe_id for o in analysis.ranking] == ["fp32/sdpa/off", "fp32/eager/off"]


def test_a_configuration_whose_rerun_failed_is_not_ranked():
    records = [
        probe("fp32/eager/off", [50] * 8),
        probe("fp32/sdpa/off", [60] * 8),
        probe("fp32/sdpa/off", [60] * 3, probe_id="fp32/sdpa/off rerun1", losses=[8.0, 7.9, float("nan")]),
    ]
    assert [o.probe_id for o in analyze_records(META, records).ranking] == ["fp32/eager/off"]


def test_speed_decides_only_between_cells_of_the_leading_fidelity_bucket():
    tied = analyze_records(META, [probe("fp32/eager/off", [50] * 8), probe("fp32/sdpa/off", [60] * 8)])
    assert [[o.probe_id for o in kind] for kind, _ in speed_candidates(tied, 4)] == [
        ["fp32/sdpa/off", "fp32/eager/off"]
    ]
    far = [8.0 - 0.2 * i for i in range(8)]  # about 5% off the reference: another bucket
    alone = analyze_records(META, [probe("fp32/eager/off", [50] * 8), probe("bf16-amp/sdpa/off", [90] * 8, losses=far)])
    assert alone.ranking[0].probe_id == "fp32/eager/off" and speed_candidates(alone, 4) == []


def test_rounds_run_interleaved_and_reversed_every_other_round():
    assert interleaved(["A", "B"], 3) == [("A", 1), ("B", 1), ("B", 2), ("A", 2), ("A", 3), ("B", 3)]


def timing_of(rounds: dict[str, list[list[float]]]) -> dict:
    """retime.json of these rounds of 4-step re-timing probes (recorded.timing_of)."""
    return recorded.timing_of(rounds, n_steps=4)


def test_the_re_timed_figure_replaces_the_grid_probes_and_decides_the_ranking():
    # the grid measured eager 3x faster (sdpa's probe ran while the host was busy); interleaved, they are equal
    records = [probe("fp32/eager/off", [300] * 8), probe("fp32/sdpa/off", [100] * 8)]
    assert analyze_records(META, records).recommended.probe_id == "fp32/eager/off"
    timed = timing_of(
        {
            "fp32/eager/off": [[10, 100, 110, 90], [10, 95, 105, 100]],
            "fp32/sdpa/off": [[10, 104, 96, 100], [10, 100, 108, 92]],
        }
    )
    analysis = analyze_records(META, records, timed)
    assert analysis.recommended.probe_id == "fp32/sdpa/off" and all(o.retimed for o in analysis.ranking)
    assert [o.probe_id for o in analysis.speed_ties] == ["fp32/eager/off"]
    assert analysis.fastest is analysis.recommended  # "fastest" too is only said beyond the noise
    lines = timing.speed_lines(analysis)
    assert (
        "so speed decides between them: they were re-timed back to back, interleaved, 2 rounds of 4 steps" in lines[0]
    )
    assert "As fast as fp32/eager/off within their measured noise" in lines[1]
    assert [r["rounds ok"] for r in timing.retime_rows(analysis)] == ["2/2", "2/2"]


def test_a_gain_the_load_moves_between_rounds_as_much_as_its_size_is_a_tie():
    # measured under `pytest -n 3` on two cores (bench/RESULTS.md): eager's rounds ran at 1,015 and
    # 1,450 tokens/s, sdpa's at 818 and 878. Pooled, eager's lower quartile is above sdpa's upper one, but
    # the ratio moved from 1.24 to 1.65 between the rounds: the host's load, not the attention. On a
    # quiet host the two measure within 0.5% of each other.
    records = [probe("fp32/eager/off", [1000] * 8), probe("fp32/sdpa/off", [800] * 8)]
    noisy = timing_of(
        {
            "fp32/eager/off": [[10, 1000, 1015, 1030], [10, 1440, 1450, 1460]],
            "fp32/sdpa/off": [[10, 810, 818, 826], [10, 870, 878, 886]],
        }
    )
    analysis = analyze_records(META, records, noisy)
    assert analysis.recommended.probe_id == "fp32/sdpa/off"  # the fixed tie order's choice
    assert [o.probe_id for o in analysis.speed_ties] == ["fp32/eager/off"] and analysis.fastest is analysis.recommended


def test_a_gain_every_round_measures_alike_still_wins():
    records = [probe("fp32/eager/off", [1000] * 8), probe("fp32/sdpa/off", [800] * 8)]
    steady = timing_of(
        {
            "fp32/eager/off": [[10, 990, 1000, 1010], [10, 1030, 1040, 1050]],
            "fp32/sdpa/off": [[10, 790, 800, 810], [10, 820, 830, 840]],
        }
    )  # 1.25 and 1.253
    analysis = analyze_records(META, records, steady)
    assert analysis.recommended.probe_id == "fp32/eager/off" and analysis.speed_ties == []
    assert analysis.ranking[1].speed_class == 1


def timing_under(rounds: dict[str, list[list[float]]], other_cores: float) -> dict:
    timed = timing_of(rounds)
    for p in timed["probes"]:
        p["host_load"] = {
            "wall_s": 1.0,
            "cpu_count": 1,
            "other_cpu_cores": other_cores,
            "loadavg": [2.0, 1.5, 1.0],
            "gpus": None,
        }
    return timed


# The re-timing rounds of two runs of test_trust_ranking_e2e's grid in a clean-clone CI run (2026-11-25),
# steady steps as recorded: the quiet one, and the one with a busy loop sharing the probes' core.
QUIET_ROUNDS = {
    "fp32/eager/off": [[1993, 2625, 2696, 2863, 3568], [2215, 2987, 3199, 3425, 3308]],
    "fp32/sdpa/off": [[2075, 2628, 2652, 2872, 2850], [2233, 3126, 3614, 3734, 3501]],
}
LOADED_ROUNDS = {
    "fp32/eager/off": [[1472, 1925, 2275, 2474, 2364], [1313, 1558, 2200, 2274, 2319]],
    "fp32/sdpa/off": [[1385, 1563, 1970, 2068, 2009], [1327, 1657, 1899, 1827, 1760]],
}


def test_on_a_loaded_host_only_a_gain_above_the_loaded_margin_counts_so_both_runs_recommend_alike():
    records = [probe("fp32/eager/off", [2500] * 8), probe("fp32/sdpa/off", [2500] * 8)]
    quiet = analyze_records(META, records, timing_under(QUIET_ROUNDS, 0.0))
    loaded = analyze_records(META, records, timing_under(LOADED_ROUNDS, 1.27))
    assert loaded.load["significant"] and not quiet.load["significant"]
    assert quiet.recommended.probe_id == loaded.recommended.probe_id == "fp32/sdpa/off"
    assert [o.probe_id for o in loaded.speed_ties] == ["fp32/eager/off"]  # 17% and 25% faster per round: under 25%
    # other processes kept up to 1.27 cores of 1 busy: two equal grid probes could differ by 127%
    assert "faster on its grid probe only by more than 127% (not 5%: 25% at least" in timing.speed_lines(loaded)[-1]


def test_grid_probes_timed_beside_more_load_than_the_25_percent_floor_tie_within_what_that_load_could_swing():
    # test_trust_ranking_e2e's two runs in a CI run (2026-11-27), not re-timed (over budget): pinned to one
    # core beside the other xdist worker's load, sdpa measured 36% faster; beside two busy loops too, eager
    # measured 39% faster, and with the flat 25% margin the two runs recommended different cells.
    def busy_core(other):
        return recorded.busy(other, cpu_count=1)

    first = analyze_records(
        META,
        [
            probe("fp32/eager/off", [1946] * 4, host=busy_core(1.02)),
            probe("fp32/sdpa/off", [2647] * 4, host=busy_core(1.02)),
        ],
    )
    loaded = analyze_records(
        META,
        [
            probe("fp32/eager/off", [1168] * 4, host=busy_core(1.5)),
            probe("fp32/sdpa/off", [843] * 4, host=busy_core(1.5)),
        ],
    )
    assert (first.speed_margin, loaded.speed_margin) == (1.02, 1.5)
    assert first.recommended.probe_id == loaded.recommended.probe_id == "fp32/sdpa/off"
    for a in (first, loaded):
        assert timing.speed_lines(a)[-2].startswith("Not told apart from fp32/eager/off by what was measured")


def test_on_a_loaded_host_a_gain_well_above_the_loaded_margin_still_wins():
    records = [probe("fp32/eager/off", [2500] * 8), probe("fp32/sdpa/off", [1500] * 8)]
    doubled = {
        "fp32/eager/off": [[r * 2 for r in rates] for rates in LOADED_ROUNDS["fp32/sdpa/off"]],
        "fp32/sdpa/off": LOADED_ROUNDS["fp32/sdpa/off"],
    }
    loaded = analyze_records(META, records, timing_under(doubled, 1.27))
    assert loaded.recommended.probe_id == "fp32/eager/off" and loaded.speed_ties == []


# The Quickstart's default grid on a quiet 2-core VM (2026-11-25 21:12 UTC): four fp32 cells share the
# top fidelity bucket, the re-timing takes the first three of the grid's ranking (sdpa clearly fastest,
# then eager and sdpa:math ahead of sdpa:flash in the tie order), and 5-step re-timing probes measure
# lower than 24-step grid probes. Steady steps as recorded (tokens/s).
GRID_RATES = {
    "fp32/eager/off": [
        2625,
        7489,
        8575,
        9469,
        8938,
        8668,
        9188,
        8227,
        8876,
        8236,
        9056,
        8232,
        8127,
        7972,
        8329,
        8072,
        8292,
        8439,
        8405,
        7852,
        9141,
        9019,
        8718,
        8561,
    ],
    "fp32/sdpa/off": [
        3535,
        7105,
        8920,
        9325,
        8832,
        9338,
        9730,
        9311,
        9472,
        9438,
        9853,
        9452,
        9631,
        9288,
        9090,
        9367,
        9795,
        10085,
        10265,
        9963,
        8625,
        10019,
        10148,
        9583,
    ],
    "fp32/sdpa:math/off": [
        3436,
        7550,
        8229,
        6835,
        8740,
        9262,
        9068,
        9115,
        7728,
        7375,
        8773,
        8823,
        8154,
        9076,
        9017,
        8651,
        8348,
        8811,
        9175,
        8832,
        8185,
        9184,
        8647,
        8391,
    ],
    "fp32/sdpa:flash/off": [
        3211,
        7818,
        8682,
        8378,
        8279,
        8322,
        9031,
        9033,
        9348,
        9042,
        8723,
        9080,
        9438,
        9065,
        8496,
        8501,
        7878,
        9392,
        9342,
        8862,
        7962,
        8863,
        9029,
        8730,
    ],
}
GRID_RETIME = {
    "fp32/sdpa/off": [[3852, 7494, 8242, 8275, 8455], [3733, 7227, 8242, 8282, 8347]],
    "fp32/eager/off": [[3752, 7265, 8269, 8212, 8629], [3669, 6871, 7674, 8314, 8422]],
    "fp32/sdpa:math/off": [[3727, 7196, 7677, 7975, 8080], [3620, 6871, 6692, 7974, 8101]],
}


def test_a_cell_the_re_timing_left_out_never_outranks_the_re_timed_leaders_on_its_longer_probe():
    losses = [8.0 - 0.1 * i for i in range(24)]
    records = [probe(cell, rates, losses=losses) for cell, rates in GRID_RATES.items()]
    analysis = analyze_records(META, records, timing_of(GRID_RETIME))
    # sdpa:flash's 24-step figure (8,862 tokens/s) is above every re-timed one (7,825-8,259): compared
    # with them, it took the recommendation although the re-timing never measured it
    assert analysis.recommended.probe_id == "fp32/sdpa/off"
    assert [o.probe_id for o in analysis.ranking][-1] == "fp32/sdpa:flash/off" and not analysis.ranking[-1].retimed
    assert {o.probe_id for o in analysis.speed_ties} == {"fp32/eager/off", "fp32/sdpa:math/off"}
    assert analysis.fastest is analysis.recommended  # sdpa:flash is not faster than sdpa in the grid's own probes
    said = timing.speed_lines(analysis)[0]
    assert said.startswith(
        "4 configurations share the top fidelity bucket, so speed decides between them: fp32/sdpa/off, fp32/eager/off, "
        "fp32/sdpa:math/off were re-timed"
    )
    assert said.endswith("the other one ranks after them, on its grid probe.")


def busy(other_cores: float, cpu_count: int = 2) -> dict:
    return {
        "wall_s": 1.0,
        "cpu_count": cpu_count,
        "other_cpu_cores": other_cores,
        "loadavg": [3.5, 2.0, 1.0],
        "gpus": None,
    }


def test_a_loaded_host_is_said_beside_the_recommendation():
    records = [probe("fp32/eager/off", [50] * 8, host=busy(1.6)), probe("fp32/sdpa/off", [60] * 8, host=busy(1.2))]
    analysis = analyze_records(META, records)
    assert analysis.load["significant"] and analysis.load["other_cpu_cores_max"] == 1.6
    line = timing.load_line(analysis)
    assert line.startswith("The host was loaded while probes were timed: other processes kept 1.4 of 2 CPU cores busy")
    assert "load average up to 3.5" in line and line in timing.speed_lines(analysis)


def test_a_quiet_host_and_old_records_say_nothing_about_load():
    quiet = analyze_records(
        META, [probe("fp32/eager/off", [50] * 8, host=busy(0.1)), probe("fp32/sdpa/off", [60] * 8, host=busy(0.2))]
    )
    assert not quiet.load["significant"] and timing.load_line(quiet) is None
    assert analyze_records(META, [probe("fp32/eager/off", [50] * 8)]).load is None


def test_another_process_on_the_gpu_counts_as_load():
    gpu = {**busy(0.0), "gpus": [{"index": 0, "util_percent": 90, "other_processes": 1, "other_memory_bytes": 2**30}]}
    analysis = analyze_records(META, [probe("fp32/eager/off", [50] * 8, host=gpu)])
    assert analysis.load["significant"] and "1 other process(es) on a GPU" in timing.load_line(analysis)


def test_host_load_is_measured_here_and_tolerates_a_machine_without_nvml():
    sample = host_load(get_host_sample())
    assert sample["wall_s"] >= 0 and sample["cpu_count"] >= 1
    gpus = get_gpu_load()
    assert gpus is None or all({"util_percent", "other_processes"} <= set(g) for g in gpus)


def test_host_load_counts_the_cpu_another_process_burns():
    """Without psutil other_cpu_cores is None; with it, a process spinning for 0.5 s while this one
    waits shows as other cores kept busy (other sessions on a loaded host only add to it)."""
    pytest.importorskip("psutil", reason="without psutil the host's CPU load is not measured")
    before = get_host_sample()
    spin = "import time\nend = time.monotonic() + 0.5\nwhile time.monotonic() < end:\n    pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    sample = host_load(before)
    assert sample["wall_s"] >= 0.5 and sample["other_cpu_cores"] > 0.2


def test_throughput_and_host_load_round_trip_through_the_record():
    record = probe("fp32/sdpa/off", [10, 100, 100, 100], host=busy(1.0))
    record.throughput = Throughput.of(record.steps)
    again = ProbeRecord.from_dict(record.to_dict())
    assert again == record and again.throughput.median == 100

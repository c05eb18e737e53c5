"""Forensics on the ranks of a parallel probe: every rank replays its first steps with the hooks on its
own DDP or FSDP2 wrapper, the launcher merges the ranks' replays into the probe's one forensics record,
and the report names the rank and the first offender (forward, backward, reduction or optimizer step)."""

import pytest
from conftest import records, run_cli, summary

from nandoctor.analysis.forensics import origin, ranks_alike
from nandoctor.child.launch import merge_forensics
from nandoctor.record import REPLAY_RUNNING
from nandoctor.report.forensics import event_line


def _replay(rank: int, events: list[dict]) -> dict:
    """One rank's forensics record as parallel.py writes it (what the merge reads)."""
    return {
        "compute_dtype": "float16",
        "weight_dtype": "float16",
        "replayed_steps": 2,
        "rank": rank,
        "world_size": 2,
        "events": [{**e, "rank": rank} for e in events],
        "reproduced": True,
        "cost": {"seconds": 0.5},
        "steps": [{"step": 0, "loss": 8.3, "grad_norm": 5.0, "skipped": False, "scale": None}],
    }


def _event(step: int, phase: str, parameter: str) -> dict:
    stats = {"min": -1.0, "max": float("inf"), "absmax": float("inf")}
    return {
        "step": step,
        "phase": phase,
        "module": parameter.rsplit(".", 1)[0],
        "parameter": parameter,
        "tensor": "gradient after the reduction" if phase == "reduction" else "parameter after the update",
        "stats": stats,
        "before": {"what": "before", "module": parameter, "min": -1.0, "max": 1.0, "absmax": 1.0},
        "nonfinite_elements": 3,
    }


def test_the_ranks_replays_merge_into_one_record_whose_origin_names_the_rank_and_the_ranks_alike():
    rank0 = _replay(0, [_event(1, "optimizer", "lm_head.weight")])
    rank1 = _replay(1, [_event(1, "reduction", "lm_head.weight"), _event(1, "optimizer", "lm_head.weight")])
    merged = merge_forensics([{"forensics": rank0}, {"forensics": rank1}], [0, 0], None)
    assert [e["rank"] for e in merged["events"]] == [0, 1, 1]
    assert [r["rank"] for r in merged["ranks"]] == [0, 1] and all(r["reproduced"] for r in merged["ranks"])
    root = origin(merged)  # the reduction comes before the optimizer step of the same step, whichever rank saw it
    assert (root["phase"], root["rank"]) == ("reduction", 1)
    assert event_line(root, merged).startswith(
        "step 1 on rank 1 of 2, reduction of lm_head.weight: gradient after the reduction holds NaN/inf"
    )
    assert ranks_alike(merged, merged["events"][0]) == [1]
    assert event_line(merged["events"][0], merged).startswith("step 1 on rank 0 of 2 (rank 1 alike), optimizer step")


def test_a_replay_that_raised_or_died_on_one_rank_is_the_forensics_error_naming_that_rank():
    fine = {"forensics": _replay(0, [])}
    raised = merge_forensics([fine, {"forensics": {"error": "RuntimeError: boom"}}], [0, 1], 1)
    assert raised["error"] == "rank 1: RuntimeError: boom"
    died = merge_forensics([fine, {"forensics": REPLAY_RUNNING}], [None, -11], 1)
    assert died == {"error": "rank 1 ended (SIGSEGV) during the replay"}
    assert merge_forensics([{}, {}], [1, -11], 1) is None  # failed in the timed steps: there was no replay


@pytest.mark.slow
def test_failing_parallel_probes_replay_on_every_rank_and_the_report_names_the_rank_and_the_offender(tmp_path):
    """Four gloo ranks: fp16-pure under DDP and FSDP2 (AdamW's eps is 0 in fp16: the optimizer step of
    step 0 turns the embedding non-finite on every rank), and fp16-amp under FSDP2 reducing in fp16 with
    a summing reduction, where one rank's own loss-scaled gradient overflows at a step the GradScaler
    skips and the others see the inf arrive through the reduction."""
    out, amp_out = tmp_path / "run", tmp_path / "amp"
    # two grids, not one over both dtypes: fp16-amp is read under FSDP2 only (its DDP probe: 4 ranks, 11 s)
    for dtype, parallel, where in (
        ("fp16-pure", "ddp,fsdp2-reduce-low", out),
        ("fp16-amp", "fsdp2-reduce-low", amp_out),
    ):
        proc = run_cli(
            "grid",
            *("--axis", f"dtype={dtype}", "--axis", "attn=eager", "--axis", f"parallel={parallel}"),
            *("--steps", "3", "--world-size", "4", "--set", "grad_reduce=sum", "--out", where),
            on_cpu=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr  # the fp32 reference is stable: a configuration
    recs, probes = records(out), {p["probe_id"]: p for p in summary(out)["probes"]}
    for wrapper in ("ddp", "fsdp2-reduce-low"):
        probe_id = f"fp16-pure/eager/off/{wrapper}"
        f = recs[probe_id]["forensics"]
        assert [r["rank"] for r in f["ranks"]] == [0, 1, 2, 3] and all(r["reproduced"] for r in f["ranks"]), probe_id
        root = probes[probe_id]["forensics"]["origin"]
        assert (root["phase"], root["step"], root["rank"], root["parameter"]) == (
            "optimizer",
            0,
            0,
            "model.embed_tokens.weight",
        )
        assert root["eps_in_dtype"] == 0.0
    report = (out / "report.md").read_text()
    assert (
        "Where: the AdamW step at step 0 on rank 0 of 4 (ranks 1, 2, 3 alike) "
        "turned model.embed_tokens.weight non-finite" in report
    )
    assert "optimizer step 0 on rank 0 of 4 (ranks 1, 2, 3 alike): model.embed_tokens.weight" in report

    recs, probes = records(amp_out), {p["probe_id"]: p for p in summary(amp_out)["probes"]}
    amp = recs["fp16-amp/eager/off/fsdp2-reduce-low"]
    skipped = [s["step"] for s in amp["steps"] if s["skipped"]]
    assert skipped, "no GradScaler skip: the overflow this test reads did not happen"
    events = [e for e in amp["forensics"]["events"] if e["step"] == skipped[0]]
    own = [e for e in events if e["phase"] == "backward" and e.get("parameter") == "model.embed_tokens.weight"]
    arrived = [e for e in events if e["phase"] == "reduction"]
    assert own and "before the reduction" in own[0]["tensor"]
    assert arrived and {e["rank"] for e in arrived}.isdisjoint({e["rank"] for e in own})
    assert all(float(e["before"]["absmax"]) < 65504 for e in arrived)  # finite on that rank until the reduction
    assert (
        probes["fp16-amp/eager/off/fsdp2-reduce-low"]["forensics"]["origin"] is None
    )  # a skip the scaler recovered from

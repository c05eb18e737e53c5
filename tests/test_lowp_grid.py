"""The low-precision axes end to end on a CPU: real probes of adamw and two 8-bit optimizers record
their memory split, the fp8 cells are unsupported with their reasons and never spawned, and the
report's savings section says what was measured here."""

import json

import pytest
from conftest import needs, records, summary

pytestmark = [pytest.mark.slow, needs("torchao", "bitsandbytes")]  # end to end: real probe processes


FP32 = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import run_cli

    out = tmp_path_factory.mktemp("lowp") / "run"
    proc = run_cli(
        "grid",
        "--axis",
        "optimizer=adamw,ao-adamw8bit,bnb-adamw8bit",
        "--axis",
        "dtype=fp32,fp8-rowwise,fp8-te-hybrid",
        "--axis",
        "attn=sdpa",
        "--steps",
        "3",
        "--set",
        "retime_rounds=0",
        "--out",
        out,
        on_cpu=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, records(out)


def test_the_optimizers_train_and_the_fp8_cells_are_unsupported_and_never_spawned(run):
    out, records = run
    trained = {"fp32/eager/off", "fp32/sdpa/off", "fp32/sdpa/off/ao-adamw8bit", "fp32/sdpa/off/bnb-adamw8bit"}
    assert {p for p, r in records.items() if r["status"] == "ok"} == trained
    assert all(len(records[p]["steps"]) == 3 for p in trained)
    fp8 = {p: r for p, r in records.items() if p.startswith("fp8-")}
    assert len(fp8) == 6 and {r["status"] for r in fp8.values()} == {"unsupported"}
    assert all("fp8 tensor cores" in r["reason"] and "this device is a CPU" in r["reason"] for r in fp8.values())
    assert sorted(d.name for d in (out / "probes").iterdir()) == sorted(p.replace("/", "__") for p in trained)


def test_8bit_state_is_measured_as_real_storage_well_below_adamws(run):
    _, records = run
    adamw, ao, bnb = (records[f"fp32/sdpa/off{s}"] for s in ("", "/ao-adamw8bit", "/bnb-adamw8bit"))
    params = adamw["weights_bytes"] // FP32
    assert adamw["grads_bytes"] == adamw["weights_bytes"] == ao["weights_bytes"] == bnb["weights_bytes"]
    assert adamw["optimizer_state_bytes"] >= 2 * adamw["weights_bytes"]  # two fp32 moments (+ step counters)
    # torchao's state claims fp32 dtype and shape: numel * element_size would report adamw's bytes
    for r in (ao, bnb):
        assert r["optimizer_state_bytes"] < 0.3 * adamw["optimizer_state_bytes"]
        assert (
            r["optimizer_state_bytes"] > 2 * params
        )  # one byte per moment element, plus scales and fp32 small tensors


def test_only_the_torchao_step_runs_eagerly_on_a_cpu_and_its_hooked_step_reads_the_quantized_update(run):
    _, records = run
    ao = records["fp32/sdpa/off/ao-adamw8bit"]
    assert "force_eager" in ao["optimizer_eager"]
    assert records["fp32/sdpa/off/bnb-adamw8bit"]["optimizer_eager"] is None
    # A stable probe is not replayed: its forensics come from read-only hooks on timed step 0, which
    # must have stepped the quantized optimizer and measured the update it made (none rounded away).
    forensics = ao["forensics"]
    assert "error" not in forensics and forensics["measured_on"] == "timed step 0"
    assert forensics["steps"][0]["loss"] == ao["steps"][0]["loss"]
    assert forensics["steps"][0]["update_loss"] == 0.0


def test_the_savings_section_says_what_this_cpu_measured(run):
    out, _ = run
    md = (out / "report.md").read_text()
    section = md.split("## Low-precision savings", 1)[1].split("\n## ", 1)[0]
    assert "| fp32/sdpa/off/ao-adamw8bit  | fp32/sdpa/off" in section
    assert "Measured on a CPU" in section and "says nothing about a GPU" in section
    assert "the claim is about GPU memory; this probe ran on a CPU" in section
    assert "runs the same step eagerly" in section
    assert "<h2>Low-precision savings</h2>" in (out / "report.html").read_text()
    saved = summary(out)["savings"]
    assert {c["config"] for c in saved["claims"]} == {"fp32/sdpa/off/ao-adamw8bit", "fp32/sdpa/off/bnb-adamw8bit"}
    assert {c["verdict"] for c in saved["claims"] if "overall" in c["claim"]} == {"not measured"}


def test_explain_shows_the_memory_split(run, cli):
    out, _ = run
    proc = cli("explain", out, "--probe", "fp32/sdpa/off/bnb-adamw8bit")
    assert proc.returncode == 0, proc.stderr
    assert "memory after the first step (bnb-adamw8bit): weights" in proc.stdout


def test_bisect_takes_the_optimizer_as_a_factor(tmp_path, cli):
    out = tmp_path / "bisect"
    proc = cli("bisect", "--bad", "optimizer=bnb-adamw8bit", "--steps", "3", "--reruns", "0", "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    b = json.loads((out / "bisect.json").read_text())
    assert b["factors"] == {"optimizer": ["adamw", "bnb-adamw8bit"]} and b["status"] == "nothing-to-bisect"

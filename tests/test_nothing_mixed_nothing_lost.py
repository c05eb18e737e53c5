"""A run directory holds one run: --out never mixes two, an interrupted grid or bisect is continued
with --resume, a running probe says it is alive, and every message a user can cause is one line."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from checkpoints import save_llama
from conftest import record_list, result_lines, run_main

from nandoctor.config import set_field
from nandoctor.models import plan_model, plan_warnings
from nandoctor.recipes import recipe_by_name, resolve_model
from nandoctor.recommend import checkpoint_name
from nandoctor.run.session import Heartbeat

TINY_GRID = (
    "--axis", "dtype=fp32", "--axis", "attn=eager", "--axis", "compile=off",
    "--steps", "2", "--set", "forensics_steps=0",
)  # fmt: skip
CPU = {"device": "cpu", "gpus": [], "cpu_count": 2, "ram_bytes": 8 * 2**30}


def error_lines(proc) -> list[str]:
    """stderr without the noise torch's optional libraries print on import."""
    return [line for line in proc.stderr.splitlines() if line.startswith("nandoctor:")]


def a_grid_run(path: Path) -> Path:
    """A run directory as a grid leaves it (what the refusal reads), without spending a probe on it."""
    path.mkdir()
    (path / "run.json").write_text(json.dumps({"kind": "grid"}))
    (path / "results.jsonl").write_text('{"probe_id": "fp32/eager/off"}\n')
    return path


@pytest.mark.parametrize("command", ["grid", "check", "bisect"])
def test_out_that_holds_a_run_is_refused_and_points_to_resume(command, tmp_path):
    out = a_grid_run(tmp_path / "run")
    before = (out / "results.jsonl").read_text()
    proc = run_main(command, "--out", out)
    assert proc.returncode == 2
    assert error_lines(proc) == [
        f"nandoctor: error: --out {str(out)!r} already holds a grid run; "
        f"finish it with `nandoctor grid --resume {out}` or pass another --out"
    ]
    assert "Traceback" not in proc.stderr
    assert (out / "results.jsonl").read_text() == before and not (out / "probes").exists()


def test_out_naming_a_file_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    proc = run_main("grid", "--out", path)
    assert proc.returncode == 2
    assert error_lines(proc) == [
        f"nandoctor: error: --out {str(path)!r} is a file; pass a directory for the run (it is created when missing)"
    ]
    assert "Traceback" not in proc.stderr and path.read_text() == "mine"


@pytest.mark.parametrize("command", ["grid", "bisect"])
def test_resume_of_a_file_says_it_is_a_file(command, tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text("")
    proc = run_main(command, "--resume", path)
    assert proc.returncode == 2
    assert error_lines(proc) == [
        f"nandoctor: error: {str(path)!r} is a file, not a run directory; "
        "pass the directory a run wrote, e.g. reports/<run-id>"
    ]


def test_bisect_resume_of_a_grid_run_is_refused(tmp_path):
    out = a_grid_run(tmp_path / "run")
    proc = run_main("bisect", "--resume", out)
    assert proc.returncode == 2
    assert error_lines(proc) == [
        f"nandoctor: error: {out} is a 'grid' run; `nandoctor bisect --resume` continues bisect runs only"
    ]


def test_bisect_resume_refuses_flags_that_would_change_the_search(tmp_path):
    proc = run_main("bisect", "--resume", tmp_path, "--bad", "dtype=fp16-pure", "--reruns", "0", "--fail-on", "timeout")
    assert proc.returncode == 2
    assert error_lines(proc) == [
        "nandoctor: error: --resume takes the recipe, --good, --bad, --fail-on, reruns, steps and run "
        "directory from DIR/run.json; drop --bad, --reruns, --fail-on"
    ]


def test_usage_error_is_prefixed_once():
    proc = run_main("grid", "--steps", "x")
    assert proc.returncode == 2
    assert error_lines(proc) == [
        "nandoctor: error: argument --steps: invalid int value: 'x' (see `nandoctor grid --help`)"
    ]


def test_tokenizer_without_a_planned_setup_is_an_error(tmp_path):
    proc = run_main("doctor", "--tokenizer", tmp_path)
    assert proc.returncode == 2
    assert error_lines(proc) == [
        "nandoctor: error: --tokenizer is checked as part of a planned setup; "
        "add --model, --recipe, --trainer-args or --accelerate-config"
    ]


def test_missing_tokenizer_directory_says_so_without_the_hub(tmp_path):
    proc = run_main("doctor", "--model", "tiny-llama", "--tokenizer", tmp_path / "nope")
    assert proc.returncode == 2
    assert error_lines(proc) == [
        f"nandoctor: error: tokenizer directory {str(tmp_path / 'nope')!r} does not exist; "
        "pass a local directory (nothing is downloaded)"
    ]


def test_empty_tokenizer_directory_names_the_files_it_lacks(tmp_path):
    proc = run_main("doctor", "--model", "tiny-llama", "--tokenizer", tmp_path)
    assert proc.returncode == 2
    assert error_lines(proc) == [
        f"nandoctor: error: tokenizer directory {str(tmp_path)!r} has no tokenizer files "
        "(tokenizer.json, tokenizer_config.json, vocab.json, vocab.txt, tokenizer.model, spiece.model)"
    ]


def test_trainer_args_with_bf16_and_fp16_both_true_is_an_error_finding(tmp_path):
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"bf16": True, "fp16": True}))
    proc = run_main("doctor", "--json", "--trainer-args", args)
    assert proc.returncode == 1, proc.stderr
    findings = json.loads(proc.stdout)["findings"]
    assert [f["id"] for f in findings] == ["trainer-bf16-and-fp16"] and findings[0]["severity"] == "error"


def test_from_pretrained_names_the_hub_id_the_local_path_or_your_checkpoint(tmp_path):
    assert checkpoint_name(recipe_by_name("llama-3.1-8b")) == "meta-llama/Llama-3.1-8B"
    ckpt = save_llama(tmp_path / "ckpt")
    assert checkpoint_name(resolve_model(str(ckpt))) == str(ckpt.resolve())
    assert checkpoint_name(recipe_by_name("tiny-llama")) == "<your checkpoint>"  # an architecture, not a checkpoint


def test_scale_full_that_cannot_fit_is_warned_before_probing():
    recipe = set_field(recipe_by_name("llama-3.1-8b"), "model.scale", "full")
    warnings = plan_warnings(recipe, plan_model(recipe, CPU), CPU)
    assert len(warnings) == 1 and warnings[0].startswith(
        "--scale full will likely run out of memory (8115.5M params need ~"
    )
    assert warnings[0].endswith("60% of 8 GiB is available); --scale auto probes a smaller twin")
    auto = recipe_by_name("llama-3.1-8b")
    assert plan_warnings(auto, plan_model(auto, CPU), CPU) == []  # auto picks the probe-scale twin: nothing to warn


def test_checkpoint_directory_without_weights_is_warned_loudly(tmp_path):
    ckpt = save_llama(tmp_path / "ckpt")
    for weights in ckpt.glob("*.safetensors"):
        weights.unlink()
    recipe = resolve_model(str(ckpt))
    plan = plan_model(recipe, CPU)
    assert plan.source == "architecture-twin"
    assert plan_warnings(recipe, plan, CPU) == [
        f"{ckpt.resolve()} has a config.json but no weights (*.safetensors or *.bin): "
        "every probe trains a RANDOM-INIT twin built from that config, not your checkpoint"
    ]
    real = resolve_model(str(save_llama(tmp_path / "real")))
    assert plan_warnings(real, plan_model(real, CPU), CPU) == []  # its own weights are trained: nothing to warn


def test_heartbeat_says_every_interval_which_probe_runs_and_its_last_step(tmp_path):
    (tmp_path / "steps.jsonl").write_text('{"step": 6, "loss": 6.1}\n{"step": 7, "loss": 5.93}\n{"step": 8, "lo')
    probe = SimpleNamespace(task=SimpleNamespace(probe_id="fp32/eager/off"), started=1.0, folder=tmp_path, elapsed=0.0)
    quiet = SimpleNamespace(
        task=SimpleNamespace(probe_id="fp32/sdpa/off"), started=2.0, folder=tmp_path / "none", elapsed=0.0
    )
    heard = []
    beat = Heartbeat(lambda *a: heard.append(a), every=15)
    for elapsed in (0.5, 14.9, 15.2, 29.0, 45.1, 45.6):
        probe.elapsed = quiet.elapsed = elapsed
        beat([probe, quiet])
    step = {"step": 7, "loss": 5.93}  # the half-written line is skipped
    assert heard == [
        ("fp32/eager/off", 15.2, step),
        ("fp32/sdpa/off", 15.2, None),
        ("fp32/eager/off", 45.1, step),
        ("fp32/sdpa/off", 45.1, None),
    ]


def test_heartbeat_line_reads_as_the_issue_asks():
    from nandoctor.cli.lines import alive_line

    assert (
        alive_line("fp32/eager/off", 45.2, {"step": 7, "loss": 5.93})
        == "  ... fp32/eager/off running 45 s, step 7 loss 5.93"
    )
    assert alive_line("fp32/eager/off", 15.0, None) == "  ... fp32/eager/off running 15 s, no step yet"


@pytest.mark.slow
def test_check_on_a_checkpoint_without_weights_says_so_loudly(tmp_path, cli):
    ckpt = save_llama(tmp_path / "ckpt")
    for weights in ckpt.glob("*.safetensors"):
        weights.unlink()
    proc = cli(
        "check",
        "--model",
        ckpt,
        "--dtype",
        "fp32",
        "--attn",
        "eager",
        "--set",
        "forensics_steps=0",
        "--out",
        tmp_path / "run",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model = [line for line in proc.stdout.splitlines() if line.startswith("model: ")]
    assert len(model) == 1 and "architecture-twin" in model[0] and "random-init twin" in model[0]
    assert f"nandoctor: WARNING: {ckpt.resolve()} has a config.json but no weights" in proc.stderr


@pytest.mark.slow
def test_ctrl_c_points_to_resume_and_resume_finishes_the_run(tmp_path, cli):
    out = tmp_path / "run"
    # 60 steps (seconds of training): the interrupt lands while the probe trains, not after a 2-step run
    # (a second, once its warm worker comes from the zygote) has already ended
    long_grid = [*TINY_GRID[:6], "--steps", "60", *TINY_GRID[8:]]
    grid = subprocess.Popen(
        [sys.executable, "-m", "nandoctor", "grid", *long_grid, "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    steps = out / "probes" / "fp32__eager__off" / "steps.jsonl"
    while not steps.exists() and grid.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the probe trains: the run is under way
    grid.send_signal(signal.SIGINT)
    _, stderr = grid.communicate(timeout=120)
    assert grid.returncode == 130
    assert (
        stderr.splitlines()[-1]
        == f"nandoctor: interrupted; the probes recorded so far are kept: continue with `nandoctor grid --resume {out}`"
    )

    proc = cli("grid", "--resume", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["probe_id"] for r in record_list(out)] == ["fp32/eager/off"]


@pytest.mark.slow
def test_resumed_bisect_spawns_only_the_missing_probes_and_finds_the_same_culprit(fp16_pure_bisect, tmp_path, cli):
    out = tmp_path / "run"
    shutil.copytree(fp16_pure_bisect[0], out)  # the shared run stays whole for its other readers
    finished = json.loads((out / "bisect.json").read_text())
    lines = result_lines(out)
    assert len(lines) >= 3, "the bisection must need more probes than it keeps for this test to mean anything"

    # as if it had been stopped just before its last probe was recorded: every probe but one is reused
    kept = lines[:-1]
    (out / "results.jsonl").write_text("\n".join(kept) + "\n" + lines[-1][:40])  # and a line cut off mid-write
    (out / "bisect.json").unlink()
    # a resume is sized for the host it runs on; --jobs 2 gives it the width the bisection ran with, whose
    # batches of trials decide the order of its path
    resumed = cli("bisect", "--resume", out, "--jobs", "2", on_cpu=True)  # where the shared bisection ran
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    after = result_lines(out)
    assert after[: len(kept)] == kept
    ran = [json.loads(line)["probe_id"] for line in after[len(kept) :]]
    assert ran == [json.loads(lines[-1])["probe_id"]]
    finished_lines = [line for line in resumed.stdout.splitlines() if "probe finished" in line]
    assert len(finished_lines) == len(ran)
    assert not any(line.endswith(": " + json.loads(k)["probe_id"]) for line in finished_lines for k in kept)
    again = json.loads((out / "bisect.json").read_text())
    assert [c["factors"] for c in again["culprits"]] == [c["factors"] for c in finished["culprits"]] == [["dtype"]]
    assert again["recommended"] == finished["recommended"]
    assert [(s["phase"], s["outcome"]) for s in again["path"]] == [(s["phase"], s["outcome"]) for s in finished["path"]]

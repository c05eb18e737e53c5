"""`nandoctor bisect` end to end: real tiny models trained in real probe processes."""

import json

import pytest
from checkpoints import save_flaky_llama
from conftest import run_main, summary

# slow: the end-to-end tests (real probe processes); the bad-input ones end in this process (run_main)


def bisection(run_dir):
    return json.loads((run_dir / "bisect.json").read_text())


@pytest.fixture(scope="module")
def default_bisect(tmp_path_factory):
    """`nandoctor bisect` with no --bad on tiny-llama, 3 steps, no reruns: its target, the fastest cell
    this CPU supports, trains stably. Read by the two tests below; returns (run directory, CompletedProcess)."""
    from conftest import run_cli

    out = tmp_path_factory.mktemp("default-bisect") / "run"
    proc = run_cli("bisect", "--steps", "3", "--reruns", "0", "--out", out, on_cpu=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # 0: the fp32 target trains stably, nothing to bisect
    return out, proc


@pytest.mark.slow
def test_fp16_pure_alone_is_the_culprit_and_sdpa_is_kept(fp16_pure_bisect):
    out, proc = fp16_pure_bisect
    b = bisection(out)
    # fp16-pure with AdamW eps=1e-8: eps rounds to 0 in fp16, the update divides by zero at step 1
    assert [c["factors"] for c in b["culprits"]] == [["dtype"]]
    assert b["path"][b["culprits"][0]["evidence"]]["verdicts"] == ["nonfinite"]
    assert b["recommended"] == {
        "dtype": "fp32",
        "attn": "sdpa",
        "compile": "off",
        "optimizer": "adamw",
        "parallel": "none",
        "quant": "none",
    }
    assert "Culprit (single factor): dtype=fp16-pure -> nonfinite" in proc.stdout
    rec = b["recommendation"]
    assert rec["command"] == "nandoctor check --dtype fp32 --attn sdpa --compile off"
    assert rec["model_loading"] == {"dtype": "torch.float32", "attn_implementation": "sdpa"}
    md = (out / "report.md").read_text()
    assert "## Bisection" in md and "| fp16-pure/eager/off" in md and "2^2 = 4 configurations" in md
    assert "Bisection path, probe by probe" in (out / "report.html").read_text()
    junit = (out / "junit.xml").read_text()
    assert 'classname="nandoctor.bisect.culprit" name="dtype=fp16-pure"' in junit
    assert 'name="recommended configuration"' in junit


@pytest.mark.slow
def test_bf16_pure_with_a_small_lr_comes_out_as_an_interaction(tmp_path, cli):
    out = tmp_path / "pair"
    # no forensics replay: nothing here reads it, and each bf16-pure replay costs seconds of slow CPU bf16 matmuls
    proc = cli(
        "bisect",
        "--bad",
        "dtype=bf16-pure,optimizer.lr=2e-5",
        "--steps",
        "8",
        "--reruns",
        "0",
        "--jobs",
        "2",
        "--set",
        "forensics_steps=0",
        "--out",
        out,
        on_cpu=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    b = bisection(out)
    # bf16 weights round away updates of lr 2e-5 (the loss stalls against fp32 at the same lr);
    # at lr 1e-3 bf16-pure tracks fp32, and fp32 at lr 2e-5 is its own reference
    assert [sorted(c["factors"]) for c in b["culprits"]] == [["dtype", "optimizer.lr"]]
    path = b["path"]
    assert path[b["culprits"][0]["evidence"]]["verdicts"] == ["drift"]
    assert [path[i]["outcome"] for i in b["culprits"][0]["minimality"]] == ["pass", "pass"]
    # the nearest stable configuration reverts one of the two and keeps the other
    rec = b["recommended"]
    assert (rec["dtype"], rec["optimizer.lr"]) in {("fp32", 2e-05), ("bf16-pure", 0.001)}
    assert "interaction of 2 factors" in (out / "report.md").read_text()


@pytest.mark.slow
def test_verdict_that_changes_on_an_identical_rerun_is_flaky(tmp_path, cli):
    ckpt = save_flaky_llama(tmp_path / "flaky")
    out = tmp_path / "run"
    # the checkpoint counts model constructions, and a forensics replay would construct it once more
    # inside the same probe: keep one construction per probe process
    proc = cli(
        "bisect",
        "--model",
        ckpt,
        "--trust-remote-code",
        "--bad",
        "attn=sdpa",
        "--steps",
        "3",
        "--reruns",
        "1",
        "--set",
        "forensics_steps=0",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the baseline held up: a stable config exists
    b = bisection(out)
    assert b["status"] == "flaky-target" and b["culprits"] == []
    target = b["path"][0]
    assert target["outcome"] == "flaky" and target["verdicts"] == ["nonfinite", "stable"]
    assert "Flaky, not used as a culprit: attn=sdpa" in proc.stdout
    assert (ckpt / "runs.txt").read_text() == "2"  # the target and its rerun, nothing else with sdpa


def test_unknown_factor_is_one_line_and_exit_2():
    proc = run_main("bisect", "--bad", "dtype=bf16-pure,optimizer.epsilon=1e-8")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "unknown factor 'optimizer.epsilon'" in proc.stderr


@pytest.mark.slow
def test_a_target_that_only_times_out_is_unresolved_exit_2_and_blames_nothing(tmp_path, cli):
    from checkpoints import save_faulty_llama

    ckpt = save_faulty_llama(tmp_path / "faulty")  # fp32/sdpa trains; half-precision weights with eager hang
    out = tmp_path / "run"
    proc = cli(
        "bisect",
        "--model",
        ckpt,
        "--trust-remote-code",
        "--good",
        "attn=sdpa",
        "--bad",
        "dtype=bf16-pure,attn=eager",
        "--steps",
        "2",
        "--reruns",
        "0",
        "--set",
        "timeout_s=4",
        "--out",
        out,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    b = bisection(out)
    assert b["status"] == "unresolved-target" and b["culprits"] == []
    assert b["path"][0]["verdicts"] == ["timeout"] and b["path"][0]["outcome"] == "unresolved"
    assert "could not test the target" in proc.stdout and "--fail-on timeout" in proc.stdout


@pytest.mark.slow
def test_stable_target_ends_with_nothing_to_bisect(default_bisect):
    out, proc = default_bisect
    assert "nothing to bisect" in proc.stdout
    b = bisection(out)
    assert b["status"] == "nothing-to-bisect" and b["culprits"] == []
    target = "/".join(b["bad"][axis] for axis in ("dtype", "attn", "compile"))
    assert {p["probe_id"] for p in summary(out)["probes"]} == {target, "fp32/eager/off"}  # the target, the baseline


@pytest.mark.slow
def test_the_default_cpu_bisect_on_tiny_llama_targets_a_fast_cell_and_finishes(default_bisect):
    out, _ = default_bisect
    b = bisection(out)
    assert b["status"] == "nothing-to-bisect"
    assert b["bad"]["dtype"] == "fp32" and b["bad"]["compile"] == "off"  # no bf16 or inductor on a CPU by default
    assert b["bad"]["attn"].startswith("sdpa")  # fused attention: the fastest the CPU has, not the eager baseline
    assert not any("timeout" in step["verdicts"] for step in b["path"])

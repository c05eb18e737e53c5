"""A probe that raises, aborts or hangs becomes a classified record; the grid goes on and keeps
everything. Bad input is one line and exit code 2."""

import shutil

import pytest
from checkpoints import save_faulty_llama
from conftest import record_list, result_lines, run_cli, run_main, summary

# slow: the end-to-end tests (real probe processes); the bad-input ones end in this process (run_main)


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("faulty")
    ckpt = save_faulty_llama(base / "faulty-llama")
    out = base / "run"
    proc = run_cli(
        "grid",
        "--model",
        ckpt,
        "--trust-remote-code",
        "--axis",
        "dtype=fp32,bf16-pure",
        "--axis",
        "attn=eager,sdpa",
        "--axis",
        "compile=off",
        "--set",
        "timeout_s=4",
        "--steps",
        "3",
        "--jobs",
        "2",
        "--out",
        out,
    )
    return out, proc


def probe(out, probe_id):
    return next(p for p in summary(out)["probes"] if p["probe_id"] == probe_id)


@pytest.mark.slow
def test_a_probe_that_raises_is_a_crash_with_its_message(faulty_run):
    out, _ = faulty_run
    p = probe(out, "fp32/eager/off")
    assert p["verdict"] == "crash" and "RuntimeError: faulty-llama: unsupported rotary layout" in p["reason"]


@pytest.mark.slow
def test_a_probe_that_aborts_is_a_crash_naming_the_signal(faulty_run):
    out, _ = faulty_run
    p = probe(out, "bf16-pure/sdpa/off")
    assert p["verdict"] == "crash" and "SIGABRT" in p["reason"]


@pytest.mark.slow
def test_a_probe_that_hangs_is_a_timeout(faulty_run):
    out, _ = faulty_run
    p = probe(out, "bf16-pure/eager/off")
    assert p["verdict"] == "timeout" and "no result within 4 s of its build" in p["reason"]


@pytest.mark.slow
def test_the_grid_completes_with_every_result_recorded(faulty_run):
    out, proc = faulty_run
    records = record_list(out)
    assert sorted(r["probe_id"] for r in records) == sorted(
        ["fp32/eager/off", "fp32/sdpa/off", "bf16-pure/eager/off", "bf16-pure/sdpa/off"]
    )
    assert probe(out, "fp32/sdpa/off")["verdict"] == "stable"
    assert proc.returncode == 1  # a probe crashed or hung: not a clean bill of health
    assert "Traceback" not in proc.stderr
    crashed = next(r for r in records if r["probe_id"] == "fp32/eager/off")
    assert "faulty-llama" in crashed["log_tail"] and crashed["error"]["traceback"]


@pytest.mark.slow
def test_report_rerenders_an_interrupted_run(faulty_run, tmp_path):
    out, _ = faulty_run
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    lines = result_lines(cut)
    (cut / "results.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:40])  # a half-written line
    for name in ("report.md", "report.html", "summary.json"):
        (cut / name).unlink()
    proc = run_cli("report", cut)
    # 1: of the four probes only fp32/sdpa/off is healthy, so the two kept hold a crash or the hang
    assert proc.returncode == 1, proc.stderr
    md = (cut / "report.md").read_text()
    assert "Interrupted run: 2 of 4 planned probes have results." in md
    assert summary(cut)["finished"] == 2


@pytest.mark.parametrize(
    "args, words",
    [
        (["grid", "--model", "llama-9"], "unknown model 'llama-9'"),
        (["grid", "--axis", "dtype=bf17"], "unknown dtype value 'bf17'; valid: fp32, tf32"),
        (["grid", "--axis", "precision=fp32"], "unknown axis 'precision'; valid axes: dtype, attn, compile"),
        (["grid", "--set", "optimizer.epsilon=1"], "unknown recipe field 'optimizer.epsilon'"),
        (["check", "--attn", "sdpa:fast"], "unknown attn value 'sdpa:fast'"),
        (["report", "/nonexistent/run"], "does not exist"),
        (["grid", "--jobs", "two"], "invalid int value"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, words):
    proc = run_main(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr


def test_malformed_recipe_and_unreadable_run_dir_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optimizer:\n  lr: [1e-3\n")
    proc = run_main("grid", "--recipe", bad)
    assert (
        proc.returncode == 2
        and "is not valid YAML at line" in proc.stderr
        and len(proc.stderr.strip().splitlines()) == 1
    )
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("optimiser:\n  lr: 1e-3\n")
    proc = run_main("grid", "--recipe", unknown)
    assert proc.returncode == 2 and "unknown key 'optimiser'" in proc.stderr
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    proc = run_main("report", empty)
    assert proc.returncode == 2 and "not a nandoctor run directory" in proc.stderr
    locked = tmp_path / "locked"
    shutil.copytree(empty, locked)
    (locked / "run.json").write_text("{not json")
    proc = run_main("report", locked)
    assert proc.returncode == 2 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_check_passes_on_tiny_llama_and_fails_on_fp16_overflow(fp32_check, large_mlp_checkpoint, tmp_path):
    _, ok, _ = fp32_check
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASS" in ok.stdout and "initial loss near ln(vocab)" in ok.stdout
    bad = run_cli(
        "check", "--model", large_mlp_checkpoint, "--dtype", "fp16-amp", "--attn", "sdpa", "--out", tmp_path / "bad"
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL loss finite at step 0" in bad.stdout
    assert (tmp_path / "bad" / "junit.xml").exists()


@pytest.mark.slow
def test_github_step_summary_gets_the_markdown(fp32_check):
    _, proc, target = fp32_check
    assert proc.returncode == 0, proc.stderr
    assert "# nandoctor check: tiny-llama" in target.read_text()


@pytest.mark.slow
def test_check_with_more_steps_fails_on_a_later_non_finite_step(tmp_path):
    """fp16-pure with AdamW eps 1e-8: step 0 is finite, the update at step 0 makes step 1's loss NaN. A
    check asked for 3 steps judges all 3, not only step 0."""
    proc = run_cli("check", "--dtype", "fp16-pure", "--attn", "eager", "--steps", "3", "--out", tmp_path / "run")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ok   loss finite at step 0" in proc.stdout
    assert "FAIL loss and grad-norm finite after step 0: non-finite at step 1: loss nan" in proc.stdout

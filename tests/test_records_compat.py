"""Runs written before the typed records (tests/fixtures/run-before-issue-9: a 4-probe tiny-llama grid
with --cache, written by the code of that time) still read, resume and hit the cache."""

import json
import shutil
from pathlib import Path

import pytest
from conftest import record_list, result_lines, verdicts

from nandoctor.analysis.outcomes import analyze
from nandoctor.record import ProbeRecord, ProbeSpec
from nandoctor.run.cache import ProbeCache
from nandoctor.run.fingerprint import probe_fingerprint
from nandoctor.run.store import ResultsStore

FIXTURE = Path(__file__).parent / "fixtures" / "run-before-issue-9"
EXPECTED = {
    "fp32/eager/off": "stable",
    "fp32/sdpa/off": "stable",
    "fp16-pure/eager/off": "nonfinite",
    "fp16-pure/sdpa/off": "nonfinite",
}


def test_old_records_read_as_typed_records_and_round_trip():
    records = ResultsStore(FIXTURE).records()
    assert [r.probe_id for r in records] == list(EXPECTED)
    assert all(ProbeRecord.from_dict(json.loads(json.dumps(r.to_dict()))) == r for r in records)
    fp16 = records[2]
    assert fp16.first_nonfinite == {"step": 1, "what": "loss"} and len(fp16.steps) == 2


def test_old_run_analyses_to_the_same_verdicts():
    analysis = analyze(FIXTURE)
    assert {o.probe_id: o.verdict.name for o in analysis.outcomes} == EXPECTED
    assert all(o.verdict.step == 1 for o in analysis.outcomes if o.verdict.name == "nonfinite")
    assert analysis.recommended.probe_id in ("fp32/eager/off", "fp32/sdpa/off")


def test_an_old_cache_still_reads_but_its_entries_no_longer_hit(tmp_path):
    """Entries written before nandoctor's version was part of the fingerprint may come from any version:
    they are read, and rerun rather than reused."""
    old_spec = json.loads((FIXTURE / "spec-fp32-sdpa-off.json").read_text())
    env = json.loads((FIXTURE / "run.json").read_text())["env"]
    record = next(r for r in ResultsStore(FIXTURE).records() if r.probe_id == "fp32/sdpa/off")
    now = probe_fingerprint(ProbeSpec.from_dict(old_spec).to_dict(), {}, env)
    (tmp_path / "probes.jsonl").write_text((FIXTURE / "cache-probes.jsonl").read_text())
    cached, run_dir = ProbeCache(tmp_path).lookup(record.fingerprint)
    assert cached.steps == record.steps and run_dir == "/tmp/oldfix/run"
    assert now != record.fingerprint and ProbeCache(tmp_path).lookup(now) is None


@pytest.mark.slow
def test_an_old_interrupted_run_resumes_with_only_its_missing_probe(tmp_path, cli):
    from nandoctor.env import collect_doctor

    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    meta = json.loads((run / "run.json").read_text())
    meta["env"] = collect_doctor().to_dict()  # resume refuses another environment; the format is what is tested here
    meta["axes"]["compile"] = ["off"]  # the CPU default it was made with (a GPU host's default compiles too)
    (run / "run.json").write_text(json.dumps(meta))
    lines = result_lines(run)
    (run / "results.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    proc = cli("grid", "--resume", run)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = [r["probe_id"] for r in record_list(run)[3:]]
    assert ran == ["fp16-pure/sdpa/off"]
    assert verdicts(run) == EXPECTED


def test_load_run_gives_one_row_per_probe_with_its_rank():
    import nandoctor

    table = nandoctor.load_run(FIXTURE)
    assert list(table["probe_id"]) == list(EXPECTED) and list(table["verdict"]) == list(EXPECTED.values())
    assert {"dtype", "attn", "compile", "step", "fidelity", "tokens_per_s", "peak_memory_bytes", "rank"} <= set(
        table.columns
    )
    assert sorted(table["rank"].dropna()) == [1, 2] and table["step"].iloc[2] == 1


@pytest.mark.slow
def test_report_csv_writes_the_same_table(tmp_path, cli):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    proc = cli("report", run, "--csv", tmp_path / "probes.csv")
    assert proc.returncode == 0, proc.stderr
    import pandas as pd

    assert list(pd.read_csv(tmp_path / "probes.csv")["verdict"]) == list(EXPECTED.values())


def test_a_record_without_the_fp8_section_meets_a_reference_written_with_it():
    from nandoctor.analysis.verdicts import reference_key
    from nandoctor.config import recipe_to_dict
    from nandoctor.recipes import recipe_by_name

    old = next(r for r in ResultsStore(FIXTURE).records() if r.probe_id == "fp32/eager/off")
    assert "fp8" not in old.recipe
    now = ProbeRecord.from_dict({**old.to_dict(), "recipe": recipe_to_dict(recipe_by_name("tiny-llama"))})
    assert reference_key(old) == reference_key(now)

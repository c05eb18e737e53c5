"""Every JSON file nandoctor writes parses with a strict parser: a non-finite number is the string "NaN",
"Infinity" or "-Infinity", never the bare constant Python's json writes by default. Readers turn those
strings back into floats, and runs written before (bare NaN in results.jsonl) still read. The files are
written and read by the real store, cache, step log, result writer and report writers; fast: no probe runs."""

import math
import shutil
from pathlib import Path

from conftest import strict_json as strict

from nandoctor.cells import Cell
from nandoctor.child.outcome import write as write_result
from nandoctor.child.train import StepLog
from nandoctor.cli import main
from nandoctor.record import ProbeRecord, Step
from nandoctor.report.doctor import render_doctor_json
from nandoctor.run.cache import ProbeCache
from nandoctor.run.store import RETIME_FILE, ResultsStore
from nandoctor.run.task import read_result, read_steps

OLD_RUN = Path(__file__).parent / "fixtures" / "run-lr30"  # written with bare NaN / Infinity


def strict_lines(path: Path) -> list:
    return [strict(line) for line in path.read_text().splitlines() if line.strip()]


def nonfinite_record() -> ProbeRecord:
    steps = [
        Step(0, 6.9, 1.0, tokens_per_s=100.0),
        Step(1, math.inf, math.nan, scale=65536.0, time_s=math.nan),
        Step(2, math.nan, -math.inf, tokens_per_s=math.inf),
    ]
    return ProbeRecord(
        "fp16-amp/sdpa/off",
        Cell("fp16-amp", "sdpa"),
        "ok",
        steps=steps,
        wall_s=math.inf,
        fingerprint="f" * 64,
        first_nonfinite={"step": 1, "what": "loss"},
        forensics={"stats": {"min": -math.inf, "max": math.nan}},
    )


def same_steps(a: list[Step], b: list[Step]) -> bool:
    def same(x, y):
        return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))

    return len(a) == len(b) and all(same(getattr(s, f), getattr(t, f)) for s, t in zip(a, b) for f in vars(s))


def test_results_jsonl_is_strict_and_reads_back_the_nonfinite_floats(tmp_path):
    store = ResultsStore(tmp_path / "run")
    store.create({"kind": "grid", "run_id": "strict", "host_load": math.nan})
    record = nonfinite_record()
    store.append(record)
    [line] = strict_lines(store.results_path)
    assert (
        line["steps"][1]["loss"] == "Infinity"
        and line["steps"][1]["grad_norm"] == "NaN"
        and line["wall_s"] == "Infinity"
    )
    [back] = store.records()
    assert same_steps(back.steps, record.steps) and back.wall_s == math.inf
    assert back.forensics["stats"]["min"] == -math.inf and math.isnan(back.forensics["stats"]["max"])
    assert strict((store.dir / "run.json").read_text())["host_load"] == "NaN" and math.isnan(store.meta()["host_load"])


def test_retime_json_is_strict_and_reads_back(tmp_path):
    store = ResultsStore(tmp_path / "run")
    store.create({"kind": "grid", "run_id": "strict"})
    store.write_json(RETIME_FILE, {"rounds": [{"fp32/sdpa/off": [math.inf, 10.0, math.nan]}]})
    assert strict((store.dir / RETIME_FILE).read_text())["rounds"][0]["fp32/sdpa/off"] == ["Infinity", 10.0, "NaN"]
    rates = store.read_json(RETIME_FILE)["rounds"][0]["fp32/sdpa/off"]
    assert rates[0] == math.inf and rates[1] == 10.0 and math.isnan(rates[2])


def test_the_step_log_and_result_json_are_strict_and_read_back(tmp_path):
    log = StepLog(tmp_path / "steps.jsonl", planned=4)
    record = nonfinite_record()
    for s in record.steps:
        if not log(s):
            break  # the step log stops the run at the first unrecoverable step
    log.file.close()
    assert [s["loss"] for s in strict_lines(tmp_path / "steps.jsonl")][:2] == [6.9, "Infinity"]
    assert same_steps([Step.from_dict(s) for s in read_steps(tmp_path / "steps.jsonl")], record.steps[:2])
    write_result(record, tmp_path / "result.json")
    strict((tmp_path / "result.json").read_text())
    assert same_steps(ProbeRecord.from_dict({**read_result(tmp_path / "result.json")}).steps, record.steps)


def test_the_cache_index_is_strict_and_reads_back(tmp_path):
    record = nonfinite_record()
    ProbeCache(tmp_path).add(record, tmp_path / "run")
    strict_lines(ProbeCache(tmp_path).path)
    cached, run_dir = ProbeCache(tmp_path).lookup(record.fingerprint)
    assert same_steps(cached.steps, record.steps) and run_dir == str(tmp_path / "run")


def test_an_old_run_with_bare_nan_still_reads_and_its_reports_are_strict(tmp_path, capsys):
    assert "NaN" in (OLD_RUN / "results.jsonl").read_text()  # the fixture predates strict JSON
    records = ResultsStore(OLD_RUN).records()
    assert any(not math.isfinite(s.loss) or not math.isfinite(s.grad_norm) for r in records for s in r.steps)
    run = tmp_path / "run"
    shutil.copytree(OLD_RUN, run)
    main(["report", str(run)])
    main(["diff", str(run), str(run), "--out", str(tmp_path / "diff")])
    strict((run / "summary.json").read_text())
    written = list((tmp_path / "diff").glob("*.json"))
    assert written and all(strict(p.read_text()) is not None for p in written)


def test_doctor_json_and_the_writer_itself_are_strict():
    from nandoctor import jsonio

    report = {"findings": [{"measured": math.inf}], "ram": 10**400, "ratio": (math.nan, -math.inf)}
    assert strict(render_doctor_json(report))["ratio"] == ["NaN", "-Infinity"]
    text = jsonio.dumps({"a": [math.nan, {"b": math.inf}], "c": Path("x")})
    assert strict(text) == {"a": ["NaN", {"b": "Infinity"}], "c": "x"}
    back = jsonio.loads(text)
    assert math.isnan(back["a"][0]) and back["a"][1]["b"] == math.inf
    assert math.isnan(jsonio.loads('{"old": NaN}')["old"])  # files written before still read

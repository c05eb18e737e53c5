"""The Data section of the reports and of `nandoctor doctor --data`: the synthetic stream says it is
not the user's data; the user's rows show what was read, histograms (inline SVG in report.html), the
lint's findings with their figures, and the rows each batch and each probe trained on."""

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

from checkpoints import save_llama
from conftest import run_main
from userdata_fixtures import chat_rows, save_chat_tokenizer, write_jsonl

from nandoctor.cli import main
from nandoctor.config import recipe_from_dict
from nandoctor.doctor import data_lint
from nandoctor.report.data import data_markdown, histogram_svg

OLD_RUN = Path(__file__).parent / "fixtures" / "run-lr30"


def chat_section(tmp_path) -> dict:
    tok = save_chat_tokenizer(tmp_path / "tok")
    r = recipe_from_dict(
        {"data": {"path": str(write_jsonl(tmp_path / "chat.jsonl", chat_rows(10))), "tokenizer": str(tok)}}, "r"
    )
    return json.loads(json.dumps(data_lint(r)))  # as run.json would hold it


def test_a_run_on_the_synthetic_stream_says_so(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(OLD_RUN, run)
    main(["report", str(run)])
    md = (run / "report.md").read_text()
    assert "## Data" in md and "The synthetic stream: 4 distinct batches" in md and "not your data" in md
    assert '<h2 id="data">Data</h2><p>The synthetic stream' in (run / "report.html").read_text()


def test_a_run_that_read_the_users_rows_says_so_without_the_lint_section(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(OLD_RUN, run)
    meta = json.loads((run / "run.json").read_text())
    meta["recipe"]["data"].update(source="file", path="data/chat.jsonl", tokenizer="./tok", packing="position_ids")
    (run / "run.json").write_text(json.dumps(meta))
    main(["report", str(run)])
    md = (run / "report.md").read_text()
    assert "Your rows: data/chat.jsonl, tokenized with ./tok;" in md and "packing position_ids" in md
    assert "synthetic" not in md.split("## Data")[1].split("##")[0]


def test_a_run_on_the_users_rows_shows_histograms_findings_and_batches(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(OLD_RUN, run)
    meta = json.loads((run / "run.json").read_text())
    meta["data"] = chat_section(tmp_path)
    (run / "run.json").write_text(json.dumps(meta))
    main(["report", str(run)])
    md, html = (run / "report.md").read_text(), (run / "report.html").read_text()
    assert (
        "Your rows: " in md and "(10 messages rows)" in md and "| tokens per row" in md and "| fewest_supervised" in md
    )
    svgs = [s + "</svg>" for s in html.split("</svg>") if '<svg xmlns="http://www.w3.org/2000/svg" width="380"' in s]
    svgs = [s[s.index("<svg") :] for s in svgs]
    assert len(svgs) == 2 and all(ET.fromstring(s).tag.endswith("svg") for s in svgs)


def test_the_rows_each_probe_trained_on_are_listed_when_records_carry_them():
    batches = [{"kind": "first", "rows": [0, 1]}, {"kind": "longest", "rows": [7, 3]}]
    outcomes = [SimpleNamespace(record=SimpleNamespace(probe_id="fp32/sdpa/off", data={"batches": batches}))]
    lines = data_markdown({"recipe": {"data": {"batches": 4}}}, outcomes, lambda rows: json.dumps(rows))
    assert (
        json.dumps(
            [
                {"probe": "fp32/sdpa/off", "kind": "first", "rows": "0, 1"},
                {"probe": "fp32/sdpa/off", "kind": "longest", "rows": "7, 3"},
            ]
        )
        in lines
    )


def test_a_histogram_svg_draws_a_bar_per_bin_with_its_count():
    svg = ET.fromstring(histogram_svg({"edges": [0, 5, 10, 15], "counts": [3, 0, 9]}, "tokens per row"))
    bars = [e for e in svg.iter() if e.tag.endswith("rect")]
    assert len(bars) == 3 and [b.find("{http://www.w3.org/2000/svg}title").text for b in bars] == ["3", "0", "9"]
    assert float(bars[2].get("height")) > float(bars[0].get("height")) > float(bars[1].get("height")) == 0


def test_the_doctor_prints_the_data_section_and_each_figure(tmp_path):
    tok = save_chat_tokenizer(tmp_path / "tok", pad="</s>")
    ckpt = save_llama(tmp_path / "ckpt", use_cache=False)
    rows = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    proc = run_main(
        "doctor", "--data", rows, "--model", ckpt, "--tokenizer", tok, "--axis", "dtype=fp32", "--axis", "attn=sdpa"
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "Data\nYour rows: " in proc.stdout
        and "8 rows scanned" in proc.stdout
        and "supervised tokens per row" in proc.stdout
    )
    assert "Batches a probe trains on (rows of the data set):" in proc.stdout
    assert "      measured: EOS ('</s>', id 3) occurs 16 times in your 8 rows and is a target in none" in proc.stdout

"""report.html's first screen and Data section read as a user needs them: the recommendation box
gives the answer and the verdicts before how speed decided (folded), each data finding shows its fix,
the special tokens have their table, the rows the probes trained on are not listed twice, and a
histogram's axis labels stay inside the chart."""

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

from recorded import meta, probe
from userdata_fixtures import chat_rows, save_chat_tokenizer, write_jsonl

from nandoctor.analysis.outcomes import analyze_records
from nandoctor.cli import main
from nandoctor.config import recipe_from_dict
from nandoctor.doctor import data_lint
from nandoctor.report import timing
from nandoctor.report.data import data_html, histogram_svg, probe_groups, trained_as_listed
from nandoctor.report.html import render_html
from nandoctor.runmeta import RunMeta

OLD_RUN = Path(__file__).parent / "fixtures" / "run-lr30"


def report_with_rows(tmp_path) -> tuple[str, dict]:
    """report.html of a recorded run whose run.json holds the lint of 10 chats cut at 16 tokens."""
    tok = save_chat_tokenizer(tmp_path / "tok")
    data = {"path": str(write_jsonl(tmp_path / "chat.jsonl", chat_rows(10))), "tokenizer": str(tok), "max_length": 16}
    section = json.loads(json.dumps(data_lint(recipe_from_dict({"data": data}, "r"))))
    run = tmp_path / "run"
    shutil.copytree(OLD_RUN, run)
    meta = json.loads((run / "run.json").read_text())
    meta["data"] = section
    (run / "run.json").write_text(json.dumps(meta))
    main(["report", str(run)])
    return (run / "report.html").read_text(), section


def test_each_data_finding_shows_its_fix_and_the_special_tokens_have_a_table(tmp_path):
    html, section = report_with_rows(tmp_path)
    truncated = next(f for f in section["findings"] if f["id"] == "rows-truncated-at-max-length")
    item = html.split('<ul class="findings">')[1].split("</ul>")[0]
    assert "rows-truncated-at-max-length" in item and f"Fix: {truncated['fix']}" in item
    table = html.split("<h3>Special tokens</h3>")[1].split("</table>")[0]
    assert "<th>as a target</th>" in table
    assert all(f"<td>{t['id']}</td>" in table for t in section["special_tokens"])
    assert "&#39;&lt;/s&gt;&#39;" in table  # the EOS, by its text


def test_the_rows_the_probes_trained_on_are_said_once():
    listed = [{"kind": "first", "rows": [0, 1], "tokens": 9, "padded": 0, "supervised": 7}]
    same, other = [{"kind": "first", "rows": [0, 1]}], [{"kind": "first", "rows": [5, 6]}]

    def probes(*ids_and_batches):
        return [SimpleNamespace(record=SimpleNamespace(probe_id=i, data={"batches": b})) for i, b in ids_and_batches]

    shared = probe_groups(probes(("fp32/eager/off", same), ("fp32/sdpa/off", same)))
    assert shared == [{"probes": "fp32/eager/off, fp32/sdpa/off", "batches": [{"kind": "first", "rows": "0, 1"}]}]
    assert trained_as_listed(shared, listed) == (
        "Every probe (2: fp32/eager/off, fp32/sdpa/off) trained on the batches above, row for row."
    )
    split = probe_groups(probes(("fp32/eager/off", same), ("bf16-amp/sdpa/off", other)))
    assert [g["probes"] for g in split] == ["fp32/eager/off", "bf16-amp/sdpa/off"]
    assert trained_as_listed(split, listed) is None and trained_as_listed(shared, None) is None
    meta = RunMeta.of({"recipe": {"data": {}}})  # no lint section: each group's table, its probes named once
    html = render_html_of(data_html(meta, probes(("fp32/eager/off", same), ("bf16-amp/sdpa/off", other))))
    assert html.count("fp32/eager/off") == 1 and '<td rowspan="1">bf16-amp/sdpa/off</td>' in html


def render_html_of(context: dict) -> str:
    from nandoctor.report.html import _env

    template = _env.get_template("report.html.j2")
    source = template.environment.loader.get_source(template.environment, "report.html.j2")[0]
    block = source[source.index("{% if data.trained_as_listed %}") : source.index("{% if data.checks %}")]
    return template.environment.from_string(block).render(data=context)


def test_a_histograms_outer_labels_end_inside_the_chart():
    svg = ET.fromstring(histogram_svg({"edges": list(range(0, 2600, 200)), "counts": [1] * 12}, "tokens per row"))
    labels = [e for e in svg.iter() if e.tag.endswith("text") and e.text in ("0", "2400")]
    assert [(e.text, e.get("text-anchor")) for e in labels] == [("0", "start"), ("2400", "end")]
    assert float(labels[1].get("x")) <= float(svg.get("width"))


def test_the_recommendation_box_answers_before_the_speed_statistics():
    a = analyze_records(meta(), [probe("fp32/eager/off", [100] * 8), probe("fp32/sdpa/off", [104] * 8)])
    speed = timing.speed_lines(a)
    assert speed  # a tie told in words
    box = render_html(a).split('<div class="answer" id="recommendation">')[1].split("</div>")[0]
    answer, _, folded = box.partition('<details id="speed">')
    assert "Recommended: fp32/sdpa/off" in answer and "Verdicts: 2 stable" in answer
    assert all(line not in answer and line in folded for line in speed)

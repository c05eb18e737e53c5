"""The reports show what each probe trained on and how its setup measured: the rows of the user's data
set each probe's batches held (probes on the same rows together), the step-0 setup checks with their
figures and result, and the trainable groups that got no gradient; summary.json carries the same, and
the recommendation's data and training settings. Records as the child writes them; renderers unpatched."""

import json

from recorded import twin_meta as meta
from test_setup_verdicts import LEAK, LOSSES

from nandoctor.analysis.outcomes import analyze_records
from nandoctor.cells import Cell
from nandoctor.record import ProbeRecord, Step
from nandoctor.report.html import render_html
from nandoctor.report.markdown import render_markdown
from nandoctor.report.summary import render_summary

BATCHES = [
    {"kind": "first", "rows": [0, 1, 2, 3], "tokens": 60, "padded": 4, "supervised": 50},
    {"kind": "longest", "rows": [11, 5, 2, 9], "tokens": 64, "padded": 0, "supervised": 58},
]
TRAINABLE = {
    "adapter": {"tensors": 8, "elements": 2048, "first": "base_model.model.model.layers.0.self_attn.q_proj.lora_A"},
    "modules_to_save": {"tensors": 1, "elements": 65536, "first": "base_model.model.lm_head.modules_to_save"},
}
DATA_RECIPE = {
    "name": "tiny-llama",
    "data": {"source": "file", "path": "chat.jsonl", "packing": "position_ids_with_mask", "batches": 4},
}


def probe(cell, setup=None, groups=None):
    steps = [Step(i, loss, 1.0, groups=groups) for i, loss in enumerate(LOSSES)]
    return ProbeRecord(
        cell.id,
        cell,
        steps=steps,
        recipe={**DATA_RECIPE, "adapter": {"type": "lora"}},
        setup_checks=setup,
        trainable_groups=TRAINABLE if groups else None,
        data={"source": "file", "batches": BATCHES, "micro_batches_per_step": 1},
    )


def analysis():
    records = [
        probe(Cell("fp32", "eager", "off"), setup=LEAK),
        probe(Cell("fp32", "sdpa", "off"), setup={**LEAK, "packing_max_logit_diff": 2e-7}),
        probe(Cell("bf16-amp", "sdpa", "off"), groups={"adapter": None, "modules_to_save": 0.3}),
    ]
    return analyze_records({**meta(3), "recipe": DATA_RECIPE}, records)


def test_the_data_section_shows_rows_setup_checks_and_starved_groups():
    md = render_markdown(analysis()).split("## Data")[1].split("\n## ")[0]
    assert "Rows each probe trained on:" in md
    assert "| fp32/eager/off, fp32/sdpa/off, bf16-amp/sdpa/off | longest | 11, 5, 2, 9 |" in md
    assert "Setup checks each probe measured at step 0, on its own model:" in md
    leak = next(line for line in md.splitlines() if line.startswith("| fp32/eager/off | packing isolation"))
    assert "max logit difference 0.771 to each of 4 segments run alone (a 2-D attention mask" in leak
    assert "bound 0.0001 (the segments alone move by 0 against fp32)" in leak and leak.endswith("| leaks    |")
    assert "| fp32/sdpa/off  | packing isolation | max logit difference 2e-07" in md and "| isolated |" in md
    assert "Trainable groups that got no gradient at any step:" in md
    assert (
        "| bf16-amp/sdpa/off | adapter |         8 | base_model.model.model.layers.0.self_attn.q_proj.lora_A | all 6"
        in md
    )


def test_report_html_shows_the_same_tables():
    html = render_html(analysis())
    data = html.split('<h2 id="data">Data</h2>')[1].split("<h2>")[0]
    assert "<h3>Setup checks each probe measured at step 0</h3>" in data and '<td class="bad">leaks</td>' in data
    assert "<h3>Trainable groups that got no gradient at any step</h3>" in data and "lora_A" in data
    assert "<h3>Rows each probe trained on</h3>" in data


def test_summary_json_carries_each_probes_checks_groups_and_rows():
    summary = json.loads(json.dumps(render_summary(analysis())))
    probes = {p["probe_id"]: p for p in summary["probes"]}
    assert probes["fp32/eager/off"]["verdict"] == "misconfigured"
    assert probes["fp32/eager/off"]["setup_checks"]["packing_max_logit_diff"] == LEAK["packing_max_logit_diff"]
    assert probes["bf16-amp/sdpa/off"]["verdict"] == "no-learning"
    assert probes["bf16-amp/sdpa/off"]["groups_without_gradient"] == ["adapter"]
    assert probes["fp32/sdpa/off"]["trained_rows"][1] == {"kind": "longest", "rows": [11, 5, 2, 9]}

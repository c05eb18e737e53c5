"""One verdict whichever door (STYLE rule 25), fault by fault: each faulty setup of issue 44 and the one
before it goes through `grid`, through `check` and through a real training run watched by a training
callback, on the same checkpoint and the same pre-tokenized rows, and all three name the same verdict at
the same step (the grid's is the reference), with the same data lint rule at the same severity where the
fault is in the data. docs/architecture.md's one-judge table lists the faults and what each door says.

- a GradScaler that skips every step: both MLPs' down_proj x1e5 overflow fp16's backward at every scale
  from 65536 down; a Lightning fit with the 16-mixed plugin and a CPU GradScaler (fp16 autocast runs on a
  CPU there, a transformers Trainer trains fp16=True in fp32);
- a non-finite loss: fp32 at learning rate 1e30, the weights leave fp32's range after step 0;
- a batch with no target: the first 4 rows' labels are all -100, so step 0's mean loss is 0/0; the data
  lint's error;
- one row with no target among supervised ones: no step divides by zero, the data lint's warning;
- a stall: bf16-pure at learning rate 1e-6, where step 0's AdamW update rounds away in the bf16 weights;
- a drift from fp32, which only the grid judges (it probes the fp32 reference): bf16-pure at 1e-3 is
  stable in every door, and check and the callback say that they did not judge its drift;
- packing that leaks in bf16-pure: modeling code that drops position_ids, its rows packed with
  position_ids (a Trainer's DataCollatorWithFlattening), weights in bf16 with no autocast flag: the leak
  is measured against the fp32 floor whatever the cell, so it is `misconfigured` at step 0 as in fp32;
- a mixture of experts too lightly loaded to judge collapse: 64 experts, top-1, 96 tokens a step (1.5 an
  expert): stable in every door, each saying that expert collapse was not judged and what batch judges it;
- a router that collapsed: every token to experts 0 and 1 of 8 (tests/checkpoints.py), `expert-collapse`
  in every door (the callback judges step 0's routing);
- a loss spike: fp32 at learning rate 0.1, constant, unclipped, 4 steps (a Trainer schedules its learning
  rate linearly unless told; the probe keeps it constant); steps 0-2 train one repeated row (loss 6.91,
  6.85, 3.54), step 3 four new rows of the same length (13.64, 2.4x their mean): `diverged` at step 3,
  the grad-norm staying under 10x its largest before (51.6 after 13.3), so no explosion comes first."""

from __future__ import annotations

import json
import random
import re
import warnings
from dataclasses import dataclass, field

import pytest
import torch
from checkpoints import save_collapsed_qwen3_moe, save_drops_positions_llama, save_llama, tiny_qwen3_moe
from conftest import run_main
from training_runs import JsonlRows, hf_trainer, lightning_fit, nandoctor_lightning, nandoctor_transformers, tiny_llama

pytestmark = pytest.mark.slow  # probes through the CLI, and a Trainer or Lightning run for each fault

STEPS = 2
ROWS, LENGTH = 16, 24  # 4 batches of 4 rows, unpadded


@dataclass(frozen=True)
class Fault:
    """One faulty setup: its checkpoint and rows (keys of the `files` fixture), its cell and recipe
    settings, how the callback's run sets the same up, and what every door must say."""

    name: str
    dtype: str
    verdict: str
    step: int | None
    rows: str = "clean"
    checkpoint: str = "plain"
    settings: tuple = ()  # --set key=value for grid and check
    framework: str = "transformers"
    train: dict = field(default_factory=dict)  # TrainingArguments for the transformers run
    load: torch.dtype = torch.float32  # the dtype the callback's run loads the checkpoint in
    packed: bool = False  # the callback's Trainer packs each batch's rows with position_ids (custom modeling code)
    rule: tuple | None = None  # (rule id, severity) the data lint gives in every door
    said: str = ""  # what every door's reason says
    unjudged: str = ""  # what check's and the callback's reasons say of a rule they cannot judge, the grid's not
    steps: int = STEPS


FAULTS = (
    Fault(
        "gradscaler-skips-every-step",
        "fp16-amp",
        "nonfinite",
        0,
        checkpoint="overflowing",
        framework="lightning",
        said="GradScaler skipped every one of the 2 steps (scale 65536 -> 16384)",
    ),
    Fault(
        "nonfinite-loss",
        "fp32",
        "nonfinite",
        1,
        settings=("optimizer.lr=1e30",),
        train={"learning_rate": 1e30},
        said="loss is nan at step 1",
    ),
    Fault(
        "no-target",
        "fp32",
        "no-target",
        0,
        rows="no_target",
        rule=("rows-without-supervised-token", "error"),
        said="batch has no supervised token (every label -100 after the shift), so its mean loss is 0/0 = nan",
    ),
    Fault(
        "row-without-target",
        "fp32",
        "stable",
        None,
        rows="one_unsupervised",
        rule=("rows-without-supervised-token-in-full-batches", "warning"),
    ),
    Fault(
        "stall",
        "bf16-pure",
        "drift",
        0,
        settings=("optimizer.lr=1e-6",),
        train={"learning_rate": 1e-6},
        load=torch.bfloat16,
        said="stalled: step 0's optimizer step lost ",
    ),
    Fault(
        "drift-from-fp32",
        "bf16-pure",
        "stable",
        None,
        train={"learning_rate": 1e-3},
        load=torch.bfloat16,
        unjudged="; drift from fp32 not judged: no fp32 reference",
    ),
    Fault(
        "packing-leak-bf16-pure",
        "bf16-pure",
        "misconfigured",
        0,
        checkpoint="drops_positions",
        settings=("model.trust_remote_code=true", "data.packing=position_ids"),
        load=torch.bfloat16,
        packed=True,
        rule=("packing-leaks-across-segments", "error"),
        said="packing: one packed forward",
    ),
    Fault(
        "collapse-unjudged",
        "fp32",
        "stable",
        None,
        checkpoint="moe",
        said="expert collapse not judged: 96 tokens x top-1 over 64 experts is 1.5 assignments per expert, under "
        "the 8 an even router must give each before an idle expert means collapse; a batch of 512 tokens or more "
        "judges it",
    ),
    Fault(
        "expert-collapse",
        "fp32",
        "expert-collapse",
        0,
        checkpoint="collapsed_moe",
        said="router collapse: layer 0 (model.layers.0.mlp.gate): 6 of 8 experts got no token at step ",
    ),
    Fault(
        "loss-spike",
        "fp32",
        "diverged",
        3,
        rows="memorised",
        settings=("optimizer.lr=0.1", "grad_clip=0"),
        train={"learning_rate": 0.1, "max_grad_norm": 0.0, "lr_scheduler_type": "constant"},
        said="loss spiked to ",
        steps=4,
    ),
)


def write_rows(path, unsupervised: range = range(0), repeated: range = range(0)):
    """ROWS rows of LENGTH random ids, labels = input_ids, except the rows in `unsupervised`: all -100.
    The rows in `repeated` repeat the first row."""
    rng = random.Random(0)
    drawn = []
    for i in range(ROWS):
        drawn.append(drawn[0] if i in repeated and drawn else [rng.randrange(10, 1000) for _ in range(LENGTH)])
    with open(path, "w") as f:
        for i, ids in enumerate(drawn):
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * LENGTH if i in unsupervised else ids}) + "\n")
    return path


def save_moe(path):
    """A tiny Qwen3-MoE of 64 experts, top-1: a step of 4 rows of LENGTH tokens gives each expert 1.5
    assignments, under the expert_min_load that judging collapse needs."""
    tiny_qwen3_moe(num_experts=64, num_experts_per_tok=1, use_cache=False).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("every-door")
    return {
        "dir": d,
        "plain": save_llama(d / "plain", use_cache=False),
        # backward overflows fp16 at every scale from 65536 down to 2048 (tests/test_check_judges_as_grid.py)
        "overflowing": save_llama(d / "overflowing", mlp_scale={0: (3e-3, 1e5), 1: (3e-3, 1e5)}, use_cache=False),
        "drops_positions": save_drops_positions_llama(d / "drops-positions", use_cache=False),
        "moe": save_moe(d / "moe"),
        "collapsed_moe": save_collapsed_qwen3_moe(d / "collapsed-moe"),
        "clean": write_rows(d / "clean.jsonl"),
        "no_target": write_rows(d / "no-target.jsonl", range(4)),  # step 0's batch
        "one_unsupervised": write_rows(d / "one-unsupervised.jsonl", range(1, 2)),
        "memorised": write_rows(d / "memorised.jsonl", repeated=range(12)),  # steps 0-2 train one row, 3 new ones
    }


def live_rules(findings: list[dict]) -> set[tuple[str, str]]:
    """(id, severity) of the findings of rules the callbacks' lint judges too (scope live)."""
    from nandoctor.integrations.setup_lint import LIVE_RULES

    return {(f["id"], f["severity"]) for f in findings if f["id"] in LIVE_RULES}


def grid_door(fault: Fault, files, out) -> tuple[dict, dict, set]:
    """The grid's probe of the fault's cell and every probe (summary.json), and its data lint's rules
    (run.json)."""
    proc = run_main(
        "grid", "--model", files[fault.checkpoint], "--data", files[fault.rows], "--axis", f"dtype={fault.dtype}",
        "--axis", "attn=sdpa", "--axis", "compile=off", "--steps", fault.steps, "--set", "retime_rounds=0",
        *[a for s in fault.settings for a in ("--set", s)], "--out", out,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    probes = {p["probe_id"]: p for p in json.loads((out / "summary.json").read_text())["probes"]}
    data = json.loads((out / "run.json").read_text())["data"] or {}
    return probes[f"{fault.dtype}/sdpa/off"], probes, live_rules(data.get("findings", []))


def check_door(fault: Fault, files, out) -> tuple[str, str, int | None, set]:
    """The verdict `check` prints and its reason, the step its summary.json names, and its data lint's
    rules."""
    proc = run_main(
        "check", "--model", files[fault.checkpoint], "--data", files[fault.rows], "--dtype", fault.dtype,
        "--attn", "sdpa", "--steps", fault.steps, *[a for s in fault.settings for a in ("--set", s)], "--out", out,
    )  # fmt: skip
    said = next((line for line in proc.stdout.splitlines() if " verdict: " in line), None)
    assert said is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    mark, name, reason = re.match(r"  (ok  |FAIL) verdict: ([a-z-]+): (.*)", said).groups()
    assert proc.returncode == (0 if mark == "ok  " else 1), proc.stdout[-3000:]
    [probe] = json.loads((out / "summary.json").read_text())["probes"]
    data = json.loads((out / "run.json").read_text())["data"] or {}
    return name, reason, probe["step"], live_rules(data.get("findings", []))


def callback_door(fault: Fault, files, out):
    """The callback's verdict on a real run of the same setup (the one its summary line says: a failure
    that stopped the run, else the whole run's), and its lint's rules."""
    model = tiny_llama(fault.load, path=files[fault.checkpoint], trust_remote_code=fault.packed)
    data = JsonlRows(files[fault.rows])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lint's and the step-0 check's warnings: the verdict is the point
        if fault.framework == "lightning":
            from lightning.pytorch.plugins.precision import MixedPrecision

            # Lightning makes no scaler on a CPU ("16-mixed" becomes bf16): the plugin is given one
            plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
            callback = nandoctor_lightning().NandoctorCallback()
            lightning_fit(model, out, None, [callback], max_steps=fault.steps, plugins=[plugin], data=data)
        else:
            from transformers import DataCollatorWithFlattening

            callback = nandoctor_transformers().NandoctorCallback()
            # packed: the modeling code names neither input_ids nor labels (**kwargs): keep the columns
            packing = {"data_collator": DataCollatorWithFlattening(), "remove_unused_columns": False}
            trainer = hf_trainer(
                model,
                out,
                [callback],
                data,
                max_steps=fault.steps,
                train_sampling_strategy="sequential",
                **(packing if fault.packed else {}),
                **fault.train,
            )
            trainer.train()
    watch = callback.watch
    assert watch.off is None, watch.off
    verdict = watch.failure.verdict if watch.failure else watch.judging.verdict()
    line = watch.finish()
    assert f": {verdict.name} (" in line, line
    return watch, verdict, live_rules(watch.findings)


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_grid_check_and_the_callback_give_the_fault_one_verdict(fault, files):
    d = files["dir"] / fault.name
    probe, probes, grid_rules = grid_door(fault, files, d / "grid")
    assert (probe["verdict"], probe["step"]) == (fault.verdict, fault.step), probe["reason"]

    name, reason, step, check_rules = check_door(fault, files, d / "check")
    assert (name, step) == (probe["verdict"], probe["step"]), reason

    watch, verdict, callback_rules = callback_door(fault, files, d / "callback")
    assert watch.run.cell.id == probe["probe_id"]  # the run is the cell the grid probed
    assert (verdict.name, verdict.step) == (probe["verdict"], probe["step"]), verdict.reason

    assert all(fault.said in r for r in (probe["reason"], reason, verdict.reason)), (
        probe["reason"],
        reason,
        verdict.reason,
    )
    if fault.unjudged:  # only the grid probes the fp32 reference a drift is judged against
        assert fault.unjudged not in probe["reason"] and "fp32/eager/off" in probes
        assert fault.unjudged in reason and fault.unjudged in verdict.reason
    expected = {fault.rule} if fault.rule else set()
    assert grid_rules == check_rules == callback_rules == expected

"""The probe's own setup decides its verdict where the loss cannot: a packed forward whose segments see
each other, or accumulated micro-batches whose gradient is not the full batch's, is `misconfigured`
(judged on the probe itself, from record.setup_checks, whatever its fp32 reference says); a trainable
group (the LoRA weights, a modules_to_save copy) that gets no gradient at any step is `no-learning`
even while the loss falls through the others. Pure: records as the child writes them, the figures
measured on a 2-layer tiny Llama (tests/test_training_options.py)."""

import math

import pytest

from nandoctor.analysis.outcomes import analyze_records
from nandoctor.analysis.verdicts import STABLE, References, check_results, classify
from nandoctor.cells import Cell
from nandoctor.report.failures import failure_classes, failure_line
from nandoctor.report.matrix import VERDICT_COLORS, matrix_panels

FP32 = Cell("fp32", "sdpa", "off")
MISCONFIGURED, NO_LEARNING = "misconfigured", "no-learning"  # by name: what the reports and summary.json say
LOSSES = [6.93, 6.71, 6.52, 6.30, 6.11, 5.95]  # falling: nothing in the curve warns
# what a probe with data.packing=position_ids_with_mask measured at step 0 (2-D all-ones mask)
LEAK = {
    "packing_segments": 4,
    "packing_max_logit_diff": 0.7712,
    "packing_floor": 0.0,
    "packing_cause": "a 2-D attention mask is passed beside the position_ids",
    "seconds": 0.2,
}
# loss_normalization=micro_batch over rows of 32, 4, 4 and 4 tokens, one per micro-batch (measured on
# the tiny Llama: tests/test_measure.py)
MISWEIGHTED = {
    "accumulation_steps": 4,
    "accumulation_targets": "31, 3, 3, 3",
    "accumulation_tokens": 40,
    "loss_normalization": "micro_batch",
    "accumulation_error": 1.18,
    "accumulation_floor": 0.0,
    "accumulation_cosine": 0.587,
    "accumulation_norm_ratio": 1.45,
    "seconds": 0.4,
}


def record(cell=FP32, groups=None, trainable=None, setup=None, losses=LOSSES, adapter="none", probe_id=None):
    from nandoctor.record import ProbeRecord, Step

    steps = [Step(i, loss, 1.0, groups=dict(groups) if groups is not None else None) for i, loss in enumerate(losses)]
    return ProbeRecord(
        probe_id or cell.id,
        cell,
        steps=steps,
        recipe={"name": "r", "adapter": {"type": adapter}},
        setup_checks=setup,
        trainable_groups=trainable,
    )


def test_a_packed_forward_that_leaks_is_misconfigured_with_its_figure():
    v = classify(record(setup=LEAK))
    assert (v.name, v.step) == (MISCONFIGURED, 0) and v.failed
    assert v.reason.startswith(
        "packing: one packed forward of 4 segments differs from each segment run alone by 0.7712"
    )
    assert "(a 2-D attention mask is passed beside the position_ids), beyond 0.0001" in v.reason


def test_packing_within_the_models_own_rounding_is_not_a_leak():
    isolated = {**LEAK, "packing_max_logit_diff": 2.3e-7}
    assert classify(record(setup=isolated)).name == STABLE
    # bf16-pure on the tiny Llama: 0.0039 packed against alone, the segments alone 0.0044 from fp32
    bf16 = {**LEAK, "packing_max_logit_diff": 0.0039, "packing_floor": 0.0044}
    assert classify(record(setup=bf16)).name == STABLE
    # a leak stands out from the same floor (a model that drops position_ids: 0.5)
    assert classify(record(setup={**bf16, "packing_max_logit_diff": 0.5})).name == MISCONFIGURED
    unmeasured = {**LEAK, "packing_max_logit_diff": math.nan}  # nothing measured, nothing judged
    assert classify(record(setup=unmeasured)).name == STABLE


def test_accumulation_that_misweights_the_micro_batches_is_misconfigured():
    v = classify(record(setup=MISWEIGHTED))
    assert v.name == MISCONFIGURED
    assert (
        "accumulation: step 0's gradient over 4 micro-batches (31, 3, 3, 3 loss terms each), "
        "loss_normalization=micro_batch, differs from the full batch's by 1.18 (relative; cosine 0.587, "
        "norm ratio 1.45), beyond 0.001" in v.reason
    )
    by_tokens = {**MISWEIGHTED, "accumulation_error": 8.9e-8, "loss_normalization": "tokens"}
    assert classify(record(setup=by_tokens)).name == STABLE
    unmeasured = {**MISWEIGHTED, "accumulation_error": None}  # a micro-batch without targets: NaN, no figure
    assert classify(record(setup=unmeasured)).name == STABLE


def test_a_bf16_probes_own_rounding_is_not_misweighting():
    """A bf16-pure probe measures its step-0 gradients in bf16: by tokens 0.0043 from the full batch's,
    whose own gradient is 0.0065 from fp32's (the tiny Llama over rows of 32, 4, 4, 4 tokens); per
    micro-batch (1.18) still fails."""
    bf16 = {**MISWEIGHTED, "accumulation_floor": 0.0065, "loss_normalization": "tokens"}
    assert classify(record(setup={**bf16, "accumulation_error": 0.0043})).name == STABLE
    v = classify(record(setup={**bf16, "loss_normalization": "micro_batch"}))
    assert (
        v.name == MISCONFIGURED and "differs from the full batch's by 1.18" in v.reason and "beyond 0.065" in v.reason
    )


def test_misconfigured_is_judged_on_the_probe_itself_though_its_reference_shares_the_setup():
    """The fp32 reference trains the same packed batches and leaks the same way: it cannot be the
    yardstick. Both are misconfigured, and nothing is recommended."""
    ref = record(Cell("fp32", "eager", "off"), setup=LEAK)
    probe = record(setup=LEAK)
    refs = References()
    for r in (ref, probe):
        refs.learn(r)
    assert refs.judge(ref).name == MISCONFIGURED and refs.judge(probe).name == MISCONFIGURED
    a = analyze_records({"kind": "grid", "seed": 0, "doctor": {"findings": []}}, [ref, probe])
    assert a.recommended is None and a.exit_code == 1
    line = failure_line(failure_classes(a)[0])
    assert "misconfigured: packing: one packed forward" in line
    assert "Fix (rule packing-leaks-across-segments): Pass position_ids without an attention mask" in line


def test_a_lora_group_without_gradient_is_no_learning_while_the_loss_falls():
    trainable = {
        "adapter": {"tensors": 8, "elements": 2048, "first": "base_model.model.model.layers.0.self_attn.q_proj.lora_A"},
        "modules_to_save": {"tensors": 1, "elements": 65536, "first": "base_model.model.lm_head.modules_to_save"},
    }
    v = classify(record(groups={"adapter": None, "modules_to_save": 0.42}, trainable=trainable, adapter="lora"))
    assert (v.name, v.step) == (NO_LEARNING, 0)
    assert v.reason == (
        "adapter: 8 of 8 LoRA tensors got no gradient at any of 6 steps, "
        "while the loss fell 6.9300 -> 5.9500 through modules_to_save"
    )
    a = analyze_records(
        {"kind": "grid", "seed": 0, "doctor": {"findings": []}},
        [record(groups={"adapter": 0.0, "modules_to_save": 0.4}, trainable=trainable, adapter="lora")],
    )
    assert a.recommended is None
    assert "Fix (rule trainable-group-without-gradient): Use non-reentrant" in failure_line(failure_classes(a)[0])


def test_a_group_that_overflows_or_learns_once_is_not_starved():
    from nandoctor.record import Step

    overflow = record(groups={"adapter": math.inf, "rest": 0.3})
    assert classify(overflow).name != NO_LEARNING
    once = record(groups={"adapter": None, "rest": 0.3})
    once.steps[3] = Step(3, LOSSES[3], 1.0, groups={"adapter": 0.01, "rest": 0.3})
    assert classify(once).name == STABLE
    assert classify(record()).name == STABLE  # records before per-group accounting: nothing to judge


def test_one_step_with_a_starved_group_is_judged_from_the_first_step():
    v = classify(record(groups={"embeddings": 0.0, "rest": 0.2}, losses=[6.9]))
    assert v.name == NO_LEARNING and v.reason == "embeddings: its embedding tensors got no gradient at step 0"


def test_nandoctor_check_fails_a_setup_check_and_a_starved_group():
    checks = {name: (ok, detail) for name, ok, detail in check_results(record(setup=LEAK), 1024, True)}
    ok, detail = checks["the setup passes its step-0 checks"]
    assert not ok and detail.startswith("packing: one packed forward of 4 segments")
    passed = {**LEAK, "packing_max_logit_diff": 1e-7, **MISWEIGHTED, "accumulation_error": 8.9e-8}
    fine = {name: (ok, detail) for name, ok, detail in check_results(record(setup=passed), 1024, True)}
    ok, detail = fine["the setup passes its step-0 checks"]
    assert ok and detail == (  # a check that passes shows what it measured
        "packed segments isolated (max logit difference 1e-07 to each segment alone, bound 0.0001); "
        "accumulated gradient is the full batch's (relative difference 8.9e-08, bound 0.001; cosine 0.587)"
    )
    starved = {n: ok for n, ok, _ in check_results(record(groups={"adapter": None, "rest": 1.0}), 1024, True)}
    assert not starved["gradients reach the weights"]


def test_the_matrix_colours_misconfigured_as_its_own_verdict():
    a = analyze_records({"kind": "grid", "seed": 0, "doctor": {"findings": []}}, [record(setup=LEAK)])
    cells = [c for p in matrix_panels(a) for r in p["rows"] for c in r["cells"] if c]
    assert [c["verdict"] for c in cells] == [MISCONFIGURED] and MISCONFIGURED in VERDICT_COLORS


DEVICE = "cuda"


@pytest.mark.gpu
def test_on_cuda_clean_packing_and_token_accumulation_are_stable_in_every_precision(tmp_path):
    """What a GPU host should confirm: the misconfigured rule calls no clean setup misconfigured in the
    low-precision cells (bf16 / fp16 rounding, flash and efficient SDPA kernels, which differ between a
    packed forward and each segment alone), and still catches the 2-D mask and per-micro-batch
    normalisation there."""
    from checkpoints import save_llama
    from test_training_options import ids_rows, probe
    from userdata_fixtures import write_jsonl

    ckpt = save_llama(tmp_path / "ckpt", use_cache=False)
    uneven = write_jsonl(tmp_path / "uneven.jsonl", ids_rows([10, 7, 12, 5, 9, 14, 6, 8], seed=3))
    skewed = write_jsonl(tmp_path / "skewed.jsonl", ids_rows([32, 4, 4, 4]))
    packed = {"data.path": str(uneven), "batch_size": 4, "gradient_accumulation_steps": 2}
    micro = {"data.path": str(skewed), "batch_size": 1, "gradient_accumulation_steps": 4}
    for dtype in ("fp32", "bf16-amp", "bf16-pure", "fp16-amp"):
        for attn in ("sdpa", "eager"):
            cell = Cell(dtype, attn, "off")
            for fields, misconfigured in (
                ({**packed, "data.packing": "position_ids"}, False),
                ({**packed, "data.packing": "block_mask"}, False),
                ({**packed, "data.packing": "position_ids_with_mask"}, True),
                (micro, False),
                ({**micro, "loss_normalization": "micro_batch"}, True),
            ):
                record = probe(ckpt, fields, steps=2, cell=cell, device=DEVICE)
                assert (classify(record).name == MISCONFIGURED) == misconfigured, (cell.id, record.setup_checks)


# a tiny Qwen3-MoE's figures at 2 micro-batches with its balancing loss on (tests/test_moe_accumulation.py):
# the whole gradient inside its bound, the router's own 0.122 off
ROUTER_MISWEIGHTED = {
    "accumulation_steps": 2,
    "accumulation_error": 3.8e-4,
    "accumulation_floor": 0.0,
    "loss_normalization": "tokens",
    "accumulation_balancing_loss": 0.001,
    "accumulation_groups": {"router": {"error": 0.122, "floor": 0.0}, "experts": {"error": 1.6e-4, "floor": 0.0}},
}


def test_a_router_misweighted_inside_a_whole_gradient_that_passes_is_misconfigured_by_the_balancing_loss():
    v = classify(record(setup=ROUTER_MISWEIGHTED))
    assert v.name == "misconfigured"
    assert "within 0.001 as a whole, but the router's own gradient by 0.122" in v.reason
    assert "counted 2 times a step" in v.reason  # the cause: the balancing loss under token normalisation
    per_batch = classify(record(setup={**ROUTER_MISWEIGHTED, "loss_normalization": "micro_batch"}))
    assert per_batch.name == "misconfigured" and "counted 2 times" not in per_batch.reason

"""Each training option changes what a probe trains the way transformers / peft / the Trainer apply it,
on a real tiny Llama checkpoint (hidden 64, 2 layers) and real rows, probes run in this process:
gradient accumulation normalised per micro-batch or by the step's tokens, reentrant and non-reentrant
gradient checkpointing with a LoRA adapter and modules_to_save, peft's autocast_adapter_dtype and the
dtype the base is loaded in, and packing with and without a 2-D mask. The probe measures its own setup
at step 0 (record.setup_checks), each trainable group's gradient norm at every step (Step.groups), and
which of the data set's rows each batch held (record.data)."""

import random

import pytest
from checkpoints import save_llama
from userdata_fixtures import write_jsonl

from nandoctor.cells import Cell
from nandoctor.config import set_field
from nandoctor.recipes import resolve_model
from nandoctor.record import ProbeRecord, ProbeSpec

FP32 = Cell("fp32", "sdpa", "off")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("ckpt") / "tiny", use_cache=False)


def ids_rows(lengths, seed=0) -> list[dict]:
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(10, 1000) for _ in range(n)]} for n in lengths]


def spec_for(ckpt, fields: dict, steps: int = 4, cell: Cell = FP32, device: str = "cpu") -> ProbeSpec:
    from nandoctor.models import plan_model

    recipe = set_field(resolve_model(str(ckpt)), "forensics_steps", 0)
    for key, value in fields.items():
        recipe = set_field(recipe, key, value)
    return ProbeSpec(cell.id, recipe, cell, plan_model(recipe, {"device": device}), steps, recipe.seed, device, 1)


def probe(ckpt, fields: dict, steps: int = 4, cell: Cell = FP32, device: str = "cpu") -> ProbeRecord:
    """One probe of the checkpoint with these recipe fields, trained in this process as the child does."""
    from nandoctor.child.probe import run_probe
    from nandoctor.child.ranks import ONE_PROCESS

    spec = spec_for(ckpt, fields, steps, cell, device)
    record = ProbeRecord(spec.probe_id, spec.cell)
    run_probe(spec, record, ONE_PROCESS, None)
    return record


@pytest.fixture(scope="module")
def skewed(ckpt, tmp_path_factory):
    """Rows of 32, 4, 4 and 4 tokens, one per micro-batch, four micro-batches a step (the issue's case)."""
    path = write_jsonl(tmp_path_factory.mktemp("rows") / "skewed.jsonl", ids_rows([32, 4, 4, 4]))
    return {"data.path": str(path), "batch_size": 1}


def test_micro_batch_normalisation_on_lengths_32_4_4_4_skews_step_0s_gradient(ckpt, skewed):
    """Each micro-batch's mean loss over the steps weighs the 3 loss terms of a 4-token row like the 31 of
    the long one: step 0's gradient leaves the full batch's direction (cosine 0.587, relative difference
    1.18 on this model)."""
    micro = probe(ckpt, {**skewed, "gradient_accumulation_steps": 4, "loss_normalization": "micro_batch"})
    checks = micro.setup_checks
    assert checks["accumulation_targets"] == "31, 3, 3, 3" and checks["loss_normalization"] == "micro_batch"
    assert 0.5 < checks["accumulation_cosine"] < 0.8 and checks["accumulation_norm_ratio"] > 1.2
    assert checks["accumulation_error"] > 0.5 and checks["accumulation_floor"] == 0.0


def test_token_normalisation_accumulates_the_full_batchs_step(ckpt, skewed):
    """By tokens (num_items_in_batch), four micro-batches of one row train step 0 exactly as one batch of
    the four rows: the same loss, the same gradient norm; per micro-batch they do not."""
    tokens = probe(ckpt, {**skewed, "gradient_accumulation_steps": 4, "loss_normalization": "tokens"}, steps=2)
    micro = probe(ckpt, {**skewed, "gradient_accumulation_steps": 4, "loss_normalization": "micro_batch"}, steps=2)
    whole = probe(ckpt, {**skewed, "batch_size": 4}, steps=2)
    assert tokens.setup_checks["accumulation_error"] < 1e-5
    assert tokens.steps[0].loss == pytest.approx(whole.steps[0].loss, rel=1e-6)
    assert tokens.steps[0].grad_norm == pytest.approx(whole.steps[0].grad_norm, rel=1e-5)
    assert micro.steps[0].grad_norm > 1.2 * whole.steps[0].grad_norm
    assert tokens.steps[0].tokens == micro.steps[0].tokens == 44  # every micro-batch's tokens: 32 + 4 + 4 + 4


def test_the_steps_loss_is_what_the_trainer_logs(ckpt, skewed):
    """Trainer logs the sum of the micro-batches' losses it backpropagated: per micro-batch, the mean of
    their mean losses; by tokens, the step's summed token loss over its loss terms."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt).train()
    rows = [torch.tensor([r["input_ids"]]) for r in ids_rows([32, 4, 4, 4])]
    with torch.no_grad():
        means = [model(input_ids=r, labels=r).loss.item() for r in rows]
    terms = [r.shape[1] - 1 for r in rows]
    micro = probe(ckpt, {**skewed, "gradient_accumulation_steps": 4, "loss_normalization": "micro_batch"}, steps=2)
    tokens = probe(ckpt, {**skewed, "gradient_accumulation_steps": 4, "loss_normalization": "tokens"}, steps=2)
    assert micro.steps[0].loss == pytest.approx(sum(means) / 4, rel=1e-5)
    assert tokens.steps[0].loss == pytest.approx(sum(m * n for m, n in zip(means, terms)) / sum(terms), rel=1e-5)


def test_one_micro_batch_by_tokens_is_its_mean_loss_bit_for_bit(ckpt):
    """num_items_in_batch over a single micro-batch divides the same summed loss the mean divides: the
    default recipe's curves are the ones probes trained before the option existed."""
    import torch

    from nandoctor.child.build import setup
    from nandoctor.child.train import micro_loss

    s = setup(spec_for(ckpt, {"data.pad_fraction": 0.5}))
    (batch,), items = next(s.data)
    assert s.normalization == "tokens" and int(items) == int((batch["labels"][:, 1:] != -100).sum())
    with torch.no_grad():
        assert micro_loss(s.model, batch, items, 1, s).item() == s.model(**batch).loss.item()


LORA = {"adapter.type": "lora", "adapter.target_modules": ["q_proj", "v_proj"]}


def test_reentrant_checkpointing_with_a_saved_lm_head_starves_the_lora_group(ckpt):
    """Reentrant checkpointing without the input-gradient hook: no checkpointed block's input needs a
    gradient, so the 8 LoRA tensors inside them get none, at every step, while the trained lm_head copy
    keeps the loss falling. Non-reentrant checkpointing gives them their gradient."""
    fields = {**LORA, "adapter.modules_to_save": ["lm_head"]}
    starved = probe(ckpt, {**fields, "gradient_checkpointing": "reentrant"}, steps=6)
    assert starved.trainable_groups["adapter"]["tensors"] == 8
    assert set(starved.trainable_groups) == {"adapter", "modules_to_save"}
    assert all(s.groups["adapter"] is None and s.groups["modules_to_save"] > 0 for s in starved.steps)
    assert starved.steps[-1].loss < starved.steps[0].loss  # the loss falls: nothing else warns
    trained = probe(ckpt, {**fields, "gradient_checkpointing": "non_reentrant"}, steps=6)
    assert all(s.groups["adapter"] > 0 for s in trained.steps)
    unchecked = probe(ckpt, fields, steps=6)
    assert [s.groups["adapter"] for s in trained.steps] == pytest.approx([s.groups["adapter"] for s in unchecked.steps])


def test_reentrant_checkpointing_with_only_the_adapter_trainable_fails_loudly(ckpt):
    """Without a trained lm_head nothing in the loss needs a gradient: the backward raises, as the
    user's run does (the probe's error, not a silent stall)."""
    with pytest.raises(RuntimeError, match="does not require grad"):
        probe(ckpt, {**LORA, "gradient_checkpointing": "reentrant"}, steps=2)


def test_a_full_fine_tune_accounts_its_embeddings_apart(ckpt):
    record = probe(ckpt, {}, steps=2)
    assert set(record.trainable_groups) == {"embeddings", "rest"}
    assert record.trainable_groups["embeddings"]["tensors"] == 2  # embed_tokens and the untied lm_head
    assert all(s.groups["embeddings"] > 0 and s.groups["rest"] > 0 for s in record.steps)


@pytest.mark.parametrize("autocast", [True, False])
def test_adapters_are_kept_as_peft_keeps_them_over_a_bf16_base(ckpt, autocast):
    """peft's autocast_adapter_dtype puts the LoRA weights in fp32 over a bf16 base (its default) or
    leaves them bf16; a modules_to_save copy stays in the base's dtype either way; nothing is cast after."""
    import torch

    from nandoctor.child.build import build_model

    spec = spec_for(
        ckpt,
        {**LORA, "adapter.modules_to_save": ["lm_head"], "model.dtype_on_load": "bf16"}
        | {"adapter.autocast_adapter_dtype": autocast},
        cell=Cell("bf16-amp", "sdpa", "off"),
    )
    model = build_model(spec.plan, spec.recipe, spec.cell, spec.seed)
    dtypes = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    lora = {d for n, d in dtypes.items() if "lora_" in n}
    assert lora == {torch.float32 if autocast else torch.bfloat16}
    assert {d for n, d in dtypes.items() if "modules_to_save" in n} == {torch.bfloat16}
    assert model.get_base_model().model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    path = write_jsonl(tmp_path_factory.mktemp("rows") / "uneven.jsonl", ids_rows([10, 7, 12, 5, 9, 14, 6, 8], seed=3))
    return {"data.path": str(path), "batch_size": 4}


def test_packing_with_a_2d_mask_leaks_between_segments_and_position_ids_alone_do_not(ckpt, uneven):
    """The probe measures packing isolation on its own model and collator at step 0: the usual all-ones
    mask beside the position_ids makes each segment attend to the ones before it (transformers PR
    #46634); position_ids alone and the 4-D block mask keep them apart."""
    leak = probe(ckpt, {**uneven, "data.packing": "position_ids_with_mask"}, steps=2).setup_checks
    assert leak["packing_segments"] == 4 and leak["packing_max_logit_diff"] > 0.1 and leak["packing_floor"] == 0.0
    assert "2-D attention mask" in leak["packing_cause"]
    for packing in ("position_ids", "block_mask"):
        kept = probe(ckpt, {**uneven, "data.packing": packing}, steps=2).setup_checks
        assert kept["packing_max_logit_diff"] < 1e-4, packing


@pytest.mark.parametrize("packing", ["position_ids", "block_mask", "position_ids_with_mask"])
def test_a_packed_batch_counts_every_token_it_trains_on(ckpt, uneven, packing):
    record = probe(ckpt, {**uneven, "data.packing": packing}, steps=2)
    assert [s.tokens for s in record.steps] == [10 + 7 + 12 + 5, 9 + 14 + 6 + 8]
    assert all(s.tokens_per_s > 0 for s in record.steps)


def test_the_record_names_the_rows_each_batch_held(ckpt, uneven):
    record = probe(ckpt, {**uneven, "gradient_accumulation_steps": 2}, steps=2)
    data = record.data
    assert data["source"] == "file" and data["micro_batches_per_step"] == 2
    assert [(b["kind"], b["rows"]) for b in data["batches"][:2]] == [("first", [0, 1, 2, 3]), ("first", [4, 5, 6, 7])]
    assert {b["kind"] for b in data["batches"][2:]} <= {"longest", "most_padded", "fewest_supervised"}
    assert probe(ckpt, {**uneven, "gradient_accumulation_steps": 2}, steps=2).data == data  # the seed decides
    synthetic = probe(ckpt, {}, steps=2).data
    assert synthetic["source"] == "synthetic" and all(b["rows"] == [] for b in synthetic["batches"])


def test_records_written_before_the_new_fields_read_them_as_none():
    old = {"probe_id": "p", "cell": FP32.to_dict(), "steps": [{"step": 0, "loss": 1.0, "grad_norm": 1.0}]}
    record = ProbeRecord.from_dict(old)
    assert record.data is None and record.setup_checks is None and record.trainable_groups is None
    assert record.steps[0].groups is None


def test_options_that_cannot_break_the_setup_cost_no_check(ckpt):
    assert probe(ckpt, {}, steps=2).setup_checks is None


@pytest.mark.gpu
def test_on_cuda_the_options_train_as_on_the_cpu(ckpt, skewed, uneven):
    """What a GPU host should confirm: one micro-batch by tokens is its mean loss bit for bit on CUDA's
    loss kernels too; bf16 autocast with a block mask (a floating mask moved in the compute dtype) stays
    isolated and a 2-D mask leaks; reentrant checkpointing starves the LoRA group there as well."""
    import torch

    from nandoctor.child.build import setup
    from nandoctor.child.train import micro_loss

    s = setup(spec_for(ckpt, {"data.pad_fraction": 0.5}, device="cuda"))
    (batch,), items = next(s.data)
    with torch.no_grad():
        assert micro_loss(s.model, batch, items, 1, s).item() == s.model(**batch).loss.item()
    amp = Cell("bf16-amp", "sdpa", "off")
    for packing, leaks in (("block_mask", False), ("position_ids_with_mask", True)):
        record = probe(ckpt, {**uneven, "data.packing": packing}, steps=2, cell=amp, device="cuda")
        assert (record.setup_checks["packing_max_logit_diff"] > 0.1) == leaks and record.steps[-1].tokens == 37
    micro = probe(
        ckpt, {**skewed, "gradient_accumulation_steps": 4, "loss_normalization": "micro_batch"}, device="cuda"
    )
    assert 0.5 < micro.setup_checks["accumulation_cosine"] < 0.8
    fields = {**LORA, "adapter.modules_to_save": ["lm_head"], "gradient_checkpointing": "reentrant"}
    starved = probe(ckpt, fields, cell=amp, device="cuda")
    assert all(s.groups["adapter"] is None and s.groups["modules_to_save"] > 0 for s in starved.steps)

"""The code a recommendation prints runs as pasted, with only its imports added (IMPORTS), and trains what
was probed: a few real Trainer (or TRL SFTTrainer, GRPOTrainer) steps on a tiny checkpoint for each kind
of recommendation (a dense model, LoRA, QLoRA over an nf4 base, a mixture of experts, chat rows labelled
by TRL's assistant_only_loss, a GRPO run), at the probe's constant learning rate and precision. Nothing in
the printed lines is edited: they write to output_dir 'trained' of the working directory (here tmp_path),
and carry use_cpu=True because they were probed on a CPU. The probe's optimizer groups weight decay as
the Trainer does (no decay on biases and norm weights)."""

from __future__ import annotations

import types

import pytest
from checkpoints import save_llama, tiny_qwen3_moe
from conftest import needs
from userdata_fixtures import (
    CHATML_GENERATION_TEMPLATE,
    CHATML_TEMPLATE,
    GENERATION_TEMPLATE,
    chat_rows,
    save_chat_tokenizer,
    write_jsonl,
)

from nandoctor.cells import Cell
from nandoctor.config import Recipe, recipe_from_dict, set_field
from nandoctor.recommend import recommendation

# What a user adds above the pasted lines
IMPORTS = """
import bitsandbytes, lightning, torch, transformers, trl
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainingArguments
"""
ROWS = 4  # one batch of the recipe's batch_size: each of the Trainer's 3 default epochs is one step

pytestmark = [pytest.mark.slow, needs("lightning", "trl", "bitsandbytes")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("pasted") / "ckpt")


def pasted(rec: dict, cwd) -> dict:
    """The names the recommendation's lines bind, run as one pasted block below IMPORTS in `cwd`."""
    import os

    scope, here = {}, os.getcwd()
    os.chdir(cwd)
    try:
        exec(IMPORTS + "\n".join(rec["python"]), scope)
    finally:
        os.chdir(here)
    return scope


def train(scope: dict, recipe: Recipe, rows, cwd, trainer_class=None, **kwargs):
    """Three steps of the pasted model under the pasted arguments (kwargs: the trainer's others)."""
    import os

    from transformers import Trainer

    here = os.getcwd()
    os.chdir(cwd)
    try:
        trainer = (trainer_class or Trainer)(model=scope["model"], args=scope["args"], train_dataset=rows, **kwargs)
        out = trainer.train()
    finally:
        os.chdir(here)
    assert out.global_step == 3 and out.training_loss == out.training_loss  # three real steps, a finite loss
    assert set(trainer.lr_scheduler.get_last_lr()) == {recipe.optimizer.lr}  # constant, as probed: no decay to 0
    return trainer


def token_rows(vocab: int = 1024):
    import torch

    torch.manual_seed(0)
    return [{"input_ids": x, "labels": x} for x in torch.randint(0, vocab, (ROWS, 16))]


def lora(path) -> Recipe:
    return set_field(set_field(Recipe(), "adapter.type", "lora"), "model.path", str(path))


def advised(cell: str, recipe: Recipe, **kw) -> dict:
    return recommendation(Cell.parse(cell).to_dict(), recipe, recipe, [], device="cpu", **kw)


def test_a_dense_recommendation_pastes_and_trains_at_the_probed_constant_lr(ckpt, tmp_path):
    recipe = set_field(Recipe(), "model.path", str(ckpt))
    scope = pasted(advised("fp32/sdpa/off", recipe), tmp_path)
    assert (scope["args"].bf16, scope["args"].fp16, scope["args"].lr_scheduler_type.value) == (False, False, "constant")
    train(scope, recipe, token_rows(), tmp_path)
    assert (tmp_path / "trained").is_dir()


def test_a_lora_recommendation_pastes_and_trains_the_adapter(ckpt, tmp_path):
    recipe = lora(ckpt)
    scope = pasted(advised("fp32/sdpa/off", recipe), tmp_path)
    trainable = {n for n, p in scope["model"].named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)  # the adapter alone trains
    train(scope, recipe, token_rows(), tmp_path)


def test_a_qlora_recommendation_pastes_and_trains_bf16_autocast_over_the_nf4_base(ckpt, tmp_path):
    recipe = lora(ckpt)
    rec = advised("bf16-amp/sdpa/off/nf4", recipe)
    scope = pasted(rec, tmp_path)
    assert type(scope["model"].get_base_model().model.layers[0].self_attn.v_proj.base_layer).__name__ == "Linear4bit"
    assert (scope["args"].bf16, scope["args"].fp16) == (True, False)
    train(scope, recipe, token_rows(), tmp_path)


def test_a_moe_recommendation_pastes_and_trains_with_its_load_balancing_loss(tmp_path):
    path = tmp_path / "moe"
    tiny_qwen3_moe().save_pretrained(path)
    recipe = set_field(Recipe(), "model.path", str(path))
    scope = pasted(advised("fp32/sdpa/off", recipe, moe={"aux_loss_on": True, "aux_loss_coef": 0.02}), tmp_path)
    assert (scope["model"].config.output_router_logits, scope["model"].config.router_aux_loss_coef) == (True, 0.02)
    train(scope, recipe, token_rows(), tmp_path)


def test_a_chat_recommendation_pastes_an_sft_config_that_trains_fp32_on_the_assistant_turns(ckpt, tmp_path):
    import json

    from datasets import Dataset
    from trl import SFTTrainer

    from nandoctor.doctor import data_lint

    tok = save_chat_tokenizer(tmp_path / "tok", template=GENERATION_TEMPLATE)
    rows = chat_rows(ROWS)
    data = {"source": "file", "path": str(write_jsonl(tmp_path / "chat.jsonl", rows)), "tokenizer": str(tok)}
    recipe = recipe_from_dict({"model": {"path": str(ckpt)}, "data": {**data, "labels": "completion_only"}}, "r")
    lint = json.loads(json.dumps(data_lint(recipe)))  # as run.json holds it
    rec = advised("fp32/sdpa/off", recipe, lint=lint)
    assert rec["python"][0].startswith("args = trl.SFTConfig(")
    scope = pasted(rec, tmp_path)
    args = scope["args"]
    assert (args.bf16, args.fp16, args.assistant_only_loss, args.gradient_checkpointing) == (False, False, True, False)
    train(scope, recipe, Dataset.from_list(rows), tmp_path, SFTTrainer, processing_class=scope["tokenizer"])


def test_chatml_marked_as_advised_pastes_an_sft_config_whose_labels_are_the_probes(ckpt, tmp_path):
    """A ChatML template without marks was probed; the advice says where the marks go. With them placed so
    (CHATML_GENERATION_TEMPLATE), the pasted SFTConfig trains with SFTTrainer, and the labels TRL's collator
    builds are the probe's labels of the unmarked template, token for token (the newline after each turn
    included)."""
    import json

    from datasets import Dataset
    from trl import SFTTrainer

    from nandoctor.doctor import data_lint
    from nandoctor.models import model_config
    from nandoctor.userdata.encode import IGNORE
    from nandoctor.userdata.rows import encoded_rows

    rows = chat_rows(ROWS, turns=2)
    path = str(write_jsonl(tmp_path / "chat.jsonl", rows))

    def recipe_of(template: str, name: str) -> Recipe:
        tok = str(save_chat_tokenizer(tmp_path / name, template=template))
        data = {"source": "file", "path": path, "tokenizer": tok, "labels": "completion_only"}
        return recipe_from_dict({"model": {"path": str(ckpt)}, "data": data}, "r")

    probed = recipe_of(CHATML_TEMPLATE, "unmarked")
    (said,) = [line for line in advised("fp32/sdpa/off", probed, lint=data_lint(probed))["python"] if "marks" in line]
    assert "right after '<|im_start|>assistant\\n'" in said and "right after '<|im_end|>\\n'" in said, said
    marked = recipe_of(CHATML_GENERATION_TEMPLATE, "marked")
    rec = advised("fp32/sdpa/off", marked, lint=json.loads(json.dumps(data_lint(marked))))
    assert rec["python"][0].startswith("args = trl.SFTConfig(") and "assistant_only_loss=True" in rec["python"][0]
    scope = pasted(rec, tmp_path)
    trainer = train(scope, marked, Dataset.from_list(rows), tmp_path, SFTTrainer, processing_class=scope["tokenizer"])

    encoded = encoded_rows(probed, model_config(probed))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(ROWS)])
    for i in range(ROWS):
        ids, labels = encoded.rows[i]["input_ids"], encoded.rows[i]["labels"]
        assert batch["input_ids"][i, : len(ids)].tolist() == ids
        assert batch["labels"][i, : len(ids)].tolist() == labels and IGNORE in labels and set(labels) != {IGNORE}


def test_the_probe_decays_the_parameters_the_trainer_decays(ckpt, tmp_path):
    """weight_decay=0.1: the probe's optimizer (child/build._optimizer) and the Trainer built from the
    pasted arguments put each parameter in a group of the same decay (norm weights none), and the hand-built
    optimizer the recommendation prints for Lightning or a custom loop does too."""
    from transformers import Trainer

    from nandoctor.child.build import _optimizer

    recipe = set_field(set_field(Recipe(), "model.path", str(ckpt)), "optimizer.weight_decay", "0.1")
    cell = Cell.parse("fp32/sdpa/off/bnb-adamw8bit")
    scope = pasted(advised(cell.id, recipe), tmp_path)
    model = scope["model"]
    names = {id(p): n for n, p in model.named_parameters()}

    def decay_of(optimizer) -> dict:
        return {names[id(p)]: g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}

    trainer_decay = decay_of(Trainer(model=model, args=scope["args"]).create_optimizer())
    probe, _ = _optimizer(types.SimpleNamespace(cell=cell, recipe=recipe, device="cpu"), model)
    assert decay_of(probe) == trainer_decay == decay_of(scope["optimizer"])
    assert trainer_decay["model.norm.weight"] == 0.0 and trainer_decay["lm_head.weight"] == 0.1


def test_a_grpo_recommendation_pastes_a_grpo_config_with_the_probed_precision_sampler_and_correction(ckpt, tmp_path):
    """objective=grpo: the lines build trl.GRPOConfig with bf16 written, TRL's sequence-mask importance
    sampling at the cap the probe used, the rollout's sampler settings, each step's completions as one
    batch; GRPOTrainer then trains three steps on them at the constant lr."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    recipe = set_field(set_field(Recipe(), "model.path", str(ckpt)), "objective", "grpo")
    recipe = set_field(set_field(recipe, "rollout.temperature", "0.7"), "rollout.max_new_tokens", "8")
    rec = advised("bf16-amp/sdpa/off", recipe)
    assert rec["python"][1].startswith("args = trl.GRPOConfig(")
    assert rec["grpo"]["rollout_precision"] == rec["grpo"]["training_precision"] == "bf16-amp"
    assert "vllm.LLM(dtype='bfloat16')" in "\n".join(rec["python"])
    args = pasted(rec, tmp_path)["args"]
    assert (args.bf16, args.fp16, args.use_cpu, args.output_dir) == (True, False, True, "trained")
    assert (args.vllm_importance_sampling_correction, args.vllm_importance_sampling_mode) == (True, "sequence_mask")
    assert args.vllm_importance_sampling_clip_max == 3.0 and args.vllm_importance_sampling_clip_min is None
    assert (args.temperature, args.top_p, args.top_k, args.max_completion_length) == (0.7, 1.0, 0, 8)
    assert (args.num_generations, args.per_device_train_batch_size, args.gradient_checkpointing) == (4, 8, False)
    assert (args.loss_type, args.beta, args.lr_scheduler_type.value) == ("dapo", 0.0, "constant")
    assert args.cast_lm_head_to_fp32 is False  # rollout.lm_head_fp32 off
    tok = AutoTokenizer.from_pretrained(save_chat_tokenizer(tmp_path / "tok"))
    prompts = Dataset.from_list([{"prompt": "the cat sat on"}, {"prompt": "a dog ran to"}])  # 2 prompts x 4: one step
    scope = pasted(rec, tmp_path)

    def even_ids(completion_ids, **_):
        return [sum(i % 2 == 0 for i in c) / max(len(c), 1) for c in completion_ids]

    train(scope, recipe, prompts, tmp_path, GRPOTrainer, reward_funcs=even_ids, processing_class=tok)


def test_an_fp16_grpo_recommendation_writes_fp16_and_its_grad_scaler(ckpt, tmp_path):
    recipe = set_field(set_field(Recipe(), "model.path", str(ckpt)), "objective", "grpo")
    rec = advised("fp16-amp/sdpa/off", recipe)
    scope = pasted(rec, tmp_path)
    assert (scope["args"].fp16, scope["args"].bf16) == (True, False)
    assert isinstance(scope["scaler"], __import__("torch").amp.GradScaler) and scope["scaler"].is_enabled()
    assert "vllm.LLM(dtype='float16')" in "\n".join(rec["python"])
    assert "--objective grpo" in rec["command"]

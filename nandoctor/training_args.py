"""A probed configuration as the arguments a user passes to train with it: a `nandoctor check` command
line, `transformers.TrainingArguments` and the model-loading call. Pure: imports only config.

Names come from the transformers v5 TrainingArguments reference (bf16, fp16, tf32, torch_compile,
torch_compile_backend, learning_rate, adam_beta1/2, adam_epsilon, weight_decay, max_grad_norm,
per_device_train_batch_size, seed), `from_pretrained(dtype=, attn_implementation=)`, peft's LoraConfig
(r, lora_alpha, target_modules, lora_dropout, use_dora) and torch.nn.attention.sdpa_kernel.
"""
from __future__ import annotations

import shlex

from .config import AXES, Cell, Recipe, get_field

AMP_FLAGS = {"bf16-amp": {"bf16": True}, "fp16-amp": {"fp16": True}, "tf32": {"tf32": True}}
# pure cells hold the weights themselves in half precision: load them so and turn autocast off
PURE_LOAD = {"bf16-pure": "torch.bfloat16", "fp16-pure": "torch.float16"}
ON_LOAD = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}
SDPA_BACKEND = {"sdpa:math": "MATH", "sdpa:flash": "FLASH_ATTENTION", "sdpa:efficient": "EFFICIENT_ATTENTION",
                "sdpa:cudnn": "CUDNN_ATTENTION"}


def call_text(name: str, kwargs: dict) -> str:
    """kwargs whose value is a str starting with 'torch.' are written as code, the rest as literals."""
    def show(v):
        return v if isinstance(v, str) and v.startswith("torch.") else repr(v)
    return f"{name}(" + ", ".join(f"{k}={show(v)}" for k, v in kwargs.items()) + ")"


def check_command(config: dict, base: Recipe, model_flags: list[str]) -> str:
    cell = Cell(config["dtype"], config["attn"], config["compile"])
    parts = ["nandoctor", "check", *model_flags, "--dtype", cell.dtype, "--attn", cell.attn, "--compile", cell.compile]
    for name, value in config.items():
        if name not in AXES and value != get_field(base, name):
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            parts += ["--set", f"{name}={text}"]
    return shlex.join(parts)


def training_arguments(cell: Cell, recipe: Recipe) -> dict:
    o = recipe.optimizer
    args = {**AMP_FLAGS.get(cell.dtype, {}), "learning_rate": o.lr, "adam_beta1": o.betas[0], "adam_beta2": o.betas[1],
            "adam_epsilon": o.eps, "weight_decay": o.weight_decay, "max_grad_norm": recipe.grad_clip,
            "per_device_train_batch_size": recipe.batch_size, "seed": recipe.seed}
    if cell.compile != "off":
        args.update(torch_compile=True, torch_compile_backend=cell.compile)
    return args


def model_loading(cell: Cell, recipe: Recipe) -> dict:
    attn = "sdpa" if cell.attn.startswith("sdpa") else cell.attn
    dtype = PURE_LOAD.get(cell.dtype) or ON_LOAD[recipe.model.dtype_on_load]
    return {"dtype": dtype, "attn_implementation": attn}


def recommendation(config: dict, recipe: Recipe, base: Recipe, model_flags: list[str]) -> dict:
    """What the reports print for a recommended configuration (`recipe` is its variant of `base`)."""
    cell = Cell(config["dtype"], config["attn"], config["compile"])
    lines = [call_text("TrainingArguments", training_arguments(cell, recipe)),
             call_text("AutoModelForCausalLM.from_pretrained", {"pretrained_model_name_or_path": recipe.model.path or recipe.model.hub_id or recipe.name, **model_loading(cell, recipe)})]
    a = recipe.adapter
    if a.type != "none":
        lines.append(call_text("LoraConfig", {"r": a.r, "lora_alpha": a.alpha, "target_modules": list(a.target_modules),
                                              "lora_dropout": a.dropout, "use_dora": a.type == "dora"}))
    if cell.attn in SDPA_BACKEND:
        lines.append(f"with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.{SDPA_BACKEND[cell.attn]}): trainer.train()")
    return {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()},
            "command": check_command(config, base, model_flags),
            "training_arguments": training_arguments(cell, recipe), "model_loading": model_loading(cell, recipe),
            "python": lines}

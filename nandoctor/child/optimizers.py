"""Build the optimizer an `optimizer` axis value names, inside the probe process.

The row in cells.OPTIMIZERS says where the class lives and which flags it takes; the optional
package is imported only here, in the child, after the parent has checked it is installed.
"""

from __future__ import annotations

import functools
import importlib

from ..cells import OPTIMIZERS, optimizer_kwargs
from ..config import OptimizerConfig

# torchao compiles its step once per parameter shape: ~40 s for the tiny Llama on 2 CPU cores, more
# than a whole probe, and inductor needs a C++ compiler there. The same step functions run eagerly.
EAGER_ON_CPU = (
    "{name} compiles its optimizer step per parameter shape (~40 s on 2 CPU cores); on a CPU the "
    "probe runs the same step eagerly (torch.compiler.set_stance('force_eager')), so its step time "
    "is not the compiled step's"
)


def optimizer_class(name: str):
    module, attribute = OPTIMIZERS[name].import_path.split(":")
    return getattr(importlib.import_module(module), attribute)


# The parameters transformers' Trainer leaves out of weight decay: those of nn.LayerNorm modules and those
# whose name matches one of these (transformers 5.24, Trainer.get_decay_parameter_names); importing the
# Trainer itself costs a probe seconds. tests/test_pasted_code.py compares the groups with the Trainer's.
NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


def param_groups(model, weight_decay: float, left_out: frozenset = frozenset()) -> list:
    """The trainable parameters (but those named in `left_out`) as the Trainer groups them for its optimizer:
    weight decay on all but biases and norm weights, which get none. One group with every trainable parameter
    where there is no decay."""
    import torch
    from transformers.trainer_pt_utils import get_parameter_names

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in left_out]
    if not weight_decay:
        return [p for _, p in trainable]
    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], list(NO_DECAY_PATTERNS)))
    groups = [
        {"params": [p for n, p in trainable if n in decay]},
        {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(name: str, params, o: OptimizerConfig):
    """The optimizer `name` over `params` (param_groups), with the recipe's hyper-parameters as the Trainer
    passes them to its class and the row's own flags. Its state follows the parameters' dtype (half in the
    pure cells, for torch's AdamW). Library defaults stay as the user gets them (bitsandbytes' and torchao's
    fp32 state for tensors under 4096 elements included), so the memory it reports is the memory the user's
    run would use. A schedule-free optimizer is put in train mode, as the Trainer puts it before each step."""
    row = OPTIMIZERS[name]
    optimizer = optimizer_class(name)(params, **optimizer_kwargs(row, o.lr, o.betas, o.eps, o.weight_decay))
    if row.eval_mode:
        optimizer.train()
    return optimizer


def optimizer_for(name: str, model, o: OptimizerConfig):
    """The optimizer `name` over the model's trainable parameters, grouped for weight decay as the Trainer
    groups them; a split row (muon) gives its class the 2-D hidden matrices and AdamW the rest (muon.py)."""
    if OPTIMIZERS[name].split == "muon":
        from .muon import MuonWithAdamW, muon_split

        hidden, split = muon_split(model)
        muon = [p for n, p in model.named_parameters() if n in hidden]
        return MuonWithAdamW(muon, param_groups(model, o.weight_decay, frozenset(hidden)), o, split)
    return build_optimizer(name, param_groups(model, o.weight_decay), o)


def step_eagerly(optimizer) -> None:
    """Make every `optimizer.step()` run under torch.compiler.set_stance('force_eager'), which reaches
    the library's own torch.compile calls and nothing outside the step (a compiled model stays compiled)."""
    import torch

    step = optimizer.step

    @functools.wraps(step)
    def eager_step(*args, **kwargs):
        with torch.compiler.set_stance("force_eager"):
            return step(*args, **kwargs)

    optimizer.step = eager_step


def dense(state):
    """An optimizer-state tensor as a plain one: torchao's quantized moments (tensor subclasses that
    implement few operators) dequantized, anything else as it is."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return state.dequantize() if is_traceable_wrapper_subclass(state) else state


def eager_reason(name: str, device: str) -> str | None:
    """Why the probe steps optimizer `name` eagerly on this device, or None when it runs as shipped."""
    return EAGER_ON_CPU.format(name=name) if OPTIMIZERS[name].compiles_step and device != "cuda" else None

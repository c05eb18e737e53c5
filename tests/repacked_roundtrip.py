"""tests/test_quant.py's repack case, run in a process of its own: an nf4 LoRA model whose 4-bit weights are
repacked as bitsandbytes repacks them for its AVX512-BF16 CPU kernel, read back by the round trip as the layer
computes with them. Usage: python tests/repacked_roundtrip.py CHECKPOINT; prints ok."""

from __future__ import annotations

import contextlib
import sys


def rel(a, b) -> float:
    import torch

    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def nf4_lora(path):
    """The checkpoint at `path` as an fp32-compute nf4 cell's probe builds it, with a LoRA adapter."""
    from nandoctor.cells import Cell
    from nandoctor.child.build import build_model
    from nandoctor.config import Recipe, set_field
    from nandoctor.record import ModelPlan

    recipe = set_field(set_field(Recipe(), "adapter.type", "lora"), "model.path", str(path))
    plan = ModelPlan("local-weights", "full", "llama", 1, 1, 1, str(path), "", {})
    return build_model(plan, recipe, Cell("fp32", "sdpa", "off", quant="nf4"), 0)


def main(path: str) -> None:
    import torch
    from bitsandbytes.functional import _convert_weight_packed_for_cpu, dequantize_4bit

    from nandoctor.analysis.verdicts import roundtrip_differs
    from nandoctor.child.quant import bnb_layer
    from nandoctor.child.roundtrip import dense_weights, restore_cpu_layout, roundtrip

    model = nf4_lora(path)
    assert type(model.get_base_model().model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"  # peft's
    stored, _ = dense_weights(model)
    layers = [m for m in model.modules() if bnb_layer(m)]
    assert layers and all(m.out_features % 32 == 0 and m.in_features % 64 == 0 for m in layers)
    down = model.get_base_model().model.layers[0].mlp.down_proj
    for m in layers:
        m.weight.data, m.weight.quant_state = _convert_weight_packed_for_cpu(m.weight.data, m.weight.quant_state)
    as_read = dequantize_4bit(down.weight.data, down.weight.quant_state)
    assert rel(as_read, stored["model.layers.0.mlp.down_proj.weight"]) > 0.5  # the repacked buffer misread
    assert restore_cpu_layout(model) == len(layers) and restore_cpu_layout(model) == 0
    restored, _ = dense_weights(model)
    changes = [rel(restored[k], stored[k]) for k in stored]
    assert max(changes) < 2**-8 and max(changes) > 0, max(changes)  # the scales rounded to bf16, nothing else

    for m in layers:
        m.weight.data, m.weight.quant_state = _convert_weight_packed_for_cpu(m.weight.data, m.weight.quant_state)
    ids = torch.randint(0, 1024, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    no = contextlib.nullcontext
    rt = roundtrip(model, batch, no, no, torch.float32, "cpu", False)
    assert "error" not in rt and rt["cpu_repack"]["restored"] >= len(layers), rt
    assert roundtrip_differs(rt) == [], roundtrip_differs(rt)
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])

"""The round trip of what a probe trained (`nandoctor check --roundtrip`): is the model saved at the end
of a fine-tune the model that was trained?

After the timed steps the probe measures one fixed batch (its first micro-batch) three times: on the live
model, on the model with its adapter merged as peft merges it (merge_and_unload: a 4-bit or 8-bit base is
dequantized, the update added and the sum quantized again), and on that model saved with save_pretrained
and loaded back with from_pretrained. A full fine-tune has nothing to merge: its merged model is the live
one. Beside the losses and logits, every weight is compared as the dense matrix it computes with (a
quantized weight dequantized, a LoRA layer's base plus its update), so that a difference names its
tensors. Only figures are recorded here; analysis/verdicts.roundtrip_check judges them.
"""

from __future__ import annotations

import tempfile

from .quant import bnb_layer

# Per stage, the tensors that changed most are kept in the record (a model has hundreds).
KEPT_TENSORS = 12
PEFT_PREFIX = "base_model.model."


def _name(name: str) -> str:
    """A live (peft) module name as the merged model names it."""
    name = name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer", "").replace(".modules_to_save.default", "")


def dense_weights(model) -> tuple[dict, dict]:
    """({name: the fp32 weight a module computes with}, {name: the adapter's update in it}) for every
    module's own weight and bias: a bitsandbytes weight dequantized (as peft dequantizes it to merge), a
    LoRA layer's base weight plus its active adapters' update, a modules_to_save wrapper's trained copy
    (its original left out). Names are the merged model's."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.integrations import dequantize_module_weight

    weights, updates = {}, {}
    inside: tuple[str, ...] = ()  # modules whose weights are read through their parent
    for name, module in model.named_modules():
        if inside and name.startswith(inside):
            continue
        if name.endswith(".original_module"):
            inside += (name + ".",)
            continue
        if isinstance(module, LoraLayer):
            inside += (name + ".",)
            base = module.get_base_layer()
            w = dequantize_module_weight(base).detach().float()
            delta = sum(
                module.get_delta_weight(a).detach().float() for a in module.active_adapters if a in module.lora_A
            )
            weights[_name(name) + ".weight"] = w + delta
            updates[_name(name) + ".weight"] = delta
            if getattr(base, "bias", None) is not None:
                weights[_name(name) + ".bias"] = base.bias.detach().float()
            continue
        if bnb_layer(module):
            weights[_name(name) + ".weight"] = dequantize_module_weight(module).detach().float()
            if module.bias is not None:
                weights[_name(name) + ".bias"] = module.bias.detach().float()
            continue
        for pname, p in module.named_parameters(recurse=False):
            weights[_name(f"{name}.{pname}")] = p.detach().float()
    return weights, updates


def _differences(before: dict, after: dict, updates: dict) -> list[dict]:
    """Each tensor that changed between two stages: its relative change (to its own norm) and, for a
    tensor an adapter updated, the share of that update lost (unsloth-zoo#810's error / update ratio)."""
    import torch

    out = []
    for name, b in before.items():
        a = after.get(name)
        if a is None:
            out.append({"tensor": name, "missing": True})
            continue
        if a.shape != b.shape:
            out.append({"tensor": name, "shape": [list(b.shape), list(a.shape)]})
            continue
        diff = float(torch.linalg.vector_norm(a.to(b.device) - b))
        if diff == 0.0:
            continue
        row = {"tensor": name, "rel_change": diff / max(float(torch.linalg.vector_norm(b)), 1e-30)}
        if name in updates:
            row["update_lost"] = diff / max(float(torch.linalg.vector_norm(updates[name])), 1e-30)
        out.append(row)
    out += [{"tensor": name, "added": True} for name in after if name not in before]
    return sorted(out, key=lambda r: -r.get("update_lost", r.get("rel_change", float("inf"))))[:KEPT_TENSORS]


def _repacked_for_cpu(module) -> bool:
    """A bitsandbytes Linear4bit whose weight bitsandbytes repacked for its CPU kernel."""
    if not bnb_layer(module):
        return False
    state = getattr(module.weight, "quant_state", None)
    return bool(getattr(state, "packing_format_for_cpu", False))


def restore_cpu_layout(model) -> int:
    """Put every 4-bit weight that bitsandbytes repacked for its CPU kernel back in the stored layout, in
    place; returns how many it restored.

    On a CPU with AVX512-BF16, bitsandbytes (0.49+) repacks a Linear4bit's weight on its first forward in
    eval mode without gradients: the nibbles in another order and the block scales rounded to bf16. Its
    dequantize_4bit, and so peft's merge and this module's weight comparison, read that buffer as if it were
    the stored layout, and get other numbers. bitsandbytes itself restores the layout before it saves a
    state dict; this does the same, keeping the bf16-rounded scales the layer computed with."""
    layers = [m for m in model.modules() if _repacked_for_cpu(m)]
    if not layers:
        return 0
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    for m in layers:
        data, state = _convert_weight_packed_for_cpu_inverse(m.weight.data, m.weight.quant_state)
        if state.absmax.dim() == 2:  # bitsandbytes 0.50.2 leaves the scales of an unnested weight [K/block, N]
            state.absmax = state.absmax.T.reshape(-1).float()
        m.weight.data, m.weight.quant_state = data, state
    return len(layers)


def keep_cpu_layout(model) -> list[str]:
    """The 4-bit layers that bitsandbytes' CPU repack cannot take, told to compute in the stored layout
    instead: its forward raises on an output size that is not a multiple of 32 and on an input size that is
    not a multiple of the quantization block."""
    kept = []
    for name, m in model.named_modules():
        if not (bnb_layer(m) and getattr(m, "support_avx512bf16_for_cpu", False)) or _repacked_for_cpu(m):
            continue
        block = getattr(getattr(m.weight, "quant_state", None), "blocksize", 64)
        if m.out_features % 32 or m.in_features % block:
            m.support_avx512bf16_for_cpu = False
            kept.append(_name(name))
    return kept


def _measure(model, batch: dict, autocast, attend, repack: dict) -> tuple[float, object]:
    """(loss, fp32 logits) of one batch, without gradients and in eval mode (no dropout). The weights are
    left in their stored layout (restore_cpu_layout); `repack` counts the layers restored and lists those
    kept from a repack they cannot take."""
    import torch

    model.eval()
    repack["kept_unpacked"] = sorted({*repack.get("kept_unpacked", ()), *keep_cpu_layout(model)})
    with torch.no_grad(), autocast(), attend():
        out = model(**batch)
    repack["restored"] = repack.get("restored", 0) + restore_cpu_layout(model)
    return float(out.loss), out.logits.detach().float()


def _tied(model) -> bool:
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight.data_ptr() == embed.weight.data_ptr()


def roundtrip(
    model, batch: dict, autocast, attend, dtype, device: str, remote: bool, optimizer=None, eval_before_save=False
) -> dict:
    """Live -> merged -> saved and reloaded, measured on `batch`; returns the record's `roundtrip`. The live
    model is merged in place (the probe ends after it). dtype: what from_pretrained loads the weights in.
    optimizer: a schedule-free one, whose eval-mode weights (what the Trainer's evaluate() scores) are
    measured first; the model is then saved as the run saves it: in train mode (the Trainer's save_model()),
    or in eval mode where the run calls optimizer.eval() before saving (eval_before_save)."""
    from transformers import AutoModelForCausalLM

    repack: dict = {}
    evaluated = None
    if optimizer is not None:
        optimizer.eval()
        scored = {name: w.clone() for name, w in dense_weights(model)[0].items()}  # the swap back is in place
        evaluated = _measure(model, batch, autocast, attend, repack), scored
        if not eval_before_save:
            optimizer.train()
    live_loss, live_logits = _measure(model, batch, autocast, attend, repack)
    live_weights, updates = dense_weights(model)
    adapter = hasattr(model, "merge_and_unload")
    live_tied = _tied(model.get_base_model() if adapter else model)
    merged = model.merge_and_unload() if adapter else model
    merged_loss, merged_logits = _measure(merged, batch, autocast, attend, repack)
    merged_weights, _ = dense_weights(merged)
    with tempfile.TemporaryDirectory(prefix="nandoctor-roundtrip-") as tmp:
        merged.save_pretrained(tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, device_map=device, trust_remote_code=remote)
    reloaded_loss, reloaded_logits = _measure(reloaded, batch, autocast, attend, repack)
    reloaded_weights, _ = dense_weights(reloaded)
    scale = max(float(live_logits.abs().max()), 1e-30)

    def logits_change(logits) -> float:
        return float((logits - live_logits).abs().max()) / scale

    out = {
        "adapter": adapter,
        "loss": {"live": live_loss, "merged": merged_loss, "reloaded": reloaded_loss},
        "logits_rel_change": {"merged": logits_change(merged_logits), "reloaded": logits_change(reloaded_logits)},
        "tied": {"live": live_tied, "merged": _tied(merged), "reloaded": _tied(reloaded)},
        "quantized": any(bnb_layer(m) for m in merged.modules()),
        "unmerged": sorted(n for n, _ in merged.named_parameters() if ".lora_" in n)[:KEPT_TENSORS],
        "tensors": {
            "merge": _differences(live_weights, merged_weights, updates),
            "reload": _differences(merged_weights, reloaded_weights, {}),
        },
        "dtype": str(dtype).removeprefix("torch."),
        "cpu_repack": repack,
    }
    if evaluated is not None:
        (loss, logits), weights = evaluated
        out["evaluated"] = {
            "loss": loss,
            "saved_in": "eval" if eval_before_save else "train",
            "logits_rel_change": float((reloaded_logits - logits).abs().max()) / max(float(logits.abs().max()), 1e-30),
            "tensors": _differences(weights, reloaded_weights, {}),
        }
    return out

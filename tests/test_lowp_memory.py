"""Optimizer state is counted as the bytes it really occupies, after real steps on a tiny Llama:
plain AdamW holds two fp32 moments, the 8-bit and 4-bit optimizers hold codes plus block scales,
and torchao's tensor subclasses, which claim an fp32 dtype, are opened to their real storage."""

import math

import pytest
import torch
from checkpoints import TINY
from conftest import needs
from transformers import AutoConfig, AutoModelForCausalLM

from nandoctor.child.memory import memory_split, split_after_first_step
from nandoctor.child.optimizers import build_optimizer, step_eagerly
from nandoctor.config import OptimizerConfig

pytestmark = needs("torchao", "bitsandbytes")

FP32 = 4
QUANTIZED_FROM = 4096  # bitsandbytes' min_8bit_size, which torchao follows: smaller tensors keep fp32 state


def tiny_llama():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))


def train(name: str, steps: int = 2):
    """(losses, memory split after the last backward) for `steps` real steps of optimizer `name`."""
    model = tiny_llama()
    optimizer = build_optimizer(name, model.parameters(), OptimizerConfig(lr=1e-3, betas=(0.9, 0.95)))
    batch = torch.randint(0, TINY["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(0))
    losses = []
    step_eagerly(optimizer)  # as a CPU probe does: torchao compiles its step per parameter shape (~40 s here)
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        split = memory_split(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, split, [p.numel() for p in model.parameters()]


def quantized_bytes(sizes, block: int, code_bytes: float, qmap_entries: int, step_bytes: int, shared_qmaps: bool):
    """Two moments per parameter: codes plus one fp32 scale per block for tensors of QUANTIZED_FROM
    elements or more (and divisible by the block), fp32 below; plus the quantization maps."""
    total, maps = 0, 0
    for n in sizes:
        if n >= QUANTIZED_FROM and n % block == 0:
            total += 2 * (int(n * code_bytes) + FP32 * math.ceil(n / block))
            maps += 2
        else:
            total += 2 * FP32 * n
    maps = 2 if shared_qmaps else maps  # bitsandbytes keeps one signed and one unsigned map for all parameters
    return total + maps * qmap_entries * FP32 + step_bytes * len(sizes)


def test_the_split_is_taken_once_after_the_first_step_while_the_gradients_exist():
    model = tiny_llama()
    optimizer = build_optimizer("adamw", model.parameters(), OptimizerConfig())
    split = split_after_first_step(model, optimizer)
    batch = torch.randint(0, TINY["vocab_size"], (2, 16))
    model(input_ids=batch, labels=batch).loss.backward()
    assert split == {}
    optimizer.step()
    first = dict(split)
    assert first["grads_bytes"] == first["weights_bytes"] > 0 and first["optimizer_state_bytes"] > 0
    optimizer.zero_grad(set_to_none=True)
    optimizer.step()
    assert split == first  # the hook removed itself


@pytest.mark.parametrize("name", ["adamw", "adamw-fused"])
def test_adamw_state_is_two_fp32_moments_plus_a_step_scalar_per_parameter(name):
    losses, split, sizes = train(name)
    assert losses[1] < losses[0]
    assert split["weights_bytes"] == FP32 * sum(sizes) == split["grads_bytes"]
    assert split["optimizer_state_bytes"] == 2 * split["weights_bytes"] + FP32 * len(sizes)
    assert split["optimizer_state_naive_bytes"] == split["optimizer_state_bytes"]


def test_bnb_adamw8bit_counts_its_shared_quantization_maps_once():
    losses, split, sizes = train("bnb-adamw8bit")
    assert losses[1] < losses[0]
    expected = quantized_bytes(sizes, block=256, code_bytes=1, qmap_entries=256, step_bytes=0, shared_qmaps=True)
    assert split["optimizer_state_bytes"] == expected
    assert split["optimizer_state_naive_bytes"] > expected  # a per-parameter sum counts the shared maps again


@pytest.mark.parametrize(
    "name, block, code_bytes, qmap_entries", [("ao-adamw8bit", 256, 1, 256), ("ao-adamw4bit", 128, 0.5, 16)]
)
def test_torchao_state_is_counted_from_its_inner_tensors_not_its_fp32_face(name, block, code_bytes, qmap_entries):
    losses, split, sizes = train(name, steps=1)
    assert all(map(math.isfinite, losses))
    adamw_bytes = 2 * FP32 * sum(sizes) + FP32 * len(sizes)
    assert split["optimizer_state_naive_bytes"] == adamw_bytes  # what numel * element_size reports
    expected = quantized_bytes(sizes, block, code_bytes, qmap_entries, step_bytes=FP32, shared_qmaps=False)
    assert split["optimizer_state_bytes"] == expected < adamw_bytes * (0.32 if code_bytes == 1 else 0.18)

"""Crash signatures: a crashed probe's exception text is matched against the knowledge base."""

import pytest

from nandoctor.analysis.verdicts import CRASH, classify
from nandoctor.cells import Cell
from nandoctor.knowledge import diagnose_crash, rule_by_id, signatures
from nandoctor.record import ProbeRecord

MESSAGES = {  # signature id: an exception message as the library raises it
    "unscale-fp16-gradients": "Attempting to unscale FP16 gradients.",
    "unscale-bf16-gradients-cuda": "\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'",
    "flash-attn-needs-ampere": "FlashAttention only supports Ampere GPUs or newer.",
    "flash-attn-half-only": "FlashAttention only support fp16 and bf16 data type",
    "sdpa-no-viable-backend": "No viable backend for scaled_dot_product_attention was found.",
    "cpu-allocator-out-of-memory": "[enforce fail at alloc_cpu.cpp:127] err == 0. "
    "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes. "
    "Error code 12 (Cannot allocate memory)",
    "inductor-no-cxx-compiler": "torch._inductor.exc.InvalidCxxCompiler: No working C++ compiler found",
    "fp8-gemm-shape-not-multiple-of-16": "RuntimeError: Expected trailing dimension of mat1 to be divisible by 16 "
    "but got mat1 shape: (18432x1).",
    "architecture-refuses-attention": "Gemma2ForCausalLM does not support an attention implementation through "
    "torch.nn.functional.scaled_dot_product_attention yet.",
}


@pytest.mark.parametrize("sig_id", sorted(MESSAGES))
def test_signature_matches_its_message(sig_id):
    assert diagnose_crash(MESSAGES[sig_id]).id == sig_id


def test_every_signature_has_a_message_and_its_rule_exists():
    assert {s.id for s in signatures()} == set(MESSAGES)
    for s in signatures():
        if s.rule:
            assert rule_by_id(s.rule).id == s.rule


def test_unrelated_crash_gets_no_diagnosis():
    assert diagnose_crash("RuntimeError: faulty-llama: unsupported rotary layout in custom kernel") is None


def test_crash_verdict_carries_the_diagnosis_and_fix():
    record = ProbeRecord(
        "p", Cell(), "error", error={"type": "ValueError", "message": MESSAGES["unscale-fp16-gradients"]}
    )
    verdict = classify(record)
    assert verdict.name == CRASH
    assert verdict.reason.startswith("ValueError: Attempting to unscale FP16 gradients.")
    assert "known issue unscale-fp16-gradients" in verdict.reason and "Fix: load the model in fp32" in verdict.reason

"""How a probe's process ended becomes its verdict: a refused kernel is unsupported (with PyTorch's
reason), a host allocator failure is oom, a replay cut short leaves the timed verdict alone, and
faulthandler's module list stays out of the log tail."""

import json

import pytest

from nandoctor.analysis.verdicts import classify
from nandoctor.cells import Cell
from nandoctor.record import REPLAY_RUNNING, ProbeRecord, Step
from nandoctor.run.task import LOG_TAIL_CHARS, ProbeTask, collect, log_tail

# What PyTorch 2.x prints on CUDA for sdpa:efficient pinned on a GQA model (sdp_utils.cpp), as the
# probe's WarningLog records it
GQA_WARNINGS = [
    "UserWarning: Memory efficient kernel not used because: "
    "(Triggered internally at ../aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:859.)",
    "UserWarning: Both fused kernels require query, key and value to have the same num_heads. "
    "Query.sizes(): [4, 32, 64, 128], Key sizes(): [4, 8, 64, 128], Value sizes(): [4, 8, 64, 128] instead. "
    "(Triggered internally at ../aten/src/ATen/native/transformers/sdp_utils_cpp.h:395.)",
    "UserWarning: `torch_dtype` is deprecated! Use `dtype` instead!",
]


def errored(message: str, warnings=(), oom=False) -> ProbeRecord:
    return ProbeRecord(
        "bf16-amp/sdpa:efficient/off",
        Cell("bf16-amp", "sdpa:efficient", "off"),
        "error",
        error={"type": "RuntimeError", "message": message, "traceback": "", "oom": oom, "warnings": list(warnings)},
    )


def test_no_available_kernel_is_unsupported_with_pytorchs_reason():
    verdict = classify(errored("No available kernel. Aborting execution.", GQA_WARNINGS))
    assert verdict.name == "unsupported" and not verdict.failed
    assert "same num_heads" in verdict.reason and "Memory efficient kernel not used" in verdict.reason
    assert "deprecated" not in verdict.reason


def test_no_viable_backend_on_a_cpu_is_unsupported_without_warnings():
    verdict = classify(errored("No viable backend for scaled_dot_product_attention was found."))
    assert verdict.name == "unsupported" and "pinned SDPA backend" in verdict.reason


def test_the_cpu_allocators_failure_is_oom():
    import torch

    with pytest.raises(RuntimeError) as raised:
        torch.empty(1 << 50, dtype=torch.uint8)  # the allocator's own message, as under ulimit -v
    verdict = classify(errored(str(raised.value)))
    assert verdict.name == "oom" and "can't allocate memory" in verdict.reason


def test_an_ordinary_runtime_error_is_still_a_crash():
    assert classify(errored("mat1 and mat2 shapes cannot be multiplied")).name == "crash"


def tiny_task(forensics_timeout_s=7.0) -> ProbeTask:
    from nandoctor.config import Recipe
    from nandoctor.record import ModelPlan, ProbeSpec

    plan = ModelPlan("architecture-twin", "full", "llama", 1, 1, 1, None, "", {})
    spec = ProbeSpec("fp32/sdpa/off", Recipe(forensics_timeout_s=forensics_timeout_s), Cell(), plan, 2, 0, "cpu", 1)
    return ProbeTask(spec, 60.0)


def leave_result(folder, forensics) -> None:
    steps = [Step(0, 2.0, 1.0).to_dict(), Step(1, 1.5, 1.0).to_dict()]
    (folder / "result.json").write_text(
        json.dumps({"cell": Cell().to_dict(), "probe_id": "fp32/sdpa/off", "steps": steps, "forensics": forensics})
    )


def test_a_replay_killed_for_its_budget_keeps_the_timed_verdict(tmp_path):
    leave_result(tmp_path, REPLAY_RUNNING)
    record = collect(tiny_task(), tmp_path, -9, False, 12.0, replay_overran=True)
    assert record.status == "ok" and record.exit_code == -9
    assert record.forensics == {"error": "replay overran its 7 s budget"}
    assert classify(record).name == "stable"


def test_a_replay_that_died_is_noted_and_the_timed_verdict_stands(tmp_path):
    leave_result(tmp_path, REPLAY_RUNNING)
    record = collect(tiny_task(), tmp_path, -11, False, 12.0)
    assert record.status == "ok" and record.forensics == {"error": "replay died of signal 11"}


def test_a_probe_killed_just_after_its_replay_finished_is_not_killed(tmp_path):
    leave_result(tmp_path, {"reproduced": True})
    record = collect(tiny_task(), tmp_path, -9, False, 12.0, replay_overran=True)
    assert record.status == "ok" and record.forensics == {"reproduced": True}


def test_the_log_tail_leaves_out_faulthandlers_extension_module_list(tmp_path):
    log = tmp_path / "log.txt"
    stack = (
        "Fatal Python error: Segmentation fault\n\n"
        'Current thread 0x1 (most recent call first):\n  File "m.py", line 3 in forward\n'
    )
    modules = "Extension modules: " + ", ".join(f"torch._C._mod{i}" for i in range(900)) + " (total: 900)\n"
    log.write_text("x" * 10000 + "\n" + stack + "\n" + modules)
    tail = log_tail(log)
    assert stack in tail and "Extension modules" not in tail and len(tail) <= LOG_TAIL_CHARS

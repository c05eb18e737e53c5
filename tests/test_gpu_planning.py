"""How a GPU host is used, decided without one: probes packed by memory and cores, the replay's
snapshot placed, kernels refused by shape predicted, compile time split from steady steps. Pure."""

from nandoctor.capabilities import data_masked, input_support
from nandoctor.cells import Cell
from nandoctor.child.snapshot import keep_on_device
from nandoctor.child.train import step_times
from nandoctor.config import DataConfig
from nandoctor.models import training_bytes
from nandoctor.record import Step
from nandoctor.run.slots import CUDA_CONTEXT_BYTES, most_jobs, packed_jobs

GB = 10**9
H100_HOST = {
    "device": "cuda",
    "cpu_count": 16,
    "torch": "2.13.0+cu128",
    "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_bytes": 80 * GB}],
}
CPU_HOST = {"device": "cpu", "cpu_count": 2, "gpus": []}
GQA = {"heads": 32, "kv_heads": 8}
MHA = {"heads": 32, "kv_heads": 32}


def test_tiny_models_fill_a_gpu_up_to_one_probe_per_two_cores():
    assert packed_jobs(H100_HOST, training_bytes(1_800_000, 1_800_000)) == 8


def test_an_8b_lora_twin_gets_a_gpu_to_itself():
    eight_b_lora = training_bytes(8_030_000_000, 42_000_000)  # fp32 base + adapter training state
    assert packed_jobs(H100_HOST, eight_b_lora) == 2  # ~33 GB + a context each: two fit in 85% of 80 GB
    assert packed_jobs(H100_HOST, 40 * GB) == 1


def test_a_model_larger_than_the_gpu_still_runs_one_probe():
    assert packed_jobs(H100_HOST, 200 * GB) == 1


def test_measured_peaks_replace_the_estimate():
    estimate = training_bytes(100_000_000, 100_000_000)  # 1.6 GB: 8 would fit by memory and by cores
    assert packed_jobs(H100_HOST, estimate) == 8
    assert packed_jobs(H100_HOST, estimate, peak_bytes=30 * GB) == 2  # activations the estimate left out
    assert packed_jobs(H100_HOST, estimate, peak_bytes=int(68 * GB - CUDA_CONTEXT_BYTES)) == 1


def test_two_gpus_hold_twice_the_probes_within_the_cores():
    two = {**H100_HOST, "gpus": H100_HOST["gpus"] * 2}
    assert packed_jobs(two, 30 * GB) == 4
    assert packed_jobs(two, 1 * GB) == 8  # 16 cores


def test_a_cpu_host_runs_one_probe_at_a_time_by_default():
    assert packed_jobs(CPU_HOST, 1) == 1 and most_jobs(CPU_HOST) == 1
    assert most_jobs(H100_HOST) == 8


def test_the_snapshot_stays_on_the_gpu_only_beside_the_training_state():
    assert keep_on_device(16 * GB, 1 * GB, 64 * GB)  # a LoRA base: 16 GB kept, little to train
    assert not keep_on_device(16 * GB, 16 * GB, 64 * GB)  # full fine-tuning: grads and moments come first


def test_efficient_sdpa_with_gqa_and_no_mask_is_predicted_unsupported():
    reason = input_support(Cell("bf16-amp", "sdpa:efficient", "off"), GQA, padded=False, device=H100_HOST)
    assert "same num_heads" in reason and "32 query / 8 key-value" in reason


def test_efficient_sdpa_runs_when_transformers_repeats_the_kv_heads():
    # with a mask (padding, or torch.compile before 2.14) transformers repeats kv heads instead of enable_gqa
    assert input_support(Cell("bf16-amp", "sdpa:efficient", "off"), GQA, padded=True, device=H100_HOST) is None
    assert input_support(Cell("bf16-amp", "sdpa:efficient", "inductor"), GQA, padded=False, device=H100_HOST) is None
    assert input_support(Cell("bf16-amp", "sdpa:efficient", "off"), MHA, padded=False, device=H100_HOST) is None


def test_flash_sdpa_under_compile_or_padding_is_predicted_unsupported():
    assert "under torch.compile (aot_eager)" in input_support(
        Cell("bf16-amp", "sdpa:flash", "aot_eager"), MHA, False, H100_HOST
    )
    assert "padded" in input_support(Cell("bf16-amp", "sdpa:flash", "off"), MHA, True, H100_HOST)
    assert input_support(Cell("bf16-amp", "sdpa:flash", "off"), GQA, False, H100_HOST) is None
    assert (
        input_support(Cell("bf16-amp", "sdpa:flash", "inductor"), MHA, False, {**H100_HOST, "torch": "2.14.0"}) is None
    )


def test_kernel_predictions_leave_a_cpu_alone():
    assert input_support(Cell("fp32", "sdpa:flash", "inductor"), MHA, True, CPU_HOST) is None


def _steps(*times):
    return [Step(i, 1.0, 1.0, time_s=t) for i, t in enumerate(times)]


def test_a_compiled_probe_splits_its_first_step_into_compile_and_a_steady_step():
    assert step_times(_steps(30.0, 0.5, 0.4, 0.6), compiled=True) == (29.5, 0.5)


def test_an_eager_probe_has_no_compile_time():
    assert step_times(_steps(1.0, 0.5, 0.4, 0.6), compiled=False) == (None, 0.5)
    assert step_times(_steps(1.0), compiled=False) == (None, None)


def test_the_users_padded_rows_count_as_masked_for_the_sdpa_kernel_predictions():
    # issue 34: the session passed data.pad_fraction > 0, which only the synthetic stream sets, so a GQA
    # model trained on the user's padded rows had sdpa:efficient planned unsupported (and sdpa:flash not)
    padded_rows = {"batches": [{"kind": "first", "padded": 0}, {"kind": "most_padded", "padded": 37}]}
    one_length = {"batches": [{"kind": "first", "padded": 0}, {"kind": "most_padded", "padded": 0}]}
    rows = DataConfig(path="chats.jsonl")
    assert data_masked(rows, padded_rows) and not data_masked(rows, one_length)
    assert data_masked(DataConfig(path="chats.jsonl", packing="position_ids"), one_length)
    assert data_masked(rows, None)  # a resumed run, without the lint: rows of one length are the exception
    assert not data_masked(DataConfig(), None) and data_masked(DataConfig(pad_fraction=0.25), None)
    efficient, flash = Cell("bf16-amp", "sdpa:efficient", "off"), Cell("bf16-amp", "sdpa:flash", "off")
    assert input_support(efficient, GQA, data_masked(rows, padded_rows), H100_HOST) is None
    assert "for padded batches" in input_support(flash, GQA, data_masked(rows, padded_rows), H100_HOST)

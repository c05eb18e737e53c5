"""Between the frameworks and nandoctor's cells, the setup check at train start, and the live
watch's step-by-step verdicts. Fast: no training step runs."""

import subprocess
import sys

import pytest
import torch
from training_runs import hf_trainer, nandoctor_lightning, nandoctor_transformers, tiny_llama

from nandoctor.analysis.verdicts import numeric_verdict
from nandoctor.cells import ALIASES, PRECISIONS, Cell
from nandoctor.errors import NandoctorError
from nandoctor.record import Step

TURING = {
    "device": "cuda",
    "cudnn": 90100,
    "gpus": [{"index": 0, "name": "Tesla T4", "capability": "7.5", "memory_bytes": 16 * 2**30}],
}


def training_args(tmp_path, **flags):
    from transformers import TrainingArguments

    return TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, **flags)


# the dtypes a Lightning precision string names on its own; the torchao fp8 rows and fp8-te-e4m3
# share theirs (bf16-mixed, transformer-engine) and add their conversion in code
NAMED_BY_LIGHTNING = [d for d, p in PRECISIONS.items() if ALIASES["dtype"][p.lightning] == d or p.tf32]


def test_the_lightning_dtypes_are_the_six_precisions_and_te_hybrid():
    assert NAMED_BY_LIGHTNING == ["fp32", "tf32", "bf16-amp", "fp16-amp", "bf16-pure", "fp16-pure", "fp8-te-hybrid"]


@pytest.mark.parametrize("dtype", NAMED_BY_LIGHTNING)
def test_every_dtype_reads_back_from_its_lightning_arguments(dtype):
    args = nandoctor_lightning().lightning_arguments(Cell(dtype, "eager"))
    assert nandoctor_lightning().cell_from_lightning(
        args["precision"], "eager", args.get("float32_matmul_precision")
    ) == Cell(dtype, "eager")


def test_a_32_true_run_reads_tf32_set_through_torchs_per_backend_api():
    """torch's per-backend setting (torch.backends.cuda.matmul.fp32_precision) tells tf32 from fp32, as
    the legacy one does; the legacy reader raises in such a process (torch >= 2.9)."""
    from nandoctor.measure.numerics import fp32_precision_knobs

    if not fp32_precision_knobs():
        pytest.skip(f"torch {torch.__version__} has only the legacy precision API")
    saved = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        assert nandoctor_lightning().cell_from_lightning("32-true", "eager") == Cell("tf32", "eager")
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert nandoctor_lightning().cell_from_lightning("32-true", "eager") == Cell("fp32", "eager")
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved


def test_lightning_strings_of_the_pure_and_mixed_cells():
    assert [
        nandoctor_lightning().lightning_arguments(Cell(d))["precision"]
        for d in ("bf16-amp", "fp16-amp", "bf16-pure", "fp16-pure")
    ] == [
        "bf16-mixed",
        "16-mixed",
        "bf16-true",
        "16-true",
    ]
    assert nandoctor_lightning().lightning_arguments(Cell("tf32")) == {
        "precision": "32-true",
        "float32_matmul_precision": "high",
    }


def test_an_unknown_lightning_precision_is_one_line_error():
    with pytest.raises(NandoctorError, match="'64-true' has no nandoctor cell; valid: 16-mixed"):
        nandoctor_lightning().cell_from_lightning("64-true")


def test_training_args_bf16_is_bf16_amp_with_the_models_attention(tmp_path):
    assert nandoctor_transformers().cell_from_training_args(
        training_args(tmp_path, bf16=True), tiny_llama(attn="eager")
    ) == Cell("bf16-amp", "eager")


def test_training_args_torch_compile_is_inductor(tmp_path):
    assert (
        nandoctor_transformers().cell_from_training_args(training_args(tmp_path, torch_compile=True)).compile
        == "inductor"
    )


def test_half_weights_without_an_autocast_flag_are_the_pure_cell(tmp_path):
    assert (
        nandoctor_transformers().cell_from_training_args(training_args(tmp_path), tiny_llama(torch.float16)).dtype
        == "fp16-pure"
    )
    assert (
        nandoctor_transformers().cell_from_training_args(training_args(tmp_path), tiny_llama(torch.bfloat16)).dtype
        == "bf16-pure"
    )


def test_fp16_flag_on_a_cpu_trains_in_fp32(tmp_path):
    """accelerate enables fp16 autocast and a GradScaler only on an accelerator."""
    assert (
        nandoctor_transformers().cell_from_training_args(training_args(tmp_path, fp16=True), tiny_llama()).dtype
        == "fp32"
    )


def test_bf16_on_a_turing_gpu_is_caught_at_train_start_before_any_step(tmp_path):
    model = tiny_llama()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = hf_trainer(
        model,
        tmp_path,
        [nandoctor_transformers().NandoctorCallback(strict=True, device=TURING)],
        max_steps=2,
        bf16=True,
    )
    with pytest.raises(
        NandoctorError,
        match=r"probe ran: unsupported: bf16 needs compute capability 8\.0, this GPU has 7\.5.*"
        r"known issue no-native-bf16: .* Fix: Train with fp16-amp",
    ):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bf16_on_a_turing_gpu_warns_with_the_check_wording_when_not_strict(tmp_path):
    callback = nandoctor_transformers().NandoctorCallback(device=TURING)
    trainer = hf_trainer(tiny_llama(), tmp_path, [callback], max_steps=1, bf16=True)
    with pytest.warns(UserWarning, match="  FAIL probe ran: unsupported: bf16 needs compute capability 8.0"):
        callback.on_train_begin(
            trainer.args, trainer.state, trainer.control, model=trainer.model, optimizer=trainer.create_optimizer()
        )


CURVES = {
    "spike": [7.0, 6.9, 6.8, 6.7, 6.6, 20.0, 6.5],
    "rise": [6.0, 6.2, 6.4, 6.5, 6.7, 6.8],
    "grad explosion": [7.0, 6.5, 6.0, 5.5, 5.0, 4.5, 4.0],
    "nan": [7.0, 6.5, float("nan"), 6.0],
}


@pytest.mark.parametrize("name", CURVES)
def test_judging_each_new_step_once_gives_the_verdict_of_the_curve_so_far(name):
    steps = [Step(i, x, 60.0 if name == "grad explosion" and i == 5 else 1.0) for i, x in enumerate(CURVES[name])]
    for k in range(len(steps)):
        live, whole = numeric_verdict(steps[: k + 1], None, since=k), numeric_verdict(steps[: k + 1], None)
        assert (live.name, live.step, live.reason) == (whole.name, whole.step, whole.reason)
        if live.failed:
            break
    assert live.failed


def test_importing_nandoctor_needs_neither_framework():
    code = (
        "import sys; sys.modules['lightning'] = None\n"
        "import nandoctor, nandoctor.api, nandoctor.integrations, nandoctor.integrations.watch\n"
        "assert 'accelerate' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

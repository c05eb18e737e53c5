"""Which optimizer and fp8 values a device can run is decided in the parent, from the cell table and
package metadata, with a reason that says what to install or which GPU is needed."""

import subprocess
import sys

import pytest

from nandoctor.capabilities import cell_support
from nandoctor.cells import OPTIMIZERS, PRECISIONS, Cell

CPU = {"device": "cpu", "gpus": []}
ABSENT = {"importable": False, "version": None}
INSTALLED = {"importable": True, "version": "0.18.0"}
FP8 = sorted(name for name, p in PRECISIONS.items() if p.fp8)


def gpu(cc: str, **packages) -> dict:
    return {
        "device": "cuda",
        "gpus": [{"index": 0, "name": "test", "capability": cc, "memory_bytes": 80 << 30}],
        "cudnn": 90100,
        "packages": packages,
    }


def optimizer_support(name: str, device: dict) -> str | None:
    return cell_support(Cell("fp32", "sdpa", "off", name), device)


def test_every_optimizer_runs_on_this_cpu_except_the_paged_ones_and_32_bit_ademamix():
    reasons = {name: optimizer_support(name, CPU) for name in OPTIMIZERS}
    assert {name for name, why in reasons.items() if why} == {
        *(name for name in OPTIMIZERS if name.startswith("bnb-paged-")),
        "bnb-ademamix",
    }
    assert "falls back to the non-paged bnb-adamw8bit" in reasons["bnb-paged-adamw8bit"]


@pytest.mark.parametrize("name, package", [("bnb-adamw8bit", "bitsandbytes"), ("ao-adamw4bit", "torchao")])
def test_an_optimizer_whose_package_is_missing_says_how_to_install_it(name, package):
    device = {**CPU, "packages": {package: ABSENT}}
    assert optimizer_support(name, device) == f"{package} is not installed: pip install 'nandoctor[lowp]'"


def test_an_optimizer_package_older_than_the_checked_release_is_unsupported():
    device = {**CPU, "packages": {"bitsandbytes": {"importable": True, "version": "0.45.0"}}}
    assert optimizer_support("bnb-adamw8bit", device) == (
        "bitsandbytes 0.45.0 is older than 0.50.2, the oldest checked: pip install -U bitsandbytes"
    )


def test_torch_optimizers_need_no_package():
    device = {**CPU, "packages": {"torchao": ABSENT, "bitsandbytes": ABSENT}}
    assert optimizer_support("adamw", device) is None and optimizer_support("adamw-fused", device) is None


@pytest.mark.parametrize("name", FP8)
def test_fp8_on_a_cpu_is_unsupported_with_the_reason(name):
    assert cell_support(Cell(name), CPU) == (
        "fp8 matmuls need fp8 tensor cores (CUDA compute capability >= 8.9: Ada, Hopper, Blackwell); "
        "this device is a CPU"
    )


def test_fp8_needs_ada_or_newer():
    assert cell_support(Cell("fp8-tensorwise"), gpu("8.0", torchao=INSTALLED)).startswith(
        "fp8 needs compute capability 8.9, this GPU has 8.0"
    )
    assert cell_support(Cell("fp8-tensorwise"), gpu("8.9", torchao=INSTALLED)) is None
    assert cell_support(Cell("fp8-rowwise", optimizer="ao-adamw8bit"), gpu("9.0", torchao=INSTALLED)) is None


def test_torchao_fp8_without_torchao_says_how_to_install_it():
    assert (
        cell_support(Cell("fp8-rowwise"), gpu("9.0", torchao=ABSENT))
        == "torchao is not installed: pip install 'nandoctor[lowp]'"
    )


def test_te_cells_are_offered_only_where_transformer_engine_is_installed():
    assert cell_support(Cell("fp8-te-hybrid"), gpu("9.0", transformer_engine=ABSENT)).startswith(
        "transformer_engine is not installed: pip install --no-build-isolation"
    )
    assert (
        cell_support(Cell("fp8-te-e4m3"), gpu("9.0", transformer_engine={"importable": True, "version": "2.8.0"}))
        is None
    )


def test_support_is_decided_without_importing_the_optional_packages():
    code = (
        "import sys; from nandoctor.capabilities import cell_support; from nandoctor.cells import AXES, Cell\n"
        "[cell_support(Cell('fp32', 'sdpa', 'off', o), {'device': 'cpu'}) for o in AXES['optimizer']]\n"
        "[cell_support(Cell(d), {'device': 'cuda', 'gpus': [{'capability': '9.0'}]}) for d in AXES['dtype']]\n"
        "print(sorted(m for m in ('torch', 'torchao', 'bitsandbytes', 'transformer_engine') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

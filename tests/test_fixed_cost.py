"""What a run costs before and beside its probes (issue 20, issue 16 §5): the first line comes before
the heavy imports, the optional packages stay unimported (and silent) when no cell needs them, and
`check` replays nothing when it passes. Timings themselves live in bench/, not here."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run_cli

from nandoctor import __version__
from nandoctor.env import get_gpu_count_guess
from nandoctor.optional import hidden

# what the lowp/test extras' packages print when something imports them (issue 16 §5)
NOISE = ("Failed to load", "_pytree", "kernels-community", "register_constant")

# a check through the API, as the CLI runs it, noting what this process had imported when the run
# directory was announced and what the probe's record says about its forensics replay
CHECK_SCRIPT = textwrap.dedent("""
    import json, sys
    from nandoctor.api import Listener, run_check
    from nandoctor.cells import Cell
    from nandoctor.recipes import resolve_model
    seen = {}
    def opened(run_dir):
        seen["imported at the first line"] = sorted({"torch", "transformers", "pandas"} & set(sys.modules))
    analysis, checks = run_check(resolve_model("tiny-llama", None).validate(), Cell.parse("bf16-amp/sdpa/off"),
                                 out=sys.argv[1], listener=Listener(opened=opened))
    seen["passed"] = all(ok for _, ok, _ in checks)
    seen["forensics"] = [o.record.forensics for o in analysis.outcomes]
    seen["optional imported"] = sorted({"torchao", "bitsandbytes"} & set(sys.modules))
    print(json.dumps(seen))
""")


@pytest.fixture(scope="module")
def api_check(tmp_path_factory):
    out = tmp_path_factory.mktemp("check") / "run"
    proc = subprocess.run([sys.executable, "-c", CHECK_SCRIPT, str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def small_grid(tmp_path_factory):
    out = tmp_path_factory.mktemp("grid") / "run"
    proc = run_cli(
        "grid",
        "--axis",
        "dtype=fp32",
        "--axis",
        "attn=eager,sdpa",
        "--axis",
        "compile=off",
        "--steps",
        "4",
        "--out",
        out,
        process=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_version_flag_prints_the_package_version():
    proc = run_cli("--version")
    assert (proc.returncode, proc.stdout.strip()) == (0, f"nandoctor {__version__}")


def test_importing_the_cli_loads_neither_torch_nor_pandas():
    code = "import sys, nandoctor.cli; print(sorted({'torch', 'transformers', 'pandas', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_a_hidden_package_looks_absent_inside_the_block_and_imports_after_it():
    import importlib.util

    name = "wave"  # a stdlib module nothing here imports
    sys.modules.pop(name, None)
    with hidden([name]):
        assert importlib.util.find_spec(name) is None
        with pytest.raises(ImportError):
            __import__(name)
    assert importlib.util.find_spec(name) is not None
    assert __import__(name).__name__ == name


def test_an_empty_cuda_visible_devices_means_no_gpu_for_the_first_worker(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert get_gpu_count_guess() == 0


@pytest.mark.slow
def test_the_run_directory_is_announced_before_torch_transformers_or_pandas_are_imported(api_check):
    seen, _ = api_check
    assert seen["imported at the first line"] == []


@pytest.mark.slow
def test_a_passing_check_runs_no_forensics_replay(api_check):
    seen, _ = api_check
    assert seen["passed"] and seen["forensics"] == [None]


@pytest.mark.slow
def test_a_check_without_lowp_cells_never_imports_the_optional_packages_nor_prints_their_noise(api_check):
    seen, stderr = api_check
    assert seen["optional imported"] == []
    assert [line for line in stderr.splitlines() if any(n in line for n in NOISE)] == []


@pytest.mark.slow
def test_a_grid_without_lowp_cells_prints_nothing_on_stderr(small_grid):
    assert small_grid.stderr == ""
    assert small_grid.stdout.splitlines()[0].startswith("run directory: ")
    assert small_grid.stdout.splitlines()[1].startswith("model: ")


@pytest.mark.slow
def test_a_grids_stable_probes_are_not_replayed_and_still_get_their_headroom(small_grid):
    run_dir = small_grid.stdout.splitlines()[0].removeprefix("run directory: ").strip()
    probes = json.loads((Path(run_dir) / "summary.json").read_text())["probes"]
    assert {p["verdict"] for p in probes} == {"stable"} and len(probes) == 2
    for p in probes:  # forked from a warm worker: the hooks watched the timed step 0
        f = p["forensics"]
        assert f["measured_on"] == "timed step 0" and f["reproduced"] is None
        assert f["tightest"] and all(r["activation_absmax"] > 0 for r in f["tightest"])
    assert "none; measured on timed step 0 by read-only hooks" in (Path(run_dir) / "report.md").read_text()


UNUSED = ("scipy", "sklearn", "boto3", "trio")  # where installed, as all four are on the development VM


@pytest.mark.slow
def test_the_warm_workers_import_leaves_out_what_no_probe_uses_and_freezes_what_it_imported():
    # transformers imports scipy.optimize for its object-detection losses only; transformers 5.17 imports
    # sklearn.metrics (and through it scipy and an OpenMP pool) for assisted generation where scikit-learn
    # is installed, as on the GPU host's image; accelerate imports boto3 for its SageMaker config, and the
    # hub's HTTP client trio for an async backend
    code = (
        "import gc, json, sys; from nandoctor.child.worker import preload; preload(); preload('llama'); "
        f"print(json.dumps([sorted(set({UNUSED!r}) & set(sys.modules)), gc.get_freeze_count(), gc.isenabled()]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    imported, frozen, collecting = json.loads(out.splitlines()[-1])
    assert imported == []
    # torch's and transformers' objects are out of every later collection, and the collector is on again
    assert frozen > 100_000 and collecting


# a cold probe (`python -m nandoctor.child SPEC RESULT`, as the SLURM and Ray executors and --cold start it),
# saying at its exit which of the packages no probe uses it had imported
COLD_PROBE = textwrap.dedent("""
    import atexit, runpy, sys
    atexit.register(lambda: print(sorted({"scipy", "sklearn", "boto3", "trio"} & set(sys.modules))))
    sys.argv = ["nandoctor.child", *sys.argv[1:]]
    runpy.run_module("nandoctor.child", run_name="__main__", alter_sys=True)
""")


@pytest.mark.slow
def test_a_cold_probe_imports_what_a_warm_worker_does_and_leaves_out_what_no_probe_uses(tmp_path):
    from nandoctor import jsonio
    from nandoctor.cells import Cell
    from nandoctor.models import plan_model
    from nandoctor.recipes import recipe_by_name
    from nandoctor.record import ProbeSpec

    recipe, cell = recipe_by_name("tiny-llama"), Cell("fp32", "eager", "off")
    spec = ProbeSpec(cell.id, recipe, cell, plan_model(recipe, {"device": "cpu"}), 1, 0, "cpu", 1)
    (tmp_path / "spec.json").write_text(jsonio.dumps(spec.to_dict()))
    proc = subprocess.run(
        [sys.executable, "-c", COLD_PROBE, tmp_path / "spec.json", tmp_path / "result.json"],
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "ok"  # it trained
    assert proc.stdout.splitlines()[-1] == "[]"

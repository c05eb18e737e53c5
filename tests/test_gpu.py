"""On a CUDA host: the fused SDPA kernels, tf32, the CUDA allocator's peak, packing several probes on
one GPU, the snapshot replay on the device, and the compile cache. Skipped without a GPU (conftest)."""

import json

import pytest
from conftest import records, summary, verdicts

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def cuda_run(tmp_path_factory):
    """Half precision on the fused kernels, tf32 on the default one; packed (no --jobs)."""
    from conftest import run_cli

    out = tmp_path_factory.mktemp("cuda") / "run"
    proc = run_cli(
        "grid",
        "--axis",
        "dtype=fp32,tf32,bf16-amp",
        "--axis",
        "attn=sdpa,sdpa:flash,sdpa:efficient",
        "--axis",
        "compile=off",
        "--steps",
        "4",
        "--out",
        out,
        all_cores=True,  # packed by the host's cores, not the one core an xdist worker keeps to
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_flash_sdpa_trains_stably_in_bf16_on_a_gqa_model(cuda_run):
    assert verdicts(cuda_run)["bf16-amp/sdpa:flash/off"] == "stable"


def test_cudnn_sdpa_trains_stably_in_bf16(tmp_path, cli):
    # gpt2 (query heads = key/value heads): what cuDNN's fused attention certainly takes
    out = tmp_path / "cudnn"
    proc = cli(
        "grid",
        "--model",
        "gpt2",
        "--scale",
        "probe",
        "--axis",
        "dtype=bf16-amp",
        "--axis",
        "attn=sdpa:cudnn",
        "--axis",
        "compile=off",
        "--steps",
        "3",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert verdicts(out)["bf16-amp/sdpa:cudnn/off"] == "stable"


def test_fused_kernels_that_take_half_inputs_only_are_unsupported_in_fp32(cuda_run):
    assert verdicts(cuda_run)["fp32/sdpa:flash/off"] == "unsupported"


def test_efficient_sdpa_on_a_gqa_model_is_predicted_unsupported_and_never_spawned(cuda_run):
    probe = next(p for p in summary(cuda_run)["probes"] if p["probe_id"] == "bf16-amp/sdpa:efficient/off")
    assert probe["verdict"] == "unsupported" and "same num_heads" in probe["reason"]
    assert not (cuda_run / "probes" / "bf16-amp__sdpa:efficient__off").exists()


def test_tf32_trains_stably_on_cuda(cuda_run):
    assert verdicts(cuda_run)["tf32/sdpa/off"] == "stable"


def test_cuda_probes_report_the_allocators_peak_and_their_build_time(cuda_run):
    ran = [r for r in records(cuda_run).values() if r["status"] == "ok"]
    # the stable probes of the other tests: with none of them run, this test has nothing to check and fails
    assert {"fp32/sdpa/off", "tf32/sdpa/off", "bf16-amp/sdpa:flash/off"} <= {r["probe_id"] for r in ran}
    for r in ran:
        assert r["peak_memory_kind"] == "cuda-allocator-peak" and r["peak_memory_bytes"] > 0
        assert 0 < r["build_s"] <= r["load_s"]


def test_several_probes_share_the_gpu_when_packed(cuda_run):
    run = json.loads((cuda_run / "run.json").read_text())
    planned_on = {k: run["env"].get(k) for k in ("cpu_count", "gpus")}
    assert run["jobs"] > 1, planned_on  # tiny-llama fits many times over: packed by memory and cores
    assert len({r["worker_pid"] for r in records(cuda_run).values() if r.get("worker_pid")}) > 1


def test_a_stable_probe_is_measured_on_its_timed_step_with_its_snapshot_on_the_gpu(cuda_run):
    forensics = records(cuda_run)["fp32/sdpa/off"]["forensics"]
    assert forensics["snapshot"]["where"] == "cuda"
    assert (forensics["measured_on"], forensics["replayed_steps"]) == ("timed step 0", 0)  # not replayed


def test_the_replay_restores_its_snapshot_on_the_gpu_and_retraces_the_timed_run(large_mlp_checkpoint, tmp_path, cli):
    """Layer 1's MLP output passes fp16's 65504 in step 0: the failing probe is replayed from its snapshot."""
    out = tmp_path / "run"
    grid = ("grid", "--model", large_mlp_checkpoint, "--axis", "dtype=fp16-amp", "--axis", "attn=sdpa")
    proc = cli(*grid, "--axis", "compile=off", "--steps", "4", "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    forensics = records(out)["fp16-amp/sdpa/off"]["forensics"]
    assert forensics["snapshot"]["where"] == "cuda"
    assert forensics["reproduced"] is True
    probe = next(p for p in summary(out)["probes"] if p["probe_id"] == "fp16-amp/sdpa/off")
    assert probe["forensics"]["origin"]["module"].startswith("model.layers.1.mlp")


def test_a_compiled_cell_pays_its_compile_once_across_runs(tmp_path, cli):
    # the host's own inductor cache settings would win over nandoctor's (slots.inductor_cache_env)
    inductor = ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE")
    env = {"NANDOCTOR_CACHE_DIR": str(tmp_path / "cache"), **dict.fromkeys(inductor)}
    grid = ("grid", "--axis", "dtype=bf16-amp", "--axis", "attn=sdpa", "--axis", "compile=inductor", "--steps", "4")
    first = cli(*grid, "--out", tmp_path / "first", env=env)
    second = cli(*grid, "--out", tmp_path / "second", env=env)
    assert first.returncode == second.returncode == 0, first.stdout + second.stdout
    assert (tmp_path / "cache" / "inductor").is_dir()
    cold, warm = (records(tmp_path / run)["bf16-amp/sdpa/inductor"]["compile_s"] for run in ("first", "second"))
    assert warm < cold  # an FX-graph and autograd cache hit

"""`nandoctor doctor --accelerate-config FILE`: an accelerate config YAML lints as the cell it trains,
with the rules `--trainer-args` uses; a bad file is one line and exit 2."""

import json

import pytest
from conftest import run_main

# As `accelerate config` (accelerate 1.15) writes an FSDP2 setup on one 8-GPU machine
FSDP_BF16 = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def doctor(tmp_path, config: str, *flags) -> tuple[int, dict]:
    path = tmp_path / "accelerate.yaml"
    path.write_text(config)
    proc = run_main("doctor", "--json", "--accelerate-config", path, *flags)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_fsdp_with_bf16_mixed_precision_lints_as_a_bf16_gradient_reduction(tmp_path):
    code, report = doctor(tmp_path, FSDP_BF16)
    assert report["setup"]["cells"] == ["bf16-amp/sdpa/off/fsdp2-reduce-low"]  # accelerate's plugin: reduce_dtype=bf16
    assert report["setup"]["world_size"] == 8 and report["setup"]["accelerate_config"].endswith("accelerate.yaml")
    assert [f["id"] for f in report["findings"]] == ["low-precision-gradient-reduction"]
    assert code == 0  # a warning


def test_fsdp_fp16_with_a_bf16_loaded_model_is_the_trainer_args_error(tmp_path):
    code, report = doctor(
        tmp_path,
        FSDP_BF16.replace("mixed_precision: bf16", "mixed_precision: fp16"),
        "--model",
        "tiny-llama",
        "--set",
        "model.dtype_on_load=bf16",
    )
    assert report["setup"]["cells"] == ["fp16-amp/sdpa/off/fsdp2-reduce-low"]
    ids = [f["id"] for f in report["findings"]]
    assert ids[0] == "bf16-weights-with-fp16-grad-scaler" and "low-precision-gradient-reduction" in ids
    assert code == 1


@pytest.mark.parametrize(
    "config, cell",
    [
        (
            "distributed_type: FSDP\nmixed_precision: 'no'\nnum_processes: 2\n",
            "fp32/sdpa/off/fsdp2",
        ),  # fp32: an fp32 reduction
        ("distributed_type: MULTI_GPU\nmixed_precision: bf16\nnum_processes: 4\n", "bf16-amp/sdpa/off/ddp"),
        ("distributed_type: MULTI_CPU\nmixed_precision: fp16\nnum_processes: 2\n", "fp16-amp/sdpa/off/ddp"),
        (
            "distributed_type: MULTI_GPU\nmixed_precision: bf16\nnum_processes: 1\n",
            "bf16-amp/sdpa/off",
        ),  # one process: no DDP
        (
            "distributed_type: NO\nmixed_precision: no\ndynamo_config:\n  dynamo_backend: INDUCTOR\n",
            "fp32/sdpa/inductor",
        ),  # YAML 1.1: NO is False
    ],
)
def test_each_setting_plans_the_cell_it_trains(tmp_path, config, cell):
    _, report = doctor(tmp_path, config)
    assert report["setup"]["cells"] == [cell]


def test_with_trainer_args_their_precision_and_the_configs_parallel_setup_plan_one_cell(tmp_path):
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"bf16": True, "fp16": False, "torch_compile": False}))
    _, report = doctor(
        tmp_path, FSDP_BF16.replace("mixed_precision: bf16", "mixed_precision: 'no'"), "--trainer-args", args
    )
    assert report["setup"]["cells"] == ["bf16-amp/sdpa/off/fsdp2-reduce-low"]
    args.write_text(
        json.dumps({"bf16": True, "fsdp": ["full_shard", "auto_wrap"]})
    )  # the Trainer's own FSDP, no config
    report = json.loads(run_main("doctor", "--json", "--trainer-args", args).stdout)
    assert report["setup"]["cells"] == ["bf16-amp/sdpa/off/fsdp2-reduce-low"]


@pytest.mark.parametrize(
    "config, says",
    [
        ("distributed_type: [FSDP\n", "not valid YAML (line 2)"),
        ("- FSDP\n", "expected a mapping of accelerate config keys"),
        (
            "distributed_type: DEEPSPEED\n",
            "distributed_type 'DEEPSPEED' is not linted; valid: NO, MULTI_CPU, MULTI_GPU, FSDP",
        ),
        ("mixed_precision: fp8\n", "mixed_precision 'fp8' is not linted; valid: no, bf16, fp16"),
        ("distributed_type: FSDP\nfsdp_config: [1]\n", "fsdp_config must be a mapping"),
        ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 3\n", "fsdp_version 3 is not valid; valid: 1, 2"),
        ("num_processes: 0\n", "num_processes must be a positive integer, got 0"),
        ("dynamo_config:\n  dynamo_backend: TVM\n", "dynamo_backend 'TVM' is not linted"),
    ],
)
def test_a_bad_config_file_is_one_line_and_exit_2(tmp_path, config, says):
    path = tmp_path / "accelerate.yaml"
    path.write_text(config)
    proc = run_main("doctor", "--accelerate-config", path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and says in proc.stderr and "Traceback" not in proc.stderr


def test_a_missing_config_file_is_one_line_and_exit_2(tmp_path):
    proc = run_main("doctor", "--accelerate-config", tmp_path / "nope.yaml")
    assert (
        proc.returncode == 2
        and proc.stderr
        == f"nandoctor: error: cannot read --accelerate-config '{tmp_path / 'nope.yaml'}': No such file or directory\n"
    )

"""model.dtype_on_load=auto, the default: a base model loaded as from_pretrained loads it by default
since transformers 5 (dtype="auto"), in the checkpoint's saved dtype. A bf16-saved checkpoint trained
with bf16=True then has no fp32 master weights, and doctor says so with the one-line fix."""

import json

import pytest
from checkpoints import save_bf16_llama, save_llama

from nandoctor.config import load_dtype, recipe_from_dict

BF16_ARGS = {"bf16": True, "fp16": False, "learning_rate": 2e-5, "torch_compile": False}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return {"bf16": save_bf16_llama(d / "bf16"), "fp32": save_llama(d / "fp32")}


def recipe(**model):
    return recipe_from_dict({"model": model}, "r")


def test_auto_loads_a_checkpoint_in_its_saved_dtype(ckpts):
    assert json.loads((ckpts["bf16"] / "config.json").read_text())["dtype"] == "bfloat16"
    assert recipe(path=str(ckpts["bf16"])).model.dtype_on_load == "auto"
    assert load_dtype(recipe(path=str(ckpts["bf16"]))) == "bf16"
    assert load_dtype(recipe(path=str(ckpts["fp32"]))) == "fp32"
    assert load_dtype(recipe(path=str(ckpts["bf16"]), dtype_on_load="fp32")) == "fp32"
    assert load_dtype(recipe(arch={"model_type": "llama"})) == "fp32"  # from_config builds fp32


def test_auto_reads_the_safetensors_where_the_config_names_no_dtype(ckpts, tmp_path):
    import shutil

    bare = shutil.copytree(ckpts["bf16"], tmp_path / "bare")
    config = json.loads((bare / "config.json").read_text())
    config.pop("dtype")
    (bare / "config.json").write_text(json.dumps(config))
    assert load_dtype(recipe(path=str(bare))) == "bf16"


def test_doctor_on_a_bf16_checkpoint_with_bf16_arguments_names_the_missing_fp32_master_weights(cli, ckpts, tmp_path):
    args = tmp_path / "args.json"
    args.write_text(json.dumps(BF16_ARGS))
    proc = cli("doctor", "--json", "--model", ckpts["bf16"], "--trainer-args", args)
    report = json.loads(proc.stdout)
    assert report["setup"]["cells"] == ["bf16-amp/sdpa/off"], proc.stderr
    found = {f["id"]: f for f in report["findings"]}
    assert "no fp32 master" in found["bf16-weights-without-fp32-master"]["title"]
    assert "dtype=torch.float32" in found["bf16-weights-without-fp32-master"]["fix"]
    for clean in (("--model", ckpts["fp32"]), ("--model", ckpts["bf16"], "--set", "model.dtype_on_load=fp32")):
        report = json.loads(cli("doctor", "--json", *clean, "--trainer-args", args).stdout)
        assert "bf16-weights-without-fp32-master" not in {f["id"] for f in report["findings"]}


@pytest.mark.slow  # probes through the CLI
def test_grid_on_a_bf16_checkpoint_trains_its_amp_cell_on_bf16_weights_and_says_so(cli, ckpts, tmp_path):
    from conftest import summary

    out = tmp_path / "grid"
    proc = cli(
        "grid", "--model", ckpts["bf16"], "--axis", "dtype=bf16-amp", "--axis", "attn=sdpa", "--axis", "compile=off",
        "--steps", "2", "--set", "retime_rounds=0", "--out", out,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    s = summary(out)
    findings = {f["id"]: f for f in s["doctor"]["findings"]}
    assert findings["bf16-weights-without-fp32-master"]["cells"] == ["bf16-amp/sdpa/off"]
    assert "dtype=torch.float32" in findings["bf16-weights-without-fp32-master"]["fix"]
    record = next(json.loads(line) for line in (out / "results.jsonl").open() if '"bf16-amp/sdpa/off"' in line)
    assert record["forensics"]["weight_dtype"] == "bfloat16", record.get("forensics")

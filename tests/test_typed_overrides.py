"""`--set` through the CLI as a user types it: a list value reaches a real probe typed by its field."""

import json

import pytest
from conftest import verdicts


@pytest.mark.slow
def test_betas_set_as_a_comma_list_train_a_grid_probe(tmp_path, cli):
    out = tmp_path / "run"
    proc = cli(
        "grid",
        "--axis",
        "dtype=fp32",
        "--axis",
        "attn=eager,sdpa",
        "--axis",
        "compile=off",
        "--steps",
        "3",
        "--set",
        "optimizer.betas=0.9,0.95",
        "--set",
        "retime_rounds=0",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert verdicts(out) == {"fp32/eager/off": "stable", "fp32/sdpa/off": "stable"}
    assert json.loads((out / "run.json").read_text())["recipe"]["optimizer"]["betas"] == [0.9, 0.95]

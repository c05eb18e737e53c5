"""The run's planning happens in a child of the first warm worker (child/plan.py, issue 20): the CLI's
own process imports neither torch nor transformers for a check, the worker's answer is the same data
the parent's own planning gives (device facts, model plan, the doctor's config facts), and a model
config that does not load is still the user's one-line error. Timings live in bench/check_speed.py."""

import dataclasses
import json

import pytest
from conftest import run_cli_noting_imports

from nandoctor.child.plan import answer
from nandoctor.config import recipe_to_dict
from nandoctor.env import collect_doctor
from nandoctor.errors import NandoctorError
from nandoctor.models import config_facts, model_type_hint, plan_model
from nandoctor.recipes import recipe_by_name
from nandoctor.run.options import RunOptions
from nandoctor.run.planner import plan_request
from nandoctor.run.session import Session

TINY = recipe_by_name("tiny-llama")
UNKNOWN_TYPE = dataclasses.replace(
    TINY, model=dataclasses.replace(TINY.model, arch={"model_type": "no-such-architecture"})
)


def test_the_planning_child_answers_what_the_parent_would_plan():
    device = collect_doctor()
    got = answer(plan_request(None, [recipe_to_dict(TINY)], 3))
    moving = ("ram_available_bytes", "cpu_matmul_cost")  # free memory and timings move between two readings
    assert {k: v for k, v in got["device"].items() if k not in moving} == {
        k: v for k, v in device.to_dict().items() if k not in moving
    }
    assert got["plans"] == [plan_model(TINY, device, 3).to_dict()]
    assert got["facts"] == config_facts(TINY)
    assert got["facts"]["all_masked_batches"] == 0 and got["facts"]["attn_softcapping"] is None


def test_a_given_device_is_planned_for_as_given():
    no_room = {"device": "cpu", "gpus": [], "ram_bytes": 1 << 20, "ram_available_bytes": 1 << 20}  # probe scale
    device = {**collect_doctor().to_dict(), **no_room}
    got = answer(
        plan_request(
            device, [recipe_to_dict(dataclasses.replace(TINY, model=dataclasses.replace(TINY.model, scale="auto")))], 3
        )
    )
    assert got["device"] == device and got["plans"][0]["scale"] == "probe"


def test_a_model_config_that_does_not_load_is_an_error_in_the_answer():
    got = answer(plan_request(None, [recipe_to_dict(UNKNOWN_TYPE)], 3))
    with pytest.raises(NandoctorError) as parent:
        plan_model(UNKNOWN_TYPE, collect_doctor(), 3)
    assert got == {"error": str(parent.value)}


def test_the_model_type_hint_needs_no_transformers(tmp_path):
    assert model_type_hint(TINY) == "llama"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    assert (
        model_type_hint(dataclasses.replace(TINY, model=dataclasses.replace(TINY.model, path=str(tmp_path), arch={})))
        == "gemma2"
    )
    assert (
        model_type_hint(dataclasses.replace(TINY, model=dataclasses.replace(TINY.model, hub_id="org/model", arch={})))
        is None
    )


@pytest.mark.slow
def test_a_warm_session_gets_its_plan_from_the_worker_and_the_users_error_unchanged(tmp_path):
    with Session("check", TINY, RunOptions(out=tmp_path / "ok", steps=1)) as session:
        session.prepare()
        assert session.plan == plan_model(TINY, session.device, 1)
        assert session.model_facts == config_facts(TINY)  # only the worker's planning gathers these
    with (
        pytest.raises(NandoctorError) as raised,
        Session("check", UNKNOWN_TYPE, RunOptions(out=tmp_path / "bad", steps=1)) as session,
    ):
        session.prepare()
    assert str(raised.value).startswith(f"model of recipe {TINY.name!r}: ")


@pytest.mark.slow
def test_the_cli_process_of_a_check_never_imports_torch_or_transformers(tmp_path):
    proc, imported = run_cli_noting_imports("check", "--model", "tiny-llama", "--out", tmp_path / "run")
    assert proc.returncode == 0 and imported == [], proc.stdout + proc.stderr
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["model_plan"]["source"] == "architecture-twin" and meta["model_plan"]["params"] == 1787008
    assert meta["env"]["torch"] and meta["doctor"]["setup"]["cells"] == ["bf16-amp/sdpa/off"]


@pytest.mark.slow
def test_the_cli_process_of_a_grid_on_the_users_rows_leaves_their_lint_to_the_worker(tmp_path):
    """The data lint reads, tokenizes and measures the rows on a model: the planning child does it, and
    its report is the one this process makes of the same rows."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [10 + (i * r) % 90 for i in range(30)]}) + "\n" for r in range(8)))
    data = ["--set", "data.source=file", "--set", f"data.path={rows}"]
    grid = ("grid", "--axis", "dtype=fp32", "--axis", "attn=eager", "--axis", "compile=off", "--steps", "2")
    proc, imported = run_cli_noting_imports(*grid, "--set", "retime_rounds=0", *data, "--out", tmp_path / "run")
    # (datasets is: readable_rows says at once which line of the file is unreadable, before any worker)
    assert proc.returncode == 0 and imported == [], proc.stdout + proc.stderr
    from nandoctor import jsonio
    from nandoctor.config import recipe_from_dict
    from nandoctor.doctor import data_lint

    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    recipe = recipe_from_dict({k: v for k, v in meta["recipe"].items() if k != "name"}, meta["recipe"]["name"])
    assert meta["data"]["measured"] and meta["data"]["batches"]
    assert meta["data"] == json.loads(jsonio.dumps(data_lint(recipe), default=str))

"""The run's planning, done where torch and transformers are already imported: a child forked by a warm
worker (worker.py; a local run's first, or the planner of a cluster run, run/planner.py) gathers the
device facts and plans the models, so that the parent never imports torch, transformers or modeling code
for it (issue 20). The parent's critical path is then the worker's one import, not two imports in turn
competing for the same cores.

The same functions run as in the parent (env.collect_doctor, models.plan_model, models.config_facts):
the facts and plans are the same data, only computed elsewhere. The parent plans itself when there is
no warm worker (--cold) or when this child does not answer.

Request (JSON file): {"device": facts or null (gather them; a cluster run's start-up jobs gathered them
on the cluster), "recipes": [recipe dicts], "steps": n}.
Result (JSON file): {"device": facts, "plans": [plan dicts], "facts": the first recipe's
models.config_facts}, or {"error": message} for the user's own error (a model config that does not
load, a bad adapter), which the parent raises as its own.

The data lint of the user's rows is measured here too (measure/lint.lint_rows: reading, tokenizing and
measuring them on a model), as a request of its own once the run is planned: {"lint": recipe dict}
gives {"data": what it measured} or {"error": message}; the parent judges it (doctor.judge_lint).
The worker, and so this child, sees the GPUs the parent was given: a worker is not pinned to a GPU
(each probe it forks sets its own).
"""

from __future__ import annotations

from pathlib import Path

from .. import jsonio
from ..config import recipe_from_dict
from ..device import DeviceFacts
from ..errors import NandoctorError


def _recipe(data: dict):
    return recipe_from_dict({k: v for k, v in data.items() if k != "name"}, data["name"])


def answer(request: dict) -> dict:
    if "lint" in request:
        return lint_answer(request["lint"])
    from ..env import collect_doctor
    from ..models import config_facts, plan_model

    device = DeviceFacts.from_dict(request["device"]) if request["device"] else collect_doctor()
    recipes = [_recipe(r) for r in request["recipes"]]
    try:
        plans = [plan_model(recipe, device, request["steps"]) for recipe in recipes]
        facts = config_facts(recipes[0])
    except NandoctorError as e:
        return {"error": str(e)}
    return {"device": device.to_dict(), "plans": [p.to_dict() for p in plans], "facts": facts}


def lint_answer(recipe: dict) -> dict:
    from ..measure.lint import lint_rows

    try:
        return {"data": lint_rows(_recipe(recipe))}
    except NandoctorError as e:
        return {"error": str(e)}


def main(request_path: str, result_path: str) -> int:
    result = answer(jsonio.loads(Path(request_path).read_text()))
    Path(result_path).write_text(jsonio.dumps(result, default=str))
    return 0

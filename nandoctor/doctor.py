"""The doctor: what this machine can run and which known issues the planned setup walks into,
before any probe runs. `run_doctor` is what `nandoctor doctor` calls; `doctor_section` is what every
grid run stores in run.json for its reports."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .capabilities import cell_support, gpu_capabilities, sdpa_backends
from .cells import Cell, reference_of
from .config import Recipe
from .device import DeviceFacts
from .env import collect_doctor
from .errors import NandoctorError
from .knowledge import SEVERITIES, evaluate, finding
from .knowledge.accelerate_config import accelerate_cell, read_accelerate_config
from .knowledge.facts import env_facts, read_trainer_args, router_setup_facts, setup_facts, trainer_cell
from .models import config_facts, model_config, plan_model
from .plan import plan_grid
from .userdata.tokenizer import load_tokenizer, tokenizer_of


def planned_findings(
    env: DeviceFacts,
    recipe: Recipe,
    cells: list[Cell],
    trainer_args: dict | None = None,
    tokenizer=None,
    known: dict | None = None,
    lint: dict | None = None,
) -> list[dict]:
    """Every rule that fires on some planned cell, once, with the cells it fires on. known: the
    recipe's models.config_facts when already gathered; lint: the data lint of the recipe's rows."""
    known = known or config_facts(recipe)
    recipe_facts = {**env_facts(env), "all_masked_batches": masked_batches(recipe, known, lint)}
    fired: dict[str, tuple] = {}
    for cell in cells:
        eager = dataclasses.replace(cell, compile="off") in cells
        facts = {
            **recipe_facts,
            **setup_facts(recipe, cell, None, trainer_args, tokenizer, eager_baseline=eager),
            "attn_softcapping": known["attn_softcapping"],
            "tied_embeddings": known.get("tied_embeddings"),
            "model_type": known.get("model_type"),
            **router_setup_facts(known.get("router")),
        }
        for rule in evaluate(facts, "setup"):
            fired.setdefault(rule.id, (rule, []))[1].append(cell.id)
    ordered = sorted(fired.values(), key=lambda pair: SEVERITIES.index(pair[0].severity))
    return [{**finding(rule, ids), "scope": finding_scope(ids, cells)} for rule, ids in ordered]


def masked_batches(recipe: Recipe, known: dict, lint: dict | None) -> int | None:
    """How many of the batches a probe cycles through have no loss term: config_facts' count for the
    synthetic stream; for the user's rows the data lint's, on the batches it chose (the ones a probe trains
    on), else counted here on the whole stream."""
    if known.get("all_masked_batches") is not None or recipe.data.source != "file":
        return known.get("all_masked_batches")
    if lint and lint.get("batches") is not None:
        return sum(b.get("supervised") == 0 for b in lint["batches"])
    from .data import all_masked_batches

    return all_masked_batches(recipe, model_config(recipe))


def finding_scope(fired_on: list[str], cells: list[Cell]) -> str:
    """'setup' when a rule fires on every planned cell (the user's recipe, model or environment walks
    into it whatever the grid chooses), 'grid' when it fires on some cells only (what the grid will find).
    The fp32 reference the grid always adds is not the user's choice and does not count."""
    chosen = {c.id for c in cells if c != reference_of(c)} or {c.id for c in cells}
    return "setup" if chosen <= set(fired_on) else "grid"


def doctor_section(
    env: DeviceFacts | dict,
    recipe: Recipe | None = None,
    cells: list[Cell] | None = None,
    trainer_args: dict | None = None,
    tokenizer=None,
    setup: dict | None = None,
    known: dict | None = None,
    lint: dict | None = None,
) -> dict:
    """Capabilities and findings: for the environment alone, or for a recipe's planned cells (known:
    the recipe's models.config_facts, when a Session's planning already gathered them; lint: the data
    lint of the recipe's rows)."""
    env = DeviceFacts.of(env)
    if recipe is None:
        findings = [finding(rule) for rule in evaluate(env_facts(env), "environment")]
    else:
        findings = planned_findings(env, recipe, cells or [], trainer_args, tokenizer, known, lint)
    return {
        "capabilities": gpu_capabilities(env),
        "sdpa_backends": sdpa_backends(env),
        "setup": setup,
        "findings": findings,
    }


def run_doctor(
    recipe: Recipe | None = None,
    trainer_args_path: str | None = None,
    tokenizer_path: str | None = None,
    attn: str = "sdpa",
    axes: dict | None = None,
    env: DeviceFacts | dict | None = None,
    accelerate_config_path: str | None = None,
) -> dict:
    """The doctor report as data: environment, capabilities and, when a recipe, a TrainingArguments
    JSON or an accelerate config file is given, the findings for that planned setup. Either file plans
    one cell (precision, compile and, from the accelerate config or TrainingArguments `fsdp`, the
    parallel setup; with `attn`); a recipe alone plans the cells `grid` would run. A recipe with
    data.path adds the data lint (userdata/lint.py) as `data`, its findings among the others. The
    environment is the facts as JSON data (DeviceFacts.to_dict), as the report is written."""
    env = DeviceFacts.of(env) or collect_doctor()
    trainer_args = read_trainer_args(trainer_args_path) if trainer_args_path else None
    accelerate = read_accelerate_config(accelerate_config_path) if accelerate_config_path else None
    if recipe is None and trainer_args is None and accelerate is None:
        if tokenizer_path:
            raise NandoctorError(
                "--tokenizer is checked as part of a planned setup; "
                "add --model, --recipe, --trainer-args or --accelerate-config"
            )
        return {"environment": env.to_dict(), **doctor_section(env)}
    probed = _probed(recipe, env) if recipe is not None else None
    recipe = recipe or Recipe()
    tokenizer_path = tokenizer_path or tokenizer_of(recipe)
    tokenizer = load_tokenizer(tokenizer_path, recipe.model.trust_remote_code) if tokenizer_path else None
    if trainer_args is not None:
        cells = [trainer_cell(trainer_args, attn, accelerate)]
    elif accelerate is not None:
        cells = [accelerate_cell(accelerate, attn)]
    else:
        cells = [p.cell for p in plan_grid(recipe, env, axes) if not p.unsupported]
    if accelerate is not None and cells[0].parallel != "none":
        recipe = dataclasses.replace(recipe, world_size=accelerate["num_processes"])
    reasons = {c.id: cell_support(c, env) for c in cells}
    known = config_facts(recipe)
    setup = {
        "recipe": recipe.name,
        "cells": [c.id for c in cells],
        "unsupported": {cell: why for cell, why in reasons.items() if why},
        "trainer_args": str(Path(trainer_args_path)) if trainer_args_path else None,
        "accelerate_config": str(Path(accelerate_config_path)) if accelerate_config_path else None,
        "world_size": recipe.world_size if any(c.parallel != "none" for c in cells) else None,
        "tokenizer": str(tokenizer_path) if tokenizer_path else None,
        "router": known.get("router"),  # a mixture of experts' routing as configured (models.router_facts)
        "probed": probed,
    }
    if recipe.data.source != "file":
        return {
            "environment": env.to_dict(),
            **doctor_section(env, recipe, cells, trainer_args, tokenizer, setup, known),
        }
    data = data_lint(recipe, attn, tokenizer)
    setup["data"] = recipe.data.path
    section = doctor_section(env, recipe, cells, trainer_args, tokenizer, setup, known, data)
    return {
        "environment": env.to_dict(),
        **section,
        "findings": data["findings"] + section["findings"],
        "data": data,
    }


def _probed(recipe: Recipe, env: DeviceFacts) -> dict:
    """What `grid` would probe for this recipe on this machine (models.plan_model): the model, why, and
    what makes it a stand-in for the named one (None when it is not one)."""
    plan = plan_model(recipe, env)
    return {"model": plan.describe(), "why": plan.why, "stand_in": plan.stand_in()}


def data_lint(recipe: Recipe, attn: str = "sdpa", tokenizer=None, model=None) -> dict | None:
    """The data and setup lint of the recipe's rows (the Data section of the reports, run.json's
    "data"), measured here (measure/lint.lint_rows) and judged (judge_lint); None when the recipe trains
    on the synthetic stream. `nandoctor doctor --data` runs it; grid, check and bisect measure in their
    warm worker's planning child (Session.lint) and judge here."""
    from .measure.lint import lint_rows

    return judge_lint(lint_rows(recipe, attn, tokenizer, model))


def judge_lint(measured: dict | None) -> dict | None:
    """The data lint's report from what lint_rows measured: the measured checks judged by the rules the
    probes are judged by (verdicts.setup_judged), and the findings (the data rules of knowledge/rules.yaml) that fire on
    every figure."""
    if measured is None:
        return None
    from .analysis.verdicts import setup_judged
    from .userdata.lint import findings

    facts = {**measured["facts"], **measured["report"]["measured"]}
    facts.update(setup_judged(measured["report"]["measured"]))
    report = {k: v for k, v in measured["report"].items() if k != "assistant_mask"}
    report["findings"] = findings(facts)
    if "assistant_mask" in measured["report"]:
        report["assistant_mask"] = measured["report"]["assistant_mask"]
    return report


def lint_lines(data: dict | None) -> list[str]:
    """The lint's errors and warnings, one line each, for a run to print before its first probe; and the
    measurements it could not make, since the model returns no loss."""
    no_loss = ((data or {}).get("measured") or {}).get("no_loss")
    return [
        f"the data lint found {'an error' if f['severity'] == 'error' else 'a warning'} ({f['id']}): {f['figure']}"
        for f in (data or {}).get("findings") or []
        if f["severity"] in ("error", "warning")
    ] + ([f"the data lint could not measure the checks that train on the loss: {no_loss}"] if no_loss else [])


def exit_code(report: dict) -> int:
    """1 when a finding of severity error is the user's own (setup or environment), else 0, so that CI
    can gate on `nandoctor doctor`. An error that only some grid cells walk into (fp16-pure with eps 1e-8)
    is what the grid will find, not a problem of the setup."""
    return 1 if any(f["severity"] == "error" and f.get("scope", "setup") == "setup" for f in report["findings"]) else 0

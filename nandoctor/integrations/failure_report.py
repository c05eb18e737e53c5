"""The report of a live run's failure, written into the run's output directory (`REPORT_DIR`): the
recipe that reproduces the failing step as probes (recipe.yaml, and the `nandoctor bisect` command
that takes it), then the run as one probe record through the reports of report/.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import yaml

from ..analysis.outcomes import analyze_records
from ..cells import Cell
from ..config import Recipe, recipe_to_dict
from ..device import DeviceFacts
from ..models import shape_of
from ..record import ModelPlan, ProbeRecord, Step
from ..report import write_reports
from .live import LiveRun

REPORT_DIR = "nandoctor"  # under the run's output directory


def write_recipe(report_dir: Path, recipe: Recipe, cell: Cell) -> str:
    """Write `recipe` to report_dir/recipe.yaml; returns the bisect command that reproduces `cell` with it."""
    recipe_path = report_dir / "recipe.yaml"
    data = {k: v for k, v in recipe_to_dict(recipe).items() if k != "name"}
    recipe_path.write_text(yaml.safe_dump(_plain(data), sort_keys=False))
    return shlex.join(
        [
            "nandoctor",
            "bisect",
            "--recipe",
            str(recipe_path),
            "--bad",
            f"dtype={cell.dtype},attn={cell.attn},compile={cell.compile}",
        ]
    )


def write_report(
    report_dir: Path,
    run: LiveRun,
    recipe: Recipe,
    steps: list[Step],
    forensics: dict | None,
    *,
    device: DeviceFacts,
    findings: list[dict],
    bisect_command: str,
    setup_checks: dict | None = None,
) -> None:
    """Write the reports of report/ into report_dir for a live run stopped at a failure: its judged
    `steps` and the replay's `forensics` (None when the step was not replayed) as one probe record of
    `recipe`, with the `device` facts, the knowledge `findings` on its setup, the bisect command and the
    figures of its step-0 `setup_checks` (judged as a probe's)."""
    config = run.model.config
    params = sum(p.numel() for p in run.model.parameters())
    trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    plan = ModelPlan(
        "live-run",
        "full",
        config.model_type,
        params,
        params,
        trainable,
        recipe.model.path,
        f"the model of this {run.framework} run, watched in process",
        shape_of(config),
    )
    meta = {
        "kind": "watch",
        "run_id": f"{run.framework}-{run.output_dir.name}",
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": shlex.join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "recipe": recipe_to_dict(recipe),
        "model_plan": plan.to_dict(),
        "steps": len(steps),
        "seed": recipe.seed,
        "jobs": 1,
        "env": device,
        "planned": 1,
        "doctor": {
            "capabilities": [],
            "setup": {"recipe": recipe.name, "cells": [run.cell.id]},
            "findings": findings,
        },
        "run_dir": str(report_dir),
        "bisect_command": bisect_command,
    }
    record = ProbeRecord(
        run.cell.id,
        run.cell,
        "ok",
        steps=steps,
        seed=recipe.seed,
        recipe=recipe_to_dict(recipe),
        forensics=forensics,
        setup_checks=setup_checks,
    )
    write_reports(analyze_records(meta, [record]), report_dir)


def _plain(data):
    """Tuples as lists, so that yaml.safe_dump writes the recipe as recipes/*.yaml are written."""
    if isinstance(data, dict):
        return {k: _plain(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_plain(v) for v in data]
    return data

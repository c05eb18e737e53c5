"""A grid's recommendation as code to paste: the `nandoctor check` command line, then the
TrainingArguments, from_pretrained, Lightning and plain PyTorch lines (recommend.recommendation, the
code a bisection's report prints too), per kind of hardware when the grid has a hardware axis."""

from __future__ import annotations

from ..analysis.outcomes import RunAnalysis
from ..config import recipe_from_dict
from ..errors import NandoctorError
from ..recommend import model_flags_of, recommendation


def grid_recommendations(a: RunAnalysis) -> list[tuple[str, dict]]:
    """(kind of hardware, recommend.recommendation dict) per recommended configuration of a grid: one
    (hardware ""), or one per kind of hardware; [] for another kind of run, or a recipe this version
    cannot read back."""
    if a.meta.kind != "grid":
        return []
    data = a.meta.recipe or {}
    try:
        recipe = recipe_from_dict({k: v for k, v in data.items() if k != "name"}, data.get("name", ""))
    except NandoctorError:
        return []
    flags = model_flags_of(a.meta.command or "", recipe)
    chosen = [(h, a.recommended_on(h)) for h in a.hardware] if a.hardware else [("", a.recommended)]
    return [
        (
            h,
            recommendation(
                o.record.cell.anywhere.to_dict(), recipe, recipe, flags, a.meta.data, o.record.moe, o.record.device
            ),
        )
        for h, o in chosen
        if o is not None
    ]


def title(hardware: str) -> str:
    return f"Train with it on {hardware}" if hardware else "Train with it"


def code_lines(rec: dict) -> list[str]:
    """The command line, then the Python lines."""
    return [rec["command"], *rec["python"]]

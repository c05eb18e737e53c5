"""Which fp32 curve each probe is judged against (References, Reference), and its fidelity to it."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

from ...cells import REFERENCE_CELL, reference_of
from ...config import recipe_from_dict, recipe_to_dict, with_load_dtype_resolved
from ...errors import NandoctorError
from ...record import ProbeRecord, Step
from .classify import classify
from .moe import route_flips
from .table import STABLE, Verdict


def is_reference(record: ProbeRecord) -> bool:
    return record.cell == reference_of(record.cell)


def reference_key(record: ProbeRecord) -> str:
    """Drift is judged against the reference of the same recipe variant and seed, on the same kind of
    hardware (Cell.hardware: fp32 itself differs between GPUs). The recipe is read
    back with today's defaults, so that a record written before a recipe section existed (fp8) meets
    the reference a resumed run writes now."""
    recipe = with_load_dtype_resolved(read_back(json.dumps(record.recipe, sort_keys=True, default=str)))
    same = [recipe, record.seed] + ([record.cell.hardware] if record.cell.hardware else [])
    same += [record.cell.quant] if record.cell.quant != "none" else []  # a quantized base has its own reference
    return json.dumps(same, sort_keys=True, default=str)


@functools.lru_cache(maxsize=64)
def read_back(recipe_json: str) -> dict:
    """A record's recipe (as JSON) read back with today's defaults; as written when this version cannot
    read it (a newer one's). Cached: every probe of a run has one of a few recipes, and reference_key
    is asked for each probe many times per analysis (the round trip is most of a tiny grid's analysis).
    The dict is shared: not to be changed."""
    recipe = json.loads(recipe_json)
    try:
        return recipe_to_dict(
            recipe_from_dict({k: v for k, v in recipe.items() if k != "name"}, recipe.get("name", ""))
        )
    except NandoctorError:
        return recipe


@dataclass(frozen=True)
class Reference:
    """The fp32 curve one recipe variant's probes are judged against, or why there is none.
    probe_id: the probe whose steps these are (None: no fp32 probe trained stably); stands_in: it is
    another fp32 cell, since fp32/eager did not train stably (`why`)."""

    probe_id: str | None
    steps: list[Step] | None
    stands_in: bool = False
    why: str = ""
    hardware: str = ""

    def sentence(self) -> str | None:
        """What the reports say first about it: None for fp32/eager itself."""
        on = f" on {self.hardware}" if self.hardware else ""
        if self.probe_id is None:
            return (
                f"Drift was not judged{on}: {self.why}, and no other fp32 probe trained stably, so no probe's "
                "fidelity to fp32 is known and a stable verdict says only that its curve did not break."
            )
        if self.stands_in:
            return f"Drift was judged{on} against {self.probe_id}, standing in for the fp32 reference: {self.why}."
        return None


def without_reference(v: Verdict, cell) -> Verdict:
    """A verdict reached with no fp32 curve to compare with (a `check` of one cell, a live run a callback
    watches): a stable one of a cell not computed in fp32 says that its drift from fp32 was not judged,
    rather than passing for judged."""
    if v.name != STABLE or cell.precision.compute == "float32":
        return v
    return Verdict(v.name, f"{v.reason}; drift from fp32 not judged: no fp32 reference (`nandoctor grid` probes one)")


def stand_in_order(record: ProbeRecord) -> tuple:
    """Which fp32 probe stands in for a failed fp32/eager first: compile off, then SDPA's default kernel."""
    return record.cell.compile != REFERENCE_CELL.compile, record.cell.attn != "sdpa", record.probe_id


class References:
    """The one place where a probe meets its fp32 reference: the steps of the stable fp32/eager probe
    of the same recipe variant and seed, or, when that one did not train stably (out of memory, timed
    out, ...), of another stable one-process fp32 probe of them (`Reference.stands_in`), or none, said
    once (`notes`). Learn the probes first, then judge any probe."""

    def __init__(self):
        self.primary: dict[str, ProbeRecord] = {}  # reference key -> its fp32/eager probe (a stable one first)
        self.candidates: dict[str, list[ProbeRecord]] = {}  # reference key -> other one-process fp32 probes
        self.keys: dict[str, str] = {}  # reference key -> its hardware, for every probe learnt
        self.singles: dict[tuple, list[Step]] = {}  # (reference key, cell id) -> a one-process probe's steps
        self.chosen: dict[str, Reference] = {}
        self.routes: dict[str, list] = {}  # probe id -> a mixture of experts probe's step-0 expert choices

    def learn(self, record: ProbeRecord) -> None:
        key = reference_key(record)
        self.keys.setdefault(key, record.cell.hardware)
        self.chosen.pop(key, None)
        if record.cell.parallel == "none" and record.status == "ok" and record.steps:
            self.singles[(key, record.cell.id)] = record.steps
        if (record.moe or {}).get("step0_choices"):
            self.routes[record.probe_id] = record.moe["step0_choices"]
        if is_reference(record):
            if key not in self.primary or not _trains(self.primary[key]):
                self.primary[key] = record
        elif (
            record.cell.dtype == (base := reference_of(record.cell)).dtype
            and record.cell.parallel == base.parallel
            and record.cell.optimizer == base.optimizer
        ):
            self.candidates.setdefault(key, []).append(record)

    def reference(self, record: ProbeRecord) -> Reference:
        """The reference this probe's recipe variant is judged against."""
        key = reference_key(record)
        if key not in self.chosen:
            self.chosen[key] = self._choose(key, record.cell.hardware)
        return self.chosen[key]

    def _choose(self, key: str, hardware: str) -> Reference:
        primary = self.primary.get(key)
        if primary is not None and _trains(primary):
            return Reference(primary.probe_id, primary.steps, hardware=hardware)
        if primary is None:
            why = f"the fp32 reference {REFERENCE_CELL.id} did not run"
        else:
            v = classify(primary)
            at = f" at step {v.step}" if v.step is not None else ""
            why = f"the fp32 reference {primary.probe_id} ended {v.name}{at} ({_clause(v.reason)})"
        stand_in = min(filter(_trains, self.candidates.get(key, [])), key=stand_in_order, default=None)
        if stand_in is None:
            return Reference(None, None, why=why, hardware=hardware)
        return Reference(stand_in.probe_id, stand_in.steps, stands_in=True, why=why, hardware=hardware)

    def notes(self) -> list[Reference]:
        """The references that are not fp32/eager's (a stand-in, or none), one per recipe variant."""
        out = []
        for key, hardware in self.keys.items():
            if key not in self.chosen:
                self.chosen[key] = self._choose(key, hardware)
            if self.chosen[key].sentence():
                out.append(self.chosen[key])
        return out

    def knows(self, record: ProbeRecord) -> bool:
        """Whether the fp32/eager reference of this probe has run (stable or not)."""
        return reference_key(record) in self.primary

    def is_own(self, record: ProbeRecord) -> bool:
        """Whether this probe is the reference of its recipe variant (fp32/eager, or its stand-in)."""
        return is_reference(record) or self.reference(record).probe_id == record.probe_id

    def of(self, record: ProbeRecord) -> list[Step] | None:
        """The reference curve this probe is judged against; None for a reference itself, or when no
        fp32 probe of its recipe variant trained stably."""
        return None if self.is_own(record) else self.reference(record).steps

    def exact(self, record: ProbeRecord) -> list[Step] | None:
        """A parallel probe's exact reference: the one-process probe of the same cell, recipe and seed,
        which trains the same global batch; None for a one-process probe or when that one has not run."""
        if record.cell.parallel == "none":
            return None
        return self.singles.get((reference_key(record), record.cell.single.id))

    def routes_of(self, record: ProbeRecord) -> list | None:
        """The step-0 token -> expert choices of this probe's reference (a mixture of experts), else None."""
        return None if self.is_own(record) else self.routes.get(self.reference(record).probe_id)

    def flips(self, record: ProbeRecord) -> float | None:
        """The share of this probe's step-0 expert choices that differ from its reference's (route_flips)."""
        return route_flips((record.moe or {}).get("step0_choices"), self.routes_of(record))

    def judge(self, record: ProbeRecord) -> Verdict:
        ref = self.reference(record)
        return classify(
            record, self.of(record), against=ref.probe_id if ref.stands_in else "", routes=self.routes_of(record)
        )

    def fidelity(self, record: ProbeRecord, verdict: Verdict) -> float | None:
        if self.is_own(record) and verdict.name == STABLE:
            return 0.0
        return fidelity(record.steps, self.of(record))


def _clause(reason: str, most: int = 160) -> str:
    """A verdict's reason cut to its first clause and to `most` characters, at a word."""
    first = reason.split("; ")[0]
    return first if len(first) <= most else first[:most].rsplit(" ", 1)[0] + " ..."


def _trains(record: ProbeRecord) -> bool:
    """A probe whose curve can be a reference: it finished and is stable on its own."""
    return record.status == "ok" and bool(record.steps) and classify(record).name == STABLE


def fidelity(steps: list[Step], reference: list[Step] | None) -> float | None:
    """Mean relative loss error against the fp32 reference over their common steps (0 = identical)."""
    errors = [point["loss"] for point in fidelity_curve(steps, reference)]
    if not errors or None in errors:
        return None
    return sum(errors) / len(errors)


def _rel(a: float, b: float) -> float | None:
    return abs(a - b) / abs(b) if math.isfinite(a) and math.isfinite(b) and b != 0 else None


def fidelity_curve(steps: list[Step], reference: list[Step] | None) -> list[dict]:
    """Per common step: relative loss and grad-norm error against the fp32 reference (None where
    either value is non-finite). A GradScaler-skipped step still has a loss, so it still counts."""
    return [
        {"step": a.step, "loss": _rel(a.loss, b.loss), "grad_norm": _rel(a.grad_norm, b.grad_norm)}
        for a, b in zip(steps, reference or [])
    ]

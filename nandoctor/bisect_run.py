"""`nandoctor bisect` as an API: parse the good and bad configurations, run the bisection engine with
real probes (each in its own process through the Session / ProbeRunner), write bisect.json next to
results.jsonl and render the reports.

A configuration is a mapping factor -> value: the three grid axes plus any dotted recipe field.
"""
from __future__ import annotations

import itertools
import re

from .analysis import RunAnalysis, is_reference, reference_key, reference_steps
from .api import Session, render_run
from .bisect import Bisection, BisectResult, Run, Trial
from .capabilities import cell_support
from .config import AXES, REFERENCE_CELL, Cell, NandoctorError, Recipe, dotted_fields, get_field, parse_axis_values, set_field
from .env import collect_summary
from .plan import PlannedProbe
from .ranking import tokens_per_s
from .store import BISECT_FILE
from .training_args import recommendation
from .verdicts import STABLE, UNSUPPORTED, classify

BASELINE_AXES = {"dtype": REFERENCE_CELL.dtype, "attn": REFERENCE_CELL.attn, "compile": REFERENCE_CELL.compile}
# What a user would like to train with, fastest first: lowest precision, fused attention, compile on.
# The default target is the first combination the device supports (capabilities.cell_support).
FASTEST_FIRST = {
    "dtype": ("bf16-pure", "fp16-pure", "bf16-amp", "fp16-amp", "tf32", "fp32"),
    "attn": ("sdpa:flash", "sdpa:cudnn", "flash_attention_2", "sdpa:efficient", "sdpa", "eager"),
    "compile": ("inductor", "aot_eager", "off"),
}


def fastest_cell(device: dict) -> Cell:
    for dtype, attn, compile_ in itertools.product(*FASTEST_FIRST.values()):
        cell = Cell(dtype, attn, compile_)
        if cell_support(cell, device) is None:
            return cell
    return REFERENCE_CELL


def parse_assignments(text: str, flag: str) -> dict[str, str]:
    """'dtype=bf16-pure,optimizer.eps=1e-8' -> {'dtype': 'bf16-pure', 'optimizer.eps': '1e-8'}. A comma
    starts a new assignment only when NAME= follows, so tuple values like q_proj,v_proj survive."""
    out = {}
    for item in re.split(r",(?=\s*[A-Za-z_][\w.]*\s*=)", text):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise NandoctorError(f"bad {flag} {item!r}: expected NAME=VALUE[,NAME=VALUE], e.g. dtype=bf16-pure,optimizer.eps=1e-8")
        out[name.strip()] = value.strip()
    return out


def typed_value(recipe: Recipe, name: str, value: str, flag: str):
    """An axis value checked against its axis, or a recipe field typed like its default."""
    if name in AXES:
        if "," in value:
            raise NandoctorError(f"{flag}: {name} takes one value, got {value!r}")
        return parse_axis_values(name, [value])[0]
    try:
        return get_field(set_field(recipe, name, value).validate(), name)
    except NandoctorError as e:
        if name not in dotted_fields():
            raise NandoctorError(f"{flag}: unknown factor {name!r}; valid: {', '.join(AXES)} or a recipe field "
                                 f"({', '.join(dotted_fields())})") from None
        raise NandoctorError(f"{flag}: {e}") from None


def parse_configurations(recipe: Recipe, device: dict, good: str | None, bad: str | None,
                         factors: list[str]) -> tuple[dict, dict]:
    """(good, bad) as full configurations. The baseline defaults to fp32/eager/off with the recipe's
    own fields; the target to the baseline with the given --bad values, or to the fastest cell the
    device supports when --bad is absent. --factor NAME=VALUE adds one more target value. Only the
    values that differ between the two are factors of the search."""
    good_set = {k: typed_value(recipe, k, v, "--good") for k, v in parse_assignments(good, "--good").items()} if good else {}
    bad_set = {k: typed_value(recipe, k, v, "--bad") for k, v in parse_assignments(bad, "--bad").items()} if bad else \
        {"dtype": (c := fastest_cell(device)).dtype, "attn": c.attn, "compile": c.compile}
    for item in factors:
        bad_set.update({k: typed_value(recipe, k, v, "--factor") for k, v in parse_assignments(item, "--factor").items()})
    fields = [k for k in {**good_set, **bad_set} if k not in AXES]
    good_cfg = {**BASELINE_AXES, **{k: get_field(recipe, k) for k in fields}, **good_set}
    bad_cfg = {**good_cfg, **bad_set}
    if bad_cfg == good_cfg:  # a value equal in both is not a factor; with none left there is nothing to search
        raise NandoctorError(f"the target and the baseline are the same configuration ({', '.join(f'{k}={v}' for k, v in bad_set.items())}); "
                             "give --bad / --factor values that differ from the baseline")
    for label, cfg in (("target", bad_cfg), ("baseline", good_cfg)):
        variant(recipe, cfg)  # every combination is validated when it is probed; fail early on these two
        why = cell_support(cell_of(cfg), device)
        if why:
            raise NandoctorError(f"the {label} {cell_of(cfg).id} cannot run on this device: {why}")
    return good_cfg, bad_cfg


def cell_of(config: dict) -> Cell:
    return Cell(config["dtype"], config["attn"], config["compile"])


def variant(recipe: Recipe, config: dict) -> Recipe:
    for name, value in config.items():
        if name not in AXES:
            recipe = set_field(recipe, name, value)
    return recipe.validate()


def fmt_value(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


class ProbeOracle:
    """The bisection's oracle: runs each trial as a real probe process, and before trusting a stable
    verdict runs the fp32/eager reference of the same recipe variant and seed, since drift is
    measured against it. Records are cached by probe id, which names the full configuration."""

    def __init__(self, session: Session, recipe: Recipe):
        self.session, self.recipe = session, recipe
        self.records: dict[str, dict] = {}
        self.references: dict[str, list | None] = {}  # reference key -> steps of a stable reference, else None

    def planned(self, trial: Trial) -> PlannedProbe:
        cell = cell_of(trial.config)
        own = variant(self.recipe, trial.config)
        overrides = {k: v for k, v in trial.config.items() if k not in AXES and v != get_field(self.recipe, k)}
        probe_id = cell.id + "".join(f" {k}={fmt_value(v)}" for k, v in overrides.items())
        probe_id += (f" seed+{trial.seed}" if trial.seed else "") + (f" rerun{trial.attempt}" if trial.attempt else "")
        return PlannedProbe(probe_id, cell, cell_support(cell, self.session.device), cell == REFERENCE_CELL,
                            {k: fmt_value(v) for k, v in overrides.items()}, trial.seed, own)

    def _run(self, probes: list[PlannedProbe]) -> None:
        todo = [p for p in probes if p.probe_id not in self.records]
        for record in self.session.run(self.recipe, todo) if todo else []:
            self.records[record["probe_id"]] = record
            if is_reference(record):
                self.references[reference_key(record)] = reference_steps(record)

    def __call__(self, trials: list[Trial]) -> list[Run]:
        probes = [self.planned(t) for t in trials]
        self._run(probes)
        needed = {}
        for t, p in zip(trials, probes):
            r = self.records[p.probe_id]
            if not is_reference(r) and reference_key(r) not in self.references and classify(r).name == STABLE:
                ref = Trial({**t.config, **BASELINE_AXES}, t.seed, 0)
                needed[self.planned(ref).probe_id] = self.planned(ref)
        self._run(list(needed.values()))
        return [self._outcome(self.records[p.probe_id]) for p in probes]

    def _outcome(self, record: dict) -> Run:
        ref = None if is_reference(record) else self.references.get(reference_key(record))
        v = classify(record, ref)
        return Run(record["probe_id"], v.name, v.failed, v.name != UNSUPPORTED, tokens_per_s(record.get("steps") or []))


def run_bisect(recipe: Recipe, good: str | None = None, bad: str | None = None, factors: list[str] | None = None,
               reruns: int = 1, data_seeds: int = 0, steps: int | None = None, jobs: int | None = None, out=None,
               model_flags: list[str] | None = None, progress=None, on_step=None,
               device: dict | None = None) -> tuple[RunAnalysis, BisectResult]:
    """Bisect between a good and a bad configuration with real probes; returns the analysis of the
    run directory (reports written) and the bisection result (also saved as bisect.json)."""
    if reruns < 0 or data_seeds < 0:
        raise NandoctorError(f"--reruns and --data-seeds must be >= 0, got {reruns} and {data_seeds}")
    device = device or collect_summary()
    good_cfg, bad_cfg = parse_configurations(recipe, device, good, bad, factors or [])  # before any model work
    with Session("bisect", recipe, out, jobs, steps, device, progress) as session:
        session.start(0, {"good": good_cfg, "bad": bad_cfg, "reruns": reruns, "data_seeds": data_seeds})
        oracle = ProbeOracle(session, recipe)
        result = Bisection(good_cfg, bad_cfg, oracle, reruns, data_seeds, session.jobs, on_step).run()
    result.probes = len(oracle.records)  # processes actually run, references for drift included
    data = result.to_dict()
    if result.recommended is not None:
        data["recommendation"] = recommendation(result.recommended, variant(recipe, result.recommended),
                                                recipe, model_flags or [])
    session.store.write_json(BISECT_FILE, data)
    return render_run(session.dir), result

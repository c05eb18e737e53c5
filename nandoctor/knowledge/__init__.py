"""The knowledge base: the one rule table and the crash signatures, as data (rules.yaml, signatures.yaml),
and the small pure logic that matches them against facts or exception text. Every rule (environment,
setup, data, probe and live) is a `Rule` of rules.yaml, read by `rules`, with the scopes it is judged in.

Imports nothing from nandoctor, so that verdicts can diagnose a crash without pulling in torch.
Fact gathering lives in knowledge/facts.py.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
# libyaml's parser where PyYAML was built with it: the same documents, parsed 5-10x faster than in Python
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
SEVERITIES = ("error", "warning", "advice")
# Where a rule is judged, and on what: `environment`, the device alone (`nandoctor doctor` without a
# recipe); `setup`, the planned setup on it (facts.py: the doctor's planned cells, the callbacks' setup
# check); `data`, the data lint's figures on the user's rows and model (userdata/lint.py; the rule's
# `figure` says them); `probe`, what a probe's record showed (facts.observed_facts,
# analysis/verdicts.judged_facts); `live`, the callbacks' lint of the trainer's first batches
# (integrations/setup_lint.LIVE_RULES says their figure).
SCOPES = ("environment", "setup", "data", "probe", "live")
# the ids of rules merged into another, as older run directories name them: read as the kept id
RENAMED = {
    "packed-segments-not-isolated": "packing-leaks-across-segments",
    "accumulation-not-token-normalised": "accumulation-normalised-per-micro-batch",
    "trainable-group-gets-no-gradient": "trainable-group-without-gradient",
}
OWN_SOURCES = ("tests/", "nandoctor/", "bench/")  # the project's own files verify a rule; they are not its evidence
OPERATORS = {
    "eq": lambda fact, v: fact == v,
    "ne": lambda fact, v: fact is not None and fact != v,
    "in": lambda fact, v: fact in v,
    "lt": lambda fact, v: fact is not None and fact < v,
    "le": lambda fact, v: fact is not None and fact <= v,
    "gt": lambda fact, v: fact is not None and fact > v,
    "ge": lambda fact, v: fact is not None and fact >= v,
}


def holds(when: dict, facts: dict) -> bool:
    """Whether every condition of a rule's `when` holds on `facts`: {fact: value} is {fact: {eq: value}},
    else {fact: {operator: value, ...}} (OPERATORS). An unknown fact (absent or None) fails every
    comparison and holds only for `eq: null` or an `in` list that contains None. The one rule matcher:
    the known-issue rules, the data lint's rules and the training callbacks' live rules match here."""
    for name, condition in when.items():
        fact = facts.get(name)
        ops = condition if isinstance(condition, dict) else {"eq": condition}
        if not all(OPERATORS[op](fact, value) for op, value in ops.items()):
            return False
    return True


@dataclass(frozen=True)
class Rule:
    """One row of rules.yaml: a known issue, the condition (`when`) on the facts or figures of the places
    it is judged (`scope`, SCOPES) under which it fires, and what to say when it does."""

    id: str
    scope: tuple  # where it is judged: some of SCOPES
    severity: str
    title: str
    when: dict
    why: str
    fix: str
    evidence: tuple  # public sources: issues, documentation, papers, upstream code
    verified_by: tuple = ()  # where nandoctor itself reproduces it (its own tests and tables): not evidence
    figure: str | None = None  # the data lint's measured sentence, formatted from its figures

    def matches(self, facts: dict) -> bool:
        return holds(self.when, facts)


@dataclass(frozen=True)
class Signature:
    id: str
    rule: str | None
    pattern: str
    diagnosis: str
    fix: str
    evidence: str
    verdict: str | None = None  # a verdict other than crash this failure stands for (unsupported, oom)
    explained_by: str | None = None  # a pattern picking, from the warnings the probe emitted, those that say why


def _load(name: str) -> list[dict]:
    return yaml.load((HERE / name).read_text(), Loader=SafeLoader)


def _rule(entry: dict) -> Rule:
    scope = entry.get("scope")
    rule = Rule(
        **{
            **entry,
            "scope": tuple(scope) if isinstance(scope, list) else (scope,),
            "evidence": tuple(entry["evidence"]),
            "verified_by": tuple(entry.get("verified_by") or ()),
        }
    )
    unknown = [op for c in rule.when.values() if isinstance(c, dict) for op in c if op not in OPERATORS]
    scopes = [s for s in rule.scope if s not in SCOPES]
    if rule.severity not in SEVERITIES or unknown or scopes or not rule.evidence:
        raise ValueError(
            f"rules.yaml: rule {rule.id!r} is malformed (severity, scope {scopes}, operators {unknown} or evidence)"
        )
    if "data" in rule.scope and not rule.figure:
        raise ValueError(f"rules.yaml: rule {rule.id!r} is judged on the data lint's figures and has no figure")
    own = [e for e in rule.evidence if e.startswith(OWN_SOURCES)]
    if own:
        raise ValueError(
            f"rules.yaml: rule {rule.id!r} cites nandoctor's own {own[0]!r} as evidence; list it under verified_by"
        )
    return rule


@functools.cache
def all_rules() -> tuple[Rule, ...]:
    """Every rule of rules.yaml, in its order: the one rule table, read once."""
    return tuple(_rule(entry) for entry in _load("rules.yaml"))


def rules(*scopes: str) -> tuple[Rule, ...]:
    """The rules judged in any of `scopes` (SCOPES), in the table's order; every rule when none is given."""
    return tuple(r for r in all_rules() if not scopes or set(scopes) & set(r.scope))


@functools.cache
def signatures() -> tuple[Signature, ...]:
    return tuple(Signature(**entry) for entry in _load("signatures.yaml"))


def current_id(rule_id: str) -> str:
    """The id a rule has now: a merged rule's dropped id (RENAMED), as an older run.json names it, is
    read as the id it was merged into."""
    return RENAMED.get(rule_id, rule_id)


def rule_by_id(rule_id: str) -> Rule:
    rule_id = current_id(rule_id)
    return next(r for r in all_rules() if r.id == rule_id)


def evaluate(facts: dict, scope: str) -> list[Rule]:
    """The rules judged in `scope` (SCOPES) that fire on these facts, most severe first (the table's
    order within a severity)."""
    fired = [r for r in rules(scope) if r.matches(facts)]
    return sorted(fired, key=lambda r: SEVERITIES.index(r.severity))


def diagnose_crash(text: str) -> Signature | None:
    """The first crash signature whose pattern occurs in an exception message or output tail."""
    for sig in signatures():
        if re.search(sig.pattern, text or ""):
            return sig
    return None


def finding(rule: Rule, cells: list[str] | None = None, figure: str | None = None) -> dict:
    """A fired rule as plain data, for run.json, summary.json and the renderers; `figure`: the sentence
    of what was measured, for a rule judged on the data lint's or the callbacks' figures."""
    return {
        "id": rule.id,
        "severity": rule.severity,
        "title": rule.title,
        **({"figure": " ".join(figure.split())} if figure is not None else {}),
        "why": rule.why,
        "fix": rule.fix,
        "evidence": list(rule.evidence),
        "verified_by": list(rule.verified_by),
        "cells": list(cells or []),
    }

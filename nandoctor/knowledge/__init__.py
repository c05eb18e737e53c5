"""The knowledge base: known-issue rules and crash signatures, as data (rules.yaml, signatures.yaml),
and the small pure logic that matches them against facts or exception text.

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
    id: str
    severity: str
    title: str
    when: dict
    why: str
    fix: str
    evidence: tuple  # public sources: issues, documentation, papers, upstream code
    verified_by: tuple = ()  # where nandoctor itself reproduces it (its own tests and tables): not evidence

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


@functools.cache
def rules() -> tuple[Rule, ...]:
    out = []
    for entry in _load("rules.yaml"):
        rule = Rule(
            **{**entry, "evidence": tuple(entry["evidence"]), "verified_by": tuple(entry.get("verified_by") or ())}
        )
        unknown = [op for c in rule.when.values() if isinstance(c, dict) for op in c if op not in OPERATORS]
        if rule.severity not in SEVERITIES or unknown or not rule.evidence:
            raise ValueError(f"rules.yaml: rule {rule.id!r} is malformed (severity, operators {unknown} or evidence)")
        own = [e for e in rule.evidence if e.startswith(OWN_SOURCES)]
        if own:
            raise ValueError(
                f"rules.yaml: rule {rule.id!r} cites nandoctor's own {own[0]!r} as evidence; list it under verified_by"
            )
        out.append(rule)
    return tuple(out)


@functools.cache
def signatures() -> tuple[Signature, ...]:
    return tuple(Signature(**entry) for entry in _load("signatures.yaml"))


def rule_by_id(rule_id: str) -> Rule:
    return next(r for r in rules() if r.id == rule_id)


def evaluate(facts: dict) -> list[Rule]:
    """The rules that fire on these facts, most severe first."""
    fired = [r for r in rules() if r.matches(facts)]
    return sorted(fired, key=lambda r: SEVERITIES.index(r.severity))


def diagnose_crash(text: str) -> Signature | None:
    """The first crash signature whose pattern occurs in an exception message or output tail."""
    for sig in signatures():
        if re.search(sig.pattern, text or ""):
            return sig
    return None


def finding(rule: Rule, cells: list[str] | None = None) -> dict:
    """A fired rule as plain data, for run.json, summary.json and the renderers."""
    return {
        "id": rule.id,
        "severity": rule.severity,
        "title": rule.title,
        "why": rule.why,
        "fix": rule.fix,
        "evidence": list(rule.evidence),
        "verified_by": list(rule.verified_by),
        "cells": list(cells or []),
    }

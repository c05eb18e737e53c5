"""Turn one probe record into one verdict with a one-line reason, and judge every probe against the
right fp32 reference (References). Pure: no torch, no processes. Every threshold lives in
thresholds.Thresholds."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from ..cells import REFERENCE_CELL, reference_of
from ..config import recipe_from_dict, recipe_to_dict, with_load_dtype_resolved
from ..errors import NandoctorError
from ..knowledge import diagnose_crash
from ..record import ProbeRecord, Step
from ..thresholds import THRESHOLDS, Thresholds

STABLE, NONFINITE, ZERO_LOSS, DIVERGED, DRIFT = "stable", "nonfinite", "zero-loss", "diverged", "drift"
# finite, but nothing trains: every gradient exactly 0, a loss that never moves, or a trainable group
# (the adapter, modules_to_save, ...) that gets no gradient at any step while the rest trains
NO_LEARNING = "no-learning"
# the probe's own setup failed a step-0 check (record.setup_checks): packed segments that attend to each
# other, or micro-batches accumulated into a gradient that is not the full batch's. The loss may fall all
# the same; judged on the probe itself, since its fp32 reference usually shares the setup.
MISCONFIGURED = "misconfigured"
CRASH, OOM, TIMEOUT, KILLED, UNSUPPORTED = "crash", "oom", "timeout", "killed", "unsupported"
# a step trained on a batch with no supervised token (every label -100: completion-only rows whose answer
# fell past max_length): its mean loss is 0/0. A data finding, judged before any numeric verdict: every
# configuration meets it, so it says nothing about the one probed
NO_TARGET = "no-target"
# a mixture of experts' router sends the tokens of a layer to a few experts: half or more of them get
# none, or one takes nearly every token (record.moe), whatever the loss does
EXPERT_COLLAPSE = "expert-collapse"
GRAD_MISMATCH = "grad-mismatch"  # a parallel probe's reduced gradient is not the one-process gradient
# an RL probe (objective=grpo) whose rollout log-probs are too far from the training path's for its
# completions' importance ratios to stay inside TRL's cap (record.rollout_mismatch; Thresholds.off_policy)
OFF_POLICY = "off-policy"


@dataclass(frozen=True)
class VerdictKind:
    """One verdict, declared once: what every list of verdicts (the lists below, the report's colours and
    marks, bisect's advice, the probe table's column) reads.
    - failed: the probe fails with it (a stable one does not, nor one this device cannot run).
    - unresolved: it says nothing about the configuration's numerics: the probe could not run here, ran out
      of time or memory, or was killed from outside; or its batch had no target, the data's fault whatever
      the configuration. A crash is resolved: the configuration raised.
    - harness: the probe did not finish its steps.
    - color: (background, text) of its cell in the HTML matrix.
    - mark: its cell in the Markdown matrix.
    - advice: what to do when a bisection is left unresolved by it (bisect/oracle.py)."""

    name: str
    failed: bool
    color: tuple[str, str]
    unresolved: bool = False
    harness: bool = False
    mark: str = "❌"
    advice: str = ""


_HARNESS_COLOR = ("#c98bd6", "#3f0a4d")
# In the order of the report's colour key.
VERDICTS = (
    VerdictKind(STABLE, False, ("#bfe5b4", "#1b4d14"), mark="✅"),
    VerdictKind(DRIFT, True, ("#fbe49a", "#5c4a00")),
    VerdictKind(GRAD_MISMATCH, True, ("#f9c185", "#6b3600")),
    VerdictKind(DIVERGED, True, ("#f9c185", "#6b3600")),
    VerdictKind(ZERO_LOSS, True, ("#e7b3e6", "#5a1657")),
    VerdictKind(NO_LEARNING, True, ("#d9d2c5", "#4a3f2a")),
    VerdictKind(MISCONFIGURED, True, ("#b9d3f0", "#0f3a66")),
    VerdictKind(EXPERT_COLLAPSE, True, ("#a9e0dc", "#0c4a45")),
    VerdictKind(OFF_POLICY, True, ("#f5c6a5", "#6a2e0a")),
    VerdictKind(
        NO_TARGET,
        True,
        ("#d6e9e4", "#1f4a40"),
        unresolved=True,
        advice="fix the data: a batch has no supervised token, whatever the configuration "
        "(`nandoctor doctor --data` names its rows and why)",
    ),
    VerdictKind(NONFINITE, True, ("#f29a9a", "#6d0f0f")),
    VerdictKind(CRASH, True, _HARNESS_COLOR, harness=True),
    VerdictKind(
        OOM,
        True,
        _HARNESS_COLOR,
        unresolved=True,
        harness=True,
        advice="use a smaller model (--scale probe) or batch (--set batch_size=...); "
        "--fail-on oom counts running out of memory as the failure",
    ),
    VerdictKind(
        TIMEOUT,
        True,
        _HARNESS_COLOR,
        unresolved=True,
        harness=True,
        advice="give the probe more time (--set timeout_s=...), fewer steps (--steps) "
        "or a smaller model (--scale probe); --fail-on timeout counts the hang itself as the failure",
    ),
    VerdictKind(
        KILLED,
        True,
        _HARNESS_COLOR,
        unresolved=True,
        harness=True,
        advice="something outside killed the probe (the kernel's OOM killer sends SIGKILL): "
        "free memory or use --scale probe; --fail-on killed counts it as the failure",
    ),
    VerdictKind(
        UNSUPPORTED,
        False,
        ("#eeeeee", "#9a9a9a"),
        unresolved=True,
        mark="–",
        advice="choose a --bad / --good this device can run (`nandoctor doctor` lists what it runs)",
    ),
)
VERDICT = {v.name: v for v in VERDICTS}
HARNESS_FAILURES = tuple(v.name for v in VERDICTS if v.harness)  # the probe did not finish its steps
UNRESOLVED_VERDICTS = tuple(v.name for v in VERDICTS if v.unresolved)
# what bisect's --fail-on may count as a failure: a probe stopped from outside its numerics
FAIL_ON = tuple(v.name for v in VERDICTS if v.harness and v.unresolved)
CRASH_SIGNALS = {
    "SIGSEGV": "segmentation fault",
    "SIGABRT": "abort",
    "SIGBUS": "bus error",
    "SIGILL": "illegal instruction",
    "SIGFPE": "floating-point exception",
}


@dataclass(frozen=True)
class Verdict:
    name: str
    reason: str
    step: int | None = None

    @property
    def failed(self) -> bool:
        return VERDICT[self.name].failed


def _fmt(x: float) -> str:
    return repr(x) if not math.isfinite(x) else f"{x:.4g}"


def known_crash(text: str) -> str:
    """' -- known issue ID: diagnosis Fix: fix' when the text matches a crash signature, else ''."""
    sig = diagnose_crash(text)
    return f" -- known issue {sig.id}: {sig.diagnosis} Fix: {sig.fix}" if sig else ""


def harness_verdict(record: ProbeRecord) -> Verdict | None:
    """The verdict of a probe that did not finish on its own, or None if it did."""
    status = record.status
    last = len(record.steps) - 1
    done = f"after {last + 1} completed step(s)"
    if record.failed_rank is not None:  # a parallel probe: the rank whose end stopped the others
        done = f"on rank {record.failed_rank} of {len(record.ranks or []) or '?'} {done}"
    if status == "unsupported":
        return Verdict(UNSUPPORTED, record.reason)
    if status == "lost":
        return Verdict(KILLED, f"{record.reason}; this says nothing about the configuration")
    if status == "timeout":
        if record.timed_out_in == "build":
            budget = (record.recipe or {}).get("build_timeout_s")
            budget = f"{budget:g}" if isinstance(budget, (int, float)) else "?"
            return Verdict(TIMEOUT, f"model not built within build_timeout_s={budget} s (imports, load, wrapping)", 0)
        since = " of its build" if record.timed_out_in == "steps" else ""
        budget = f"{record.timeout_s:g}" if isinstance(record.timeout_s, (int, float)) else "?"
        return Verdict(TIMEOUT, f"no result within {budget} s{since}, {done}", max(last, 0))
    if status == "signal":
        sig = record.signal
        if sig in CRASH_SIGNALS:
            return Verdict(
                CRASH,
                f"process died of {sig} ({CRASH_SIGNALS[sig]}) {done}" + known_crash(record.log_tail or ""),
                max(last, 0),
            )
        hint = " (the kernel's OOM killer sends SIGKILL)" if sig == "SIGKILL" else ""
        return Verdict(KILLED, f"process killed by {sig}{hint} {done}", max(last, 0))
    if status == "error":
        err = record.error
        first = (err.get("message") or "").strip().splitlines()[:1]
        text = f"{err['type']}: {first[0] if first else ''}".strip().rstrip(":")
        sig = diagnose_crash(err.get("message") or "")
        if sig and sig.verdict == UNSUPPORTED:  # the device refused the cell: not the probe's failure
            said = [w for w in err.get("warnings") or [] if re.search(sig.explained_by or "$^", w)]
            because = "; ".join(w.split(": ", 1)[-1].strip() for w in said)
            return Verdict(
                UNSUPPORTED,
                f"{text[:200]} ({sig.diagnosis.rstrip('.')})" + (f": PyTorch said {because[:600]}" if because else ""),
            )
        oom = err.get("oom") or (sig is not None and sig.verdict == OOM)
        return Verdict(OOM if oom else CRASH, text[:300] + known_crash(err.get("message") or ""), max(last + 1, 0))
    if not record.steps:
        return Verdict(CRASH, "the probe finished without completing a training step")
    return None


def agreement_tolerance(dtypes, t: Thresholds = THRESHOLDS) -> tuple[float, str]:
    """(the largest step-0 relative gradient error the coarsest of `dtypes` explains, that dtype)."""
    bounds = dict(t.grad_agreement)
    coarsest = max((d for d in dtypes if d in bounds), key=lambda d: bounds[d], default="float32")
    return bounds[coarsest], coarsest


def parallel_verdict(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> Verdict | None:
    """A parallel probe whose reduced step-0 gradient is not the one-process gradient of the same
    global batch fails, whatever its loss curve does: AdamW and clipping hide a gradient scaled W-fold."""
    facts = record.parallel or {}
    got = facts.get("grad_agreement")
    if not got or got.get("norm_ratio") is None:
        return None
    w, ratio, err = facts["world_size"], got["norm_ratio"], got["max_rel_error"]
    if w > 1 and abs(ratio / w - 1) <= t.grad_ratio_rel:
        return Verdict(
            GRAD_MISMATCH,
            f"gradients are {ratio:.2f}x the single-process ones: the reduction sums "
            f"instead of averaging (world size {w})",
            0,
        )
    if w > 1 and abs(ratio * w - 1) <= t.grad_ratio_rel:
        return Verdict(
            GRAD_MISMATCH,
            f"gradients are {ratio:.2f}x the single-process ones: the reduction divides by the world size ({w}) twice",
            0,
        )
    tol, coarsest = agreement_tolerance([record.cell.precision.compute, *(facts.get("reduce_dtype") or [])], t)
    if not math.isfinite(err) or err > tol:
        return Verdict(
            GRAD_MISMATCH,
            f"step-0 gradients differ from the single-process ones by up to {_fmt(err)} "
            f"(relative, {got.get('worst_param')}), beyond the {tol:g} a {coarsest} "
            "computation and reduction explain" + _parallel_group_clause(facts, tol),
            0,
        )
    return None


def _own(group: str) -> str:
    """ "router's own", "experts' own": a tensor group's name as the owner of its gradient."""
    return f"{group}' own" if group.endswith("s") else f"{group}'s own"


def _parallel_group_clause(facts: dict, tol: float) -> str:
    """'; by group: router 0.9 (beyond ...)' for the tensor groups whose reduced gradient differs from
    the one-process one beyond `tol`, and the cause with its fix where the router's does and the model
    adds a balancing loss to a token-normalised loss that Trainer multiplies by the ranks
    (average_tokens_across_devices; huggingface/transformers#48690)."""
    got = facts.get("grad_agreement") or {}
    groups = got.get("groups") or {}
    bad = [g for g, err in groups.items() if err is None or not math.isfinite(err) or err > tol]
    if not bad:
        return ""
    bad.sort(key=lambda g: -_num(groups[g]) if math.isfinite(_num(groups[g])) else -math.inf)
    out = "; by tensor group: the " + ", the ".join(f"{_own(g)} gradient by {_fmt(_num(groups[g]))}" for g in bad)
    w = facts.get("world_size")
    if "router" in bad and facts.get("balancing_loss") and facts.get("loss_normalization") == "tokens":
        out += (
            f": the load-balancing loss (router_aux_loss_coef {_fmt(_num(facts['balancing_loss']))}) is in each "
            f"rank's token-normalised loss, which is multiplied by the world size ({w}), so it is counted {w} "
            f"times; fix: count it once, model.router_aux_loss_coef = model.config.router_aux_loss_coef / {w} "
            "(the data-parallel ranks) after from_pretrained"
        )
    return out


def setup_failures(checks: dict | None, t: Thresholds = THRESHOLDS) -> list[str]:
    """The step-0 setup checks (record.setup_checks, or the live lint's figures) that failed, each as one
    clause naming the check and its figure; [] when none failed or none was measured."""
    c = checks or {}
    judged = setup_judged(c, t)
    out = []
    if judged["packing_leaks"]:
        floor = c.get("packing_floor")
        out.append(
            f"packing: one packed forward of {c.get('packing_segments', '?')} segments differs from each segment "
            f"run alone by {_fmt(c['packing_max_logit_diff'])} max logit ({c.get('packing_cause') or 'as collated'}), "
            f"beyond {t.packing_bound(floor):.2g}"
            + (f" (the segments alone move by {_fmt(_num(floor))} against fp32)" if floor is not None else "")
            + (
                f"; in fp32 the packed forward differs by {_fmt(_num(c['packing_fp32_diff']))}, beyond "
                f"{t.packing_leak_abs:.2g}"
                if t.packing_leaks(None, None, c.get("packing_fp32_diff"))
                else ""
            )
            + _leaking_layer_clause(t.leaking_layer(c.get("packing_layers"), c.get("packing_max_logit_diff")))
        )
    if judged["accumulation_misweighted"]:
        out.append(_accumulation_failure(c, t))
    return out


def misweighted_groups(checks: dict, t: Thresholds = THRESHOLDS) -> list[str]:
    """The tensor groups (measure/accumulation.py accumulation_groups: router, experts, embeddings,
    adapter, ...) whose own accumulated gradient differs from the full batch's beyond the bound of their
    own fp32 floor, in the order measured."""
    groups = checks.get("accumulation_groups") or {}
    return [g for g, f in groups.items() if t.accumulation_misweighted(f.get("error"), f.get("floor"))]


def accumulation_cause(checks: dict, t: Thresholds = THRESHOLDS) -> str | None:
    """Why a step's accumulated gradient is misweighted: "balancing_loss" where the router's is and the
    model adds its load-balancing loss to every micro-batch's loss under token normalisation (the
    Trainer divides none of them by the steps: it is counted once per micro-batch), "normalisation"
    for any other misweighted step; None where none is."""
    bad = misweighted_groups(checks, t)
    if "router" in bad and checks.get("accumulation_balancing_loss") and checks.get("loss_normalization") == "tokens":
        return "balancing_loss"
    whole = t.accumulation_misweighted(checks.get("accumulation_error"), checks.get("accumulation_floor"))
    return "normalisation" if bad or whole else None


def _accumulation_failure(c: dict, t: Thresholds) -> str:
    """The failed accumulation check in one clause: the whole gradient's figure, each misweighted tensor
    group's, and the cause with its fix where it is a balancing loss counted per micro-batch."""
    norm = c.get("loss_normalization") or "?"
    bound = t.accumulation_bound(c.get("accumulation_floor"))
    whole = t.accumulation_misweighted(c.get("accumulation_error"), c.get("accumulation_floor"))
    out = (
        f"accumulation: step 0's gradient over {c.get('accumulation_steps', '?')} micro-batches "
        f"({c.get('accumulation_targets', '?')} loss terms each), loss_normalization={norm}, differs from "
        f"the full batch's by {_fmt(_num(c.get('accumulation_error')))} (relative; cosine "
        f"{_fmt(_num(c.get('accumulation_cosine')))}, norm ratio {_fmt(_num(c.get('accumulation_norm_ratio')))}), "
        + (f"beyond {bound:.2g}" if whole else f"within {bound:.2g} as a whole")
    )
    groups = c.get("accumulation_groups") or {}
    said = [
        f"the {_own(g)} gradient by {_fmt(_num(groups[g].get('error')))} "
        f"(beyond {t.accumulation_bound(groups[g].get('floor')):.2g})"
        for g in misweighted_groups(c, t)
    ]
    if said:
        out += f"{'; so does' if whole else ', but'} {', '.join(said)}"
    if accumulation_cause(c, t) == "balancing_loss":
        steps = c.get("accumulation_steps", "k")
        out += (
            f": the load-balancing loss (router_aux_loss_coef {_fmt(_num(c.get('accumulation_balancing_loss')))}) is "
            f"added to each of the {steps} micro-batches' token-normalised losses, counted {steps} times a step; "
            f"fix: count it once a step, model.router_aux_loss_coef = model.config.router_aux_loss_coef / {steps} "
            "(gradient_accumulation_steps) after from_pretrained"
        )
    return out


def _leaking_layer_clause(leak: dict | None) -> str:
    """'; the segments first mix at layer N (kind) ...' for the first layer of a packed forward that mixes
    its segments (Thresholds.leaking_layer), '' when none was found."""
    if not leak:
        return ""
    return (
        f"; the segments first mix at layer {leak['layer']} ({leak['kind']}): its output past the first segment "
        f"differs from the segments run alone by {_fmt(leak['later_segments'])}, on the first segment by "
        f"{_fmt(leak['first_segment'])}"
    )


def setup_judged(checks: dict | None, t: Thresholds = THRESHOLDS) -> dict:
    """Whether each measured setup check failed: packing_leaks, accumulation_misweighted (None where the
    check was not measured), and the bound each applied (packing_bound, accumulation_bound). The one
    rule each, for the probes, the data lint and the callbacks."""
    c = checks or {}
    return {
        "packing_leaks": t.packing_leaks(
            c.get("packing_max_logit_diff"), c.get("packing_floor"), c.get("packing_fp32_diff")
        )
        if "packing_max_logit_diff" in c
        else None,
        "accumulation_misweighted": (
            t.accumulation_misweighted(c.get("accumulation_error"), c.get("accumulation_floor"))
            or bool(misweighted_groups(c, t))
        )
        if "accumulation_error" in c
        else None,
        "accumulation_cause": accumulation_cause(c, t),
        # the bounds those decisions applied, for the reports to show beside the figures
        "packing_bound": t.packing_bound(c.get("packing_floor")) if "packing_max_logit_diff" in c else None,
        "accumulation_bound": t.accumulation_bound(c.get("accumulation_floor")) if "accumulation_error" in c else None,
    }


def setup_passed(checks: dict, t: Thresholds = THRESHOLDS) -> str:
    """The figures of setup checks that passed, in a few words: what was measured and its bound."""
    said = []
    if "packing_max_logit_diff" in checks:
        said.append(
            f"packed segments isolated (max logit difference {_fmt(_num(checks['packing_max_logit_diff']))} "
            f"to each segment alone, bound {t.packing_bound(checks.get('packing_floor')):.2g})"
        )
    if "accumulation_error" in checks:
        said.append(
            "accumulated gradient is the full batch's (relative difference "
            f"{_fmt(_num(checks['accumulation_error']))}, "
            f"bound {t.accumulation_bound(checks.get('accumulation_floor')):.2g}; cosine "
            f"{_fmt(_num(checks.get('accumulation_cosine')))})" + _groups_passed(checks)
        )
    return "; ".join(said) or "nothing measured"


def _groups_passed(checks: dict) -> str:
    """', and each tensor group's own (router, experts, ...)' where the check compared them one by one."""
    groups = list(checks.get("accumulation_groups") or {})
    return f", and each tensor group's own ({', '.join(groups)})" if groups else ""


def _num(x) -> float:
    """A figure as a float: NaN when absent, +-inf for an int beyond a float's range."""
    if not isinstance(x, (int, float)):
        return math.nan
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def setup_verdict(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> Verdict | None:
    """`misconfigured` when a step-0 setup check of the probe failed (setup_failures), else None."""
    failed = setup_failures(record.setup_checks, t)
    return Verdict(MISCONFIGURED, "; ".join(failed), 0) if failed else None


def collapsed_layers(moe: dict | None, t: Thresholds = THRESHOLDS) -> list[str]:
    """One clause per router layer whose step (the last one measured, else step 0) left
    t.expert_dead_fraction of its experts without a token, or gave one expert t.expert_token_share of
    its tokens, naming the layer and the counts; [] for a dense model or a router that still spreads."""
    if not moe:
        return []
    experts, k = moe.get("experts") or 0, moe.get("top_k") or 1
    out = []
    for layer in moe.get("layers") or []:
        for key in ("step_last", "step_0"):
            at = layer.get(key) or {}
            rows, tokens = at.get("rows") or 0, at.get("tokens") or []
            if not rows or not experts or rows * k / experts < t.expert_min_load:
                continue
            dead, top = at.get("no_token") or 0, max(tokens)
            share = top / rows
            if dead >= t.expert_dead_fraction * experts or (
                k / experts <= t.expert_share_even_max and share >= t.expert_token_share
            ):
                out.append(
                    f"layer {layer['layer']} ({layer.get('module', '?')}): {dead} of {experts} experts got no token "
                    f"at step {at.get('step', '?')}, expert {tokens.index(top)} took {share:.0%} of its {rows} "
                    f"tokens (top-{k}; an even router gives each {k / experts:.0%})"
                )
                break
    return out


def collapse_unjudged(moe: dict | None, t: Thresholds = THRESHOLDS) -> str | None:
    """Why a mixture of experts' collapse was not judged, when no router layer had the load that judging
    needs (tokens x top-k / experts below expert_min_load at its last and first step measured): said with
    the verdict, so that a stable one does not read as a router that spreads. None for a dense model or
    where a layer was judged."""
    if not moe:
        return None
    experts, k = moe.get("experts") or 0, moe.get("top_k") or 1
    seen = [
        at.get("rows") or 0
        for layer in moe.get("layers") or []
        for at in (layer.get("step_last") or {}, layer.get("step_0") or {})
        if at.get("rows")
    ]
    if not experts or not seen or any(rows * k / experts >= t.expert_min_load for rows in seen):
        return None
    rows = max(seen)
    return (
        f"expert collapse not judged: {rows} tokens x top-{k} over {experts} experts is {rows * k / experts:.2g} "
        f"assignments per expert, under the {t.expert_min_load:g} an even router must give each before an idle "
        f"expert means collapse; a batch of {math.ceil(t.expert_min_load * experts / k)} tokens or more judges it"
    )


def router_verdict(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> Verdict | None:
    """`expert-collapse` when a router layer collapsed (collapsed_layers), else None."""
    layers = collapsed_layers(record.moe, t)
    return Verdict(EXPERT_COLLAPSE, "router collapse: " + "; ".join(layers), 0) if layers else None


def route_flips(choices: list | None, reference: list | None) -> float | None:
    """The share of step 0's (token, slot) expert choices that differ from the reference's, over every
    router layer and the tokens both kept (record.moe step0_choices); None when either is missing."""
    if not choices or not reference:
        return None
    differ = total = 0
    for mine, theirs in zip(choices, reference):
        for a, b in zip(mine, theirs):
            differ += len(a) - len(set(a) & set(b))
            total += len(a)
    return differ / total if total else None


def routing_cause(verdict: Verdict, flips: float | None, t: Thresholds = THRESHOLDS) -> Verdict:
    """A drift whose step-0 routing differs from the fp32 reference's by more than t.route_flip_share,
    with the routing named as its cause; any other verdict as it is."""
    if verdict.name != DRIFT or flips is None or flips <= t.route_flip_share:
        return verdict
    return Verdict(
        DRIFT,
        f"{verdict.reason}; caused by the routing: {flips:.1%} of step 0's token -> expert choices differ from "
        f"the fp32 reference's (over {t.route_flip_share:.0%}), the same weights and batch choose other experts "
        "in this precision (moe.router_dtype=fp32 keeps the router's logits in fp32)",
        verdict.step,
    )


# How a group's tensors are named in a verdict: the adapter's by its type (lora -> LoRA)
GROUP_WORDS = {"modules_to_save": "modules_to_save", "embeddings": "embedding", "rest": "other trainable"}
ADAPTER_WORDS = {"lora": "LoRA", "dora": "DoRA"}


def starved_groups(steps: list[Step]) -> list[str]:
    """The trainable groups (Step.groups) whose gradient norm is absent or exactly 0.0 at every step that
    recorded the groups, in their order; [] when no step did (records before per-group accounting). A
    non-finite norm is a gradient (an overflow), not its absence."""
    recorded = [s.groups for s in steps if s.groups is not None]
    if not recorded:
        return []
    names = list(dict.fromkeys(g for groups in recorded for g in groups))
    return [g for g in names if all(groups.get(g) is None or groups.get(g) == 0.0 for groups in recorded)]


def group_no_learning(steps: list[Step], trainable: dict | None = None, adapter: str | None = None) -> Verdict | None:
    """no-learning for the trainable groups that got no gradient at any step, even while the loss falls
    through the others; `trainable` (record.trainable_groups) gives each group's tensor count."""
    starved = starved_groups(steps)
    if not starved:
        return None
    recorded = [s for s in steps if s.groups is not None]
    n = len(recorded)
    when = f"at any of {n} steps" if n > 1 else f"at step {recorded[0].step}"
    parts = []
    for g in starved:
        count = ((trainable or {}).get(g) or {}).get("tensors")
        kind = ADAPTER_WORDS.get(adapter or "", "adapter") if g == "adapter" else GROUP_WORDS.get(g, g)
        tensors = f"{count} of {count} {kind} tensors" if count else f"its {kind} tensors"
        parts.append(f"{g}: {tensors} got no gradient {when}")
    losses = [s.loss for s in steps]
    falls = len(losses) > 1 and losses[-1] < losses[0]
    trained = [g for g in recorded[0].groups if g not in starved]
    tail = (
        f", while the loss fell {losses[0]:.4f} -> {losses[-1]:.4f} through {', '.join(trained)}"
        if falls and trained
        else ""
    )
    return Verdict(NO_LEARNING, "; ".join(parts) + tail, recorded[0].step)


def judged_facts(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> dict:
    """Facts for the knowledge rules from what the verdicts judge on the probe's own setup: whether its
    packing leaked, its accumulation misweighted the micro-batches, how many trainable groups got no
    gradient, and how many steps trained on a batch with no target (knowledge/rules.yaml: the failure
    classes' known fix)."""
    c, judged = record.setup_checks or {}, setup_judged(record.setup_checks, t)
    # the kind of the first layer that mixes segments packed by position_ids alone (a 2-D mask beside them
    # is its own cause, with its own rule)
    alone = str(c.get("packing_cause", "")).startswith("position_ids alone")
    leak = (
        t.leaking_layer(c.get("packing_layers"), c.get("packing_max_logit_diff")) if judged["packing_leaks"] else None
    )
    return {
        **judged,
        "groups_without_gradient": len(starved_groups(record.steps)),
        # steps whose batch had no target and whose loss was 0/0 (or 0.0): the no-target verdict
        "all_masked_batches": sum(_untargeted(s) for s in record.steps) or None,
        "experts_collapsed": bool(collapsed_layers(record.moe, t)) if record.moe else None,
        "packing_layer_leaks": leak["kind"] if leak and alone else None,
    }


def _tail(n: int, t: Thresholds) -> int:
    """How many of the last steps the end of a curve is judged on."""
    return max(1, int(n * t.tail_fraction))


def numeric_verdict(
    steps: list[Step],
    reference: list[Step] | None,
    t: Thresholds = THRESHOLDS,
    since: int = 0,
    trainable: dict | None = None,
    adapter: str | None = None,
    against: str = "",
) -> Verdict:
    """Classify a finished loss / grad-norm curve, against the fp32 reference curve when given (`against`:
    the reference's name when another fp32 probe stands in for fp32/eager).
    Steps before index `since` were judged already (a live run's watch judges each new step once);
    they still count as history for the spike window, the largest grad-norm and the rise.
    trainable / adapter: the record's trainable_groups and adapter type, for naming a group that got
    no gradient (group_no_learning)."""
    for s in steps[since:]:
        if _untargeted(s):
            return Verdict(NO_TARGET, untargeted(s), s.step)
        what = s.unrecoverable(t.min_scale)
        if what == "loss":
            return Verdict(NONFINITE, f"loss is {_fmt(s.loss)} at step {s.step}", s.step)
        if what == "grad":
            return Verdict(
                NONFINITE, f"grad-norm is {_fmt(s.grad_norm)} at step {s.step} with no GradScaler to skip it", s.step
            )
        if what == "scale":
            return Verdict(
                NONFINITE,
                f"GradScaler scale fell below {t.min_scale:g} at step {s.step}: gradients overflow fp16 even unscaled",
                s.step,
            )
    for s in steps[since:]:
        if s.loss == 0.0:
            return Verdict(ZERO_LOSS, f"loss is exactly 0.0 at step {s.step}", s.step)
    dead = no_learning(steps, t, trainable, adapter)
    if dead:
        return dead
    spike = loss_spike(steps, t, since)
    if spike:
        return spike
    losses = [s.loss for s in steps]
    counted = [s.grad_norm for s in steps[:since] if not s.skipped and math.isfinite(s.grad_norm)]
    largest = max(counted, default=None)
    for s in steps[since:]:
        if s.skipped or not math.isfinite(s.grad_norm):
            continue
        if largest is not None and largest > 0 and s.grad_norm > t.grad_explode_factor * largest:
            return Verdict(
                DIVERGED,
                f"grad-norm exploded to {_fmt(s.grad_norm)} at step {s.step}, "
                f"{s.grad_norm / largest:.0f}x the largest before",
                s.step,
            )
        largest = max(largest or 0.0, s.grad_norm)
    q = _tail(len(losses), t)
    end = sum(losses[-q:]) / q
    if len(losses) >= t.rise_min_steps and end > losses[0] + t.rise_nats:
        return Verdict(
            DIVERGED, f"loss rose from {_fmt(losses[0])} to {_fmt(end)} (mean of the last {q} steps)", steps[-1].step
        )
    if reference:
        n = min(len(steps), len(reference))
        q = _tail(n, t)
        ref = [s.loss for s in reference[:n]]
        dev = sum(abs(a - b) for a, b in zip(losses[n - q : n], ref[n - q : n])) / q
        ref_drop = max(0.0, ref[0] - sum(ref[n - q : n]) / q)
        tol = t.drift_rel * ref_drop + t.drift_abs
        if dev > tol:
            mine, theirs = sum(losses[n - q : n]) / q, sum(ref[n - q : n]) / q
            return Verdict(
                DRIFT,
                f"loss {mine:.4f} vs fp32 reference{' ' + against if against else ''} {theirs:.4f} "
                f"over the last {q} steps: "
                f"{dev:.3f} nats off, tolerance {tol:.3f} "
                f"({t.drift_rel:.0%} of the reference's {ref_drop:.3f}-nat drop + {t.drift_abs})",
                n - q,
            )
    return Verdict(STABLE, f"{len(steps)} steps finite, loss {losses[0]:.4f} -> {losses[-1]:.4f}")


def _untargeted(s: Step) -> bool:
    """A step whose batch had no supervised token, and whose loss shows it (0/0, or a reported 0.0)."""
    return s.supervised == 0 and (not math.isfinite(s.loss) or s.loss == 0.0)


def untargeted(s: Step) -> str:
    """Why step s has no verdict of its own: its batch had no supervised token."""
    kind = f"{s.batch} " if s.batch else ""
    return (
        f"step {s.step}'s {kind}batch has no supervised token (every label -100 after the shift), so its mean "
        f"loss is 0/0 = {_fmt(s.loss)}: a fault of the data, not of this configuration"
    )


def loss_spike(steps: list[Step], t: Thresholds = THRESHOLDS, since: int = 0) -> Verdict | None:
    """A loss above spike_factor x the mean of the previous spike_window steps that trained the same kind
    of batch (Step.batch: the longest rows or the fewest targets of the user's data lose differently
    from its first batches, every time); steps before `since` count only as history."""
    kinds = {s.batch for s in steps}
    for k in range(since, len(steps)):
        kind = steps[k].batch
        window = [s.loss for s in steps[:k] if s.batch == kind][-t.spike_window :]
        if len(window) < t.spike_min_history:
            continue
        mean = sum(window) / len(window)
        loss = steps[k].loss
        if mean > 0 and loss > t.spike_factor * mean:  # a spike is a multiple of a positive mean
            of = f" of {kind} batches" if kind and len(kinds) > 1 else ""
            return Verdict(
                DIVERGED,
                f"loss spiked to {_fmt(loss)} at step {steps[k].step}, "
                f"{loss / mean:.1f}x the mean of the previous {len(window)} steps{of}",
                steps[k].step,
            )
    return None


def never_stepped(steps: list[Step], t: Thresholds = THRESHOLDS) -> Verdict | None:
    """A probe whose GradScaler skipped every one of its steps: its optimizer never stepped, so its curve
    says nothing of training (the scale halves from 65536 and reaches below 1 only after 16 skips,
    Step.unrecoverable). Judged on a finished probe of min_probe_steps or more, not on a live run's
    first steps nor on a `check`'s step 0 (a skip there is the scaler calibrating)."""
    if len(steps) < t.min_probe_steps or not all(s.skipped and s.scale is not None for s in steps):
        return None
    return Verdict(
        NONFINITE,
        f"GradScaler skipped every one of the {len(steps)} steps (scale {steps[0].scale:g} -> "
        f"{steps[-1].scale / 2:g}): the gradients overflowed fp16 at every scale tried and the optimizer never "
        "stepped; a longer probe (--steps) shows whether a lower scale fits",
        steps[0].step,
    )


def no_learning(
    steps: list[Step], t: Thresholds = THRESHOLDS, trainable: dict | None = None, adapter: str | None = None
) -> Verdict | None:
    """The no-learning verdict of a finite curve, judged on the curve itself (its fp32 reference may be
    as dead): a grad-norm of exactly 0 at every step, a trainable group with no gradient at any step
    (group_no_learning), or a loss that never moves; else None."""
    counted = [s for s in steps if not s.skipped]
    if counted and all(s.grad_norm == 0.0 for s in counted):
        n = len(counted)
        return Verdict(
            NO_LEARNING,
            "grad-norm is exactly 0 at "
            f"{'every one of ' + str(n) + ' steps' if n > 1 else 'step ' + str(counted[0].step)}: "
            "no parameter receives a gradient, nothing trains",
            counted[0].step,
        )
    starved = group_no_learning(steps, trainable, adapter)
    if starved:
        return starved
    losses = [s.loss for s in steps]
    if len(losses) >= t.no_learning_min_steps and all(
        abs(x - losses[0]) <= t.no_learning_loss_rel * abs(losses[0]) for x in losses
    ):
        return Verdict(
            NO_LEARNING,
            f"loss stayed at {losses[0]:.6g} for all {len(losses)} steps "
            f"(within {t.no_learning_loss_rel:g} relative): nothing trains",
            steps[0].step,
        )
    return None


def objective(record: ProbeRecord) -> str:
    """The probe's training objective (recipe field objective): sft, or grpo."""
    return (record.recipe or {}).get("objective") or "sft"


def rollout_failures(mismatch: dict | None, t: Thresholds = THRESHOLDS) -> list[str]:
    """One clause per way an RL probe's rollout mismatch (record.rollout_mismatch) is beyond the bounds
    (Thresholds.off_policy), each with its figures; [] when inside them or not measured."""
    m = mismatch or {}
    mean, masked, cap = m.get("logp_diff_mean"), m.get("masked_share"), t.rollout_ratio_cap
    out = []
    for cause in t.off_policy(mean, masked):
        if cause == "extrapolated":
            bound, n = t.rollout_log_ratio(mean), t.rollout_reference_tokens
            out.append(
                f"mean |dlogp| {mean:.2e} between rollout and training: a {n}-token completion whose "
                f"differences share a sign has an importance ratio of exp({bound:.3g}) = "
                f"{_fmt(math.exp(min(bound, 700)))}, beyond TRL's sequence cap {cap:g} "
                f"(mean |dlogp| up to {math.log(cap) / n:.2g} stays inside)"
            )
        else:
            ratio = (m.get("ratio") or {}).get("max")
            out.append(
                f"{_fmt(masked * 100)}% of the probe's own {m.get('sequences', '?')} completions "
                f"({m.get('tokens', '?')} tokens) have a ratio above {cap:g} (largest {_fmt(_num(ratio))}): "
                "TRL's default sequence mask drops them"
            )
    return out


def rollout_verdict(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> Verdict | None:
    """`off-policy` when an RL probe's rollout mismatch is beyond the bounds (rollout_failures), else None."""
    failed = rollout_failures(record.rollout_mismatch, t) if objective(record) != "sft" else []
    fix = "; fp16 (fp16-amp) rounds 8x finer than bf16, and an importance-sampling correction bounds the rest"
    return Verdict(OFF_POLICY, "; ".join(failed) + fix, 0) if failed else None


def classify(
    record: ProbeRecord,
    reference: list[Step] | None = None,
    t: Thresholds = THRESHOLDS,
    against: str = "",
    routes: list | None = None,
) -> Verdict:
    """The probe's verdict: what stopped it, its ranks' agreement, its setup, then its curve against the
    reference curve (`against` names the reference when it stands in for fp32/eager). A mixture of experts
    whose curve is finite and not diverged is judged on its routing (router_verdict), and a drift is traced
    to it when step 0's choices differ from the reference's (`routes`: its record.moe step0_choices;
    routing_cause)."""
    first = harness_verdict(record) or parallel_verdict(record, t) or setup_verdict(record, t)
    if first:
        return first
    if objective(record) != "sft":  # a GRPO loss is no fidelity figure: the rollout mismatch is judged instead
        reference = None
    v = numeric_verdict(
        record.steps, reference, t, trainable=record.trainable_groups, adapter=_adapter(record), against=against
    )
    if v.name == NO_TARGET:
        return Verdict(v.name, v.reason + untargeted_rows(record, v.step), v.step)
    if v.name in (NONFINITE, ZERO_LOSS):
        return v
    stuck = never_stepped(record.steps, t)
    if stuck or v.name == DIVERGED:
        return stuck or v
    v = stall_verdict(record, v, t)
    flips = route_flips((record.moe or {}).get("step0_choices"), routes)
    v = router_verdict(record, t) or routing_cause(v, flips, t)
    if v.name == STABLE:
        v = rollout_verdict(record, t) or v
    unjudged = collapse_unjudged(record.moe, t) if v.name == STABLE else None
    return Verdict(v.name, f"{v.reason}; {unjudged}", v.step) if unjudged else v


def update_lost(record: ProbeRecord) -> float | None:
    """The share of step 0's meant weight updates that rounding to the weights' dtype left out, as its
    forensics measured it (None where they did not: a check, a compiled or parallel cell, no forensics)."""
    steps = (record.forensics or {}).get("steps") or []
    lost = next((s.get("update_loss") for s in steps if s.get("step") == 0), None)
    return lost if isinstance(lost, (int, float)) and math.isfinite(lost) else None


def stall_verdict(record: ProbeRecord, v: Verdict, t: Thresholds = THRESHOLDS) -> Verdict:
    """A stable or drifting curve whose step-0 update lost more than stall_update_lost of what it meant to
    change is a stall, named as the drift's cause: its loss may not have had time to leave the reference's."""
    lost = update_lost(record)
    if v.name not in (STABLE, DRIFT) or lost is None or lost <= t.stall_update_lost:
        return v
    weights = (record.forensics or {}).get("weight_dtype") or "its weights' dtype"
    stall = (
        f"stalled: step 0's optimizer step lost {lost:.0%} of the weight updates it meant to make to rounding in "
        f"{weights} (more than {t.stall_update_lost:.0%}), so the weights barely train whatever the loss shows "
        "over a short probe; keep fp32 master weights (an -amp dtype) or raise the learning rate"
    )
    return Verdict(DRIFT, stall if v.name == STABLE else f"{v.reason}; {stall}", 0 if v.name == STABLE else v.step)


def untargeted_rows(record: ProbeRecord, step: int | None) -> str:
    """'; rows ... of the data set' for the micro-batches of `step` that have no supervised token, read
    from record.data (step i trains batches i*k .. i*k+k-1 of its list, cycled); '' where unknown."""
    data = record.data or {}
    batches, k = data.get("batches") or [], data.get("micro_batches_per_step") or 1
    if step is None or not batches:
        return ""
    trained = [batches[(step * k + j) % len(batches)] for j in range(k)]
    rows = [r for b in trained if b.get("supervised") == 0 for r in b.get("rows") or []]
    if not rows:
        return ""
    where = f" of {data['path']}" if data.get("path") else ""
    return (
        f"; rows {', '.join(map(str, rows))}{where} have no label left (`nandoctor doctor --data` says why: "
        "truncation at max_length, or a completion mask that found no answer)"
    )


def _adapter(record: ProbeRecord) -> str | None:
    return ((record.recipe or {}).get("adapter") or {}).get("type")


def is_reference(record: ProbeRecord) -> bool:
    return record.cell == reference_of(record.cell)


def reference_key(record: ProbeRecord) -> str:
    """Drift is judged against the reference of the same recipe variant and seed, on the same kind of
    hardware (Cell.hardware: fp32 itself differs between GPUs). The recipe is read
    back with today's defaults, so that a record written before a recipe section existed (fp8) meets
    the reference a resumed run writes now."""
    recipe = record.recipe
    try:
        recipe = recipe_to_dict(
            recipe_from_dict({k: v for k, v in recipe.items() if k != "name"}, recipe.get("name", ""))
        )
    except NandoctorError:
        pass  # a recipe this version cannot read (a newer one's) is compared as written
    recipe = with_load_dtype_resolved(recipe)  # "auto" is the dtype it loads
    same = [recipe, record.seed] + ([record.cell.hardware] if record.cell.hardware else [])
    same += [record.cell.quant] if record.cell.quant != "none" else []  # a quantized base has its own reference
    return json.dumps(same, sort_keys=True, default=str)


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


def check_results(
    record: ProbeRecord, vocab: int, random_init: bool, t: Thresholds = THRESHOLDS, verdict: Verdict | None = None
) -> list[tuple[str, bool, str]]:
    """The step-0 sanity checks of `nandoctor check`: (name, passed, detail) each. `verdict`: the probe's
    verdict as a grid judges it (References.judge), a check of its own that fails where the verdict does."""
    failed = harness_verdict(record)
    if failed:
        return [("probe ran", False, f"{failed.name}: {failed.reason}")]
    s0 = record.steps[0]
    untargeted = " (its batch has no supervised token: a fault of the data)" if s0.supervised == 0 else ""
    out = [("loss finite at step 0", math.isfinite(s0.loss), f"loss {_fmt(s0.loss)}{untargeted}")]
    stuck = never_stepped(record.steps, t)
    if s0.skipped and s0.scale is not None and not math.isfinite(s0.grad_norm):
        # not "finite": a GradScaler skips exactly the steps whose gradients overflowed, at the scale it tries
        out.append(
            (
                "step 0's overflowing gradients skipped by the GradScaler",
                True,
                f"grad-norm {_fmt(s0.grad_norm)} at scale {s0.scale:g}: the GradScaler skipped the step and halved "
                "its scale" + (" (every later step too: see the verdict)" if stuck else " (calibrating)"),
            )
        )
    else:
        out.append(("grad-norm finite at step 0", math.isfinite(s0.grad_norm), f"grad-norm {_fmt(s0.grad_norm)}"))
    out.append(("loss is not 0.0", s0.loss != 0.0, f"loss {_fmt(s0.loss)}"))
    dead = no_learning(record.steps, t, record.trainable_groups, _adapter(record))
    out.append(
        (
            "gradients reach the weights",
            dead is None,
            f"{dead.name}: {dead.reason}"
            if dead
            else f"grad-norm {_fmt(s0.grad_norm)} at step {s0.step}"
            + (": the gradients overflowed, they are not absent" if not math.isfinite(s0.grad_norm) else ""),
        )
    )
    setup = setup_failures(record.setup_checks, t)
    if record.setup_checks:
        out.append(
            (
                "the setup passes its step-0 checks",
                not setup,
                "; ".join(setup) or setup_passed(record.setup_checks),
            )
        )
    if random_init and objective(record) == "sft":
        expected = math.log(vocab)
        band = max(t.init_loss_band_nats, t.init_loss_band_rel * expected)
        ok = math.isfinite(s0.loss) and abs(s0.loss - expected) <= band
        out.append(
            (
                "initial loss near ln(vocab)",
                ok,
                f"loss {_fmt(s0.loss)}, ln({vocab}) = {expected:.3f}, band +/-{band:.2f}",
            )
        )
    else:
        why = "real weights are not random-init" if objective(record) == "sft" else "a GRPO loss is no cross-entropy"
        out.append(("initial loss near ln(vocab)", True, f"skipped: {why}"))
    if objective(record) != "sft":  # the off-policy verdict's rule, as a check
        failed, m = rollout_failures(record.rollout_mismatch, t), record.rollout_mismatch or {}
        said = f"mean |dlogp| {_fmt(_num(m.get('logp_diff_mean')))}, masked {_fmt(_num(m.get('masked_share')))}"
        out.append(("rollout log-probs match training", not failed, "; ".join(failed) or said))
    if record.parallel:
        mismatch = parallel_verdict(record, t)
        got = record.parallel.get("grad_agreement") or {}
        out.append(
            (
                "step-0 gradients match one process",
                mismatch is None,
                mismatch.reason
                if mismatch
                else f"largest relative error {_fmt(got.get('max_rel_error', math.nan))}, "
                f"norm ratio {_fmt(got.get('norm_ratio') or math.nan)}",
            )
        )
    if len(record.steps) > 1:  # --steps N: the later steps must stay finite too, not only step 0
        broke = next((s for s in record.steps[1:] if s.unrecoverable(t.min_scale) in ("loss", "grad")), None)
        skipped = sum(s.skipped for s in record.steps[1:])
        out.append(
            (
                # a step the GradScaler skipped has a non-finite grad-norm that never reaches the weights
                "loss and grad-norm finite after step 0"
                if not skipped
                else "loss finite after step 0, overflowing gradients skipped by the GradScaler",
                broke is None,
                f"non-finite at step {broke.step}: loss {_fmt(broke.loss)}, grad-norm {_fmt(broke.grad_norm)}"
                if broke
                else f"steps 1-{record.steps[-1].step}: loss finite"
                + (f", {skipped} with a non-finite grad-norm skipped" if skipped else ", grad-norm finite"),
            )
        )
    bad = [s for s in record.steps if s.unrecoverable(t.min_scale) == "scale"]
    skips = sum(s.skipped for s in record.steps)
    out.append(
        (
            "no skipped step beyond GradScaler calibration",
            not bad and not stuck,
            f"scale fell below {t.min_scale:g} at step {bad[0].step}"
            if bad
            else f"every one of the {skips} steps skipped: the optimizer never stepped"
            if stuck
            else f"{skips} calibration skip(s)",
        )
    )
    if verdict is not None:
        out.append(("verdict", not verdict.failed, f"{verdict.name}: {verdict.reason}"))
    return out


def roundtrip_differs(rt: dict, t: Thresholds = THRESHOLDS) -> list[str]:
    """What makes a round trip (child/roundtrip.py) fail, one phrase each, each naming its tensors and
    their cause; [] when the live, merged and reloaded model agree within the thresholds."""
    if rt.get("error"):
        return [f"the round trip raised {rt['error']}"]
    live = rt["loss"]["live"]
    out = []
    for stage in ("merged", "reloaded"):
        loss, logits = rt["loss"][stage], rt["logits_rel_change"][stage]
        if not math.isfinite(loss) or abs(loss - live) > t.roundtrip_loss_rel * abs(live):
            out.append(f"{stage} loss {_fmt(loss)} against {_fmt(live)} live")
        elif logits > t.roundtrip_logits_rel:
            out.append(f"{stage} logits moved {logits:.3g} of their largest live value")
    evaluated = rt.get("evaluated")
    if evaluated:
        saved, scored = rt["loss"]["reloaded"], evaluated["loss"]
        loss_off = not (math.isfinite(saved) and math.isfinite(scored)) or abs(
            saved - scored
        ) > t.roundtrip_loss_rel * abs(scored)
        if loss_off or evaluated["logits_rel_change"] > t.roundtrip_logits_rel:
            fix = (
                "call optimizer.eval() before trainer.save_model() (optimizer.train() after)"
                if evaluated["saved_in"] == "train"
                else "the eval-mode weights were saved and still differ"
            )
            out.append(
                f"the saved model is not the one evaluate() scores: loss {_fmt(saved)} saved against {_fmt(scored)} "
                f"evaluated (a schedule-free optimizer saved in {evaluated['saved_in']} mode; "
                f"{_tensor_list([r for r in evaluated['tensors'] if _changed(r, t)])}): {fix}"
            )
    if rt.get("unmerged"):
        out.append(f"adapter left unmerged: {', '.join(rt['unmerged'][:4])} still in the merged model")
    merge = [r for r in rt["tensors"]["merge"] if _changed(r, t)]
    if merge:
        cause = "4-bit or 8-bit merge rounding" if rt.get("quantized") else "changed by the merge"
        out.append(f"{cause}: {_tensor_list(merge)}")
    reload = [r for r in rt["tensors"]["reload"] if _changed(r, t)]
    tied = rt["tied"]["reloaded"] and not rt["tied"]["merged"]
    heads = [r for r in reload if "lm_head" in r["tensor"] or "embed" in r["tensor"]] if tied else []
    if heads:
        out.append(f"trained head tied to the embeddings on reload: {_tensor_list(heads)}")
    rest = [r for r in reload if r not in heads]
    if rest:
        out.append(f"changed by save and reload: {_tensor_list(rest)}")
    return out


def _changed(row: dict, t: Thresholds) -> bool:
    if row.get("missing") or row.get("added") or row.get("shape"):
        return True
    if "update_lost" in row:
        return row["update_lost"] > t.roundtrip_update_lost
    return row["rel_change"] > t.roundtrip_tensor_rel


def _tensor_list(rows: list[dict], most: int = 3) -> str:
    def one(r: dict) -> str:
        if r.get("missing") or r.get("added"):
            return f"{r['tensor']} ({'missing' if r.get('missing') else 'added'})"
        if r.get("shape"):
            return f"{r['tensor']} (shape {r['shape'][0]} -> {r['shape'][1]})"
        if "update_lost" in r:
            return f"{r['tensor']} ({r['update_lost']:.0%} of its update lost)"
        return f"{r['tensor']} (changed {r['rel_change']:.2g} of its norm)"

    more = f" and {len(rows) - most} more" if len(rows) > most else ""
    return ", ".join(one(r) for r in rows[:most]) + more


def roundtrip_check(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> tuple[str, bool, str]:
    """`check --roundtrip`'s check: the saved model is the model that was trained."""
    return roundtrip_result(record.roundtrip, record.status == "ok" and not record.first_nonfinite, t)


def roundtrip_result(rt: dict | None, trained: bool, t: Thresholds = THRESHOLDS) -> tuple[str, bool, str]:
    """(check, passed, detail) of a round trip's figures (child/roundtrip.py); `trained`: whether its probe
    trained to the end (a round trip runs only then)."""
    name = "the saved model is the model that was trained"
    if not rt:
        return name, False, f"no round trip: {'no figures' if trained else 'the probe did not train to the end'}"
    differs = roundtrip_differs(rt, t)
    if rt.get("error"):
        return name, False, differs[0]
    loss = rt["loss"]
    how = "merged" if rt["adapter"] else "nothing to merge (a full fine-tune)"
    scored = f", evaluated {rt['evaluated']['loss']:.4f}" if rt.get("evaluated") else ""
    figures = (
        f"loss live {loss['live']:.4f}, merged {loss['merged']:.4f}, reloaded {loss['reloaded']:.4f}{scored} ({how}); "
        f"logits moved {rt['logits_rel_change']['merged']:.2g} / {rt['logits_rel_change']['reloaded']:.2g} "
        f"of their largest live value"
    )
    if differs:
        return name, False, f"{figures}; {'; '.join(differs)}"
    return name, True, f"{figures}; equal within {t.roundtrip_loss_rel:.0%} of the loss"


def _rel(a: float, b: float) -> float | None:
    return abs(a - b) / abs(b) if math.isfinite(a) and math.isfinite(b) and b != 0 else None


def fidelity_curve(steps: list[Step], reference: list[Step] | None) -> list[dict]:
    """Per common step: relative loss and grad-norm error against the fp32 reference (None where
    either value is non-finite). A GradScaler-skipped step still has a loss, so it still counts."""
    return [
        {"step": a.step, "loss": _rel(a.loss, b.loss), "grad_norm": _rel(a.grad_norm, b.grad_norm)}
        for a, b in zip(steps, reference or [])
    ]

"""The rules on a finished loss / grad-norm curve: nonfinite, zero-loss, no-learning, a spike, an explosion,
a rise, a drift from the fp32 reference, a stall, and the batches with no target."""

from __future__ import annotations

import math

from ...record import ProbeRecord, Step
from ...thresholds import THRESHOLDS, Thresholds
from .figures import _fmt
from .table import DIVERGED, DRIFT, NO_LEARNING, NO_TARGET, NONFINITE, STABLE, ZERO_LOSS, Verdict

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
    objective: str = "sft",
) -> Verdict:
    """Classify a finished loss / grad-norm curve, against the fp32 reference curve when given (`against`:
    the reference's name when another fp32 probe stands in for fp32/eager). objective: the recipe's. A
    GRPO loss is a policy-gradient surrogate around 0 of either sign (each group's advantages sum to 0;
    it is exactly 0.0 whenever a step's completions all run to the same length), so its size, a spike of
    it, its rise and its distance from fp32's say nothing of the run: zero-loss, the loss spike, the rise
    and the drift judge an sft curve only, and a grpo curve is judged by nonfinite, no-learning and the
    grad-norm explosion (its rollout mismatch by the off-policy rule).
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
    sft = objective == "sft"
    for s in steps[since:] if sft else ():
        if s.loss == 0.0:
            return Verdict(ZERO_LOSS, f"loss is exactly 0.0 at step {s.step}", s.step)
    dead = no_learning(steps, t, trainable, adapter, objective)
    if dead:
        return dead
    # the earlier of a spike and an explosion, a spike first at the same step: what a live run judging
    # step by step meets first
    jumps = [v for v in (loss_spike(steps, t, since) if sft else None, grad_explosion(steps, t, since)) if v]
    if jumps:
        return min(jumps, key=lambda v: v.step)
    losses = [s.loss for s in steps]
    q = _tail(len(losses), t)
    end = sum(losses[-q:]) / q
    if sft and len(losses) >= t.rise_min_steps and end > losses[0] + t.rise_nats:
        return Verdict(
            DIVERGED, f"loss rose from {_fmt(losses[0])} to {_fmt(end)} (mean of the last {q} steps)", steps[-1].step
        )
    if reference and sft:
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
    from its first batches, every time) of a like size (Step.supervised within spike_size_ratio: a hard
    batch among easy ones of the same kind is no spike); steps before `since` count only as history."""
    kinds = {s.batch for s in steps}

    def like(a: Step, b: Step) -> bool:
        if not a.supervised or not b.supervised:  # synthetic batches, or a size not recorded
            return True
        return max(a.supervised, b.supervised) <= t.spike_size_ratio * min(a.supervised, b.supervised)

    def previous(k: int) -> list[float]:
        """The losses of the last spike_window steps before k of its kind and a like size, in step order,
        read backwards from k until the window is full: a long run costs steps x window, not steps squared.
        A window that is not positive keeps the slice [-spike_window:] of every earlier match."""
        kind, now = steps[k].batch, steps[k]
        if t.spike_window <= 0:
            return [s.loss for s in steps[:k] if s.batch == kind and like(s, now)][-t.spike_window :]
        latest: list[float] = []
        for j in range(k - 1, -1, -1):
            if steps[j].batch == kind and like(steps[j], now):
                latest.append(steps[j].loss)
                if len(latest) == t.spike_window:
                    break
        return latest[::-1]

    for k in range(since, len(steps)):
        kind = steps[k].batch
        window = previous(k)
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


def grad_explosion(steps: list[Step], t: Thresholds = THRESHOLDS, since: int = 0) -> Verdict | None:
    """A grad-norm above grad_explode_factor x the largest of the steps before it (skipped and non-finite
    ones aside); steps before `since` count only as history."""
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
    steps: list[Step],
    t: Thresholds = THRESHOLDS,
    trainable: dict | None = None,
    adapter: str | None = None,
    objective: str = "sft",
) -> Verdict | None:
    """The no-learning verdict of a finite curve, judged on the curve itself (its fp32 reference may be
    as dead): a grad-norm of exactly 0 at every step, a trainable group with no gradient at any step
    (group_no_learning), or, for an sft loss, a loss that never moves (a GRPO surrogate sits at 0.0 when
    every completion has the same length, whatever the weights learn); else None."""
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
    if (
        objective == "sft"
        and len(losses) >= t.no_learning_min_steps
        and all(abs(x - losses[0]) <= t.no_learning_loss_rel * abs(losses[0]) for x in losses)
    ):
        return Verdict(
            NO_LEARNING,
            f"loss stayed at {losses[0]:.6g} for all {len(losses)} steps "
            f"(within {t.no_learning_loss_rel:g} relative): nothing trains",
            steps[0].step,
        )
    return None


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

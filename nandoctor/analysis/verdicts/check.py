"""`nandoctor check`'s step-0 checks, each passed or failed by the rules the verdicts apply."""

from __future__ import annotations

import math

from ...record import ProbeRecord
from ...thresholds import THRESHOLDS, Thresholds
from .curve import _adapter, never_stepped, no_learning
from .figures import _fmt, _num
from .harness import harness_verdict
from .parallel import parallel_verdict
from .rl import objective, rollout_failures
from .setup import setup_failures, setup_passed
from .table import Verdict


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
    if objective(record) == "sft":  # a GRPO loss may be 0.0 (curve.numeric_verdict)
        out.append(("loss is not 0.0", s0.loss != 0.0, f"loss {_fmt(s0.loss)}"))
    dead = no_learning(record.steps, t, record.trainable_groups, _adapter(record), objective(record))
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

"""An RL probe's rollout log-probs against the training path's: the off-policy verdict."""

from __future__ import annotations

import math

from ...record import ProbeRecord
from ...thresholds import THRESHOLDS, Thresholds
from .figures import _fmt, _num
from .table import OFF_POLICY, Verdict


def objective(record: ProbeRecord) -> str:
    """The probe's training objective (recipe field objective): sft, or grpo."""
    return (record.recipe or {}).get("objective") or "sft"


def rollout_failures(mismatch: dict | None, t: Thresholds = THRESHOLDS) -> list[str]:
    """One clause per way an RL probe's rollout mismatch (record.rollout_mismatch) is beyond the bounds
    (Thresholds.off_policy), each with its figures; [] when inside them or not measured."""
    m = mismatch or {}
    mean, masked, cap = m.get("logp_diff_mean"), m.get("masked_share"), t.mask_cap(m.get("mask_cap"))
    out = []
    for cause in t.off_policy(mean, masked, cap):
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
                "TRL's sequence mask drops them"
            )
    return out


def rollout_verdict(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> Verdict | None:
    """`off-policy` when an RL probe's rollout mismatch is beyond the bounds (rollout_failures), else None."""
    failed = rollout_failures(record.rollout_mismatch, t) if objective(record) != "sft" else []
    fix = "; fp16 (fp16-amp) rounds 8x finer than bf16, and an importance-sampling correction bounds the rest"
    return Verdict(OFF_POLICY, "; ".join(failed) + fix, 0) if failed else None

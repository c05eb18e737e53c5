"""Turn one probe record into one verdict with a one-line reason, and judge every probe against the
right fp32 reference (References). Pure: no torch, no processes. Every threshold lives in
thresholds.Thresholds.

By concern: the verdict table (table.py), a probe that did not finish (harness.py), a parallel probe's
gradients (parallel.py), the setup's step-0 checks (setup.py), a mixture of experts' routing (moe.py),
the curve's rules (curve.py), RL's rollout (rl.py), the rules in order (classify.py), the fp32 reference
(references.py), `check`'s results (check.py) and the round trip (roundtrip.py). Every public name is
re-exported here.
"""

from .check import check_results
from .classify import classify, judged_facts
from .curve import (
    ADAPTER_WORDS,
    GROUP_WORDS,
    group_no_learning,
    loss_spike,
    never_stepped,
    no_learning,
    numeric_verdict,
    stall_verdict,
    starved_groups,
    untargeted,
    untargeted_rows,
    update_lost,
)
from .harness import CRASH_SIGNALS, harness_verdict, known_crash
from .moe import collapse_unjudged, collapsed_layers, route_flips, router_verdict, routing_cause
from .parallel import agreement_tolerance, parallel_verdict
from .references import (
    Reference,
    References,
    fidelity,
    fidelity_curve,
    is_reference,
    reference_key,
    stand_in_order,
    without_reference,
)
from .rl import objective, rollout_failures, rollout_verdict
from .roundtrip import roundtrip_check, roundtrip_differs, roundtrip_result
from .setup import accumulation_cause, misweighted_groups, setup_failures, setup_judged, setup_passed, setup_verdict
from .table import (
    CRASH,
    DIVERGED,
    DRIFT,
    EXPERT_COLLAPSE,
    FAIL_ON,
    GRAD_MISMATCH,
    HARNESS_FAILURES,
    KILLED,
    MISCONFIGURED,
    NO_LEARNING,
    NO_TARGET,
    NONFINITE,
    OFF_POLICY,
    OOM,
    STABLE,
    TIMEOUT,
    UNRESOLVED_VERDICTS,
    UNSUPPORTED,
    VERDICT,
    VERDICTS,
    ZERO_LOSS,
    Verdict,
    VerdictKind,
)

__all__ = [
    "STABLE",
    "NONFINITE",
    "ZERO_LOSS",
    "DIVERGED",
    "DRIFT",
    "NO_LEARNING",
    "MISCONFIGURED",
    "CRASH",
    "OOM",
    "TIMEOUT",
    "KILLED",
    "UNSUPPORTED",
    "NO_TARGET",
    "EXPERT_COLLAPSE",
    "GRAD_MISMATCH",
    "OFF_POLICY",
    "VerdictKind",
    "VERDICTS",
    "VERDICT",
    "HARNESS_FAILURES",
    "UNRESOLVED_VERDICTS",
    "FAIL_ON",
    "Verdict",
    "CRASH_SIGNALS",
    "known_crash",
    "harness_verdict",
    "agreement_tolerance",
    "parallel_verdict",
    "setup_failures",
    "misweighted_groups",
    "accumulation_cause",
    "setup_judged",
    "setup_passed",
    "setup_verdict",
    "collapsed_layers",
    "collapse_unjudged",
    "router_verdict",
    "route_flips",
    "routing_cause",
    "GROUP_WORDS",
    "ADAPTER_WORDS",
    "starved_groups",
    "group_no_learning",
    "numeric_verdict",
    "untargeted",
    "loss_spike",
    "never_stepped",
    "no_learning",
    "update_lost",
    "stall_verdict",
    "untargeted_rows",
    "objective",
    "rollout_failures",
    "rollout_verdict",
    "judged_facts",
    "classify",
    "is_reference",
    "reference_key",
    "Reference",
    "stand_in_order",
    "without_reference",
    "References",
    "fidelity",
    "fidelity_curve",
    "check_results",
    "roundtrip_differs",
    "roundtrip_check",
    "roundtrip_result",
]

"""The verdict table: each verdict's name as a constant, and its row (VerdictKind: whether it fails or is
unresolved, its colour, mark and advice), which every list of verdicts reads; the Verdict a judge returns."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Verdict:
    name: str
    reason: str
    step: int | None = None

    @property
    def failed(self) -> bool:
        return VERDICT[self.name].failed

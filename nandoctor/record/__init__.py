"""Typed contracts at the process and file boundaries: what the child reads (ProbeSpec, with the
ModelPlan the parent decided: spec.py) and what every probe leaves in results.jsonl (ProbeRecord of
Steps: result.py, steps.py, throughput.py); the warm worker's messages (worker_messages.py) and the
file and environment names both processes agree on (names.py).

Each has `to_dict` / `from_dict`; `from_dict` ignores keys it does not know, so that records written
by earlier versions still read (fields.py).

Foundation package: imports only config, thresholds, cells and device.
"""

from .names import BUILT_FILE, PARENT_ENV, REPLAY_RUNNING, STALE_FILES, ZYGOTE_ENV
from .result import ProbeRecord
from .spec import ModelPlan, ProbeSpec
from .steps import Step
from .throughput import WARMUP_RATE_SHARE, Throughput, steady_rates, warmup_steps
from .worker_messages import WORKER_MESSAGES, Exited, Fork, Preload, Ready, Started, message_line, read_message

__all__ = [
    "BUILT_FILE",
    "PARENT_ENV",
    "REPLAY_RUNNING",
    "STALE_FILES",
    "ZYGOTE_ENV",
    "ProbeRecord",
    "ModelPlan",
    "ProbeSpec",
    "Step",
    "WARMUP_RATE_SHARE",
    "Throughput",
    "steady_rates",
    "warmup_steps",
    "WORKER_MESSAGES",
    "Exited",
    "Fork",
    "Preload",
    "Ready",
    "Started",
    "message_line",
    "read_message",
]

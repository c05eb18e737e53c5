"""The warm worker's protocol (child/worker.py, run/slots.py WarmSlot): one JSON object per line, on two
pipes of their own (never the worker's stdout, where any import may print). The parent sends Preload
and Fork; the worker answers Ready once it has imported, then Started and Exited per fork."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field


@dataclass
class Preload:
    """Import this model type's modeling code (and peft, for an adapter) before the next fork."""

    model_type: str | None
    adapter: bool = False


@dataclass
class Fork:
    """Fork a child that runs a probe (kind "spec": child/entry.py) or plans the run (kind "plan":
    child/plan.py) from `path`, its output in `log`. env: variables the child sets before anything
    else runs (CUDA_VISIBLE_DEVICES: the GPUs this probe was given)."""

    kind: str
    path: str
    result: str
    log: str
    env: dict = field(default_factory=dict)


@dataclass
class Ready:
    """The worker has imported everything; `threads` it holds (None where procfs cannot count them)."""

    pid: int
    threads: int | None


@dataclass
class Started:
    """A forked child runs; the worker held `threads` threads when it forked."""

    pid: int
    threads: int | None


@dataclass
class Exited:
    """A forked child ended: returncode n < 0 means killed by signal -n."""

    pid: int
    returncode: int


WORKER_MESSAGES = {cls.__name__: cls for cls in (Preload, Fork, Ready, Started, Exited)}


def message_line(message) -> str:
    """The one line a worker message travels as (the writer)."""
    return json.dumps({"type": type(message).__name__, **dataclasses.asdict(message)}) + "\n"


def read_message(line: str):
    """The worker message of one line (the reader), or None for a line that is not one."""
    try:
        data = json.loads(line)
        kind = WORKER_MESSAGES[data.pop("type")]
        return kind(**data)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None

"""What a placement (on_slurm.py, on_ray.py) is handed and hands back: the probes it places, and how
each one's job ended. Kept apart from remote.py, which imports the placements."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import NandoctorError
from .runner import ProbeTask


@dataclass
class Ending:
    """How a placed probe's job ended: the node's outcome (placed.run_placed's dict) when it wrote one,
    the scheduler's end state, and the files a placement without a shared filesystem carried back."""

    state: str
    placed: dict | None = None
    files: dict = field(default_factory=dict)
    detail: str = ""  # what the scheduler said, for a lost probe's reason


@dataclass
class PlacedProbe:
    task: ProbeTask
    folder: Path
    attempt: int = 1
    handle: Any = None  # the placement's own handle (a submitit job, a Ray ObjectRef)
    job_id: str | None = None
    state: str = "queued"  # queued | running
    queued_at: float = 0.0  # when it was placed, or when its own array's throttle last held it back
    waiting: str = ""  # why the scheduler has not started it (SLURM's pending reason, Ray's resources)
    started: float | None = None  # when the scheduler first reported it running
    cancelled: bool = False  # by us, on its timeout
    seen_done: float | None = None  # when the scheduler first said it ended (its files may lag on a shared filesystem)
    lost: list[str] = field(default_factory=list)  # why earlier attempts failed

    @property
    def ranks(self) -> int:
        """The processes this probe runs as: world_size for a parallel cell, else 1."""
        spec = self.task.spec
        return spec.recipe.world_size if spec.cell.parallel_row.wrapper else 1

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started if self.started else 0.0


def missing_extra(kind: str, module: str) -> NandoctorError:
    return NandoctorError(f"--executor {kind} needs the {module} package: pip install 'nandoctor[{kind}]'")

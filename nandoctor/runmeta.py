"""A run's meta (run.json): what was asked and on what, as typed data.

One writer, one reader: `Session.start` writes it (grid, check and bisect add their own fields),
`RunMeta.from_dict` reads what any version wrote, for the analysis, the reports, --resume and a diff. A
key an older version did not write reads as its field's default; `to_dict` writes back exactly the keys
that were read, in their order, the unknown ones included. The recipe and the model plan stay the data
they were written as (recipe_from_dict and ModelPlan.from_dict read them where a typed one is needed:
an older run's recipe may lack sections, a report still renders it).

Foundation module: imports only typed and device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .device import DeviceFacts
from .typed import AsWritten


@dataclass(frozen=True)
class RunMeta(AsWritten):
    kind: str | None = None  # grid, check, bisect; watch: a training callback's report
    run_id: str | None = None
    created: str | None = None
    command: str | None = None  # the command line, argv joined by spaces
    recipe: dict = field(default_factory=dict)  # recipe_to_dict
    model_plan: dict = field(default_factory=dict)  # ModelPlan.to_dict
    steps: int | None = None
    seed: int | None = None
    jobs: int | None = None
    env: DeviceFacts | None = None  # the facts the run was planned with
    planned: int | None = None  # probes planned
    executor: str | None = None  # where probes ran: local, slurm, ray
    # an executor's device facts per kind of hardware, gathered where its probes run
    env_by_hardware: dict[str, DeviceFacts] = field(default_factory=dict)
    # grid and check
    axes: dict = field(default_factory=dict)  # the --axis values asked for
    doctor: dict | None = None  # doctor.doctor_section: capabilities, setup, findings
    baseline: str | None = None  # the --baseline run directory
    cell: str | None = None  # a check's cell id
    # bisect: the configurations, its settings, and the --good / --bad / --factor as given (--resume)
    good: dict | None = None
    bad: dict | None = None
    reruns: int | None = None
    data_seeds: int | None = None
    fail_on: list | None = None
    request: dict | None = None
    model_flags: list | None = None
    data: dict | None = None  # doctor.data_lint of the user's rows, run before the first probe (None: synthetic)
    run_dir: str | None = (
        None  # where the run is now (analysis.outcomes.analyze), which may not be where it was written
    )

    @classmethod
    def from_dict(cls, data: dict) -> RunMeta:
        return cls.read(
            data,
            {
                "env": DeviceFacts.of,
                "env_by_hardware": lambda kinds: {k: DeviceFacts.of(f) for k, f in (kinds or {}).items()},
            },
        )

    def to_dict(self) -> dict:
        return self.written(
            {
                "env": lambda env: env.to_dict() if env is not None else None,
                "env_by_hardware": lambda kinds: {k: f.to_dict() for k, f in kinds.items()},
            }
        )

    @classmethod
    def of(cls, meta: RunMeta | dict) -> RunMeta:
        """A meta given as RunMeta or as the dict run.json holds (a test's, a training callback's)."""
        return meta if isinstance(meta, RunMeta) else cls.from_dict(meta)

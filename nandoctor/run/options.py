"""How a run goes, whichever command starts it (grid, check, bisect, their --resume): where it writes,
how many probes at once, how many steps, where they run, and who hears about it. The CLI builds one
RunOptions from its flags (cli/args.options_from_args); a Python caller builds its own, or passes the
same names as keywords to the api functions."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

from ..device import DeviceFacts
from ..executors import ExecutorConfig
from .cache import ProbeCache


@dataclass
class Listener:
    """What a run tells its caller while it goes; every hook is optional.

    opened(run_dir): at once, when the run directory is chosen (before the device facts and the model plan);
    started(run_dir, plan, warnings): once the model is planned, before any probe runs;
    probe(done, planned, record, verdict): each record as it is kept, judged against the references so far;
    alive(probe_id, elapsed_s, step): every HEARTBEAT_S while a probe runs (step: its last step as a dict, or None);
    queue(queued, running, done, job_ids, queue_wait, retries): a scheduler's queue as it changes (slurm, ray);
    retiming(news): what a grid's re-timing of its leading cells does, a retime.RetimeNews: before its first
      rounds, before each two added, while a round runs (at least every 10 s), or that it re-times nothing;
    stale(probe_ids): a resumed run reruns these recorded probes, whose inputs changed since;
    note(line): before the first probe of a compute dtype this CPU emulates, that dtype and its measured cost
      (capabilities.emulated_notes);
    uncached({probe_id: 'T of P'}): --cache kept none of these probes, each trained with T of its P planned
      CPU threads while other processes held cores;
    step(step): each step of a bisection's search, a bisect.engine.Step, as it is decided.
    """

    opened: Callable | None = None
    started: Callable | None = None
    probe: Callable | None = None
    alive: Callable | None = None
    queue: Callable | None = None
    retiming: Callable | None = None
    stale: Callable | None = None
    note: Callable | None = None
    uncached: Callable | None = None
    step: Callable | None = None


@dataclass(frozen=True)
class RunOptions:
    """out: the run directory, new or empty (None: reports/<run-id>); jobs: probes at once on this machine
    (None: local.LocalPlacement packs them); steps: training steps per probe (None: the recipe's; a check's 1);
    device: the device facts to plan with (None: gathered); warm=False starts a cold Python process per
    probe; cache: a ProbeCache that reuses records with an identical fingerprint and keeps the new ones;
    executor: where the probes run (None: this machine's slots); listener: who hears about the run;
    baseline: a run directory to compare with (grid, check); roundtrip: the recommended cell (grid) or the
    checked one (check) is merged, saved and reloaded after its steps; replay_failed_only: the forensics
    replay runs only after a non-finite step (what a check sets); trainer: {"kind", "args"} (--trainer-args,
    knowledge.facts.trainer_of): every probe trains with that trainer class (child/trainer.py), None: with
    nandoctor's own loop."""

    out: str | os.PathLike | None = None
    jobs: int | None = None
    steps: int | None = None
    device: DeviceFacts | dict | None = None
    warm: bool = True
    cache: ProbeCache | None = None
    executor: ExecutorConfig | None = None
    listener: Listener | None = None
    baseline: str | os.PathLike | None = None
    roundtrip: bool = False
    replay_failed_only: bool = False
    trainer: dict | None = None

    def hooks(self) -> Listener:
        """The listener, or one that hears nothing."""
        return self.listener or Listener()


def run_options(options: RunOptions | None = None, **settings) -> RunOptions:
    """`options` (default RunOptions()) with `settings`, RunOptions' fields by name, set over it; a name
    that is not one is a TypeError, as a wrong keyword argument is."""
    names = [f.name for f in dataclasses.fields(RunOptions)]
    unknown = [name for name in settings if name not in names]
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}; run options: {', '.join(names)}")
    return dataclasses.replace(options or RunOptions(), **settings)

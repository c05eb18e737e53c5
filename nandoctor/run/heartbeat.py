"""The line a running probe says every HEARTBEAT_S: that it is alive, for how long, and its last step."""

from __future__ import annotations

from .task import last_step

HEARTBEAT_S = 15.0  # how often a running probe says it is alive


class Heartbeat:
    """Called by the scheduling loop with the running probes at least every second; calls
    on_alive(probe_id, elapsed_s, last step or None) for each probe every `every` seconds it runs.
    step_of(probe) reads a probe's last step (its placement's, where its files are not here); by
    default from its folder's steps.jsonl."""

    def __init__(self, on_alive, every: float = HEARTBEAT_S):
        self.on_alive, self.every = on_alive, every
        self.beats: dict[tuple, int] = {}  # (probe id, start time) -> heartbeats given

    def __call__(self, running, step_of=None) -> None:
        for probe in running:
            key = (probe.task.probe_id, probe.started)
            due = int(probe.elapsed // self.every)
            if due > self.beats.get(key, 0):
                self.beats[key] = due
                step = step_of(probe) if step_of else last_step(probe.folder / "steps.jsonl")
                self.on_alive(probe.task.probe_id, probe.elapsed, step)

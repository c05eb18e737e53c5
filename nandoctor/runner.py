"""Run probes in isolated OS processes, a few at a time, and append each result to the store.

Whatever a probe does — raise, segfault, abort, run out of memory, hang — the runner turns it into a
record and goes on. Each probe gets its own folder under <run>/probes/ with spec.json, steps.jsonl,
result.json and log.txt.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .store import ResultsStore

LOG_TAIL_CHARS = 4000
POLL_S = 0.05


@dataclass
class ProbeTask:
    probe_id: str
    spec: dict  # what the child reads: recipe, cell, model plan, steps, seed, device
    timeout_s: float
    extra: dict = field(default_factory=dict)  # copied into the record (overrides, reference flag, ...)


def probe_dir(run_dir: Path, probe_id: str) -> Path:
    return run_dir / "probes" / probe_id.replace("/", "__").replace("=", "-").replace(",", "+").replace(" ", "_")


def threads_per_probe(jobs: int, cpu_count: int) -> int:
    """Divide the cores so that K probes at once do not oversubscribe them."""
    return max(1, cpu_count // max(1, jobs))


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_CHARS))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _read_steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line))
        except ValueError:
            break  # the line the child was writing when it died
    return steps


def collect(task: ProbeTask, folder: Path, returncode: int | None, timed_out: bool, wall_s: float) -> dict:
    """Build the probe's record from whatever the child left behind."""
    record = {"probe_id": task.probe_id, "cell": task.spec["cell"], "seed": task.spec["seed"],
              "steps_planned": task.spec["steps"], "device": task.spec["device"], "wall_s": wall_s, "timeout_s": task.timeout_s,
              "exit_code": returncode, "signal": None, "error": None, **task.extra}
    result_path = folder / "result.json"
    result = {}
    if result_path.exists():
        try:
            result = json.loads(result_path.read_text())
        except ValueError:
            result = {}
    record.update({k: v for k, v in result.items() if k != "error"})
    record["steps"] = result.get("steps") or _read_steps(folder / "steps.jsonl")
    if timed_out:
        record["status"] = "timeout"
    elif returncode is not None and returncode < 0:
        record["status"], record["signal"] = "signal", signal.Signals(-returncode).name
    elif result.get("error"):
        record["status"], record["error"] = "error", result["error"]
    elif returncode == 0 and result:
        record["status"] = "ok"
    else:
        record["status"] = "error"
        record["error"] = {"type": "ProbeExit", "message": f"probe process exited {returncode} without a result",
                           "traceback": "", "oom": False}
    if record["status"] != "ok":
        record["log_tail"] = _tail(folder / "log.txt")
    record["recipe"] = task.spec["recipe"]
    record["model"] = task.spec["model_plan"]
    return record


class ProbeRunner:
    """Starts each probe as `python -m nandoctor.probe` in a new session (so a timeout kills its
    whole process group), at most `jobs` at once."""

    def __init__(self, run_dir: Path, store: ResultsStore, jobs: int = 1, gpus: int = 0):
        self.run_dir = Path(run_dir)
        self.store = store
        self.jobs = max(1, jobs)
        self.gpus = gpus

    def _start(self, task: ProbeTask, slot: int):
        folder = probe_dir(self.run_dir, task.probe_id)
        folder.mkdir(parents=True, exist_ok=True)
        for stale in ("result.json", "steps.jsonl"):
            (folder / stale).unlink(missing_ok=True)
        (folder / "spec.json").write_text(json.dumps(task.spec, default=str))
        env = dict(os.environ)
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(slot % self.gpus)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env["TOKENIZERS_PARALLELISM"] = "false"
        log = open(folder / "log.txt", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "nandoctor.probe", str(folder / "spec.json"), str(folder / "result.json")],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        return proc, folder, time.monotonic()

    def run(self, tasks: list[ProbeTask], on_record=None) -> list[dict]:
        """Run every task; each record is appended to the store the moment its probe ends."""
        pending = list(tasks)
        running: dict[int, tuple] = {}
        records = []
        while pending or running:
            for slot in range(self.jobs):
                if slot not in running and pending:
                    task = pending.pop(0)
                    running[slot] = (task, *self._start(task, slot))
            time.sleep(POLL_S)
            for slot, (task, proc, folder, started) in list(running.items()):
                elapsed = time.monotonic() - started
                timed_out = proc.poll() is None and elapsed > task.timeout_s
                if timed_out:
                    _kill_group(proc)
                if proc.poll() is None:
                    continue
                del running[slot]
                record = collect(task, folder, proc.returncode, timed_out, elapsed)
                self.store.append(record)
                records.append(record)
                if on_record:
                    on_record(record)
        return records


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()

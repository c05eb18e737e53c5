"""A parallel probe: W rank processes run as one probe, with one spec, one record and one timeout.

`python -m nandoctor.child SPEC RESULT` with a parallel cell lands here (entry.main), so whatever
places that one command (a slot, an executor's job) places the whole W-rank probe. This process forks
the ranks (parallel.main in each, with RANK / WORLD_SIZE / LOCAL_RANK in its environment as torchrun
sets them, and a rendezvous file in the probe's folder, so that two probes never race for a port),
prefixes their output with their rank, and watches them. Forked from a warm worker's child, the ranks
start with torch and transformers already imported; the launcher forks before it starts any thread
and runs no torch op, for the reasons worker.py gives.

The ranks stay in this process's process group and die with it (PR_SET_PDEATHSIG): a timeout that
kills the group kills every rank. When one rank dies or raises, the others are killed at once (they
would wait for it in a collective until the backend's own timeout), and this process ends the way that
rank did: by the same signal, or with its exit code, so that the probe's one record is classified like
a one-process probe's. result.json is rank 0's record with every rank's exit and peak memory (`ranks`)
and the rank that failed (`failed_rank`).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from .. import jsonio
from ..env import VISIBLE_DEVICES_ENV, parse_visible_devices
from ..record import REPLAY_RUNNING, ProbeSpec
from .lifetime import die_with_parent
from .parallel import rank_file, rendezvous_file

POLL_S = 0.05


def rank_env(rank: int, world_size: int, device: str) -> dict:
    """The environment of rank `rank` of `world_size`: this process's, with the variables torchrun sets
    and the one device the rank may use. A GPU rank r gets the r-th entry of the CUDA_VISIBLE_DEVICES this
    launcher received, as spelled (an index, GPU-<uuid>, MIG-<uuid>; unset: GPU r), so that a probe never
    touches a GPU it was not given; fewer entries than ranks is a RuntimeError (the planner places a
    W-rank probe only where W GPUs are visible). CPU ranks run over gloo with CUDA hidden."""
    env = dict(
        os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
    )
    if device != "cuda":
        env[VISIBLE_DEVICES_ENV] = ""
        return env
    given = parse_visible_devices(os.environ.get(VISIBLE_DEVICES_ENV))
    if given is not None and len(given) < world_size:
        raise RuntimeError(
            f"a {world_size}-rank probe was given {len(given)} GPU(s) "
            f"({VISIBLE_DEVICES_ENV}={os.environ[VISIBLE_DEVICES_ENV]!r}); it needs one per rank"
        )
    env[VISIBLE_DEVICES_ENV] = str(rank) if given is None else given[rank]
    return env


def _relay(rank: int, fd: int) -> None:
    """Copy a rank's output into the probe's log, each line marked with its rank."""
    with os.fdopen(fd, "rb") as stream:
        for line in iter(stream.readline, b""):
            sys.stdout.buffer.write(b"[rank %d] " % rank + line)
            sys.stdout.buffer.flush()


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def first_failure(codes: list[int | None]) -> int | None:
    """The rank whose failure ended the probe: one killed by a signal before one that exited non-zero
    (a rank whose peer died exits with the backend's connection error), then the lowest rank."""
    failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
    return min(failed, key=lambda r: (codes[r] > 0, r)) if failed else None


class Rank:
    """A forked rank: its pid, its output pipe, and its exit status once it has one."""

    def __init__(self, rank: int, pid: int, output: int):
        self.rank, self.pid, self.output = rank, pid, output
        self.code: int | None = None

    def poll(self) -> int | None:
        if self.code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
        return self.code

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def watch(ranks: list[Rank], tick=lambda: None) -> tuple[list[int | None], int | None]:
    """Wait until every rank has exited 0, or until one fails; then kill the ranks still running.
    `tick` runs at every poll. Returns every rank's exit status (None: killed here because another
    rank failed) and the failed rank."""
    while True:
        tick()
        codes = [r.poll() for r in ranks]
        failed = first_failure(codes)
        if failed is not None or all(c == 0 for c in codes):
            break
        time.sleep(POLL_S)
    if failed is not None:
        time.sleep(POLL_S)  # a rank that died in the same instant is counted as failed, not as killed here
        codes = [r.poll() for r in ranks]
        failed = first_failure(codes)
        for r in ranks:
            if r.code is None:
                r.kill()
                os.waitpid(r.pid, 0)
    return codes, failed


def _read(path: Path) -> dict:
    try:
        return jsonio.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _ended(code: int) -> str:
    return _signal_name(code) if code < 0 else f"exit {code}"


def merge_forensics(own: list[dict], codes: list[int | None], failed: int | None) -> dict | None:
    """The probe's forensics from its ranks' replays: rank 0's record with every rank's events (each
    carries its rank) and each rank's replay in brief; a replay that raised or died on any rank is
    the probe's forensics error, naming the rank."""
    replays = [mine.get("forensics") for mine in own]
    if not any(replays):
        return None
    for r, f in enumerate(replays):
        if f and "error" in f:
            return {**f, "error": f"rank {r}: {f['error']}"}
    if failed is not None or any(f == REPLAY_RUNNING for f in replays):
        who = failed if failed is not None else next(r for r, f in enumerate(replays) if f == REPLAY_RUNNING)
        how = _ended(codes[who]) if codes[who] is not None else "stopped"
        return {"error": f"rank {who} ended ({how}) during the replay"}
    merged = dict(replays[0])
    merged["events"] = [e for f in replays for e in f.get("events", [])]
    merged["ranks"] = [
        {
            "rank": r,
            "reproduced": f.get("reproduced"),
            "events": len(f.get("events", [])),
            "seconds": (f.get("cost") or {}).get("seconds"),
        }
        for r, f in enumerate(replays)
    ]
    return merged


class TimedResult:
    """Publishes the probe's timed result (forensics REPLAY_RUNNING) once every rank has written its
    own before replaying, so that the runner gives the replay its own budget, as for one process."""

    def __init__(self, result: Path, world_size: int):
        self.result, self.world_size = result, world_size
        self.ready: set[int] = set()
        self.written = False

    def __call__(self) -> None:
        if self.written:
            return
        for r in set(range(self.world_size)) - self.ready:
            path = rank_file(self.result, r)
            if path.exists() and _read(path).get("forensics") == REPLAY_RUNNING:
                self.ready.add(r)
        if len(self.ready) == self.world_size:
            codes = [0] * self.world_size
            _publish(self.result, merge(self.result, codes, None, forensics=False) | {"forensics": REPLAY_RUNNING})
            self.written = True


def _publish(result: Path, record: dict) -> None:
    tmp = result.with_suffix(".tmp")
    tmp.write_text(jsonio.dumps(record))
    os.replace(tmp, result)  # the runner never reads half a file


def merge(result: Path, codes: list[int | None], failed: int | None, forensics: bool = True) -> dict:
    """The probe's record from its ranks' own: rank 0's measurements, every rank's end and memory,
    the failed rank's error under its rank's name, and (with `forensics`) the ranks' replays merged."""
    own = [_read(rank_file(result, r)) for r in range(len(codes))]
    record = dict(own[0])
    if forensics:
        record["forensics"] = merge_forensics(own, codes, failed)
    record["ranks"] = [
        {
            "rank": r,
            "exit": code,
            "signal": _signal_name(code) if code is not None and code < 0 else None,
            "killed": code is None,
            "peak_memory_bytes": mine.get("peak_memory_bytes"),
            "peak_memory_kind": mine.get("peak_memory_kind"),
        }
        for r, (code, mine) in enumerate(zip(codes, own))
    ]
    record["failed_rank"] = failed
    if failed is not None:
        error = own[failed].get("error")
        if error:
            record["error"] = {**error, "message": f"rank {failed}: {error.get('message', '')}"}
        else:
            record.pop("error", None)
        print(
            f"nandoctor launch: rank {failed} ended ({_ended(codes[failed])}); the other ranks were stopped", flush=True
        )
    return record


def end_like(code: int) -> int:
    """Leave this process the way the failed rank left its own: by its signal, or with its code."""
    if code < 0:
        faulthandler.disable()  # this process's own death is not the rank's stack
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)  # a signal that does not end a process (none of those a rank dies of)
    return code if code > 0 else 1


def fork_rank(rank: int, world_size: int, spec: ProbeSpec, spec_path: Path, result: Path) -> Rank:
    """Fork rank `rank`: its output goes to a pipe, its environment says which rank it is."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(write)
        return Rank(rank, pid, read)
    try:
        die_with_parent()
        os.close(read)
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.environ.update(rank_env(rank, world_size, spec.device))
        from .parallel import main

        main([str(spec_path), str(result)])  # ends the process
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def launch(spec: ProbeSpec, spec_path: Path, result: Path) -> int:
    """Run the W ranks of the probe `spec` and write its one result; returns the exit code."""
    world_size = spec.recipe.world_size
    for r in range(world_size):
        rank_file(result, r).unlink(missing_ok=True)
    rendezvous_file(result).unlink(missing_ok=True)  # a file store left by an earlier attempt would be joined
    ranks = [fork_rank(r, world_size, spec, spec_path, result) for r in range(world_size)]
    print(
        f"nandoctor launch: pid {os.getpid()}, {spec.device} ranks "
        + ", ".join(f"{r.rank}=pid {r.pid}" for r in ranks),
        flush=True,
    )
    relays = [threading.Thread(target=_relay, args=(r.rank, r.output), daemon=True) for r in ranks]
    for t in relays:
        t.start()
    timed = TimedResult(result, world_size)
    codes, failed = watch(ranks, tick=timed)
    for t in relays:
        t.join(timeout=2)
    if timed.written and failed is not None:  # the timed steps ended on every rank: their verdict stands
        record = merge(result, codes, None, forensics=False)
        record["forensics"] = merge_forensics([_read(rank_file(result, r)) for r in range(world_size)], codes, failed)
        print(
            f"nandoctor launch: rank {failed} ended ({_ended(codes[failed])}) during the forensics replay; "
            "the other ranks were stopped",
            flush=True,
        )
        _publish(result, record)
        return 0
    _publish(result, merge(result, codes, failed))
    return 0 if failed is None else end_like(codes[failed])

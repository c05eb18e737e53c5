"""The probe cache: finished probe records from earlier runs, looked up by fingerprint (`--cache`).

It lives in $NANDOCTOR_CACHE_DIR, else $XDG_CACHE_HOME/nandoctor, else ~/.cache/nandoctor, as one
append-only probes.jsonl. Only outcomes that a rerun would repeat are kept: probes that finished
(whatever their numbers did) and probes that raised. Timeouts, signals and out-of-memory depend on
the machine's load and memory at the time, so they are always rerun; so is a CPU probe that trained
with fewer threads than planned because other processes held cores (child/threads.py): CPU kernels
split their sums by thread count, so its last digits depend on the load at the time.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .. import jsonio
from ..record import ProbeRecord

CACHE_FILE = "probes.jsonl"


def default_cache_dir() -> Path:
    if os.environ.get("NANDOCTOR_CACHE_DIR"):
        return Path(os.environ["NANDOCTOR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nandoctor"


def cacheable(record: ProbeRecord) -> bool:
    """Whether a rerun of the probe would repeat `record` (see above)."""
    if record.cached_from or not record.fingerprint or gave_up_threads(record):
        return False
    return record.status == "ok" or (record.status == "error" and not record.error.get("oom"))


def gave_up_threads(record: ProbeRecord) -> str | None:
    """'T of P' when the probe trained with T CPU threads of the P planned, other processes holding
    cores (child/threads.py): a probe the cache never keeps on a busy host; else None."""
    threads = record.cpu_threads or {}
    if threads and threads.get("torch") != threads.get("planned"):
        return f"{threads.get('torch')} of {threads.get('planned')}"
    return None


class ProbeCache:
    def __init__(self, directory: str | Path | None = None):
        self.dir = Path(directory or default_cache_dir())
        self._index: dict[str, tuple[ProbeRecord, str]] | None = None

    @property
    def path(self) -> Path:
        return self.dir / CACHE_FILE

    def _records(self) -> dict[str, tuple[ProbeRecord, str]]:
        if self._index is None:
            self._index = {}
            if self.path.exists():
                for line in self.path.read_text().splitlines():
                    try:
                        entry = jsonio.loads(line)
                    except ValueError:
                        continue  # a line cut off by a crash
                    self._index[entry["fingerprint"]] = (ProbeRecord.from_dict(entry), entry["run_dir"])
        return self._index

    def lookup(self, fingerprint: str) -> tuple[ProbeRecord, str] | None:
        """(the cached record, the run directory it was measured in), or None."""
        return self._records().get(fingerprint)

    def add(self, record: ProbeRecord, run_dir: Path) -> None:
        if not cacheable(record):
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = (jsonio.dumps({**record.to_dict(), "run_dir": str(run_dir)}) + "\n").encode()
        # runs that share the cache append at once: a record is one locked write, never interleaved
        # with another run's (a long record takes several write calls of a buffered file)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        self._records()[record.fingerprint] = (record, str(run_dir))

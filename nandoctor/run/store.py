"""The results store of one run directory: run.json (what was asked) and results.jsonl (one probe
record per line, appended and fsynced as each probe finishes, so an interrupted run loses nothing)."""

from __future__ import annotations

import os
from pathlib import Path

from .. import jsonio
from ..errors import NandoctorError
from ..record import ProbeRecord

RUN_FILE = "run.json"
RESULTS_FILE = "results.jsonl"
BISECT_FILE = "bisect.json"  # the bisection path, culprits and recommendation of a `bisect` run
ROUNDTRIP_FILE = "roundtrip.json"  # grid --roundtrip: the recommended cell merged, saved and reloaded (api.py)
RETIME_FILE = "retime.json"  # a grid's leading cells re-timed back to back, interleaved (nandoctor/retime.py)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`: a full disk or a
    kill mid-write leaves the old file (or none), never a truncated one. Raises OSError."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def cannot_write(path: Path, e: OSError) -> NandoctorError:
    """The one-line error for a run-directory file the OS refused to write (full disk, read-only, ...)."""
    return NandoctorError(f"cannot write {path}: {e.strerror or e}")


class ResultsStore:
    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)

    @property
    def results_path(self) -> Path:
        return self.dir / RESULTS_FILE

    def create(self, meta: dict) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise cannot_write(self.dir, e) from None
        self.write_json(RUN_FILE, meta)

    def append(self, record: ProbeRecord) -> None:
        line = jsonio.dumps(record.to_dict())  # floats keep full precision: json writes repr
        try:
            with open(self.results_path, "a") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise cannot_write(self.results_path, e) from None

    def drop(self, probe_ids: list[str]) -> None:
        """Rewrite results.jsonl without these probes' records, the others' lines kept as they were written
        (atomically: a kill leaves the old file)."""
        gone = set(probe_ids)
        lines = self.results_path.read_text().splitlines(keepends=True) if self.results_path.exists() else []
        kept = [line for line in lines if line.strip() and jsonio.loads(line).get("probe_id") not in gone]
        try:
            write_atomic(self.results_path, "".join(kept))
        except OSError as e:
            raise cannot_write(self.results_path, e) from None

    def write_json(self, name: str, data: dict) -> None:
        try:
            write_atomic(self.dir / name, jsonio.dumps(data, indent=2))
        except OSError as e:
            raise cannot_write(self.dir / name, e) from None

    def read_json(self, name: str) -> dict | None:
        """A JSON file of the run directory, or None when the run has none (yet)."""
        path = self.dir / name
        if not path.exists():
            return None
        try:
            return jsonio.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise NandoctorError(f"cannot read {path}: {e}") from None

    def drop_partial_line(self) -> None:
        """Cut a last line that a killed run left half-written, so that appends start on a fresh line."""
        if not self.results_path.exists():
            return
        data = self.results_path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.results_path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def meta(self) -> dict:
        path = self.dir / RUN_FILE
        if self.dir.exists() and not self.dir.is_dir():
            raise NandoctorError(
                f"{str(self.dir)!r} is a file, not a run directory; "
                "pass the directory a run wrote, e.g. reports/<run-id>"
            )
        if not self.dir.is_dir():
            raise NandoctorError(
                f"run directory {str(self.dir)!r} does not exist; pass the directory a run wrote, e.g. reports/<run-id>"
            )
        try:
            return jsonio.loads(path.read_text())
        except FileNotFoundError:
            raise NandoctorError(f"{str(self.dir)!r} is not a nandoctor run directory: it has no {RUN_FILE}") from None
        except (OSError, ValueError) as e:
            raise NandoctorError(f"cannot read {path}: {e}") from None

    def records(self) -> list[ProbeRecord]:
        """Every complete record; a last line cut off by a crash of the runner itself is ignored."""
        if not self.results_path.exists():
            return []
        try:
            lines = self.results_path.read_text().splitlines()
        except OSError as e:
            raise NandoctorError(f"cannot read {self.results_path}: {e.strerror}") from None
        out = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                data = jsonio.loads(line)
            except ValueError:
                if i != len(lines) - 1:
                    raise NandoctorError(f"{self.results_path} line {i + 1} is not valid JSON") from None
                continue
            try:
                out.append(ProbeRecord.from_dict(data))
            except (KeyError, TypeError, AttributeError):
                raise NandoctorError(f"{self.results_path} line {i + 1} is not a nandoctor probe record") from None
        return out

"""A probe process's entry: a few real training steps of one grid cell, inside its own OS process.

The runner starts `python -m nandoctor.child SPEC.json RESULT.json` (or a warm worker forks a child
that calls `main`). The child reads its ProbeSpec and runs the probe body (probe.py) in this one
process, which writes one ProbeRecord as JSON beside the spec; a parallel cell's process starts its W
ranks instead (launch.py), each running the same body (parallel.py). Exit code 0: trained (whatever
the numbers did); 1: it raised.
"""

from __future__ import annotations

from pathlib import Path

from .. import jsonio
from ..record import ProbeSpec
from .probe import probe
from .ranks import ONE_PROCESS


def main(argv: list[str]) -> int:
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    spec = ProbeSpec.from_dict(jsonio.loads(spec_path.read_text()))
    if spec.cell.parallel_row.wrapper:  # W ranks, one probe
        from .launch import launch

        return launch(spec, spec_path, result_path)
    return probe(spec, ONE_PROCESS, result_path, result_path.parent)

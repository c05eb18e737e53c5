"""What a 2-rank parallel probe costs against the one-process probe of the same cell and global batch:
each round runs one grid through the real CLI (fp32 / eager / off in one process, under DDP and under
FSDP2, 2 gloo ranks on the CPU) and reads each probe's wall time from launch to exit (its record's
wall_s: for a parallel probe the launcher, both ranks' build, the step-0 agreement pass, the timed
steps and the merge). Warm workers (the default) and a cold process per probe (--cold) both. Prints a
Markdown table of medians over the rounds, the ratios parallel / none, and the steady step times (a
one-process probe runs threads_per_probe torch threads, each rank of a W-rank probe 1/W of them).

Goal (issue 17): a 2-rank probe's wall <= 2x the none probe's wall on the CPU.

    PYTHONPATH=. python bench/parallel_probe.py [ROUNDS] [STEPS]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CELLS = {"none": "fp32/eager/off", "ddp": "fp32/eager/off/ddp", "fsdp2": "fp32/eager/off/fsdp2"}
MODES = {"warm": [], "cold": ["--cold"]}


def measured(out: Path, extra: list[str], steps: int) -> dict[str, tuple[float, float]]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nandoctor",
            "grid",
            "--axis",
            "dtype=fp32",
            "--axis",
            "attn=eager",
            "--axis",
            "parallel=none,ddp,fsdp2",
            "--steps",
            str(steps),
            "--set",
            "forensics_steps=0",
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"grid failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    records = {r["probe_id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    return {name: (records[cell]["wall_s"], records[cell]["steady_step_s"]) for name, cell in CELLS.items()}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    base = Path(tempfile.mkdtemp(prefix="nandoctor-bench-parallel-"))
    seen = {mode: {name: [] for name in CELLS} for mode in MODES}
    for i in range(rounds):
        for mode, extra in MODES.items():
            for name, got in measured(base / f"{mode}-{i}", extra, steps).items():
                seen[mode][name].append(got)
    print(
        f"tiny-llama, {steps} steps, 2 gloo ranks, CPU ({os.cpu_count()} cores), {rounds} rounds, "
        f"load average {os.getloadavg()[0]:.1f} at the end; runs in {base}\n"
    )
    print(
        "| launch | none wall (s) | ddp wall (s) | fsdp2 wall (s) | ddp / none | fsdp2 / none "
        "| steady step none / ddp / fsdp2 (ms) |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, got in seen.items():
        none, ddp, fsdp2 = (statistics.median(w for w, _ in got[n]) for n in CELLS)
        step = " / ".join(f"{1000 * statistics.median(t for _, t in got[n]):.0f}" for n in CELLS)
        print(f"| {mode} | {none:.1f} | {ddp:.1f} | {fsdp2:.1f} | {ddp / none:.2f} | {fsdp2 / none:.2f} | {step} |")


if __name__ == "__main__":
    main()

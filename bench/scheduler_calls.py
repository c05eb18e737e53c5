"""How hard a SLURM grid leans on the scheduler: an 8-cell tiny-llama grid (`nandoctor grid --executor slurm`)
on a one-node SLURM of its own (tests/cluster/slurm_up.sh in a fresh folder, on free ports, stopped at the
end), with a folder first on PATH whose squeue, sacct, scontrol, sbatch and scancel log each call (time,
process, arguments) and then run the real command. Prints the calls of each command, the grid's wall time,
squeue calls per minute, and the steady-state interval between squeue calls (the median gap between
consecutive calls once the first probe is queued, and the busiest 60 s). Goal (issue 28): at most one
squeue per 10 s at steady state. Needs root and slurm-wlm + munge, as the cluster tests do.
Usage: python bench/scheduler_calls.py [--steps N] [--keep]"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SLURM_UP = Path(__file__).resolve().parent.parent / "tests" / "cluster" / "slurm_up.sh"
COMMANDS = ("squeue", "sacct", "scontrol", "sbatch", "scancel")
GRID = ("--axis", "dtype=fp32,bf16-amp,fp16-amp,bf16-pure", "--axis", "attn=eager,sdpa", "--axis", "compile=off")
SHIM = """#!/bin/sh
printf '%s %s %s\\n' "$(date +%s.%N)" "$PPID" "$*" >> {log}
exec {real} "$@"
"""


def shim_folder(folder: Path, log_dir: Path) -> Path:
    """A folder of logging stand-ins for COMMANDS, each exec'ing the real one found on PATH now."""
    folder.mkdir(parents=True)
    for name in COMMANDS:
        real = shutil.which(name)
        assert real, f"{name} is not on PATH (apt-get install slurm-wlm)"
        script = folder / name
        script.write_text(SHIM.format(log=log_dir / f"{name}.log", real=real))
        script.chmod(0o755)
    return folder


def calls(log: Path) -> list[tuple[float, str]]:
    """(time, arguments) of each logged call, in time order."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        stamp, _, rest = line.partition(" ")
        out.append((float(stamp), rest.partition(" ")[2]))
    return sorted(out)


def busiest_minute(times: list[float]) -> int:
    """The most calls within any 60 s window."""
    best, start = 0, 0
    for end, t in enumerate(times):
        while t - times[start] > 60:
            start += 1
        best = max(best, end - start + 1)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps per probe (default 8)")
    parser.add_argument("--keep", action="store_true", help="keep the folder (cluster state, logs, run)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="nandoctor-bench-squeue-"))
    cluster, logs = base / "slurm", base / "calls"
    logs.mkdir()
    up = subprocess.run([str(SLURM_UP), str(cluster)], capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    env = {
        **os.environ,
        "SLURM_CONF": str(cluster / "slurm.conf"),
        "PATH": f"{shim_folder(base / 'shims', logs)}{os.pathsep}{os.environ['PATH']}",
    }
    load_before = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "nandoctor", "grid", *GRID, "--steps", str(args.steps), "--executor", "slurm"]
    cmd += ["--executor-opt", "cpus=1", "--out", str(base / "run")]
    try:
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        wall = time.time() - t0
    finally:
        subprocess.run([str(SLURM_UP), "--down", str(cluster)], capture_output=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 1: no stable configuration, still a grid
    by_command = {name: calls(logs / f"{name}.log") for name in COMMANDS}
    squeue = [t for t, _ in by_command["squeue"]]
    first_job = min((t for t, _ in by_command["sbatch"]), default=t0)
    steady = [b - a for a, b in zip(squeue, squeue[1:]) if a >= first_job]
    print(f"# scheduler calls: nandoctor grid {' '.join(GRID)} --steps {args.steps} --executor slurm")
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; grid exit {proc.returncode}")
    print(f"wall {wall:.1f} s; " + ", ".join(f"{name} {len(c)}" for name, c in by_command.items()))
    print(f"squeue calls per minute: {len(squeue) / wall * 60:.1f} (busiest 60 s: {busiest_minute(squeue)})")
    if steady:
        q = statistics.quantiles(steady, n=10) if len(steady) > 1 else steady * 9
        print(
            f"steady-state interval between squeue calls: median {statistics.median(steady):.2f} s "
            f"(p10 {q[0]:.2f} s, p90 {q[-1]:.2f} s, max {max(steady):.2f} s, {len(steady)} gaps)"
        )
    print(f"folder: {base}" if args.keep else "")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

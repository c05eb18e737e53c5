"""How quick is `nandoctor check`? Its wall time (command start to exit, tiny-llama, one step) against
a cold `python -c "import torch, transformers"`, alternated ROUNDS times in one run so that both see
the same machine load; prints a Markdown table and the median ratio. Target (issue 16 §5): <= 2x.
Also says whether the check printed anything on stderr (it should not: issue 16 §5, quiet imports).

    PYTHONPATH=. python bench/check_speed.py [--rounds 3] [--model tiny-llama]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    return time.perf_counter() - t0, proc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="tiny-llama")
    a = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="nandoctor-check-bench-"))
    print(f"# check speed: nandoctor check --model {a.model}, against import torch, transformers\n")
    print("| round | load (1 min) | import torch, transformers s | nandoctor check s | ratio | exit | stderr lines |")
    print("|---|---|---|---|---|---|---|")
    ratios = []
    for i in range(a.rounds):
        load = os.getloadavg()[0]
        imported, _ = timed([sys.executable, "-c", "import torch, transformers"])
        checked, proc = timed([sys.executable, "-m", "nandoctor", "check", "--model", a.model, "--out", str(base / f"r{i}")])
        ratios.append(checked / imported)
        print(f"| {i + 1} | {load:.1f} | {imported:.2f} | {checked:.2f} | {ratios[-1]:.2f} | {proc.returncode} | "
              f"{len(proc.stderr.splitlines())} |", flush=True)
    ratio = statistics.median(ratios)
    print(f"\n- median check / import: {ratio:.2f} (target <= 2: {'met' if ratio <= 2 else 'NOT met'}); "
          f"load average after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"- run directories: {base}")


if __name__ == "__main__":
    main()

"""How quick is `nandoctor check`? Its wall time (command start to exit, tiny-llama, one step) against
a cold `python -c "import torch, transformers"`, alternated ROUNDS times in one run so that both see
the same machine load; prints a Markdown table and the median ratio. Target (issue 16 §5): <= 2x.
Also says whether the check printed anything on stderr (it should not: issue 16 §5, quiet imports),
when its model line came (the parent's planning done), when its probe was launched, the probe's own
wall time (its training step, which other load on the cores slows most), the CPU seconds the check's
processes used (what it takes from other work on a shared machine), and the load average before each round.

Each check runs with PYTHONPATH set to its source tree, from a neutral working directory (`python -m`
would import the package in the working directory first). --before DIR also runs the check of another
nandoctor source tree (e.g. a `git archive` of main) in each round, alternating which goes first, and the
rounds' check results must agree: the same step-0 loss and grad-norm, bit for bit.

    PYTHONPATH=. python bench/check_speed.py [--rounds 3] [--model tiny-llama] [--before /tmp/main-tree]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished children and their waited-for descendants."""
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return c.ru_utime + c.ru_stime


def timed(command: list[str], env: dict | None = None) -> tuple[float, float | None, subprocess.CompletedProcess]:
    """(wall s, s until the model line or None, the finished process)."""
    t0 = time.perf_counter()
    # run from a neutral folder: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir()
    )
    model_line, out = None, []
    for line in proc.stdout:
        if model_line is None and line.startswith("model:"):
            model_line = time.perf_counter() - t0
        out.append(line)
    err = proc.stderr.read()
    proc.wait()
    return (
        time.perf_counter() - t0,
        model_line,
        subprocess.CompletedProcess(command, proc.returncode, "".join(out), err),
    )


def probe_times(run_dir: Path, t0: float) -> tuple[float | None, float | None]:
    """(s from the command's start until its probe was launched (its spec.json written), the probe's wall s)."""
    try:
        spec = next((run_dir / "probes").glob("*/spec.json"))
        record = json.loads((run_dir / "results.jsonl").read_text().splitlines()[0])
        return spec.stat().st_mtime - t0, record["wall_s"]
    except (OSError, StopIteration, IndexError, KeyError, ValueError):
        return None, None


def step0(run_dir: Path) -> tuple | None:
    """The probe's step-0 (loss, grad-norm) as stored, or None."""
    try:
        record = json.loads((run_dir / "results.jsonl").read_text().splitlines()[0])
        return record["steps"][0]["loss"], record["steps"][0]["grad_norm"]
    except (OSError, IndexError, KeyError, ValueError):
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--before", metavar="DIR", help="another nandoctor source tree, run alternately with this one")
    a = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="nandoctor-check-bench-"))
    here = str(Path(__file__).resolve().parents[1])  # the source tree this bench belongs to
    trees = [("this", here)] + ([("before", str(Path(a.before).resolve()))] if a.before else [])
    print(f"# check speed: nandoctor check --model {a.model}, against import torch, transformers\n")
    print(
        "| round | tree | load (1 min) | import torch, transformers s | nandoctor check s | model line s "
        "| probe launched s | probe wall s | check CPU s | ratio | exit | stderr lines |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {name: [] for name, _ in trees}
    values: dict[str, set] = {name: set() for name, _ in trees}
    for i in range(a.rounds):
        order = trees if i % 2 == 0 else trees[::-1]
        for name, path in order:
            load = os.getloadavg()[0]
            imported, _, _ = timed([sys.executable, "-c", "import torch, transformers"])
            env = dict(os.environ, PYTHONPATH=path)
            out = base / f"r{i}-{name}"
            started, cpu = time.time(), cpu_s()
            checked, model_line, proc = timed(
                [sys.executable, "-m", "nandoctor", "check", "--model", a.model, "--out", str(out)], env
            )
            ratios[name].append(checked / imported)
            values[name].add(step0(out))
            cpu = cpu_s() - cpu
            launched, wall = probe_times(out, started)
            line, launched, wall = (f"{v:.2f}" if v is not None else "-" for v in (model_line, launched, wall))
            print(
                f"| {i + 1} | {name} | {load:.1f} | {imported:.2f} | {checked:.2f} | {line} | {launched} | {wall} | "
                f"{cpu:.2f} | {ratios[name][-1]:.2f} | "
                f"{proc.returncode} | {len(proc.stderr.splitlines())} |",
                flush=True,
            )
    print()
    for name, _ in trees:
        ratio = statistics.median(ratios[name])
        print(
            f"- {name}: median check / import {ratio:.2f} (target <= 2: {'met' if ratio <= 2 else 'NOT met'}); "
            f"step-0 (loss, grad-norm) over the rounds: {sorted(values[name], key=str)}"
        )
    if a.before:
        print(
            "- step-0 loss and grad-norm bit-identical between the trees: "
            f"{'yes' if values['this'] == values['before'] else 'NO'}"
        )
    print(f"- load average after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"- run directories: {base}")


if __name__ == "__main__":
    main()

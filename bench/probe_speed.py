"""How close is the wait to the probes' own training time? Runs one grid three ways through the real
CLI — warm workers with --jobs 1, a cold process per probe (--cold) with --jobs 1, warm with --jobs 2 —
and prints a Markdown table:

- per-probe overhead: a probe's wall time minus the time of its training steps (imports, fork, model
  build, optimizer, result writing), median over the grid's probes, warm against cold; shown with and
  without the forensics replay (issue 5), which runs after the timed steps in both modes alike and
  states its own cost in each record (forensics.cost.seconds): the launch overhead is what warm
  workers remove, the replay is measurement the user asked for (a stable eager probe has no replay
  since issue 20: its forensics cost is then the fp32 shadow backward of the underflow figure, and
  the read-only hooks on its step 0, a few ms, are inside that step's time);
- whole-grid wall time (the CLI command, start to exit) against the sum of the probes' step times
  (issue 20's figure: <= 1.25x on a quiet machine for the 8-cell grid below);
- where the fixed cost goes (issue 20): when the first line ("run directory") and the model line
  appear, when the first probe is launched (its spec.json is written) and when its result line
  appears, what the probes spend beside their timed steps (build, forensics replay, the rest), and
  how long the reports take after the last probe;
- grid wall time with --jobs 1 against --jobs 2;
- whether warm and cold agree: same verdicts, bit-identical losses and grad-norms.

Targets (issue 6): warm overhead <= 1/5 of cold; warm grid wall <= 1.5x the sum of step times.
Issue 20: the first line within 1 s, the first probe launched within one cold `import torch,
transformers` of it (measured here too, before each mode), and the 8-cell grid <= 1.25x.

    PYTHONPATH=. python bench/probe_speed.py                      # the default tiny-llama grid
    PYTHONPATH=. python bench/probe_speed.py --axis dtype=fp32    # a smaller grid, same table
    PYTHONPATH=. python bench/probe_speed.py --from /tmp/nandoctor-bench-XXXX   # re-tabulate a finished run
    PYTHONPATH=. python bench/probe_speed.py --mode warm,--jobs1 --axis dtype=fp32,bf16-amp,fp16-amp,bf16-pure \
        --axis attn=eager,sdpa --axis compile=off                   # issue 20's grid, warm workers only
    ... --before /tmp/main-tree --rounds 2                         # and another source tree's, ABAB

With --before DIR each round runs the chosen modes with this source tree and with DIR, alternating
which goes first (this, before; before, this; ...), so that both see the same machine load, and says
whether each round's two runs agree bit for bit (losses and grad-norms). Every grid runs from a
neutral working directory with PYTHONPATH set to its tree (`python -m` would import the package in
the working directory first).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {
    "warm, --jobs 1": ["--jobs", "1"],
    "cold, --jobs 1": ["--jobs", "1", "--cold"],
    "warm, --jobs 2": ["--jobs", "2"],
}
PROGRESS = re.compile(r"^\[\s*\d+/\d+\]")  # a finished probe's line


HERE = str(Path(__file__).resolve().parents[1])  # the source tree this bench belongs to


def run_grid(args: list[str], out: Path, tree: str = HERE) -> dict:
    """Run the grid through the CLI of source tree `tree`, reading its output as it comes: the wall
    time, and when (seconds from the start) the first line, the model line and the first and last
    probe result lines appeared."""
    marks, t0, start = {}, time.perf_counter(), time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nandoctor", "grid", *args, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=dict(os.environ, PYTHONPATH=tree),
        cwd=tempfile.gettempdir(),
    )
    for line in proc.stdout:
        now = time.perf_counter() - t0
        marks.setdefault("first line", now)
        if line.startswith("model:"):
            marks.setdefault("model line", now)  # the terminal report ends with a "model:" line too
        if PROGRESS.match(line):
            marks.setdefault("first probe done", now)
            marks["last probe done"] = now
    stderr = proc.stderr.read()
    proc.wait()
    marks["wall"] = time.perf_counter() - t0
    if proc.returncode not in (0, 1) or not (out / "results.jsonl").exists():
        sys.exit(f"grid failed ({proc.returncode}):\n{stderr[-3000:]}")
    launched = [p.stat().st_mtime for p in (out / "probes").glob("*/spec.json")]
    marks["first probe launched"] = min(launched) - start if launched else None
    marks["stderr lines"] = len(stderr.splitlines())
    return marks


def cold_import_s() -> float:
    """A fresh `python -c "import torch, transformers"`: the cost the first probe may wait for."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers"], check=True)
    return time.perf_counter() - t0


PROBE_IMPORT = (
    "import os; os.environ['OPENBLAS_NUM_THREADS'] = '1'\n"
    "from nandoctor.child.worker import preload\npreload(); preload('llama')"
)


def cold_probe_import_s(tree: str = HERE) -> float:
    """A fresh interpreter importing what a tiny-llama probe needs, as a warm worker does (worker.preload:
    torch, transformers, nandoctor's probe code, then transformers' llama modeling module, optional
    packages hidden). `import torch, transformers` leaves the modeling code lazy; importing it pulls in
    torch._dynamo and torch.distributed.tensor (transformers' masking_utils, core_model_loading), which
    no probe can start without."""
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", PROBE_IMPORT],
        check=True,
        cwd=tempfile.gettempdir(),
        env={**os.environ, "PYTHONPATH": tree},
    )
    return time.perf_counter() - t0


def records(out: Path) -> list[dict]:
    return [
        r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines()) if r["status"] != "unsupported"
    ]


def step_time(record: dict) -> float:
    return sum(s["time_s"] for s in record["steps"])


def replay_time(record: dict) -> float:
    return ((record.get("forensics") or {}).get("cost") or {}).get("seconds") or 0.0


def build_time(record: dict) -> float:
    return record.get("load_s") or 0.0


def losses(out: Path) -> dict:
    """{probe id: [(loss, grad-norm) per step]}: what two runs of the same grid must agree on bit for bit."""
    return {r["probe_id"]: [(s["loss"], s["grad_norm"]) for s in r["steps"]] for r in records(out)}


def curves(out: Path) -> dict:
    verdicts = {p["probe_id"]: p["verdict"] for p in json.loads((out / "summary.json").read_text())["probes"]}
    return {
        r["probe_id"]: (verdicts[r["probe_id"]], [(s["loss"], s["grad_norm"]) for s in r["steps"]])
        for r in records(out)
    }


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} cores"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--axis", action="append", default=[])
    p.add_argument("--steps", type=int)
    p.add_argument("--from", dest="base", help="re-tabulate the run directories of an earlier bench run")
    p.add_argument(
        "--mode",
        action="append",
        choices=[m.replace(" ", "") for m in MODES],
        help="run only this mode (repeatable; default: all three)",
    )
    p.add_argument(
        "--same-as",
        metavar="DIR",
        help="a run directory of the same grid (another commit): are the losses bit-identical?",
    )
    p.add_argument(
        "--before", metavar="DIR", help="another nandoctor source tree, run alternately with this one (ABAB)"
    )
    p.add_argument("--rounds", type=int, default=1, help="with --before: rounds of (this, before) runs")
    a = p.parse_args()
    grid = (
        ["--model", a.model]
        + [x for axis in a.axis for x in ("--axis", axis)]
        + (["--steps", str(a.steps)] if a.steps else [])
    )
    base = Path(a.base) if a.base else Path(tempfile.mkdtemp(prefix="nandoctor-bench-"))
    measured = json.loads((base / "bench.json").read_text()) if a.base else {"walls": {}, "loads": []}
    rows, outs, loads = {}, {}, measured["loads"]
    modes = {name: flags for name, flags in MODES.items() if not a.mode or name.replace(" ", "") in a.mode}
    if a.before:  # each round: both trees, alternating which goes first; a row per (round, tree, mode)
        trees = [("this", HERE), ("before", str(Path(a.before).resolve()))]
        runs = [
            (f"r{i + 1} {tree}: {name}", flags, path)
            for i in range(a.rounds)
            for tree, path in (trees if i % 2 == 0 else trees[::-1])
            for name, flags in modes.items()
        ]
    else:
        runs = [(name, flags, HERE) for name, flags in modes.items()]
    measured.setdefault("marks", {})
    measured.setdefault("imports", {})
    for name, flags, tree in runs:
        out = base / re.sub(r"[^\w.-]+", "-", name.replace(", --jobs ", "-jobs")).strip("-")
        if not a.base:
            loads.append(f"load before {name}: {load()}")
            measured["imports"][name] = cold_import_s()
            measured.setdefault("probe_imports", {})[name] = cold_probe_import_s(tree)
            measured["marks"][name] = run_grid(grid + flags, out, tree)
            measured["walls"][name] = measured["marks"][name]["wall"]
        if name not in measured["walls"]:
            continue
        recs = records(out)
        outs[name] = out
        rows[name] = {
            "probes": len(recs),
            "grid wall s": measured["walls"][name],
            "sum of step times s": sum(map(step_time, recs)),
            "median probe overhead s": statistics.median(r["wall_s"] - step_time(r) for r in recs),
            "median replay s": statistics.median(map(replay_time, recs)),
            "median launch overhead s": statistics.median(r["wall_s"] - step_time(r) - replay_time(r) for r in recs),
        }
    if not a.base:
        loads.append(f"after: {load()}")
        (base / "bench.json").write_text(json.dumps(measured))
    print(f"# probe speed: nandoctor grid {' '.join(grid)}\n")
    print(
        f"machine: {platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )
    print("\n".join(f"- {line}" for line in loads) + "\n")
    print(
        "| mode | probes | grid wall s | sum of step times s | wall / steps | median probe overhead s "
        "| of which forensics s | median launch overhead s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['probes']} | {r['grid wall s']:.1f} | {r['sum of step times s']:.1f} | "
            f"{r['grid wall s'] / r['sum of step times s']:.2f} | {r['median probe overhead s']:.2f} | "
            f"{r['median replay s']:.2f} | {r['median launch overhead s']:.2f} |"
        )
    print_fixed_cost(rows, outs, measured)
    if a.before:
        for i in range(a.rounds):
            for name in modes:
                this, before = outs.get(f"r{i + 1} this: {name}"), outs.get(f"r{i + 1} before: {name}")
                if this and before:
                    print(
                        f"- round {i + 1}, {name}: losses and grad-norms bit-identical between the trees: "
                        f"{'yes' if losses(this) == losses(before) else 'NO'}"
                    )
        for tree in ("this", "before"):
            ratios = [r["grid wall s"] / r["sum of step times s"] for n, r in rows.items() if f" {tree}: " in n]
            if ratios:
                print(
                    f"- {tree}: wall / steps median {statistics.median(ratios):.2f} "
                    f"(runs: {', '.join(f'{x:.2f}' for x in ratios)})"
                )
    if a.same_as:
        first = next(iter(outs.values()))
        print(
            f"- losses and grad-norms of {first.name} bit-identical to {a.same_as}: "
            f"{'yes' if losses(first) == losses(Path(a.same_as)) else 'NO'}"
        )
    if "warm, --jobs 1" not in rows or "cold, --jobs 1" not in rows or "warm, --jobs 2" not in rows:
        print(f"- run directories: {base}")
        return
    warm, cold = rows["warm, --jobs 1"], rows["cold, --jobs 1"]
    same = curves(outs["warm, --jobs 1"]) == curves(outs["cold, --jobs 1"])
    ratio = warm["median launch overhead s"] / cold["median launch overhead s"]
    raw = warm["median probe overhead s"] / cold["median probe overhead s"]
    wall_ratio = warm["grid wall s"] / warm["sum of step times s"]
    jobs = rows["warm, --jobs 2"]["grid wall s"] / warm["grid wall s"]
    print()
    print(
        f"- warm / cold per-probe launch overhead: {ratio:.3f} (target <= 0.2: {'met' if ratio <= 0.2 else 'NOT met'})"
    )
    print(
        f"- warm / cold per-probe overhead with the forensics replay counted in: {raw:.3f} "
        f"({'<=' if raw <= 0.2 else '>'} 0.2)"
    )
    print(
        f"- warm grid wall / sum of step times: {wall_ratio:.2f} "
        f"(target <= 1.5: {'met' if wall_ratio <= 1.5 else 'NOT met'})"
    )
    print(f"- grid wall --jobs 2 / --jobs 1: {jobs:.2f}")
    print(
        f"- warm and cold results identical (verdicts, every loss and grad-norm bit for bit): {'yes' if same else 'NO'}"
    )
    print(f"- run directories: {base}")


def print_fixed_cost(rows: dict, outs: dict, measured: dict) -> None:
    """Issue 20's breakdown of each mode's wall time, in seconds from the command's start."""
    print(
        "\n| mode | cold import torch, transformers s | cold import of a probe's code s | first line s | model line s "
        "| first probe launched s | first probe done s | probes: build s | steps s | forensics s | rest s "
        "| last probe done -> exit s | wall / steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        m, recs = measured["marks"].get(name), records(outs[name])
        if not m:
            continue
        build, steps, replay = sum(map(build_time, recs)), sum(map(step_time, recs)), sum(map(replay_time, recs))
        rest = sum(x["wall_s"] for x in recs) - build - steps - replay
        cells = [
            measured["imports"][name],
            measured.get("probe_imports", {}).get(name),
            m.get("first line"),
            m.get("model line"),
            m.get("first probe launched"),
            m.get("first probe done"),
            build,
            steps,
            replay,
            rest,
            m["wall"] - m.get("last probe done", m["wall"]),
        ]
        print(
            f"| {name} | "
            + " | ".join("-" if c is None else f"{c:.2f}" for c in cells)
            + f" | {r['grid wall s'] / r['sum of step times s']:.2f} |"
        )
    print()


if __name__ == "__main__":
    main()

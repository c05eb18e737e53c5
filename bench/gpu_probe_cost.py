"""Where a probe's time goes on a GPU host, and what packing and the compile cache save (issue 10).
Runs the real CLI and prints Markdown tables:

1. one llama-3.1-8b probe (bf16-amp / sdpa / off): wall time against build, load, training steps and
   forensics replay (issue 10 measured 196 s: load 94 s, train 4.6 s, a second build in the replay ~95 s);
2. the tiny-llama grid with compile off, packed (the default --jobs) and with --jobs 1: grid wall and
   the sum of the probes' own times, per-probe wall against training time, replay included;
3. a compiled tiny-llama grid run twice with one inductor cache: the first step's compile time, cold
   and on a cache hit.

    PYTHONPATH=. python bench/gpu_probe_cost.py --out $OUT/bench            # all three (~6 min on an H100)
    PYTHONPATH=. python bench/gpu_probe_cost.py --out DIR --skip 8b --tiny-axis dtype=fp32 --steps 2   # a CPU smoke run

Each run directory stays under --out (results.jsonl, report.md); bench.md holds the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROBE_COLUMNS = (
    "wall_s",
    "build_s",
    "load_s",
    "train_s",
    "compile_s",
    "steady_step_s",
    "replay_s",
    "snapshot",
    "reproduced",
    "peak_GiB",
)


def grid(out: Path, args: list[str], env: dict | None = None) -> float:
    """Run `nandoctor grid ARGS --out OUT`; its wall time in seconds."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "nandoctor", "grid", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    wall = time.perf_counter() - t0
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    if not (out / "results.jsonl").exists():
        sys.exit(f"grid {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall


def spawned(out: Path) -> list[dict]:
    return [
        r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines()) if r["status"] != "unsupported"
    ]


def probe_row(r: dict) -> dict:
    f = r.get("forensics") or {}
    return {
        "wall_s": r.get("wall_s"),
        "build_s": r.get("build_s"),
        "load_s": r.get("load_s"),
        "train_s": r.get("train_s"),
        "compile_s": r.get("compile_s"),
        "steady_step_s": r.get("steady_step_s"),
        "replay_s": (f.get("cost") or {}).get("seconds"),
        "snapshot": (f.get("snapshot") or {}).get("where"),
        "reproduced": f.get("reproduced", f.get("error")),
        "peak_GiB": r["peak_memory_bytes"] / 2**30 if r.get("peak_memory_bytes") else None,
    }


def cell(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def probe_table(out: Path) -> list[str]:
    lines = ["| probe | " + " | ".join(PROBE_COLUMNS) + " |", "|---" * (len(PROBE_COLUMNS) + 1) + "|"]
    for r in spawned(out):
        row = probe_row(r)
        lines.append(f"| {r['probe_id']} | " + " | ".join(cell(row[c]) for c in PROBE_COLUMNS) + " |")
    return lines


def grid_summary(name: str, out: Path, wall: float) -> str:
    recs = spawned(out)
    jobs = json.loads((out / "run.json").read_text()).get("jobs")
    train = sum(r.get("train_s") or 0 for r in recs)
    overhead = statistics.median((r["wall_s"] or 0) - (r.get("train_s") or 0) for r in recs) if recs else 0
    return (
        f"| {name} | {jobs} | {len(recs)} | {wall:.1f} | {train:.1f} | {sum(r['wall_s'] or 0 for r in recs):.1f} | "
        f"{overhead:.2f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--skip", action="append", default=[], choices=["8b", "jobs", "cache"])
    p.add_argument("--tiny-axis", action="append", default=[], help="narrow the tiny-llama grids (e.g. dtype=fp32)")
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    base = Path(a.out)
    base.mkdir(parents=True, exist_ok=True)
    steps = ["--steps", str(a.steps)]
    narrow = [x for axis in a.tiny_axis for x in ("--axis", axis)]
    report = [f"# GPU probe cost ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores)", ""]

    if "8b" not in a.skip:
        out = base / "llama-3.1-8b"
        wall = grid(
            out,
            [
                "--model",
                "llama-3.1-8b",
                "--axis",
                "dtype=bf16-amp",
                "--axis",
                "attn=sdpa",
                "--axis",
                "compile=off",
                *steps,
            ],
        )
        report += [
            f"## 1. one llama-3.1-8b probe (CLI wall {wall:.1f} s, imports and planning included)",
            "",
            *probe_table(out),
            "",
        ]

    if "jobs" not in a.skip:
        rows = []
        for name, flags in (("packed (default --jobs)", []), ("--jobs 1", ["--jobs", "1"])):
            out = base / ("tiny-packed" if not flags else "tiny-jobs1")
            wall = grid(out, ["--axis", "compile=off", *narrow, *steps, *flags])
            rows.append(grid_summary(name, out, wall))
        report += [
            "## 2. tiny-llama grid, compile off",
            "",
            "| mode | jobs | probes | grid wall s | sum of train_s | sum of probe wall s "
            "| median probe wall - train_s |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            "Per probe (packed):",
            "",
            *probe_table(base / "tiny-packed"),
            "",
        ]

    if "cache" not in a.skip:
        env = {"NANDOCTOR_CACHE_DIR": str(base / "cache")}
        compiled = [
            "--axis",
            "dtype=bf16-amp",
            "--axis",
            "attn=sdpa",
            "--axis",
            "compile=inductor,aot_eager",
            *narrow,
            *steps,
        ]
        walls = {run: grid(base / run, compiled, env) for run in ("compile-cold", "compile-cached")}
        report += ["## 3. compiled tiny-llama grid, run twice with one inductor cache", ""]
        for run, wall in walls.items():
            report += [f"{run}: grid wall {wall:.1f} s", "", *probe_table(base / run), ""]

    text = "\n".join(report)
    (base / "bench.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

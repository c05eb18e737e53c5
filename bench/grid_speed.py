"""Is a default grid no slower than its own training plus two cold imports (issue 34)? The 8-cell grid
(`nandoctor grid --model tiny-llama --axis dtype=fp32,bf16-amp,fp16-amp,bf16-pure --axis attn=eager,sdpa
--axis compile=off`, default steps) from command start to exit, re-timing included, against the sum
of its probes' train_s (results.jsonl) + 2 x one cold `python -c "import torch, transformers"`
measured in the same round, + 10%. Each round also runs the grid with `--set retime_rounds=0` (what
the re-timing adds) and notes the 1-minute load average before each command (the machine is shared).

    PYTHONPATH=. python bench/grid_speed.py [--rounds 2] [--out DIR]

Prints a Markdown table, one row per round, and the re-timing's own record (its budget, rounds, wall
time, why it stopped) from retime.json."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRID = (
    "grid",
    "--model",
    "tiny-llama",
    "--axis",
    "dtype=fp32,bf16-amp,fp16-amp,bf16-pure",
    "--axis",
    "attn=eager,sdpa",
    "--axis",
    "compile=off",
)
TREE = Path(__file__).resolve().parent.parent


def load1() -> float:
    return os.getloadavg()[0]


def wall(command: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    # from a neutral folder: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH
    proc = subprocess.run(
        command, cwd=tempfile.gettempdir(), env={**os.environ, "PYTHONPATH": str(TREE)}, capture_output=True, text=True
    )
    return time.perf_counter() - t0, proc


def train_s(run: Path) -> float:
    return sum(json.loads(line).get("train_s") or 0.0 for line in (run / "results.jsonl").read_text().splitlines())


def one_round(out: Path, n: int) -> dict:
    row = {"round": n}
    row["load_import"] = load1()
    row["import_s"], _ = wall([sys.executable, "-c", "import torch, transformers"])
    for name, extra in (("grid", ()), ("off", ("--set", "retime_rounds=0"))):
        run = out / f"{name}{n}"
        row[f"load_{name}"] = load1()
        row[f"{name}_s"], proc = wall([sys.executable, "-m", "nandoctor", *GRID, *extra, "--out", str(run)])
        if proc.returncode != 0:
            raise SystemExit(f"{name} grid failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        row[f"{name}_train_s"] = train_s(run)
        row[f"{name}_lines"] = [line for line in proc.stdout.splitlines() if "re-timing" in line]
        retime = run / "retime.json"
        row[f"{name}_retime"] = (
            {k: v for k, v in json.loads(retime.read_text()).items() if k not in ("probes", "order")}
            if retime.exists()
            else None
        )
    row["bound_s"] = 1.1 * (row["grid_train_s"] + 2 * row["import_s"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="grid-speed-"))
    rows = [one_round(out, n) for n in range(1, args.rounds + 1)]
    print(
        "| round | import s | grid wall s | its train_s | bound s | within | retime_rounds=0 wall s | its train_s "
        "| load (import, grid, off) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['round']} | {r['import_s']:.2f} | {r['grid_s']:.1f} | {r['grid_train_s']:.1f} | {r['bound_s']:.1f} "
            f"| {'yes' if r['grid_s'] <= r['bound_s'] else 'NO'} | {r['off_s']:.1f} | {r['off_train_s']:.1f} "
            f"| {r['load_import']:.1f}, {r['load_grid']:.1f}, {r['load_off']:.1f} |"
        )
    for r in rows:
        print(f"\nround {r['round']}: retime.json {json.dumps(r['grid_retime'])}")
        for line in r["grid_lines"]:
            print(f"  {line}")
    print(f"\nruns under {out}")


if __name__ == "__main__":
    main()

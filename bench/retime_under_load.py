"""Does a grid recommend the same configuration on a quiet host and with a busy loop on every core?
Issue 28's grid (16 steps; fp32, bf16-amp x eager, sdpa, sdpa:math, sdpa:flash), run by the code of one
or more source trees, each quiet, then loaded, in turn. Per run: the recommendation, its speed ties, the
re-timing (rounds, why it stopped, its wall time) and the per-round ratios of the fastest re-timed cell
over each other one, with the 1-minute load average before and after (other sessions' work shows there).

    python bench/retime_under_load.py --tree this=. --tree before=/tmp/base --out /tmp/retime-bench

Each tree runs as `python -m nandoctor` with PYTHONPATH set to it, so its probes import it too."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GRID = (
    "grid",
    "--axis",
    "dtype=fp32,bf16-amp",
    "--axis",
    "attn=eager,sdpa,sdpa:math,sdpa:flash",
    "--axis",
    "compile=off",
    "--steps",
    "16",
)


def load1() -> float:
    return os.getloadavg()[0]


def round_medians(timing: dict) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for p in timing.get("probes", []):
        rates = [s["tokens_per_s"] for s in p.get("steps") or [] if s.get("tokens_per_s")]
        if p.get("status") == "ok" and len(rates) > 1:
            out.setdefault(p["of"], {})[p["round"]] = statistics.median(rates[1:])
    return out


def ratios_text(timing: dict | None) -> str:
    """'A/B 1.31x (1.45, 1.20, ...)' for the fastest re-timed cell over each other one."""
    if not timing:
        return "-"
    rounds = round_medians(timing)
    if len(rounds) < 2:
        return "-"
    lead = max(rounds, key=lambda c: statistics.median(rounds[c].values()))
    parts = []
    for other in rounds:
        common = sorted(rounds[lead].keys() & rounds[other].keys())
        if other == lead or not common:
            continue
        r = [rounds[lead][n] / rounds[other][n] for n in common]
        mean = math.exp(statistics.fmean(math.log(x) for x in r))
        parts.append(f"{lead}/{other} {mean:.2f}x ({', '.join(f'{x:.2f}' for x in r)})")
    return "; ".join(parts)


def one_run(tree: Path, out: Path, loaded: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    loops = (
        [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
        if loaded
        else []
    )
    before, t0 = load1(), time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "nandoctor", *GRID, "--out", str(out)], env=env, capture_output=True, text=True
        )
    finally:
        for p in loops:
            p.kill()
            p.wait()
    wall, after = time.monotonic() - t0, load1()
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    timing = json.loads((out / "retime.json").read_text()) if (out / "retime.json").exists() else None
    return {
        "exit": proc.returncode,
        "wall_s": wall,
        "load_before": before,
        "load_after": after,
        "recommended": summary.get("recommended"),
        "ties": (summary.get("timing") or {}).get("speed_ties"),
        "retime_rounds": timing and timing.get("rounds"),
        "retime_stopped": timing and timing.get("stopped", "-"),
        "retime_wall_s": timing and timing.get("wall_s"),
        "ratios": ratios_text(timing),
        "stderr_tail": proc.stderr[-400:] if proc.returncode not in (0, 1) else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=DIR", help="a source tree to run")
    ap.add_argument("--out", required=True, help="a folder for the run directories")
    ap.add_argument("--modes", default="quiet,loaded", help="quiet, loaded or both, in this order per tree")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("| tree | host | exit | wall s | load before/after | recommended | ties | re-timing | ratios per round |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for item in args.tree:
            name, _, tree = item.partition("=")
            r = one_run(Path(tree).resolve(), out / f"{name}-{mode}", mode == "loaded")
            retime = (
                f"{r['retime_rounds']} rounds, {r['retime_stopped']}, {r['retime_wall_s']:.0f} s"
                if r["retime_rounds"]
                else "-"
            )
            print(
                f"| {name} | {mode} | {r['exit']} | {r['wall_s']:.0f} | {r['load_before']:.1f}/{r['load_after']:.1f} "
                f"| {r['recommended']} | {', '.join(r['ties'] or []) or '-'} | {retime} | {r['ratios']} |",
                flush=True,
            )
            if r["stderr_tail"]:
                print(r["stderr_tail"], file=sys.stderr)


if __name__ == "__main__":
    main()

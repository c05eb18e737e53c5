"""How much slower is a probe on a host whose cores other processes keep busy, and what helps?

One fp32/sdpa tiny-llama probe of 16 steps, run as a user runs it (`nandoctor grid --axis dtype=fp32
--axis attn=sdpa --axis compile=off --steps 16 --set retime_rounds=0 --set forensics_steps=0`; the grid
runs its fp32/eager reference first), its training time (`train_s`) read from results.jsonl. Each
remedy is the environment the CLI starts with (nandoctor hands a user's OpenMP settings on to its
probes unchanged):

- default: OpenMP as it is without nandoctor's setting (GOMP_SPINCOUNT=300000, libgomp's own spin when
  OMP_WAIT_POLICY is unset) and threads for the whole host (OMP_NUM_THREADS=nproc);
- passive: OMP_WAIT_POLICY=PASSIVE (idle threads sleep at once), threads for the whole host;
- threads: libgomp's default spin, threads sized to the cores other processes leave free, measured
  over SAMPLE_S just before the CLI starts (psutil: nproc minus the busy cores, rounded, at least 1);
- both: passive, and threads sized to the free cores;
- short-spin: GOMP_SPINCOUNT=10000 (idle threads spin ~30x shorter than libgomp's default, then
  sleep), threads for the whole host; short-spin+threads: with threads sized to the free cores;
- nandoctor: no OpenMP setting of ours: what nandoctor does by itself (the short spin in every probe's
  environment, run/slots.OPENMP_WAIT, and each CPU probe sizes its threads to the cores left free
  while it builds: child/threads.py).

Each host state is "idle" (nothing of ours besides the probe; other users' load is what it is: the
load average and the probe's own `host_load` figure say how idle it was), "one" (one busy loop,
`python -c "while True: pass"`, the stray process of issue 28) and "busy" (a busy loop on every core),
the loops killed after. A round runs the variants back to back on each host state in turn (ABCDE
ABCDE ABCDE), so that every variant sees the same drift of other users' load; the table gives medians
over the rounds:

    PYTHONPATH=. python bench/busy_host.py --rounds 3 --hosts idle,one,busy --out /tmp/busy-host
    PYTHONPATH=. python bench/busy_host.py --from /tmp/busy-host    # re-tabulate a finished run

Every grid runs from a neutral working directory with PYTHONPATH set to this tree.
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

TREE = Path(__file__).resolve().parent.parent
GRID = (
    "grid",
    "--axis",
    "dtype=fp32",
    "--axis",
    "attn=sdpa",
    "--axis",
    "compile=off",
    "--set",
    "retime_rounds=0",
    "--set",
    "forensics_steps=0",
)
PROBE = "fp32/sdpa/off"
SAMPLE_S = 1.0  # the free-core sample before a sized run
SPIN_DEFAULT = "300000"  # libgomp's spin count when OMP_WAIT_POLICY is unset (libgomp/env.c)
SPIN_SHORT = "10000"  # a short spin (~0.1 ms by libgomp's own estimate of 100,000 turns per ms)
# variant -> (how idle threads wait, whether the threads are sized to the free cores); None: nandoctor's own
VARIANTS = {
    "default": ({"GOMP_SPINCOUNT": SPIN_DEFAULT}, False),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, False),
    "threads": ({"GOMP_SPINCOUNT": SPIN_DEFAULT}, True),
    "both": ({"OMP_WAIT_POLICY": "PASSIVE"}, True),
    "short-spin": ({"GOMP_SPINCOUNT": SPIN_SHORT}, False),
    "short-spin+threads": ({"GOMP_SPINCOUNT": SPIN_SHORT}, True),
    "nandoctor": None,
}
OPENMP = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# Host states: how many busy loops of ours run beside the probe (of the cores this process may use).
LOOPS = {"idle": lambda cpus: 0, "one": lambda cpus: 1, "busy": lambda cpus: cpus}


def free_cores(cpus: int) -> int:
    """The cores other processes leave free, over SAMPLE_S: nproc minus the busy ones, rounded, >= 1."""
    import psutil

    busy = psutil.cpu_percent(interval=SAMPLE_S) / 100 * cpus
    return max(1, round(cpus - busy))


def variant_env(variant: str, cpus: int) -> dict:
    """The OpenMP settings a variant's CLI starts with (the wait, then the threads)."""
    if VARIANTS[variant] is None:
        return {}
    wait, sized = VARIANTS[variant]
    return {**wait, "OMP_NUM_THREADS": str(free_cores(cpus) if sized else cpus)}


def one_run(out: Path, variant: str, steps: int, cpus: int) -> dict:
    """Run the grid once with a variant's settings in a fresh directory; what its probe measured."""
    env = {k: v for k, v in os.environ.items() if k not in OPENMP}
    settings = variant_env(variant, cpus)
    env.update(settings, PYTHONPATH=str(TREE))
    load, t0 = os.getloadavg()[0], time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "nandoctor", *GRID, "--steps", str(steps), "--out", str(out)],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - t0
    records = (
        [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()] if proc.returncode < 2 else []
    )
    probe = next((r for r in records if r["probe_id"] == PROBE), None) or {}
    load_fig = probe.get("host_load") or {}
    return {
        "variant": variant,
        "settings": settings,
        "exit": proc.returncode,
        "wall_s": wall,
        "train_s": probe.get("train_s"),
        "steps": len(probe.get("steps") or []),
        "cpu_threads": probe.get("cpu_threads"),
        "other_cpu_cores": load_fig.get("other_cpu_cores"),
        "load1_before": load,
        "load1_after": os.getloadavg()[0],
        "stderr_tail": proc.stderr[-600:] if proc.returncode >= 2 else "",
    }


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run(out: Path, rounds: int, steps: int, hosts: list[str], variants: list[str]) -> list[dict]:
    cpus = len(os.sched_getaffinity(0))
    rows = []
    for n in range(rounds):
        for host in hosts:
            loops = busy_loops(LOOPS[host](cpus))
            try:
                time.sleep(1.0 if loops else 0.0)  # the loops have taken their cores
                for variant in variants:
                    row = {"round": n, "host": host, **one_run(out / f"r{n}-{host}-{variant}", variant, steps, cpus)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    with (out / "rows.jsonl").open("a") as f:
                        f.write(json.dumps(row) + "\n")
            finally:
                for p in loops:
                    p.kill()
                    p.wait()
    return rows


def median(rows: list[dict], host: str, variant: str) -> float | None:
    times = [r["train_s"] for r in rows if r["host"] == host and r["variant"] == variant and r["train_s"]]
    return statistics.median(times) if times else None


def table(rows: list[dict]) -> str:
    """Markdown: per variant, each host state's median train_s (with every round), the idle cost and the
    loaded hosts' gain against default, and each loaded host's time over the same variant's idle one."""
    hosts = [h for h in LOOPS if any(r["host"] == h for r in rows)]
    loaded = [h for h in hosts if h != "idle"]
    columns = [f"{h} train_s (rounds)" for h in hosts] + ["idle cost vs default"]
    columns += [name for h in loaded for name in (f"{h} gain vs default", f"{h} / idle")]
    lines = [
        "| remedy | " + " | ".join(columns) + " |",
        "|---|" + "---|" * (len(hosts) + 1 + 2 * len(loaded)),
    ]
    base = {h: median(rows, h, "default") for h in hosts}
    for variant in [v for v in VARIANTS if any(r["variant"] == v for r in rows)]:
        m = {h: median(rows, h, variant) for h in hosts}
        cells = [
            f"{m[h] or 0:.2f} ("
            + ", ".join(
                f"{r['train_s']:.2f}" for r in rows if (r["host"], r["variant"]) == (h, variant) and r["train_s"]
            )
            + ")"
            for h in hosts
        ]
        cells.append(f"{m['idle'] / base['idle']:.2f}x" if m.get("idle") and base.get("idle") else "-")
        for h in loaded:
            cells.append(f"{base[h] / m[h]:.1f}x" if m[h] and base[h] else "-")
            cells.append(f"{m[h] / m['idle']:.1f}x" if m[h] and m.get("idle") else "-")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    loads = [r["load1_before"] for r in rows] + [r["load1_after"] for r in rows]
    others = [r["other_cpu_cores"] for r in rows if r["host"] == "idle" and r["other_cpu_cores"] is not None]
    threads = sorted({(r["variant"], r["host"], (r["cpu_threads"] or {}).get("torch")) for r in rows})
    lines += [
        "",
        f"1-minute load average {min(loads):.1f}-{max(loads):.1f}; on the idle host other processes kept "
        f"{min(others, default=0):.2f}-{max(others, default=0):.2f} cores busy during the probe's steps "
        "(its host_load).",
        "torch threads per variant and host: " + ", ".join(f"{v}/{h} {t}" for v, h, t in threads),
    ]
    failed = [r for r in rows if r["exit"] >= 2 or not r["train_s"]]
    if failed:
        lines.append(f"{len(failed)} run(s) without a figure: " + "; ".join(r["stderr_tail"][-200:] for r in failed))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="a folder for the run directories and rows.jsonl")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help="remedies per host state, of: " + ", ".join(VARIANTS)
    )
    ap.add_argument("--hosts", default="idle,one,busy", help="host states per round, of: " + ", ".join(LOOPS))
    ap.add_argument("--from", dest="done", help="re-tabulate the rows.jsonl of a finished run")
    args = ap.parse_args()
    if args.done:
        rows = [json.loads(line) for line in (Path(args.done) / "rows.jsonl").read_text().splitlines()]
    else:
        if not args.out:
            ap.error("--out or --from is required")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        hosts = args.hosts.split(",")
        if not set(hosts) <= set(LOOPS):
            ap.error(f"--hosts takes {', '.join(LOOPS)}")
        variants = args.variants.split(",")
        if not set(variants) <= set(VARIANTS):
            ap.error(f"--variants takes {', '.join(VARIANTS)}")
        rows = run(out, args.rounds, args.steps, hosts, variants)
    print(table(rows))


if __name__ == "__main__":
    main()

"""What a GPU host shows of the shared-machine and real-run work, in one call: a grid on a tiny local
checkpoint trained on a chat JSONL through its own tokenizer (completion-only labels, packed by
position_ids, two micro-batches per step), its probes packed two at a time on the run's GPU, which the
process was given by UUID (CUDA_VISIBLE_DEVICES=GPU-...), not by index.

Prints, per probe: its verdict, the CUDA_VISIBLE_DEVICES it ran with (from its log's first line is not
needed: the record's env lists the GPU it saw), the other processes and sibling probes the host-load
figure saw on its GPU, and the step-0 setup checks; then the run's recommendation.

    python bench/gpu_check.py --out /tmp/gpu-check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def gpu_uuid() -> str | None:
    """The first GPU's UUID as nvidia-smi spells it (what CUDA_VISIBLE_DEVICES accepts)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True, text=True
        )
    except OSError:
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return lines[0] if lines else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    from checkpoints import save_llama
    from userdata_fixtures import chat_rows, save_chat_tokenizer, write_jsonl

    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = save_llama(args.out / "ckpt", use_cache=False)
    save_chat_tokenizer(ckpt)
    chat = write_jsonl(args.out / "chat.jsonl", chat_rows(64, seed=4))
    uuid = gpu_uuid()
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": uuid} if uuid else {}))
    run_dir = args.out / "grid"
    command = [
        sys.executable, "-m", "nandoctor", "grid", "--model", str(ckpt), "--data", str(chat),
        "--axis", "dtype=fp32,bf16-amp,fp16-amp,bf16-pure", "--axis", "attn=sdpa,eager", "--axis", "compile=off",
        "--steps", str(args.steps), "--jobs", "2", "--set", "data.labels=completion_only",
        "--set", "data.packing=position_ids", "--set", "gradient_accumulation_steps=2", "--out", str(run_dir),
    ]  # fmt: skip
    print("CUDA_VISIBLE_DEVICES =", env.get("CUDA_VISIBLE_DEVICES"), flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    print(f"grid exit {proc.returncode} in {time.monotonic() - t0:.1f} s")
    print(proc.stdout[-6000:])
    print(proc.stderr[-3000:])
    results = run_dir / "results.jsonl"
    for line in results.read_text().splitlines() if results.exists() else []:
        r = json.loads(line)
        gpus = ((r.get("host_load") or {}).get("gpus")) or []
        seen = [(g.get("uuid"), g.get("other_processes")) for g in gpus]
        own = (r.get("host_load") or {}).get("own_processes")
        env_gpus = [g.get("name") for g in ((r.get("env") or {}).get("gpus") or [])]
        checks = {
            k: v
            for k, v in (r.get("setup_checks") or {}).items()
            if k in ("packing_max_logit_diff", "accumulation_cosine")
        }
        print(f"{r['probe_id']:28s} {r.get('status')!s:10s} saw {env_gpus} load-gpus {seen} own {own} checks {checks}")
    summary = run_dir / "summary.json"
    if summary.exists():
        print("recommended:", json.loads(summary.read_text()).get("recommended"))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())

"""Cost of the data lint against what fine-tuning code pays to tokenize the same rows, measured in one
run: a chat JSONL of N rows (written here) linted by `nandoctor.doctor.data_lint` (read
through datasets, rendered with the chat template, tokenized, labelled, every row measured, batches
chosen and collated, the measured checks on a random-init twin), against `datasets.load_dataset` +
`Dataset.map(batched=True)` rendering and tokenizing the rows with `apply_chat_template`.

Each measurement runs in a fresh process with a fresh datasets cache (both convert the JSONL to Arrow
cold), the two alternating over ROUNDS; the ratio is lint / baseline wall time, the peak RSS that of
the measuring process (ru_maxrss), after the imports both share (torch, transformers, datasets).
The tokenizer is the tests' fixture tokenizer (tests/userdata_fixtures.py). Every temporary file
and datasets cache is removed at the end.

--completion-only (issue 34): three-exchange chats, a chat template with {% generation %} marks, the lint
with data.labels=completion_only, against the map that TRL's assistant-only loss runs
(`apply_chat_template(..., return_assistant_tokens_mask=True)`). Target: lint <= 1.2x the baseline.

Usage: python bench/data_lint.py [--completion-only] [ROUNDS] [ROWS ...]
       (default: 2 rounds of 50000 and 200000 rows)"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def child(mode: str, rows: str, tok: str, completion_only: bool = False) -> None:
    """One measurement, in this process: prints {"wall_s", "peak_rss_bytes"} as JSON."""
    import datasets  # noqa: F401  (imported before the clock, as both modes import it)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from nandoctor.config import recipe_from_dict

    t0 = time.perf_counter()
    if mode == "lint":
        from nandoctor.doctor import data_lint

        labels = {"labels": "completion_only"} if completion_only else {}
        recipe = recipe_from_dict({"data": {"source": "file", "path": rows, "tokenizer": tok, **labels}}, "bench")
        section = data_lint(recipe)
        assert section["rows"] > 0
    else:
        from datasets import load_dataset
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tok, local_files_only=True)
        ds = load_dataset("json", data_files=rows, split="train", cache_dir=os.environ["HF_DATASETS_CACHE"])
        masks = {"return_assistant_tokens_mask": True} if completion_only else {}
        ds = ds.map(
            lambda b: tokenizer.apply_chat_template(b["messages"], tokenize=True, return_dict=True, **masks),
            batched=True,
            remove_columns=ds.column_names,
        )
        assert len(ds) > 0
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"wall_s": wall, "peak_rss_bytes": peak}))


def measure(mode: str, rows: Path, tok: Path, scratch: Path, completion_only: bool = False) -> dict:
    cache = Path(tempfile.mkdtemp(dir=scratch, prefix="hf-datasets-"))
    env = {
        **os.environ,
        "HF_DATASETS_CACHE": str(cache),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS.parent), os.environ.get("PYTHONPATH")])),
    }
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, str(rows), str(tok)] + (["1"] if completion_only else []),
            capture_output=True,
            text=True,
            env=env,
            check=True,
        ).stdout
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return json.loads(out.strip().splitlines()[-1])


def main(rounds: int, sizes: list[int], completion_only: bool = False) -> None:
    sys.path.insert(0, str(TESTS))
    from userdata_fixtures import CHAT_TEMPLATE, GENERATION_TEMPLATE, chat_rows, save_chat_tokenizer, write_jsonl

    scratch = Path(tempfile.mkdtemp(prefix="nandoctor-bench-data-"))
    template, turns = (GENERATION_TEMPLATE, 3) if completion_only else (CHAT_TEMPLATE, 1)
    try:
        tok = save_chat_tokenizer(scratch / "tok", template=template)
        print(f"load average at start: {os.getloadavg()}")
        for n in sizes:
            rows = write_jsonl(scratch / f"chat-{n}.jsonl", chat_rows(n, seed=n, turns=turns))
            walls = {"lint": [], "baseline": []}
            rss = {"lint": [], "baseline": []}
            for r in range(rounds):
                for mode in ("lint", "baseline") if r % 2 == 0 else ("baseline", "lint"):
                    got = measure(mode, rows, tok, scratch, completion_only)
                    walls[mode].append(got["wall_s"])
                    rss[mode].append(got["peak_rss_bytes"])
            ratios = [a / b for a, b in zip(walls["lint"], walls["baseline"])]
            print(
                f"{n} rows ({rows.stat().st_size / 2**20:.1f} MiB): lint {statistics.median(walls['lint']):.2f} s, "
                f"load_dataset + map {statistics.median(walls['baseline']):.2f} s, ratio per round "
                f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f}x); peak RSS lint "
                f"{max(rss['lint']) / 2**20:.0f} MiB, baseline {max(rss['baseline']) / 2**20:.0f} MiB",
                flush=True,
            )
            rows.unlink()
        print(f"load average at end: {os.getloadavg()}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:5], completion_only=len(sys.argv) > 5)
    else:
        only = "--completion-only" in sys.argv
        args = [int(a) for a in sys.argv[1:] if a != "--completion-only"]
        main(args[0] if args else 2, args[1:] or [50_000, 200_000], only)

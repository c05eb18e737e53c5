import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def run_cli(*args, cwd=None, env=None, timeout=900):
    """Run `python -m nandoctor ...` as a user would; returns the CompletedProcess."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("GITHUB_STEP_SUMMARY", None) if not (env and "GITHUB_STEP_SUMMARY" in env) else None
    return subprocess.run([sys.executable, "-m", "nandoctor", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full_env, timeout=timeout)


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def verdicts(run_dir: Path) -> dict:
    return {p["probe_id"]: p["verdict"] for p in summary(run_dir)["probes"]}


@pytest.fixture
def cli():
    return run_cli


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: without it they are skipped, with the reason."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; torch sees no GPU on this machine")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)

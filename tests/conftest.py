import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

# One fixed hypothesis profile, loaded by default: the same examples on every run and every machine
# (derandomize), few enough to keep the property tests to seconds, no example database or patch file
# written under the worktree (no explain phase), no reproduction blobs printed.
# HYPOTHESIS_PROFILE=<name> picks another registered one.
settings.register_profile("nandoctor", derandomize=True, max_examples=40, deadline=None, database=None, print_blob=False,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "nandoctor"))

sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ("runs",)  # the shared session runs (tests/runs.py)


def run_cli(*args, cwd=None, env=None, timeout=900):
    """Run `python -m nandoctor ...` as a user would; returns the CompletedProcess."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("GITHUB_STEP_SUMMARY", None) if not (env and "GITHUB_STEP_SUMMARY" in env) else None
    return subprocess.run([sys.executable, "-m", "nandoctor", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full_env, timeout=timeout)


def run_main(*args, env=None):
    """`nandoctor ...` through `nandoctor.cli.main` in this process, stdout and stderr captured; returns a
    CompletedProcess like run_cli. For commands that end before any probe is spawned (refusals, usage
    errors, doctor): a fresh interpreter costs seconds of `import torch` each, this costs milliseconds.
    Spawning commands and exit codes as the shell sees them stay with run_cli."""
    from nandoctor.cli import main
    stdout, stderr = io.StringIO(), io.StringIO()
    with _environ({"GITHUB_STEP_SUMMARY": None, **(env or {})}), \
            contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(["nandoctor", *map(str, args)], code, stdout.getvalue(), stderr.getvalue())


@contextlib.contextmanager
def _environ(changes: dict):
    """os.environ with `changes` applied (None removes a variable), restored afterwards."""
    saved = {k: os.environ.get(k) for k in changes}
    try:
        for k, v in changes.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


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

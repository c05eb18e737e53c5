"""The whole tree stays as `ruff format` writes it and clean under `ruff check` (ruff.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[test]')")


def ruff(*args: str) -> subprocess.CompletedProcess:
    # --no-cache: the test writes nothing into the tree
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", "."], cwd=ROOT, capture_output=True, text=True
    )


def test_the_tree_is_formatted_by_ruff():
    proc = ruff("format", "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr + "\nrun `ruff format .` from the repository root"


def test_the_tree_passes_ruff_check():
    proc = ruff("check")
    assert proc.returncode == 0, proc.stdout + proc.stderr + "\nrun `ruff check --fix .` and fix the rest by hand"

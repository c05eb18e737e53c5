"""Output errors are one line and exit code 2, never a traceback, and a report file is either written
whole or named as not written: a read-only or impossible --out (refused before any probe runs), a full
disk, a recipe that is not UTF-8 text, `report --csv` onto a directory. The full and read-only disks
are real tmpfs mounts (root only; skipped where mounting is not allowed)."""

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli

FIXTURE_RUN = Path(__file__).parent / "fixtures" / "run-before-issue-9"
REPORTS = ("report.md", "report.html", "junit.xml", "summary.json")


@pytest.fixture
def mount(tmp_path):
    """mount(options) -> a fresh tmpfs mounted with those options, unmounted after the test."""
    mounted = []

    def make(options: str) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)


def one_line_error(proc) -> str:
    """The stderr lines nandoctor wrote itself (third-party import noise filtered), asserted traceback-free."""
    assert "Traceback" not in proc.stderr, proc.stderr
    return "\n".join(line for line in proc.stderr.splitlines() if line.startswith("nandoctor:"))


def copy_run(to: Path) -> Path:
    for f in FIXTURE_RUN.iterdir():
        shutil.copy(f, to / f.name)
    return to


def test_read_only_out_is_refused_before_any_probe_runs(mount):
    out = mount("ro,size=64k") / "run"
    proc = run_cli("check", "--out", out)
    assert proc.returncode == 2, proc.stderr
    assert "read-only file system" in one_line_error(proc)
    assert "run directory:" not in proc.stdout  # refused before the run started


def test_out_below_a_file_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("x")
    proc = run_cli("grid", "--out", tmp_path / "a-file" / "run")
    assert proc.returncode == 2
    assert "is a file, not a directory" in one_line_error(proc)


def test_full_disk_names_every_report_and_never_truncates_one(mount):
    run_dir = copy_run(mount("size=256k"))
    assert run_cli("report", run_dir).returncode == 0
    before = {name: (run_dir / name).read_bytes() for name in REPORTS}
    try:
        with open(run_dir / "filler", "wb") as f:  # fill the disk to the last block
            while True:
                f.write(b"\0" * 4096)
    except OSError:
        pass
    proc = run_cli("report", run_dir)
    assert proc.returncode == 2
    lines = one_line_error(proc).splitlines()
    assert [line.split()[2] for line in lines] == list(REPORTS)
    assert all("No space left on device" in line for line in lines)
    assert {name: (run_dir / name).read_bytes() for name in REPORTS} == before  # the old files, whole
    assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def test_a_failing_renderer_does_not_stop_the_other_reports(tmp_path, monkeypatch, capsys):
    from nandoctor.cli import main
    from nandoctor.report import html

    def broken(analysis):
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr(html, "render_html", broken)
    run_dir = copy_run(tmp_path)
    code = main(["report", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 0  # the run's own exit code: its verdicts are intact
    assert err.strip() == (
        "nandoctor: WARNING: report.html not written: its renderer failed "
        "(OverflowError: int too large to convert to float)"
    )
    assert [name for name in REPORTS if (run_dir / name).exists()] == ["report.md", "junit.xml", "summary.json"]


def test_recipe_that_is_not_utf8_is_one_line(tmp_path):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes("description: caf\xe9\nsteps: 4\n".encode("latin-1"))
    proc = run_cli("grid", "--recipe", recipe)
    assert proc.returncode == 2
    assert "is not UTF-8 text" in one_line_error(proc)


def test_report_csv_onto_a_directory_is_refused_before_anything_prints(tmp_path):
    run_dir = copy_run(tmp_path)
    proc = run_cli("report", run_dir, "--csv", tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "is a directory" in one_line_error(proc)

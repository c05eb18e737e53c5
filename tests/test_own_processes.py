"""The cluster tests find their own probe processes (tests/clusters.py probe_processes), by run directory
or by process tree, and never another checkout's probe on the same host, which looks the same to ps."""

import os
import signal
import subprocess
import sys
import time

from clusters import another_checkouts_probe, probe_processes

LOOKALIKE = "import sys, time; time.sleep(60)"  # argv: -m nandoctor.child SPEC RESULT, as a probe's


def lookalike(spec_folder, cwd) -> list[str]:
    """`python -m nandoctor.child SPEC RESULT` of a package that only sleeps, written under cwd."""
    child = cwd / "pkg" / "nandoctor" / "child"
    child.mkdir(parents=True, exist_ok=True)
    for init in (child.parent / "__init__.py", child / "__init__.py"):
        init.write_text("")
    (child / "__main__.py").write_text(LOOKALIKE)
    return [sys.executable, "-m", "nandoctor.child", str(spec_folder / "spec.json"), str(spec_folder / "result.json")]


def test_probes_are_ours_by_run_directory_or_by_process_tree_never_another_checkouts(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "probes" / "p0").mkdir(parents=True)
    scratch = tmp_path / "nandoctor-probe-x"  # a Ray scratch folder: the same name as another Ray's
    scratch.mkdir()
    env = {"PYTHONPATH": str(tmp_path / "pkg")}
    started = []  # each in a session of its own: killing it kills what it started
    with another_checkouts_probe() as theirs:
        try:
            for command in (
                lookalike(run_dir / "probes" / "p0", tmp_path),
                # a worker that starts a probe in a scratch folder, as a Ray worker of ours does
                [sys.executable, "-c", f"import subprocess; subprocess.run({lookalike(scratch, tmp_path)!r})"],
            ):
                started.append(subprocess.Popen(command, env=env, start_new_session=True))
            in_run, parent = started
            deadline = time.monotonic() + 60
            while not probe_processes(parent.pid):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert [p.pid for p in probe_processes(run_dir)] == [in_run.pid]
            [below] = probe_processes(parent.pid)
            assert below.ppid() == parent.pid and below.pid != theirs.pid
            assert theirs.pid not in {p.pid for p in probe_processes(tmp_path)}
        finally:
            for proc in started:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

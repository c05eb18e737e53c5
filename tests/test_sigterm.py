"""SIGTERM (what CI systems, `timeout`, SLURM preemption and `docker stop` send) ends a run the way
Ctrl-C does (issue 28 item 4): its probes end, what was recorded is kept, the resume line is printed,
exit 143; `--resume` then finishes the run. The run's own processes are found by process tree (the
CLI's descendants), never by a machine-wide name pattern. --resume is sized for this host too
(issue 28 item 5): not with the interrupted run's jobs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import result_lines, run_cli, summary

from nandoctor.record import ZYGOTE_ENV

# Two cells that run on a CPU and a GPU alike, long enough (16 steps) to be interrupted in their midst; fp32,
# whose steps take the same time on every CPU (bf16 trains 8x slower where the CPU has no bf16 instructions).
GRID = ("--axis", "dtype=fp32", "--axis", "attn=eager,sdpa", "--axis", "compile=off", "--steps", "16")
GRID += ("--set", "retime_rounds=0")
CELLS = {"fp32/eager/off", "fp32/sdpa/off"}


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (its children, theirs, ...), read from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":
                parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def terminate_mid_run(args: list, run_dir: Path, env: dict | None = None) -> tuple[int, str, list[str], set[int]]:
    """Start `nandoctor grid ARGS`, send it SIGTERM once a probe is recorded and another one runs;
    returns its exit code, its stderr, the records it had kept, and the processes it had started."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "nandoctor", "grid", *map(str, args)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + 600
    while True:
        assert proc.poll() is None, "the run ended before it could be interrupted: " + proc.stderr.read()
        assert time.monotonic() < deadline, "no probe recorded within 600 s"
        done = len(result_lines(run_dir))
        assert done < len(CELLS), "the run went too far to be interrupted in its midst"
        if done and descendants(proc.pid):
            break
        time.sleep(0.05)
    started = descendants(proc.pid)
    kept = result_lines(run_dir)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=120)[1]
    return proc.returncode, stderr, kept, started


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_sigterm_ends_the_probes_keeps_the_records_says_how_to_resume_and_resume_finishes(tmp_path, mode, zygote):
    out = tmp_path / "run"
    extra = ["--cold"] if mode == "cold" else []
    code, stderr, kept, started = terminate_mid_run([*GRID, "--jobs", "1", "--out", out, *extra], out)
    assert code == 143, stderr
    assert f"continue with `nandoctor grid --resume {out}`" in stderr
    deadline = time.monotonic() + 10
    while any(alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in started if alive(p)] == []  # its workers and probes ended with it
    after = result_lines(out)
    assert after[: len(kept)] == kept and len(after) < len(CELLS)  # what was recorded is kept, and no more

    # the resume's own processes are not what this test is about: it runs in this one, its worker forked by
    # the session's zygote (a cold probe would import torch and transformers again)
    resumed = run_cli("grid", "--resume", out, env={ZYGOTE_ENV: str(zygote)})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert result_lines(out)[: len(kept)] == kept
    assert {p["probe_id"] for p in summary(out)["probes"]} == CELLS
    assert {p["verdict"] for p in summary(out)["probes"]} == {"stable"}


def test_a_resume_is_sized_for_this_host_not_for_the_interrupted_run(tmp_path, monkeypatch):
    from nandoctor import api
    from nandoctor.bisect import oracle
    from nandoctor.config import recipe_to_dict
    from nandoctor.models import plan_model
    from nandoctor.recipes import resolve_model

    recipe, device = resolve_model("tiny-llama"), {"device": "cpu", "cpu_count": 2, "gpus": [], "torch": "2.13.0"}
    for kind in ("grid", "bisect"):
        (tmp_path / kind).mkdir()
        meta = {
            "kind": kind,
            "env": device,
            "recipe": recipe_to_dict(recipe),
            "model_plan": plan_model(recipe, device).to_dict(),
            "steps": 3,
            "jobs": 64,  # a SLURM run's `parallel`
            "request": {"good": None, "bad": "attn=sdpa,dtype=fp16-pure", "factors": []},
        }
        (tmp_path / kind / "run.json").write_text(json.dumps(meta))
    asked = []

    class Opened(Exception):
        pass

    def open_session(kind, recipe, options, **session_args):
        asked.append((kind, options.jobs))
        raise Opened

    monkeypatch.setattr(api, "open_session", open_session)
    monkeypatch.setattr(oracle, "open_session", open_session)
    for kind, resume in (("grid", api.resume_grid), ("bisect", oracle.resume_bisect)):
        for jobs in (None, 3):
            with pytest.raises(Opened):
                resume(tmp_path / kind, jobs=jobs, device=device)
    assert asked == [("grid", None), ("grid", 3), ("bisect", None), ("bisect", 3)]  # None: this host's default


# A signal that lands where Python cannot raise: its handler runs inside a weakref callback (as when the
# signal arrives while an import's module lock is collected), so its exception is printed as "Exception
# ignored" and swallowed. The "run" then sleeps 20 s and says how it ended.
SWALLOWED = """
import signal, sys, time, weakref
from nandoctor import cli


def run(argv):
    class Held:
        pass

    held = Held()
    ref = weakref.ref(held, lambda gone: signal.raise_signal(getattr(signal, argv[0])))  # noqa: F841
    start = time.monotonic()
    try:
        del held  # the callback runs, and the handler inside it
        time.sleep(20)
    except KeyboardInterrupt as e:
        print(f"{type(e).__name__} after {time.monotonic() - start:.1f} s")
        return 1
    print("ran to its end")
    return 0


cli.run = run
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signame, raised", [("SIGTERM", "Terminated"), ("SIGINT", "KeyboardInterrupt")])
def test_a_signal_whose_exception_python_swallowed_still_ends_the_run(signame, raised):
    proc = subprocess.run([sys.executable, "-c", SWALLOWED, signame], capture_output=True, text=True, timeout=120)
    assert "Exception ignored" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith(f"{raised} after "), proc.stdout + proc.stderr
    assert float(proc.stdout.split()[2]) < 10  # the sleep was cut short, not waited out

"""Real tiny probes through the runner: the timed steps decide the verdict whatever the replay does,
a kernel PyTorch refuses is `unsupported`, and a warm worker holds no thread when it forks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import save_slow_replay_llama

from nandoctor.analysis.verdicts import classify
from nandoctor.cells import Cell


def task(cell: Cell, steps: int, model: str | None = None, **fields):
    from nandoctor.config import set_field
    from nandoctor.env import collect_summary
    from nandoctor.models import plan_model
    from nandoctor.plan import PlannedProbe
    from nandoctor.recipes import resolve_model
    from nandoctor.run.session import probe_spec
    from nandoctor.run.task import ProbeTask

    recipe = resolve_model(model)
    for key, value in fields.items():
        recipe = set_field(recipe, key, value)
    device = collect_summary()
    spec = probe_spec(recipe, PlannedProbe(cell.id, cell), plan_model(recipe, device), device, steps, 1)
    return ProbeTask(spec, recipe.timeout_s)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    from nandoctor.executors import ExecutorConfig
    from nandoctor.run.local import LocalPlacement
    from nandoctor.run.scheduler import Scheduler
    from nandoctor.run.store import ResultsStore

    out = tmp_path_factory.mktemp("outcomes")
    slow_replay = str(save_slow_replay_llama(out / "slow-replay"))
    tasks = [
        # its replay sleeps under the hooks; the timed step trains (one step: a longer stable probe of an
        # eager cell has no replay, its hooks watch timed step 0, where this model would sleep)
        task(
            Cell("fp32", "sdpa", "off"),
            1,
            slow_replay,
            **{"model.trust_remote_code": "true", "forensics_timeout_s": "2"},
        ),
        # pinned on the CPU, where it does not exist; on CUDA, refused for tiny-llama's GQA (4 / 2 heads)
        task(Cell("fp32", "sdpa:efficient", "off"), 2),
    ]
    placement = LocalPlacement(ExecutorConfig(), out, jobs=1)
    with Scheduler(placement, ResultsStore(out), retries=0) as scheduler:
        records = scheduler.run(tasks)
        threads = placement.slots[0].threads
    return {r.probe_id: r for r in records}, threads


@pytest.mark.slow  # real probe processes
def test_a_replay_that_overruns_its_budget_leaves_the_probe_stable(outcomes):
    record = outcomes[0]["fp32/sdpa/off"]
    assert record.status == "ok" and len(record.steps) == 1 and record.exit_code == -9
    assert record.forensics == {"error": "replay overran its 2 s budget"}
    assert classify(record).name == "stable"


@pytest.mark.slow  # real probe processes
def test_a_pinned_sdpa_kernel_that_is_not_available_is_unsupported(outcomes):
    record = outcomes[0]["fp32/sdpa:efficient/off"]
    verdict = classify(record)
    assert record.status == "error" and verdict.name == "unsupported", verdict
    assert "pinned SDPA backend" in verdict.reason


@pytest.mark.slow  # real probe processes
def test_a_warm_worker_has_one_thread_when_it_forks_a_probe(outcomes):
    if outcomes[1] is None:
        pytest.skip("no procfs: the worker cannot count its threads here")
    assert outcomes[1] == 1


def test_the_thread_count_sees_native_threads():
    """The count behind the test above is a count: a second thread shows as one more. Counted in a fresh
    interpreter: in this pytest worker, threads earlier tests joined can still be leaving /proc/self/task
    between two counts (a clean-clone run counted 4 and 4)."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no procfs: threads cannot be counted here")
    code = (
        "import threading; from nandoctor.child.worker import thread_count; before = thread_count(); "
        "release = threading.Event(); waiter = threading.Thread(target=release.wait); waiter.start(); "
        "during = thread_count(); release.set(); waiter.join(); print(before, during)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent
    )
    assert out.returncode == 0, out.stderr
    before, during = map(int, out.stdout.split())
    assert during == before + 1  # (a joined thread can linger in /proc/self/task for a moment: not counted after)

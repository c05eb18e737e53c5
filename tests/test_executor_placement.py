"""The executor layer without a cluster: options are checked like every other flag, a plain install
imports neither submitit nor ray, and a probe the scheduler keeps losing is placed again a bounded
number of times, then recorded as lost — no verdict about its configuration."""

import json
import subprocess
import sys

import pytest

from nandoctor.analysis.verdicts import UNRESOLVED_VERDICTS, harness_verdict
from nandoctor.errors import NandoctorError
from nandoctor.executors import executor_config


def test_executor_options_are_typed_and_unknown_keys_are_refused():
    config = executor_config("slurm", ["partition=h100", "gpus=2", "parallel=8"])
    assert config.options == {"partition": "h100", "gpus": 2, "parallel": 8} and config.option("retries") == 2
    with pytest.raises(NandoctorError, match="KEY one of address"):
        executor_config("ray", ["partition=h100"])
    with pytest.raises(NandoctorError, match="gpus takes a int"):
        executor_config("slurm", ["gpus=two"])


def test_an_executor_option_for_the_local_executor_is_one_line_and_exit_2(cli):
    proc = cli("grid", "--executor-opt", "partition=h100")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "none (it runs on this machine)" in proc.stderr


def test_a_plain_install_imports_neither_submitit_nor_ray():
    code = (
        "import sys, nandoctor.cli, nandoctor.api, nandoctor.run.session, nandoctor.bisect.oracle; "
        "print(sorted(m for m in ('submitit', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class Scheduled:
    """What a fake scheduler's placement states beside its submit, wait and cancel."""

    launch, batches, grace_s, capacity, queue_wait = "slurm", True, 60.0, 4, 3600

    def facts(self):
        return {}  # no start-up job, no device facts

    def room(self, probes):
        return len(probes)

    def last_step(self, probe):
        return None

    def close(self):
        pass


class LosingPlacement(Scheduled):
    """A scheduler whose every job dies on a failing node before the probe writes anything."""

    def __init__(self):
        self.submitted = 0

    def submit(self, probes):
        for probe in probes:
            self.submitted += 1
            probe.job_id = f"7_{self.submitted}"

    def wait(self, probes, timeout_s):
        from nandoctor.run.placement import Ending

        return [(p, Ending("NODE_FAIL", detail="node gpu17 stopped responding")) for p in probes]

    def cancel(self, probes, wait_s):
        pass


def test_a_probe_the_scheduler_keeps_losing_is_retried_then_recorded_lost(tmp_path):
    from nandoctor.cells import Cell
    from nandoctor.models import plan_model
    from nandoctor.plan import PlannedProbe
    from nandoctor.recipes import resolve_model
    from nandoctor.run.scheduler import Scheduler
    from nandoctor.run.session import probe_spec
    from nandoctor.run.store import ResultsStore
    from nandoctor.run.task import ProbeTask

    placement = LosingPlacement()
    recipe = resolve_model(None)
    device = {"device": "cpu", "cpu_count": 2, "gpus": []}
    spec = probe_spec(
        recipe, PlannedProbe("fp32/eager/off", Cell("fp32", "eager", "off")), plan_model(recipe, device), device, 2, 1
    )
    [record] = Scheduler(placement, ResultsStore(tmp_path), retries=2).run([ProbeTask(spec, 60.0)])
    assert placement.submitted == 3  # the first placement and two retries
    assert record.status == "lost" and record.launch == "slurm" and record.job_id == "7_3"
    verdict = harness_verdict(record)
    assert verdict.name in UNRESOLVED_VERDICTS
    assert "all 3 attempts" in verdict.reason and "NODE_FAIL: node gpu17 stopped responding" in verdict.reason
    assert "nothing about the configuration" in verdict.reason


def test_a_recipe_files_executor_section_is_the_default_and_not_part_of_the_recipe(tmp_path):
    from nandoctor.recipes import executor_section, load_recipe

    path = tmp_path / "cluster.yaml"
    path.write_text("steps: 3\nexecutor:\n  kind: slurm\n  partition: h100\n  gpus: 1\n")
    assert load_recipe(path).steps == 3  # the recipe (and so every probe's fingerprint) is the same without it
    kind, options = executor_section(path)
    assert executor_config(kind, options + ["gpus=2"]).options == {"partition": "h100", "gpus": 2}


# --- a parallel probe is sized from its world size (issue 18) ---------------------------------------


def test_a_slurm_job_of_a_w_rank_probe_asks_for_w_times_the_cores_and_gpus_per_probe():
    from nandoctor.run.on_slurm import job_size

    assert job_size(executor_config("slurm", ["cpus=4", "gpus=1"]), 1) == {"cpus_per_task": 4, "gpus_per_node": 1}
    assert job_size(executor_config("slurm", ["cpus=4", "gpus=1"]), 8) == {"cpus_per_task": 32, "gpus_per_node": 8}
    assert job_size(executor_config("slurm", ["cpus=2"]), 4) == {"cpus_per_task": 8}  # no GPUs asked: none asked for


def test_a_ray_task_of_a_w_rank_probe_asks_for_w_times_the_cpus_and_gpus_per_probe():
    from nandoctor.run.on_ray import task_size

    assert task_size(executor_config("ray", ["cpus=2", "gpus=0.5"]), 1) == {"num_cpus": 2, "num_gpus": 0.5}
    assert task_size(executor_config("ray", ["cpus=2", "gpus=0.5"]), 4) == {"num_cpus": 8, "num_gpus": 2.0}
    assert task_size(executor_config("ray", []), 2) == {"num_cpus": 2, "num_gpus": 0}


def planned_spec(cell, world_size: int = 2):
    from dataclasses import replace

    from nandoctor.models import plan_model
    from nandoctor.plan import PlannedProbe
    from nandoctor.recipes import resolve_model
    from nandoctor.run.session import probe_spec

    recipe = replace(resolve_model(None), world_size=world_size)
    device = {"device": "cpu", "cpu_count": 2, "gpus": []}
    return probe_spec(recipe, PlannedProbe(cell.id, cell), plan_model(recipe, device), device, 2, 1)


def test_a_placed_probe_runs_as_world_size_ranks_only_on_the_parallel_axis():
    from nandoctor.cells import Cell
    from nandoctor.run.placement import PlacedProbe
    from nandoctor.run.task import ProbeTask

    ranks = {
        c: PlacedProbe(ProbeTask(planned_spec(Cell("fp32", "eager", "off", parallel=c), 4), 60.0), None).ranks
        for c in ("none", "ddp")
    }
    assert ranks == {"none": 1, "ddp": 4}


# --- a probe the scheduler never starts waits a bounded time (issue 18) ------------------------------


class OneRunsOneWaits(Scheduled):
    """A scheduler that runs the first probe for `runs_s` seconds and never starts the second."""

    queue_wait = 0.2

    def __init__(self, runs_s: float):
        self.runs_s, self.cancelled, self.jobs = runs_s, [], 0

    def submit(self, probes):
        for probe in probes:
            self.jobs += 1
            probe.job_id = str(self.jobs)

    def wait(self, probes, timeout_s):
        import time

        from nandoctor.run.placement import Ending

        time.sleep(min(timeout_s, 0.05))
        ended = []
        for p in probes:
            if p.task.probe_id != "first":
                p.waiting = "Priority"
            elif p.state == "queued":
                p.state, p.started = "running", time.monotonic()
            elif time.monotonic() - p.started > self.runs_s:
                ended.append((p, Ending("NODE_FAIL")))  # its end is no matter here: it is lost too
        return ended

    def cancel(self, probes, wait_s):
        self.cancelled += [p.task.probe_id for p in probes]


def test_the_queue_wait_counts_only_while_none_of_the_runs_probes_runs(tmp_path):
    import time
    from dataclasses import replace

    from nandoctor.cells import Cell
    from nandoctor.run.scheduler import Scheduler
    from nandoctor.run.store import ResultsStore
    from nandoctor.run.task import ProbeTask

    placement = OneRunsOneWaits(runs_s=0.4)
    spec = planned_spec(Cell("fp32", "eager", "off"))
    tasks = [ProbeTask(replace(spec, probe_id=name), 60.0) for name in ("first", "second")]
    start = time.monotonic()
    records = {r.probe_id: r for r in Scheduler(placement, ResultsStore(tmp_path), retries=0).run(tasks)}
    # "second" waited behind "first" (0.4 s, longer than its queue wait), then 0.2 s more with nothing running
    assert 0.6 <= time.monotonic() - start < 5
    assert placement.cancelled == ["second"]
    assert records["second"].status == "lost"
    assert records["second"].reason == (
        "the scheduler lost this probe on its one attempt (retries=0) "
        "(NOT_STARTED: still queued after 0.2 s (queue_wait): Priority)"
    )


def test_the_queue_line_says_placed_again_only_when_a_retry_is_left():
    from nandoctor.cli.lines import queue_line

    assert queue_line(1, 0, 0, ["12"], 5, 2) == (
        "  ... queue: 1 queued, 0 running, 0 done (job 12); "
        "one not started within 5 s while none runs is placed again (queue_wait)"
    )
    assert queue_line(1, 0, 0, ["12"], 5, 0).endswith("while none runs is recorded lost (queue_wait, retries=0)")


def test_a_slurm_canary_file_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    # issue 34: the client parses the canary file the moment it exists; written in place, a half-written
    # file (a node's full disk, the job killed mid-write) was there to be read
    from nandoctor.run import on_slurm, store

    canary = tmp_path / "canary-1"
    on_slurm.write_canary(str(canary), gather=False)
    assert "host" in json.loads(canary.read_text())["gathered"]
    canary.unlink()

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.os, "fsync", disk_full)
    with pytest.raises(OSError):
        on_slurm.write_canary(str(canary), gather=False)
    assert list(tmp_path.iterdir()) == []


def test_a_second_ctrl_c_during_rays_graceful_cancel_still_kills_the_tasks():
    # issue 34: a KeyboardInterrupt while cancel() waited its GRACEFUL_CANCEL_S for the asked tasks to
    # end skipped the force cancel, and the tasks trained on. Ray's calls are recorded, not made: the
    # order of the asks is the point (tests/test_executor_ray.py runs a real cluster's cancel)
    from types import SimpleNamespace

    from nandoctor.run.on_ray import RayPlacement

    asked = []

    class Task:
        def completed(self):
            return self

    def wait(refs, num_returns, timeout):
        raise KeyboardInterrupt  # the user's second Ctrl-C

    ray = SimpleNamespace(
        cancel=lambda ref, force: asked.append(force),
        wait=wait,
        exceptions=SimpleNamespace(RayError=RuntimeError),
    )
    placement = object.__new__(RayPlacement)
    placement.ray = ray
    probes = [SimpleNamespace(handle=Task()), SimpleNamespace(handle=Task())]
    with pytest.raises(KeyboardInterrupt):
        placement.cancel(probes, wait_s=30.0)
    assert asked == [False, False, True, True]


def test_a_ray_node_without_the_runs_input_files_is_named_with_the_files_and_what_to_do(tmp_path):
    # issue 34: Ray tasks read data.path, data.tokenizer and a local model.path on their node; a node
    # without them failed each probe on its own. The facts task checks them (on_ray.task_facts).
    from nandoctor.config import set_field
    from nandoctor.recipes import recipe_by_name
    from nandoctor.run.placed import inputs_not_on_node, missing_inputs
    from nandoctor.run.session import input_files

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "the cat"}\n')
    recipe = set_field(set_field(recipe_by_name("tiny-llama"), "data.source", "file"), "data.path", str(rows))
    recipe = set_field(recipe, "data.tokenizer", str(tmp_path / "tok"))  # not here: not checked there either
    inputs = input_files(recipe)
    assert inputs == {"data.path": str(rows)} and missing_inputs(inputs) == {}
    rows.unlink()  # what a node without the file sees
    line = inputs_not_on_node(missing_inputs(inputs), "gpu-07", "ray", " on node_type 'a100'")
    assert line == (
        f"--executor ray: data.path {str(rows)!r} not found on node gpu-07 on node_type 'a100'; its probes read the "
        "run's inputs at the same path there: put them on a filesystem every node mounts, or copy them to that path"
    )

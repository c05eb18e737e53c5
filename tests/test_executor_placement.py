"""The executor layer without a cluster: options are checked like every other flag, a plain install
imports neither submitit nor ray, and a probe the scheduler keeps losing is placed again a bounded
number of times, then recorded as lost — no verdict about its configuration."""
import subprocess
import sys

import pytest

from nandoctor.analysis.verdicts import UNRESOLVED_VERDICTS, harness_verdict
from nandoctor.config import executor_config
from nandoctor.errors import NandoctorError


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
    code = ("import sys, nandoctor.cli, nandoctor.api, nandoctor.run.session, nandoctor.bisect.oracle; "
            "print(sorted(m for m in ('submitit', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class LosingPlacement:
    """A scheduler whose every job dies on a failing node before the probe writes anything."""
    batches, grace_s, capacity = True, 60.0, 4

    def __init__(self):
        self.submitted = 0

    def ready(self):
        pass

    def submit(self, probes):
        for probe in probes:
            self.submitted += 1
            probe.job_id = f"7_{self.submitted}"

    def poll(self, probes):
        from nandoctor.run.placement import Ending
        return [(p, Ending("NODE_FAIL", detail="node gpu17 stopped responding")) for p in probes]

    def cancel(self, probes, wait_s):
        pass

    def close(self):
        pass


def test_a_probe_the_scheduler_keeps_losing_is_retried_then_recorded_lost(tmp_path, monkeypatch):
    from nandoctor.cells import Cell
    from nandoctor.models import plan_model
    from nandoctor.plan import PlannedProbe
    from nandoctor.recipes import resolve_model
    from nandoctor.run import remote
    from nandoctor.run.runner import ProbeTask
    from nandoctor.run.session import probe_spec
    from nandoctor.run.store import ResultsStore
    placement = LosingPlacement()
    monkeypatch.setattr(remote, "open_placement", lambda executor, run_dir: placement)
    monkeypatch.setattr(remote, "POLL_S", 0.0)
    recipe = resolve_model(None)
    device = {"device": "cpu", "cpu_count": 2, "gpus": []}
    spec = probe_spec(recipe, PlannedProbe("fp32/eager/off", Cell("fp32", "eager", "off")), plan_model(recipe, device), device, 2, 1)
    runner = remote.RemoteRunner(tmp_path, ResultsStore(tmp_path), executor_config("slurm", ["retries=2"]))
    [record] = runner.run([ProbeTask(spec, 60.0)])
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

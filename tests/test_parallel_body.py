"""One probe body for one process and for W ranks: a real 2-rank DDP probe (gloo, CPU, tiny-llama) and
the one-process probe of the same cell leave records with the same fields, timed the same way: steady
throughput over all ranks and per device, the host's load, and a steady step time that leaves out the
warm-up steps the throughput measured."""

import statistics
import subprocess
import sys
import time

import pytest
from conftest import cuda_hidden, run_warm

from nandoctor.cells import Cell
from nandoctor.child.ranks import Ranks, host_sample, probe_load
from nandoctor.config import set_field
from nandoctor.env import host_load
from nandoctor.models import plan_model
from nandoctor.recipes import resolve_model
from nandoctor.record import ProbeRecord, ProbeSpec

pytestmark = pytest.mark.slow  # real probe processes, two ranks in one of them

STEPS = 6
# what a one-process record measures and a parallel one must carry too (parallel, ranks: only W ranks)
MEASURED = (
    "env",
    "load_s",
    "build_s",
    "train_s",
    "steady_step_s",
    "throughput",
    "host_load",
    "peak_memory_bytes",
    "peak_memory_kind",
    "weights_bytes",
    "grads_bytes",
    "optimizer_state_bytes",
)


def probe(tmp_path, cell: Cell) -> ProbeRecord:
    """The record a probe of `cell` writes on this machine's CPU, forked by a warm worker as a grid's is."""
    recipe = set_field(resolve_model("tiny-llama"), "forensics_steps", "0")
    spec = ProbeSpec(cell.id, recipe, cell, plan_model(recipe, {"device": "cpu"}), STEPS, recipe.seed, "cpu", 2)
    return run_warm(spec, tmp_path / cell.parallel, env=cuda_hidden())


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("body")
    return {p: probe(tmp, Cell("fp32", "eager", "off", parallel=p)) for p in ("none", "ddp")}


def test_a_parallel_record_carries_every_field_a_one_process_record_does(records):
    for name in MEASURED:
        assert getattr(records["none"], name) is not None, name
        assert getattr(records["ddp"], name) is not None, name
    assert records["ddp"].parallel["world_size"] == 2 and records["none"].parallel is None


def test_its_steady_step_time_leaves_out_the_warmup_steps_its_throughput_measured(records):
    for record in records.values():
        warmup = record.throughput.warmup
        assert warmup >= 1 and record.throughput.steps == STEPS - warmup
        assert record.steady_step_s == statistics.median(s.time_s for s in record.steps[warmup:])


def test_its_throughput_counts_every_ranks_tokens_and_says_what_one_device_did(records):
    one, two = records["none"].throughput, records["ddp"].throughput
    assert (one.devices, two.devices) == (1, 2)
    assert one.per_device == one
    assert two.per_device.median == pytest.approx(two.median / 2) and two.per_device.devices == 1
    # every rank trains half the rows of the same global batch: the steps count the whole batch's tokens
    assert [s.tokens for s in records["ddp"].steps] == [s.tokens for s in records["none"].steps]
    assert all(s.tokens_per_s == s.tokens / s.time_s for s in records["ddp"].steps)


def test_the_host_load_of_a_parallel_probe_is_other_processes_not_its_own_ranks(records):
    load = records["ddp"].host_load
    assert load["wall_s"] > 0 and load["other_cpu_cores"] is not None
    assert load["own_processes"] == 3  # the launcher and both ranks: none of them is another process
    assert records["none"].host_load["own_processes"] == 1


class BusyPeer(Ranks):
    """One process of a probe whose other process (a real one, spinning on a core) is `pid`."""

    def __init__(self, pid: int):
        self.pid = pid

    def peers(self) -> list[int]:
        return [self.pid]


def test_the_cpu_a_probes_other_process_uses_is_the_probes_own_not_other_load():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # past its start-up
        before = host_sample(BusyPeer(busy.pid))
        time.sleep(1.5)
        raw, load = host_load(before), probe_load(before)
    finally:
        busy.kill()
        busy.wait()
    assert load["own_processes"] == 2
    assert load["other_cpu_cores"] < raw["other_cpu_cores"] - 0.2  # the peer's core is not the host's load

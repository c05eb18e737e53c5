import ast
import contextlib
import functools
import gc
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

# One fixed hypothesis profile, loaded by default: the same examples on every run and every machine
# (derandomize), few enough to keep the property tests to seconds, no example database or patch file
# written under the worktree (no explain phase), no reproduction blobs printed.
# HYPOTHESIS_PROFILE=<name> picks another registered one.
settings.register_profile(
    "nandoctor",
    derandomize=True,
    max_examples=40,
    deadline=None,
    database=None,
    print_blob=False,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "nandoctor"))

sys.path.insert(0, str(Path(__file__).parent))


# Every core this pytest process may use, read before an xdist worker keeps to one of them.
ALL_CORES = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


def unpinned() -> None:
    """preexec_fn for a daemon a test starts (slurmd, slurmctld, a Ray head): it gets back every core,
    as on a real node, instead of inheriting the one its xdist worker keeps to."""
    if ALL_CORES:
        os.sched_setaffinity(0, ALL_CORES)


def _one_core_per_worker() -> None:
    """Under pytest-xdist (the README's `-n 2`), worker gwN keeps to core N (of those this process may
    use) and so does everything it starts: nandoctor then sizes its probes for one core (one torch
    thread each), as it would on a one-core machine, instead of two workers each running probes sized
    for the whole machine and spinning their threads against each other."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cores = sorted(ALL_CORES)
    if worker.startswith("gw") and worker[2:].isdigit() and len(cores) > 1:
        os.sched_setaffinity(0, {cores[int(worker[2:]) % len(cores)]})


_one_core_per_worker()

# A suite started in the background of a non-interactive shell (`nohup ... &` in a script) inherits SIGINT
# ignored, the shell's rule for such jobs, and so would every process it starts: each Ctrl-C test would
# find its nandoctor run deaf to the interrupt. Its processes get Ctrl-C as a user's terminal gives it (a
# handler is reset to the default across exec, where an ignored signal stays ignored).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

pytest_plugins = ("runs",)  # the shared session runs (tests/runs.py)


@pytest.fixture(autouse=True, scope="session")
def datasets_cache(tmp_path_factory):
    """The Hugging Face datasets cache the user's rows are converted and encoded into (userdata/read.py
    reads HF_DATASETS_CACHE when it runs): one of the session's, not the user's ~/.cache."""
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf-datasets"))
    return os.environ["HF_DATASETS_CACHE"]


# Test modules about how a run starts, ends and kills its processes, or about what a worker's own import
# does: their runs spawn their warm workers as a user's run does, never from the session's zygote. (A
# zygote-forked worker serves a run with the same loop, worker.serve: the modules about what a worker does
# for its run, its crashing and hanging probes, planning and the data lint, use the session's.)
SPAWNED_WORKERS = {
    "test_sigterm",
    "test_process_ends",
    "test_probe_lifetime",
    "test_own_processes",
    "test_busy_host",
    "test_fixed_cost",
    "test_zygote",
}


@pytest.fixture(autouse=True, scope="session")
def zygote(request, datasets_cache, tmp_path_factory):
    """One zygote per pytest process (child/zygote.py): the warm worker of each nandoctor run a test
    starts is forked from it, already imported, instead of paying `import torch, transformers` and
    the modeling code again (8-10 s on a 2-core CI host). It serves only runs whose environment is this
    session's; any other run spawns its own worker. Until it has imported (about as long as one worker),
    runs spawn their own. Yields the socket path; None, and no zygote, where the session runs no `slow`
    test (the fast tier: the few runs it starts spawn their own workers, so the zygote's imports would
    only take CPU from the tests)."""
    from nandoctor.record import ZYGOTE_ENV

    if not any(item.get_closest_marker("slow") for item in request.session.items):
        yield None
        return
    from nandoctor.run.slots import probe_env

    path = tmp_path_factory.mktemp("zygote") / "socket"
    env = {k: v for k, v in probe_env().items() if k != "GITHUB_STEP_SUMMARY"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nandoctor.child.zygote", str(path)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.environ[ZYGOTE_ENV] = str(path)
    yield path
    os.environ.pop(ZYGOTE_ENV, None)
    proc.kill()
    proc.wait()


@pytest.fixture(autouse=True)
def _environment_restored():
    """os.environ as it was before each test, afterwards. What a test sets, or a framework it imports or
    trains in this process (lightning's import sets PYTORCH_NVML_BASED_CUDA_CHECK), would otherwise reach
    every later run of this worker, and the zygote forks only for runs whose environment is the session's:
    every nandoctor run after it would spawn and import its own worker."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True, scope="module")
def _spawned_workers(request):
    """The modules of SPAWNED_WORKERS run without the zygote."""
    from nandoctor.record import ZYGOTE_ENV

    if request.module.__name__.rpartition(".")[2] not in SPAWNED_WORKERS:
        yield
        return
    saved = os.environ.pop(ZYGOTE_ENV, None)
    yield
    if saved is not None:
        os.environ[ZYGOTE_ENV] = saved


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A source file's syntax tree, parsed once a session: test_layout and test_verdict_table each walk every
    module of the package (about 170 files, 0.3 s a pass here). Read it, never change it."""
    return ast.parse(path.read_text())


def needs(*packages: str):
    """A skip mark for tests that need these installed packages (the `test` extra), read without importing
    them: pytest.importorskip at module level would import torchao and bitsandbytes (4 s of CPU on a
    2-core CI host) in every xdist worker while it collects, whichever worker runs the tests."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (pip install -e '.[test]')")


def one_core() -> None:
    """preexec_fn for a run whose probes must train with one thread whatever the load and whether or
    not pytest-xdist pins this process: it keeps to the lowest core it may use, so that nandoctor plans
    one thread per probe (threads never exceed the plan), as a user gets with OMP_NUM_THREADS=1, while
    its environment stays the session's and its warm worker comes from the zygote."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


@functools.cache
def cuda_hidden() -> dict:
    """The variables that hide this host's GPUs from a nandoctor run (CUDA_VISIBLE_DEVICES=""), as a user
    runs it on the CPU of a GPU host; none on a host without CUDA, where such a run keeps the session's
    zygote (which serves only runs whose environment matches its own)."""
    import torch

    return {"CUDA_VISIBLE_DEVICES": ""} if torch.cuda.is_available() else {}


def run_cli(*args, cwd=None, env=None, timeout=900, all_cores=False, single_core=False, on_cpu=False, process=False):
    """`nandoctor ...` as a user runs it; returns a CompletedProcess. env: variables set over this process's
    environment (None: removed from it). all_cores: on every core of the host, not the one this xdist
    worker keeps to (a test of how nandoctor sizes its jobs to the host). single_core: on one core
    (one_core), for runs whose losses are compared bit for bit. on_cpu: on the CPU of any host
    (cuda_hidden), for a test of what a CPU does: its default grid, gloo ranks, its threads.

    The run goes through `cli.main` in this process (run_main: its workers and probes are real processes,
    and what they print is captured with the CLI's own lines), saving the 2-5 s of CPU a fresh interpreter
    spends on imports, unless it needs a process of its own: process=True (a test of what that process
    imports or prints before nandoctor's own output, or of a signal sent to it), a cwd, other cores than
    this process has, or GPUs to hide from a host whose CUDA this process may have started."""
    env = {**(cuda_hidden() if on_cpu else {}), **(env or {})}
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    own = process or cwd is not None or all_cores or (single_core and len(cores) != 1) or (on_cpu and cuda_hidden())
    if not own:
        return run_main(*args, env=env)
    full_env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    full_env.pop("GITHUB_STEP_SUMMARY", None) if "GITHUB_STEP_SUMMARY" not in env else None
    return subprocess.run(
        [sys.executable, "-m", "nandoctor", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=full_env,
        timeout=timeout,
        preexec_fn=unpinned if all_cores else one_core if single_core else None,
    )


# `nandoctor ARGS` as its own process, saying last on stdout which heavy modules that process imported:
# the run's planning and data lint happen in a warm worker of this machine (run/planner.py), never in it.
NOTING_IMPORTS = """
import json, sys
from nandoctor.cli import main
code = main(sys.argv[1:])
print(json.dumps({"imported": sorted({"torch", "transformers", "peft"} & set(sys.modules))}))
sys.exit(code)
"""


def run_cli_noting_imports(*args, env: dict | None = None) -> tuple[subprocess.CompletedProcess, list[str] | None]:
    """run_cli through NOTING_IMPORTS: the finished run, and the heavy modules its process imported."""
    proc = subprocess.run(
        [sys.executable, "-c", NOTING_IMPORTS, *map(str, args)],
        capture_output=True,
        text=True,
        env={k: v for k, v in {**os.environ, **(env or {})}.items() if k != "GITHUB_STEP_SUMMARY"},
        timeout=900,
    )
    said = proc.stdout.strip().splitlines()
    return proc, json.loads(said[-1])["imported"] if said and said[-1].startswith("{") else None


def run_main(*args, env=None):
    """`nandoctor ...` through `nandoctor.cli.main` in this process; returns a CompletedProcess like
    run_cli's. stdout and stderr are captured at the descriptors, so what the run's workers and probes
    print lands there too, as from a process of its own; Python's warnings are shown as a fresh
    interpreter shows them (its default filters, each shown again), not collected by pytest. What only
    a fresh interpreter shows (what imports print, an import's first warning) and exit codes as the shell
    sees them stay with run_cli(process=True)."""
    from nandoctor.cli import main

    with (
        _environ({"GITHUB_STEP_SUMMARY": None, **(env or {})}),
        _captured_descriptors() as (stdout, stderr),
        _fresh_warnings(),
    ):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # --help, --version
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    return subprocess.CompletedProcess(["nandoctor", *map(str, args)], code, stdout.read(), stderr.read())


class _Captured:
    def __init__(self):
        self.file = tempfile.TemporaryFile()

    def read(self) -> str:
        with self.file:
            self.file.seek(0)
            return self.file.read().decode(errors="replace")


@contextlib.contextmanager
def _captured_descriptors():
    """Descriptors 1 and 2 (and sys.stdout, sys.stderr over them) into two files for the block; yields
    their readers."""
    out, err = _Captured(), _Captured()
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    streams = sys.stdout, sys.stderr
    try:
        os.dup2(out.file.fileno(), 1)
        os.dup2(err.file.fileno(), 2)
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
        yield out, err
    finally:
        # flushed, not closed: a handler that kept one (a library's logger first set up during the run)
        # writes on, through descriptor 1 or 2, to wherever they point again
        sys.stdout.flush(), sys.stderr.flush()
        sys.stdout, sys.stderr = streams
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        os.close(saved[0]), os.close(saved[1])


@contextlib.contextmanager
def _fresh_warnings():
    """The warning filters of a fresh `python` (no -W, no PYTHONWARNINGS), every warning shown again, to
    sys.stderr at the time; restored afterwards."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.filterwarnings("ignore", category=category, append=True)
        warnings.showwarning = _show_warning
        yield


def _show_warning(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


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


def run_warm(spec, run_dir: Path, env: dict | None = None):
    """The record of one probe of `spec`, forked by a warm worker in `run_dir` as a grid's probe is (the
    session's zygote's worker where this run's environment is the session's): for a test of what a probe
    records, not of how its process starts (a cold one pays seconds of imports first)."""
    from nandoctor.executors import ExecutorConfig
    from nandoctor.run.local import LocalPlacement
    from nandoctor.run.scheduler import Scheduler
    from nandoctor.run.store import ResultsStore
    from nandoctor.run.task import ProbeTask

    with (
        _environ(env or {}),
        Scheduler(LocalPlacement(ExecutorConfig(), run_dir, jobs=1), ResultsStore(run_dir), retries=0) as runner,
    ):
        (record,) = runner.run([ProbeTask(spec, spec.recipe.timeout_s)])
    return record


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def bisection(run_dir: Path) -> dict:
    """A bisect run's bisect.json."""
    return json.loads((Path(run_dir) / "bisect.json").read_text())


def summary_probes(run_dir: Path) -> dict[str, dict]:
    """{probe_id: the probe as summary.json shows it}."""
    return {p["probe_id"]: p for p in summary(run_dir)["probes"]}


def record_list(run_dir: Path) -> list[dict]:
    """The records of a run's results.jsonl as JSON dicts, in the order they were written."""
    return [json.loads(line) for line in (Path(run_dir) / "results.jsonl").read_text().splitlines()]


def records(run_dir: Path) -> dict[str, dict]:
    """{probe_id: record} of a run's results.jsonl."""
    return {r["probe_id"]: r for r in record_list(run_dir)}


def cpu_bisect(out: Path, *args) -> tuple:
    """`nandoctor bisect ARGS --out OUT` on the CPU of any host, which must exit 0: (the finished process,
    bisect.json, {probe_id: record}, {probe_id: summary probe})."""
    proc = run_cli("bisect", *args, "--out", out, on_cpu=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, bisection(out), records(out), summary_probes(out)


def assert_only_bad_is_off_policy(records: dict, probes: dict, good: str, bad: str, attn: str) -> None:
    """Two GRPO probes that scored the same sampled tokens with the same engine attention `attn`: good's
    rollout-training mismatch is inside the bound the verdict names and stable, bad's past it and
    off-policy, its reason naming its own figure."""
    from nandoctor.thresholds import THRESHOLDS

    apart, same = records[bad]["rollout_mismatch"], records[good]["rollout_mismatch"]
    assert apart["engine_attn"] == same["engine_attn"] == attn
    assert apart["tokens"] == same["tokens"] and apart["sequences"] == same["sequences"]
    cap = math.log(THRESHOLDS.rollout_ratio_cap)  # the most a 4,096-token completion's log-ratio may reach
    assert (
        THRESHOLDS.rollout_log_ratio(same["logp_diff_mean"])
        < cap
        < THRESHOLDS.rollout_log_ratio(apart["logp_diff_mean"])
    )
    assert probes[good]["verdict"] == "stable" and probes[bad]["verdict"] == "off-policy"
    assert probes[bad]["reason"].startswith(f"mean |dlogp| {apart['logp_diff_mean']:.2e} between rollout and training")


def result_lines(run_dir: Path, complete: bool = False) -> list[str]:
    """The lines of a run's results.jsonl as written, [] before it exists; complete=True: only those a
    newline ends (a line a killed run left half-written is not one)."""
    path = Path(run_dir) / "results.jsonl"
    if not path.exists():
        return []
    return path.read_text().split("\n")[:-1] if complete else path.read_text().splitlines()


def strict_json(text: str):
    """json.loads that refuses the bare NaN / Infinity Python's json writes by default."""

    def refuse(constant):
        raise ValueError(f"bare {constant} in JSON")

    return json.loads(text, parse_constant=refuse)


def verdicts(run_dir: Path) -> dict:
    return {p["probe_id"]: p["verdict"] for p in summary(run_dir)["probes"]}


@pytest.fixture
def cli():
    return run_cli


# Test modules that must run in one process, one after another: those sharing a session run of runs.py
# (made once per process). Every other module is its own group; the two executor modules (each starts
# its own SLURM node or Ray, and makes clusters.local_run once per process) are the longest, and start
# first. Under pytest-xdist (`-n 2 --dist loadgroup`, the README's test command) a group never splits
# across workers, so module- and session-scoped runs are still made once.
SHARED_RUNS = {
    "test_forensics": "large-mlp",
    "test_robustness": "large-mlp",
    "test_grid_numerics": "large-mlp",
    "test_report_first_screen": "large-mlp",
    "test_busy_host": "large-mlp",  # reads fp32_check with the two above
    "test_bisect_e2e": "fp16-pure-bisect",
    "test_nothing_mixed_nothing_lost": "fp16-pure-bisect",
    "test_integrations_ddp": "watch-fits",  # tests/watch_fits.py's one torchrun launch
    "test_integrations_fsdp2": "watch-fits",
    "test_integrations_trainer_ddp": "watch-fits",
    # the modules that train under Lightning or the transformers Trainer in this process: one worker imports
    # lightning and peft (seconds each) for all of them; their collection imports neither
    # (training_runs.nandoctor_lightning, nandoctor_transformers)
    "test_integrations_cells": "frameworks",
    "test_integrations_grad_scaler": "frameworks",
    "test_integrations_lightning": "frameworks",
    "test_integrations_transformers": "frameworks",
    "test_integrations_setup_lint": "frameworks",
    "test_trust_callbacks": "frameworks",
    "test_pasted_code": "frameworks",
    "test_one_verdict_every_door": "frameworks",
    "test_trl_training_template": "frameworks",
    "test_every_fault_every_door": "frameworks",
}


# The groups that take longest, longest first (seconds of test time each, from a timeline of every test's
# start and end in one `-n 2` run on a 2-core CPU): xdist's loadgroup hands a worker the next group when it
# is done, so the long ones go first, then the other groups with an end-to-end (`slow`) test, and the
# short ones fill in at the end, where a long one left last would run alone on one core.
LONGEST_GROUPS = (
    "test_executor_slurm",  # 210
    # 100 before test_trl_training_template and test_every_fault_every_door joined it (the latter alone:
    # 48 s on the quiet 2-core host, up to 150 s with other work on it)
    "frameworks",
    "test_executor_ray",  # 170
    "large-mlp",  # 120
    # 120 (190 in one process on a loaded host): Trainer, SFTTrainer and own-loop grids, a bisect; the stall
    # grids (Trainer and own loop at lr 1e-6) added 20-40 s: 148 s for the module in one process at load ~1.5
    "test_trainer_probe",
    "test_warm_workers",  # 75
    "test_sigterm",  # 70
    "fp16-pure-bisect",  # 70
    "test_rl_compile",  # 60 from inductor's cache; a cold one adds its compile, 148 s on a loaded host
    "watch-fits",  # 50
    "test_parallel_probes",  # 50
    "test_grpo_trainer",  # 50
    "test_parallel_forensics",  # 45
    "test_zygote",  # 45
    "test_fixed_cost",  # 45
    "test_plan_in_worker",  # 45
    "test_bisect_training_options",  # 30
    "test_userdata_lint_cli",  # 30
    "test_moe",  # 30
    "test_diff_e2e",  # 30
)


def pytest_configure(config):
    """Keep the order pytest_collection_modifyitems gives the groups: pytest-xdist (3.6 and later) would
    otherwise hand them out by how many tests each has, largest first (--loadscope-reorder), and a group of
    one long test (a SLURM bisection) could be left to the end."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collection writes bytecode even where PYTHONDONTWRITEBYTECODE is set (as on this project's VMs):
    pytest's assert-rewritten test modules (rewriting them all again is 3-4 s of CPU per pytest process
    on a 2-core CPU) and the nandoctor modules they import, which every process the suite starts then
    reads instead of compiling them again (`.ci/run`'s compileall does the same before the suite)."""
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = saved


# The objects of the modules imported so far, frozen (gc.freeze) out of every later full collection: torch's,
# transformers', pandas' and a framework's are several hundred thousand objects that live as long as the
# process, and each gen-2 collection (pytest's own 5 at the session's end among them) traversed them all
# again, 0.2-0.4 s each. Frozen after collection, and after each test that imported many more (a
# framework, a model family's code), with what cyclic garbage that one test left; what a test frees by
# reference count is freed as before.
FREEZE_AFTER_MODULES = 300
_frozen_at = [0]


def _freeze_imported() -> None:
    _frozen_at[0] = len(sys.modules)
    gc.freeze()


def pytest_collection_finish(session):
    _freeze_imported()


def pytest_runtest_logfinish(nodeid, location):
    if len(sys.modules) - _frozen_at[0] >= FREEZE_AFTER_MODULES:
        _freeze_imported()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Each test gets its module's xdist group (SHARED_RUNS); the groups that take longest run first, so
    that two workers end together. `gpu` tests need CUDA: without it they are skipped, with the reason."""
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        item.add_marker(pytest.mark.xdist_group(SHARED_RUNS.get(module, module)))
    group = {item: item.get_closest_marker("xdist_group").args[0] for item in items}
    end_to_end = {group[item] for item in items if item.get_closest_marker("slow")}
    rank = {name: n for n, name in enumerate(LONGEST_GROUPS)}
    items.sort(key=lambda item: rank.get(group[item], len(rank) + (group[item] not in end_to_end)))
    _skip_gpu_tests(items)


def _skip_gpu_tests(items):
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; torch sees no GPU on this machine")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)

"""The import rules that keep the stages and the two processes apart, read from the source with ast
(every import counts, including the ones inside functions)."""

import ast
import functools
import os
from pathlib import Path

import pytest
from conftest import parsed

PACKAGE = Path(__file__).resolve().parent.parent / "nandoctor"
FOUNDATION = {
    "nandoctor.errors",
    "nandoctor.typed",
    "nandoctor.cells",
    "nandoctor.config",
    "nandoctor.thresholds",
    "nandoctor.executors",
    "nandoctor.device",
    "nandoctor.runmeta",
    "nandoctor.record",
    "nandoctor.env",
    "nandoctor.digests",
}
# The layers, lowest first (docs/architecture.md draws them): a module imports only modules of its own
# layer and of the layers below. The package root (nandoctor/__init__.py: __version__, and a lazy
# load_run) stands outside them.
LAYERS = (
    ("foundation", FOUNDATION | {"nandoctor.jsonio", "nandoctor.optional"}),
    ("knowledge", {"nandoctor.knowledge"}),
    ("userdata", {"nandoctor.userdata"}),
    (
        "plan",
        {"nandoctor.data", "nandoctor.recipes", "nandoctor.capabilities", "nandoctor.plan", "nandoctor.recommend"},
    ),
    ("models", {"nandoctor.models"}),
    ("measure", {"nandoctor.measure"}),
    ("child", {"nandoctor.child"}),
    ("run", {"nandoctor.run"}),
    ("analysis", {"nandoctor.analysis"}),
    ("around", {"nandoctor.report", "nandoctor.retime", "nandoctor.doctor"}),
    ("api", {"nandoctor.api", "nandoctor.integrations"}),
    ("bisect", {"nandoctor.bisect"}),
    ("cli", {"nandoctor.cli"}),
)
# what each part may never import: later stages, and across the process boundary
FORBIDDEN = {
    "nandoctor.child": (
        "nandoctor.analysis",
        "nandoctor.report",
        "nandoctor.bisect",
        "nandoctor.run",
        "nandoctor.api",
        "nandoctor.cli",
        "nandoctor.doctor",
        "nandoctor.knowledge",
    ),
    "nandoctor.analysis": (
        "nandoctor.child",
        "nandoctor.report",
        "nandoctor.bisect",
        "nandoctor.api",
        "nandoctor.cli",
        "torch",
    ),
    "nandoctor.run": (
        "nandoctor.analysis",
        "nandoctor.report",
        "nandoctor.bisect",
        "nandoctor.api",
        "nandoctor.cli",
        "nandoctor.child",
    ),
    "nandoctor.report": (
        "nandoctor.child",
        "nandoctor.run.scheduler",
        "nandoctor.run.session",
        "nandoctor.bisect",
        "nandoctor.api",
        "torch",
    ),
    "nandoctor.plan": ("nandoctor.run", "nandoctor.child", "nandoctor.analysis", "nandoctor.report"),
    # the training callbacks run in the user's process: the child's hooks and the analysis both, but
    # no probe processes, no bisection, no CLI
    "nandoctor.integrations": ("nandoctor.run", "nandoctor.bisect", "nandoctor.api", "nandoctor.cli"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py") if p.name != "__main__.py"}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module `name` imports: nandoctor modules resolved, other top-level packages by name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            subs = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known]
            out.update(subs or [target])
    return out


@functools.cache  # parsing every module takes about a second; the tree does not change during a session
def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_graph_sees_the_package():
    g = graph()
    assert "nandoctor.child.entry" in g and "nandoctor.record" in g["nandoctor.child.entry"]
    assert "torch" in g["nandoctor.child.train"]


def test_there_is_no_import_cycle():
    g = graph()
    internal = {m: {t for t in targets if t in g and t != m} for m, targets in g.items()}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for t in sorted(internal[m]):
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(t) :] + [t]))
            if t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(internal):
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_a_part_never_imports_a_later_stage_or_the_other_process(part):
    bad = [
        (m, t)
        for m, targets in graph().items()
        if within(m, part)
        for t in targets
        for f in FORBIDDEN[part]
        if within(t, f)
    ]
    assert bad == []


def layer_of(name: str) -> int | None:
    return next((i for i, (_, parts) in enumerate(LAYERS) for p in parts if within(name, p)), None)


def test_every_module_has_a_layer():
    assert [m for m in graph() if m != "nandoctor" and layer_of(m) is None] == []


def test_no_module_imports_one_of_a_layer_above_it():
    above = [
        f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
        for m, targets in graph().items()
        if m != "nandoctor"
        for t in targets
        if within(t, "nandoctor") and t != "nandoctor" and layer_of(t) > layer_of(m)
    ]
    assert above == []


def foundation(name: str) -> bool:
    """A foundation module, or a module of a foundation package (nandoctor.record.spec)."""
    return any(within(name, f) for f in FOUNDATION)


def test_foundation_modules_import_only_each_other():
    g = graph()
    for m in filter(foundation, g):
        assert {t for t in g[m] if within(t, "nandoctor") and not foundation(t)} == set(), m


@pytest.mark.parametrize(
    "module, heavy", [("nandoctor", "torch,transformers,pandas"), ("nandoctor.cli", "torch,transformers")]
)
def test_importing_the_package_and_the_cli_stays_light(module, heavy):
    import subprocess
    import sys

    code = f"import sys, {module}; print(sorted(set('{heavy}'.split(',')) & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_under_loadgroup_each_test_runs_in_its_group(request):
    """`-n 2 --dist loadgroup` keeps the tests that share a run on one worker (conftest.SHARED_RUNS) only
    if xdist reads their group: it appends it to the node id. pytest 9.2.0 with pytest-xdist 3.8 drops
    it without a word (pytest-dev/pytest-xdist#1386): a clean clone's suite then made every shared run
    once per worker and ran the two cluster modules side by side."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not getattr(
        request.config.option, "loadgroup", False
    ):  # set on the workers
        pytest.skip("not run under pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@test_layout"), request.node.nodeid


def test_config_holds_the_recipe_tree_and_nothing_else():
    """The verdict thresholds and the executor option tables are foundation modules of their own; config.py
    re-exports neither."""
    import nandoctor.config
    import nandoctor.executors
    import nandoctor.thresholds

    moved = {
        nandoctor.thresholds: ("Thresholds", "THRESHOLDS", "refuse_short_probes"),
        nandoctor.executors: (
            "EXECUTOR_OPTIONS",
            "EXECUTOR_DEFAULTS",
            "ExecutorConfig",
            "executor_config",
            "with_hardware",
        ),
    }
    for module, names in moved.items():
        assert all(hasattr(module, n) and not hasattr(nandoctor.config, n) for n in names), module.__name__

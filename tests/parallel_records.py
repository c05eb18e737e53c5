"""Parallel probe records as the launcher leaves them (child/launch.py merges its ranks' records),
with the facts the knowledge rules read, and their rule cases (tests/test_knowledge_rules.py)."""

from nandoctor.cells import Cell
from nandoctor.knowledge.facts import observed_facts, setup_facts
from nandoctor.recipes import recipe_by_name
from nandoctor.record import ProbeRecord, Step


def parallel_record(
    cell: str,
    norm_ratio: float = 1.0,
    max_rel_error: float = 0.002,
    master=("float32",),
    reduce=("float32",),
    world_size: int = 2,
    groups: dict | None = None,
    worst_group: str | None = None,
    balancing_loss: float | None = None,
) -> ProbeRecord:
    """groups: {tensor group: {"error", "floor"}} as the ranks measure them (child/parallel.agreement), or
    none measured."""
    c = Cell.parse(cell)
    return ProbeRecord(
        cell,
        c,
        steps=[Step(i, 8.3 - 0.01 * i, 5.0) for i in range(4)],
        parallel={
            "world_size": world_size,
            "backend": "gloo",
            "master_dtype": list(master),
            "reduce_dtype": list(reduce),
            "grad_agreement": {
                "max_rel_error": max_rel_error,
                "worst_param": "model.layers.0.mlp.up_proj.weight",
                "norm_ratio": norm_ratio,
                "params": 39,
                **({"groups": groups, "worst_group": worst_group} if groups else {}),
            },
            "balancing_loss": balancing_loss,
            "loss_normalization": "tokens",
        },
    )


def _setup(cell: str) -> dict:
    return setup_facts(recipe_by_name("tiny-llama"), Cell.parse(cell))


PARALLEL_CASES = {  # rule id: (a setup with the problem, a setup without it), as (tokenizers, tmp_path) -> facts
    "low-precision-gradient-reduction": (
        lambda t, p: _setup("bf16-amp/sdpa/off/fsdp2-reduce-low"),
        lambda t, p: _setup("bf16-amp/sdpa/off/fsdp2"),
    ),
    "bf16-master-weights-under-amp": (
        lambda t, p: observed_facts(parallel_record("bf16-amp/sdpa/off/fsdp2", master=("bfloat16",))),
        lambda t, p: observed_facts(parallel_record("bf16-amp/sdpa/off/fsdp2")),
    ),
    "reduction-sums-gradients": (
        lambda t, p: observed_facts(parallel_record("fp32/sdpa/off/fsdp2", norm_ratio=2.0)),
        lambda t, p: observed_facts(parallel_record("fp32/sdpa/off/fsdp2")),
    ),
}

"""One rank of a parallel probe, forked by launch.py with RANK and WORLD_SIZE in its environment: the
probe body (probe.py) with DistributedRanks, the part of it only W ranks have.

Every rank builds the same model from the same seed (DDP and FSDP assume identical starts) and trains
its rows of each global batch: rank r of W takes rows [r B/W, (r+1) B/W) of the batch_size B the
one-process probe trains, so that probe is this one's exact reference. Before wrapping, rank 0 takes
the one-process gradient of the first global batch, and the same in fp32 (the floor each tensor group
is judged against); after wrapping, one backward on each rank's rows and the reduction give the
gradient the ranks will step with, and rank 0 compares the two (step-0 gradient agreement, as a whole
and per tensor group). Then the same training loop as a one-process probe runs on the wrapped model;
each step's loss is the mean over the ranks, its tokens their sum, its grad-norm that of the full
gradient. The forensics replay runs on every rank, with a watch on the reduction (reduction_watch.py).

Each rank writes its own record to rank{r}.json; the launcher merges them into result.json, and
publishes the timed result once every rank has written its own.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path

from .. import jsonio
from ..measure.accumulation import balancing_coefficient
from ..models import checked_groups
from ..record import ProbeRecord, ProbeSpec, Step
from ..userdata.encode import segments
from .build import Setup, first_step, restart
from .probe import probe
from .ranks import Ranks
from .reduction_watch import fsdp_param_groups
from .train import micro_loss


def rank_file(result: Path, rank: int) -> Path:
    """Where rank `rank` leaves its own record; the launcher merges them into `result`."""
    return result.with_name(f"rank{rank}.json")


def rendezvous_file(result: Path) -> Path:
    """The file store the ranks meet at (torch.distributed's file:// init), in the probe's folder."""
    return result.with_name("rendezvous")


def shard(batch: dict, rank: int, world_size: int) -> dict:
    """This rank's rows of a global batch: its share of the rows, or of a packed row's segments (the
    rows a rank's own flattening collator would pack)."""
    if batch["input_ids"].shape[0] == 1 and "position_ids" in batch and world_size > 1:
        return _segments_shard(batch, rank, world_size)
    rows = next(iter(batch.values())).shape[0] // world_size
    return {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}


def _segments_shard(batch: dict, rank: int, world_size: int) -> dict:
    """This rank's share of one packed row's segments (position_ids restart at 0 for each), with the
    part of its mask that covers them (2-D: those columns; 4-D: that block)."""
    positions = batch["position_ids"][0]
    starts = [a for a, _ in segments(positions)]
    bounds = starts + [positions.numel()]
    a, b = bounds[rank * len(starts) // world_size], bounds[(rank + 1) * len(starts) // world_size]
    out = {k: v[:, a:b] for k, v in batch.items() if k != "attention_mask"}
    mask = batch.get("attention_mask")
    if mask is not None:
        out["attention_mask"] = mask[..., a:b, a:b] if mask.dim() == 4 else mask[:, a:b]
    return out


def decoder_layers(model) -> list:
    """The modules FSDP2 shards one by one: transformers names them in `_no_split_modules`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def sum_hook(state, bucket):
    """A DDP comm hook that sums the ranks' gradients and never divides: recipe grad_reduce=sum."""
    import torch.distributed as dist

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def compress_hook(dtype_name: str):
    """A DDP comm hook that reduces each gradient bucket in `dtype_name`, as torch's bf16/fp16
    compress hooks do: cast, divide by the world size, all-reduce, cast back. torch's own bf16 hook
    refuses anything but NCCL (and XCCL), so the gloo ranks of a CPU probe use this one."""
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)

    def hook(state, bucket):
        grads = bucket.buffer()
        low = grads.to(dtype).div_(dist.get_world_size())

        def back(fut):
            grads.copy_(fut.value()[0])
            return grads

        return dist.all_reduce(low, async_op=True).get_future().then(back)

    return hook


def ddp_hook(spec: ProbeSpec):
    """(the comm hook the cell's row names, or None, and how the record names it)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    row = spec.cell.parallel_row
    if spec.recipe.grad_reduce == "sum":
        return sum_hook, "sum (grad_reduce=sum)"
    if row.comm_hook is None:
        return None, None
    if spec.device == "cuda":
        return getattr(default_hooks, row.comm_hook), row.comm_hook
    low = COMPRESSED[row.comm_hook]
    return compress_hook(low), f"{low} compress hook (gloo: torch's {row.comm_hook} needs NCCL)"


COMPRESSED = {"bf16_compress_hook": "bfloat16", "fp16_compress_hook": "float16"}


def _short(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wrap(model, spec: ProbeSpec):
    """The model wrapped as the cell's parallel row says: DDP with its comm hook, or FSDP2 per decoder
    layer and at the root with the row's MixedPrecisionPolicy."""
    import torch

    cell, summed = spec.cell, spec.recipe.grad_reduce == "sum"
    row = cell.parallel_row
    if row.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[0] if spec.device == "cuda" else None)
        hook, _ = ddp_hook(spec)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        return ddp
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, cell.precision.compute),
        reduce_dtype=torch.float32 if row.reduce == "float32" else None,
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if summed:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def reduce_dtypes(wrapped, spec: ProbeSpec) -> list[str]:
    """The dtypes the gradients were reduced in, read from the wrapper after its first backward (FSDP2
    settles its dtypes at its first forward): FSDPParam's, or DDP's gradient buckets' (a compress hook
    casts them to 16 bits for the all-reduce)."""
    row = spec.cell.parallel_row
    if row.wrapper == "ddp":
        if row.comm_hook and spec.recipe.grad_reduce != "sum":
            return [COMPRESSED[row.comm_hook]]
        return sorted({_short(p.dtype) for p in wrapped.module.parameters() if p.requires_grad})
    from torch.distributed.fsdp import FSDPModule

    used = set()
    for module in wrapped.modules():
        if isinstance(module, FSDPModule):
            for group in fsdp_param_groups(module._get_fsdp_state()):
                # FSDPParam clamps reduce_dtype to None when it equals param_dtype: it then reduces in that
                used |= {_short(p.reduce_dtype or p.param_dtype or p.orig_dtype) for p in group.fsdp_params}
    return sorted(used)


def _backward(model, step: tuple, s) -> None:
    """The backward of one optimizer step, (micro-batches, loss terms), with the training loop's losses."""
    micro_batches, items = step
    for batch in micro_batches:
        with s.attend():
            with s.autocast():
                loss = micro_loss(model, batch, items, len(micro_batches), s)
            loss.backward()


def one_process_gradient(model, step: tuple, s) -> dict:
    """The gradient of a whole global step in this one process, before any wrapping (fp32 copies)."""
    _backward(model, step, s)
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def reduced_gradient(wrapped, inner, step: tuple, s, rank: int) -> dict:
    """The gradient after one backward of each rank's rows of a step and the reduction, gathered whole
    on rank 0 (every rank takes part in gathering FSDP2's shards); the weights do not move."""
    _backward(wrapped, step, s)
    grads = {}
    for name, p in inner.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if rank == 0:
            grads[name] = g.detach().float().clone()
    wrapped.zero_grad(set_to_none=True)
    return grads


def fp32_gradient(model, step: tuple, s) -> dict:
    """The same one-process gradient with the model and its inputs in fp32 (numerics.in_fp32), no
    autocast and no SDPA backend pinned: what this precision's rounding alone moves the one-process
    gradient by is the floor each tensor group's difference is judged against, as the accumulation
    check's is (measure/accumulation.py). The weights come back bit for bit."""
    from contextlib import nullcontext

    from ..measure.numerics import fp32_batch, in_fp32

    micro_batches, items = step
    with in_fp32(model):
        up = replace(s, autocast=nullcontext, attend=nullcontext)
        return one_process_gradient(model, ([fp32_batch(b) for b in micro_batches], items), up)


def _norms(got: dict, want: dict) -> list[tuple[str, float, float, float]]:
    """(name, ||got - want||, ||want||, ||got||) of each parameter of `want` that `got` holds too (a DDP
    model's "module." prefix read through)."""
    out = []
    for name, ref in want.items():
        g = got.get(name.removeprefix("module."))
        if g is not None:
            out.append((name, (g - ref).norm().item(), ref.norm().item(), g.norm().item()))
    return out


def _group_errors(norms: list, groups: dict) -> dict:
    sums: dict[str, tuple[float, float]] = {}
    for name, diff_norm, ref_norm, _ in norms:
        group = groups.get(name.removeprefix("module."))
        if group is None:
            continue
        diff, whole = sums.get(group, (0.0, 0.0))
        sums[group] = (diff + diff_norm**2, whole + ref_norm**2)
    return {g: (d / w) ** 0.5 if w > 0 else None for g, (d, w) in sums.items()}


def group_errors(got: dict, want: dict, groups: dict) -> dict:
    """{group: ||got - want|| / ||want||, each models.checked_groups group's gradients together}
    (`groups`: {parameter name: its group}), over the parameters of `want`; None for a group whose
    `want` is zero."""
    return _group_errors(_norms(got, want), groups)


def agreement(reduced: dict, reference: dict, groups: dict | None = None, floors: dict | None = None) -> dict:
    """How the reduced gradient compares with the one-process one: the largest relative error of a
    parameter's gradient (||g - g_ref|| / ||g_ref||, over the parameters with a non-zero reference) and
    the ratio of the whole gradients' norms; with `groups` ({parameter name: its models.checked_groups
    group}), each group's own (`groups`: {group: {"error": group_errors of reduced against reference,
    "floor": `floors`' figure, the one-process gradient against fp32's (fp32_gradient), or None}}) and
    the group of the worst parameter (`worst_group`): a router's gradient can be off while the rest agree.
    Each parameter's norms are taken once, for both."""
    norms = _norms(reduced, reference)
    worst, worst_name = 0.0, None
    for name, diff_norm, ref_norm, _ in norms:
        if ref_norm > 0:
            rel = diff_norm / ref_norm
            if rel > worst or not math.isfinite(rel):
                worst, worst_name = rel, name
    num, den = sum(n[3] ** 2 for n in norms), sum(n[2] ** 2 for n in norms)
    out = {
        "max_rel_error": worst,
        "worst_param": worst_name,
        "norm_ratio": (num / den) ** 0.5 if den > 0 else None,
        "params": len(reference),
    }
    if groups is not None:
        errors = _group_errors(norms, groups)
        out["groups"] = {g: {"error": e, "floor": (floors or {}).get(g)} for g, e in errors.items()}
        out["worst_group"] = groups.get((worst_name or "").removeprefix("module."))
    return out


def agree(step: Step, world_size: int) -> None:
    """Make a rank's step the probe's: the loss averaged and the tokens summed over the ranks, so that
    every rank decides to stop on the same numbers."""
    import torch
    import torch.distributed as dist

    both = torch.tensor([step.loss, float(step.tokens or 0)], dtype=torch.float64)
    dist.all_reduce(both)
    step.loss = both[0].item() / world_size
    if step.tokens is not None:
        step.tokens = int(both[1].item())
        step.tokens_per_s = step.tokens / step.time_s if step.time_s else None


class DistributedRanks(Ranks):
    """Rank `rank` of a W-rank DDP or FSDP2 probe (ranks.Ranks says what each hook is for)."""

    def __init__(self, spec: ProbeSpec, rank: int, world_size: int, result: Path):
        self.spec, self.rank, self.world_size, self.result = spec, rank, world_size, result
        self.wrapped = None

    @property
    def underflow_note(self) -> str | None:
        if self.spec.cell.parallel_row.wrapper == "fsdp2":
            return "gradient underflow not measured under FSDP2: its parameters are sharded"
        return None

    def join(self, spec: ProbeSpec) -> None:
        import torch.distributed as dist

        dist.init_process_group(
            "nccl" if spec.device == "cuda" else "gloo",
            init_method=f"file://{rendezvous_file(self.result)}",
            rank=self.rank,
            world_size=self.world_size,
            # past every budget the runner holds: a rank stuck in a collective is the runner's
            # timeout (the probe's verdict), never a collective's own error on its peer
            timeout=timedelta(seconds=spec.recipe.build_timeout_s + spec.recipe.timeout_s + 60),
        )

    def prepare(self, spec: ProbeSpec, s: Setup, record: ProbeRecord, mark_built) -> Setup:
        """Rank 0 takes the one-process gradient of the first global step, and the same in fp32 (its
        rounding floor, per tensor group); the model is wrapped; one
        backward of each rank's rows of it and the reduction give the gradient rank 0 compares with it.
        Then an optimizer over the wrapped parameters (FSDP2 replaced them) and this rank's rows of the
        stream from its start. Records what the ranks run with in record.parallel."""
        micro_batches, items = first_step(spec, s)
        groups = {name: g for g, params in checked_groups(s.model).items() for name, _ in params}
        reference, floors = {}, None
        if self.rank == 0:
            reference = one_process_gradient(s.model, (micro_batches, items), s)
            floors = group_errors(reference, fp32_gradient(s.model, (micro_batches, items), s), groups)
        self.wrapped = wrap(s.model, spec)
        mark_built()  # built and wrapped: the first collective (the gradient check) is on the steps' budget
        rows = partial(shard, rank=self.rank, world_size=self.world_size)
        s = replace(s, rows=rows, world_size=self.world_size)
        reduced = reduced_gradient(self.wrapped, s.model, ([rows(b) for b in micro_batches], items), s, self.rank)
        s = restart(spec, s)
        row = spec.cell.parallel_row
        record.parallel = {
            "world_size": self.world_size,
            "backend": "nccl" if spec.device == "cuda" else "gloo",
            "wrapper": row.wrapper,
            "comm_hook": ddp_hook(spec)[1] if row.wrapper == "ddp" else None,
            "grad_reduce": spec.recipe.grad_reduce,
            "rows_per_rank": spec.recipe.batch_size // self.world_size,
            "master_dtype": sorted({_short(p.dtype) for p in s.model.parameters() if p.requires_grad}),
            "reduce_dtype": reduce_dtypes(self.wrapped, spec),
            "grad_agreement": agreement(reduced, reference, groups, floors) if self.rank == 0 else None,
            # a balancing loss each rank adds to a loss the Trainer multiplies by the ranks (tokens)
            "balancing_loss": balancing_coefficient(s.model),
            "loss_normalization": s.normalization,
        }
        return s

    def model(self, s: Setup):
        return self.wrapped

    def agree(self, step: Step) -> None:
        agree(step, self.world_size)

    def peers(self) -> list[int]:
        """The launcher and the other ranks (the launcher's other children)."""
        import psutil

        launcher = psutil.Process().parent()
        if launcher is None:
            return []
        return [launcher.pid] + [p.pid for p in launcher.children() if p.pid != os.getpid()]

    def replay_watches(self, s: Setup) -> tuple[Setup, list]:
        """A watch on each parameter's gradient before and after the reduction, read where the loop
        unscales (reduction_watch.py)."""
        from .reduction_watch import ObservedScaler, ReductionWatch, differentiated

        trained = [(n, p) for n, p in s.model.named_parameters() if p.requires_grad]
        watch = ReductionWatch(differentiated(self.wrapped, s.model), trained)
        return replace(s, scaler=ObservedScaler(s.scaler, watch)), [watch]

    def mark(self, forensics: dict) -> dict:
        forensics["rank"], forensics["world_size"] = self.rank, self.world_size
        for e in forensics["events"]:
            e["rank"] = self.rank
        return forensics

    def exit_code(self, forensics: dict) -> int:
        """1 when the replay raised: the launcher then stops the peers at once, instead of leaving them in
        a collective (it publishes the timed result with the replay's error)."""
        return 1 if "error" in forensics else 0


def main(argv: list[str]) -> None:
    """Run this rank through the probe body, write its record to rank{r}.json and end the process with
    its code. It never returns: freeing a DDP reducer or a gloo process group after training was seen
    to wait forever on a futex (a rank of a DDP probe, torch 2.13), and nothing is left to free once the
    record is written."""
    spec_path, result = Path(argv[0]), Path(argv[1])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    spec = ProbeSpec.from_dict(jsonio.loads(spec_path.read_text()))
    ranks = DistributedRanks(spec, rank, world_size, result)
    code = probe(spec, ranks, rank_file(result, rank), result.parent if rank == 0 else None)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

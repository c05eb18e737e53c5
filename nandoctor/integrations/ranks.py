"""The ranks of a data-parallel run (DDP, FSDP) agreeing on when a watched run stops.

Each rank judges its own loss and gradients, so a failure may show on one rank first (each trains
its own shard of the batch). After every step the watches judge, the ranks all-reduce one small
tensor: whether each saw a failure, and the lowest rank that did. Every rank then stops at that
same step, and only that rank writes the report. The agreement is one collective at the same steps
on every rank, whether a rank's watch is on or off (`Watch.settle` calls it outside `guarded`), so
a watch that switched itself off on one rank never leaves the others waiting in the collective.

Without torch.distributed initialised (or at world size 1) the agreement is the rank's own answer.
"""

from __future__ import annotations


class Ranks:
    """Where this process stands in the run's process group. Lightning and accelerate initialise the
    group after the callback is built, so it is looked up until found (then kept); by the first
    optimizer step it exists on every rank of a DDP / FSDP run."""

    def __init__(self):
        self.rank, self.size, self.device = 0, 1, "cpu"

    @property
    def distributed(self) -> bool:
        if self.size == 1:
            import torch
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                self.rank, self.size = dist.get_rank(), dist.get_world_size()
                # NCCL reduces only CUDA tensors; gloo reduces CPU ones
                if "nccl" in str(dist.get_backend()).lower():
                    self.device = f"cuda:{torch.cuda.current_device()}"
        return self.size > 1

    def agree(self, failed: bool) -> int | None:
        """The lowest rank whose watch saw a failure at this step, or None when no rank did.
        Every rank must call this at the same steps."""
        if not self.distributed:
            return self.rank if failed else None
        import torch
        import torch.distributed as dist

        # MIN of (0 when failed, else 1) says whether any rank failed; MIN of the failed ranks names the lowest
        flags = torch.tensor(
            [0 if failed else 1, self.rank if failed else self.size], dtype=torch.int64, device=self.device
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        stop, by = flags.tolist()
        return by if stop == 0 else None

    @property
    def speaks(self) -> bool:
        """Rank 0 prints the run's start and summary lines, once for the whole run."""
        return not self.distributed or self.rank == 0

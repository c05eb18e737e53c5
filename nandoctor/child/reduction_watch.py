"""Numerics forensics on the ranks of a parallel probe: each rank replays its first steps with the
instruments of a one-process replay (replay.py, instruments.py) on its own DDP or FSDP2 wrapper, and
adds this watch of what only a parallel step has, the reduction between the backward and the optimizer
step (parallel.DistributedRanks.replay_watches).

Per rank, tensor hooks on the parameters autograd differentiates (DDP: the module's own; FSDP2: its
unsharded parameters) read this rank's gradient before the reduction, and the loop's unscale (right
after backward and reduction, before clipping and the step) reads what the reduction left in the
parameters' gradients (FSDP2: this rank's shard). A parameter whose own gradient holds NaN/inf is a
backward offender on that rank; one whose gradient is finite on this rank before the reduction and not
after it is a reduction offender (an overflow in a 16-bit reduction, or a peer's NaN: then that peer
has a backward offender at the same step, which comes first). Every event carries its rank; the
launcher merges the ranks' records, and the analysis orders the events by step, phase and rank.

All ranks replay the same steps: each step's loss is averaged over them before the stop decision.
"""

from __future__ import annotations

from functools import partial

from .instruments import local, minmax, minmax_dict


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


class ReductionWatch:
    """Each parameter's gradient on this rank before the reduction, and after it."""

    def __init__(self, differentiated: list[tuple], reduced: list[tuple]):
        self.reduced = reduced  # (name, parameter whose .grad holds the reduced gradient)
        self.before: dict = {}  # name -> [min, max] of this rank's own gradient, in the order backward made them
        self.after: list[tuple] = []
        self.handles = [t.register_hook(partial(self._own, name)) for name, t in differentiated]

    def _own(self, name: str, grad) -> None:
        self.before[name] = minmax([grad])

    def observe(self) -> None:
        """Read the reduced gradients (called where the loop unscales them)."""
        self.after = [(n, minmax([local(p.grad)])) for n, p in self.reduced if p.grad is not None]

    def end_step(self, step: int) -> list[dict]:
        import torch

        names = list(self.before)
        after = dict(self.after)
        queued = [self.before[n] for n in names] + [after[n] for n in names if n in after]
        rows = torch.stack(queued).cpu().tolist() if queued else []
        own = dict(zip(names, rows[: len(names)]))
        reduced = dict(zip([n for n in names if n in after], rows[len(names) :]))
        self.before, self.after = {}, []
        events = []
        bad = next((n for n in names if not _finite(own[n])), None)
        if bad is not None:
            events.append(
                {
                    "step": step,
                    "phase": "backward",
                    "module": _module(bad),
                    "parameter": bad,
                    "tensor": "this rank's gradient of the parameter, before the reduction",
                    "stats": minmax_dict(own[bad]),
                }
            )
        lost = next((n for n in names if n in reduced and _finite(own[n]) and not _finite(reduced[n])), None)
        if lost is not None:
            events.append(
                {
                    "step": step,
                    "phase": "reduction",
                    "module": _module(lost),
                    "parameter": lost,
                    "tensor": "gradient after the reduction",
                    "stats": minmax_dict(reduced[lost]),
                    "before": {
                        "what": "this rank's gradient of it before the reduction",
                        "module": lost,
                        **minmax_dict(own[lost]),
                    },
                }
            )
        return events

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _finite(row: list[float]) -> bool:
    return all(abs(x) < float("inf") for x in row)  # False for NaN too


class ObservedScaler:
    """The replay's GradScaler: before it unscales, the watch reads the gradients the reduction left."""

    def __init__(self, scaler, watch: ReductionWatch):
        self.scaler, self.watch = scaler, watch

    def unscale_(self, optimizer):
        self.watch.observe()
        return self.scaler.unscale_(optimizer)

    def __getattr__(self, name):
        return getattr(self.scaler, name)


def fsdp_param_groups(state) -> list:
    """An FSDP2 module state's parameter groups: a list in newer torch (`_fsdp_param_groups`); one group
    or None in the torch versions before it (`_fsdp_param_group`). Reading only the list found no group
    there: the record got no reduce dtype and the replay watched the sharded parameters."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups


def differentiated(wrapped, inner) -> list[tuple]:
    """(name, tensor) of what autograd differentiates on this rank: FSDP2's unsharded parameters (they
    exist once the first all-gather has run), or the module's own parameters under DDP."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for module in inner.modules():
        if isinstance(module, FSDPModule):
            for group in fsdp_param_groups(module._get_fsdp_state()):
                out += [(p._param_fqn, p._unsharded_param) for p in group.fsdp_params if p.sharded_param.requires_grad]
    if out:
        return out
    return [(n, p) for n, p in inner.named_parameters() if p.requires_grad]

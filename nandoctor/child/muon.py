"""torch.optim.Muon with the usual split, as one optimizer the probe steps.

Muon orthogonalises each update with Newton-Schulz iterations and takes 2-D parameters only (torch
refuses the others). Its users give it the hidden matrices and AdamW everything else: the embeddings and
the output head (2-D, but a lookup table and a classifier, not hidden transforms), norms and biases
(Keller Jordan's Muon README; Moonlight, arXiv 2502.16982). The probe does the same and records which
parameters were the embeddings and the head.
"""

from __future__ import annotations

import torch

from ..cells import OPTIMIZERS, optimizer_kwargs
from ..config import OptimizerConfig


def muon_split(model) -> tuple[set[str], dict]:
    """(names of the trainable parameters Muon steps, the record's `optimizer_split`: how many tensors each
    optimizer steps and the names of the embeddings and the head, which go to AdamW). A tied head is
    named under both."""
    outer = {}
    for role, module in (("embeddings", model.get_input_embeddings()), ("head", model.get_output_embeddings())):
        for p in module.parameters() if module is not None else ():
            outer.setdefault(id(p), set()).add(role)
    roles: dict = {"embeddings": [], "head": []}
    for name, p in model.named_parameters(remove_duplicate=False):
        for role in sorted(outer.get(id(p), ())):
            roles[role].append(name)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = {n for n, p in trainable if p.ndim == 2 and id(p) not in outer}
    split = {"muon_tensors": len(hidden), "adamw_tensors": len(trainable) - len(hidden), **roles}
    return hidden, split


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over the hidden matrices and AdamW over the rest, as one torch optimizer: the two share their
    parameter groups and state, so that a GradScaler, zero_grad and state_dict see a single optimizer."""

    def __init__(self, hidden: list, rest: list, o: OptimizerConfig, split: dict):
        """hidden: the parameters Muon steps; rest: AdamW's parameter groups; split: muon_split's record."""
        self.split = split
        self.muon = torch.optim.Muon(
            hidden, **optimizer_kwargs(OPTIMIZERS["muon"], o.lr, o.betas, o.eps, o.weight_decay)
        )
        self.adamw = torch.optim.AdamW(
            rest, **optimizer_kwargs(OPTIMIZERS["adamw"], o.lr, o.betas, o.eps, o.weight_decay)
        )
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self._link()

    def _link(self) -> None:
        """Point both optimizers at this one's groups and state (load_state_dict replaces them)."""
        count = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:count], self.param_groups[count:]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()

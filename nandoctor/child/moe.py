"""The routing instruments of a mixture-of-experts probe (in the probe process), hung off the unchanged
training loop: a forward hook on each router module (the class transformers records router_logits
from, whatever the family calls its experts) counts the tokens each expert gets, per layer, at step 0
and at the last step, with the router's logits dtype and the mean entropy of its softmax, and keeps
step 0's token -> expert choices of the first ROUTE_TOKENS tokens (analysis compares them with the fp32
reference's); a forward hook on the model reads the load-balancing loss (aux_loss) of each step.
`pin_router_fp32` is moe.router_dtype=fp32: the router's weights, input and logits in fp32.

The hooks only read (none returns a tensor), so a probe trains as it would without them.
"""

from __future__ import annotations

from ..models import expert_count, expert_top_k

ROUTE_TOKENS = 256  # step-0 choices kept per layer: enough for a share of flips, small in a record


def _base(model):
    """The transformers model under a DDP wrapper (.module) and a peft one."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def routers(model) -> tuple[list[tuple[str, object]], int]:
    """([(name, router module)] in layer order, the index of the logits in the router's output), from the
    class the model records router_logits from (transformers' OutputRecorder); ([], 0) for a dense
    model or a family whose routers transformers does not name."""
    base = _base(model)
    recorder = (getattr(type(base), "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    if not expert_count(base.config) or target is None:
        return [], 0
    return [(n, m) for n, m in base.named_modules() if isinstance(m, target)], getattr(recorder, "index", 0) or 0


def router_choices(output, index: int, top_k: int):
    """(logits as (tokens, experts), the experts each token chose as (tokens, k)) of a router module's
    output: its logits at `index`, its chosen experts where the router returns them (a 3-tuple), else the
    logits' top-k."""
    import torch

    out = output if isinstance(output, tuple) else (output,)
    logits = out[index].detach()
    logits = logits.reshape(-1, logits.shape[-1])
    chosen = out[2].detach() if len(out) == 3 else torch.topk(logits, top_k, dim=-1).indices
    return logits, chosen.reshape(logits.shape[0], -1)


class RouterWatch:
    """Counts per layer at the steps in `keep`, step 0's choices, and each step's aux loss.
    `step` is set by the caller before each optimizer step (its micro-batches add up)."""

    def __init__(self, model, last_step: int):
        import torch

        self.torch = torch
        base = _base(model)
        self.config = base.config  # its load-balancing loss, as figures() reads it
        self.experts, self.top_k = expert_count(base.config), expert_top_k(base.config) or 1
        self.modules, self.index = routers(model)
        self.keep = {0, last_step}
        self.step = 0
        self.layers: dict[int, list[dict]] = {s: [self._blank() for _ in self.modules] for s in self.keep}
        self.choices: list[list[list[int]]] = [[] for _ in self.modules]
        self.dtype: str | None = None
        self.aux: dict[int, float] = {}
        # outside torch.compile's tracing: the hooks read self.step and sync, which a traced hook would
        # guard on (a recompile per step) or break the graph for
        hooks = [torch.compiler.disable(self._hook(i)) for i in range(len(self.modules))]
        self.handles = [m.register_forward_hook(h) for (_, m), h in zip(self.modules, hooks)]
        self.handles.append(base.register_forward_hook(torch.compiler.disable(self._model_hook)))

    def _blank(self) -> dict:
        return {"tokens": [0] * self.experts, "entropy_sum": 0.0, "rows": 0}

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            if self.step not in self.keep:
                return
            torch = self.torch
            logits, indices = router_choices(output, self.index, self.top_k)
            self.dtype = str(logits.dtype).removeprefix("torch.")
            at = self.layers[self.step][layer]
            counts = torch.bincount(indices.flatten(), minlength=self.experts).tolist()
            at["tokens"] = [a + b for a, b in zip(at["tokens"], counts)]
            p = torch.softmax(logits.float(), dim=-1)
            at["entropy_sum"] += float(-(p * torch.log(p.clamp_min(1e-30))).sum(-1).sum())
            at["rows"] += logits.shape[0]
            if self.step == 0 and len(self.choices[layer]) < ROUTE_TOKENS:
                room = ROUTE_TOKENS - len(self.choices[layer])
                self.choices[layer] += [sorted(row) for row in indices[:room].tolist()]

        return hook

    def _model_hook(self, module, inputs, output):
        aux = getattr(output, "aux_loss", None)
        if aux is not None and getattr(output, "loss", None) is not None:
            self.aux[self.step] = self.aux.get(self.step, 0.0) + float(aux.detach())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def figures(self) -> dict:
        """The record's `moe`: per layer and kept step the tokens per expert, experts with none, the tokens
        routed (rows), the largest share of them one expert took, the mean router entropy (nats); the router's
        dtype, step 0's choices, whether the config puts the load-balancing loss in the loss
        (output_router_logits) and its weight, and whether any step's loss held it."""
        layers = []
        for i, (name, _) in enumerate(self.modules):
            row = {"layer": i, "module": name}
            for s in sorted(self.keep):
                at = self.layers[s][i]
                total = sum(at["tokens"])
                row[f"step_{'0' if s == 0 else 'last'}"] = {
                    "step": s,
                    "tokens": at["tokens"],
                    "no_token": sum(1 for c in at["tokens"] if c == 0) if total else None,
                    "rows": at["rows"],
                    "largest_share": max(at["tokens"]) / at["rows"] if at["rows"] else None,
                    "entropy": at["entropy_sum"] / at["rows"] if at["rows"] else None,
                }
            layers.append(row)
        return {
            "experts": self.experts,
            "top_k": self.top_k,
            "router_dtype": self.dtype,
            "aux_loss_on": bool(getattr(self.config, "output_router_logits", False)),
            "aux_loss_coef": getattr(self.config, "router_aux_loss_coef", None),
            "aux_loss_in_loss": bool(self.aux),
            "layers": layers,
            "step0_choices": self.choices,
        }


def pin_router_fp32(model, device: str) -> int:
    """moe.router_dtype=fp32: every router's weights in fp32, its input cast to fp32 and its forward
    outside autocast, so that its logits, softmax and top-k are fp32 whatever the cell computes in.
    Returns the routers pinned."""
    import torch

    modules, _ = routers(model)
    for _, m in modules:
        m.float()
        forward = m.forward

        def pinned(hidden_states, *args, _forward=forward, **kwargs):
            with torch.autocast(device, enabled=False):
                return _forward(hidden_states.float(), *args, **kwargs)

        m.forward = pinned
    return len(modules)


def router_watch(model, last_step: int) -> RouterWatch | None:
    """A RouterWatch over the model's routers (the caller removes it), or None for a dense model."""
    return RouterWatch(model, last_step) if routers(model)[0] else None

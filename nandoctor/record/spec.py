"""What the child reads: ProbeSpec (its spec.json), with the ModelPlan the parent decided once per run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..cells import Cell
from ..config import Recipe, recipe_from_dict, recipe_to_dict
from .fields import known_fields


@dataclass(frozen=True)
class ModelPlan:
    """What a run probes, decided once per run (models.plan_model) and read by every child."""

    source: str  # "local-weights" or "architecture-twin"
    scale: str  # "full" or "probe"
    model_type: str
    params: int  # parameters of the model actually probed
    full_params: int  # parameters of the model the recipe names
    trainable_params: int
    path: str | None  # weights directory when source is local-weights
    why: str
    shape: dict  # hidden, layers, heads, kv heads, head_dim, intermediate, vocab (experts, top_k) of the probed model
    refuses: dict = field(default_factory=dict)  # attn_implementation -> why the architecture refuses it
    named_shape: dict = field(default_factory=dict)  # the shape of the model the recipe names

    def stand_in(self) -> str | None:
        """What makes the probed model a stand-in: 'the probes train 32 of the named model's 128 routed experts
        (top-8 kept) and 2 of its 48 layers', the fewer routed experts or layers than the named one with
        both numbers; None when it has as many (a full-scale probe, a recipe this small, an older run)."""
        s, named = self.shape, self.named_shape
        fewer = [
            (k, what)
            for k, what in (("experts", "routed experts"), ("layers", "layers"))
            if s.get(k) and named.get(k) and s[k] < named[k]
        ]
        if not fewer:
            return None
        owners = ["the named model's"] + ["its"] * (len(fewer) - 1)
        parts = [
            f"{s[k]} of {owner} {named[k]} {what}"
            + (f" (top-{s['top_k']} kept)" if k == "experts" and s.get("top_k") else "")
            for owner, (k, what) in zip(owners, fewer)
        ]
        return f"the probes train {' and '.join(parts)}"

    def describe(self) -> str:
        s = self.shape
        return (
            f"{self.model_type} {self.source} at {self.scale} scale, {self.params / 1e6:.2f}M params "
            f"(hidden {s['hidden']}, {s['layers']} layers, {s['heads']}/{s['kv_heads']} heads x {s['head_dim']}, "
            f"vocab {s['vocab']})"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelPlan:
        return cls(**known_fields(cls, data))


@dataclass(frozen=True)
class ProbeSpec:
    """What one probe process is asked to do (its spec.json)."""

    probe_id: str
    recipe: Recipe
    cell: Cell
    plan: ModelPlan
    steps: int
    seed: int
    device: str  # "cpu" or "cuda"
    threads: int  # torch intra-op threads, so that K probes at once do not oversubscribe the cores
    replay_failed_only: bool = False  # the forensics replay only after a non-finite step (`check`: a quick pass)
    roundtrip: bool = False  # after the timed steps: merge, save, reload and compare (check --roundtrip)
    # --trainer-args: {"kind": "hf" | "sft", "args": the user's arguments as a dict}; the probe trains with
    # that trainer class (child/trainer.py). None: nandoctor's own loop (child/train.py)
    trainer: dict | None = None

    def to_dict(self) -> dict:
        return {
            "probe_id": self.probe_id,
            "recipe": recipe_to_dict(self.recipe),
            "cell": self.cell.to_dict(),
            "model_plan": self.plan.to_dict(),
            "steps": self.steps,
            "seed": self.seed,
            "device": self.device,
            "threads": self.threads,
            "replay_failed_only": self.replay_failed_only,
            **({"roundtrip": True} if self.roundtrip else {}),  # absent when off: older fingerprints stay
            **({"trainer": self.trainer} if self.trainer else {}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> ProbeSpec:
        recipe = data["recipe"]
        return cls(
            data["probe_id"],
            recipe_from_dict({k: v for k, v in recipe.items() if k != "name"}, recipe["name"]),
            Cell(**data["cell"]),
            ModelPlan.from_dict(data["model_plan"]),
            data["steps"],
            data["seed"],
            data["device"],
            data.get("threads") or 1,
            data.get("replay_failed_only", False),
            data.get("roundtrip", False),
            data.get("trainer"),
        )

"""The factors of a bisection: parse --good / --bad / --factor into full configurations (the four
grid axes plus dotted recipe fields), and turn a configuration back into a cell and a recipe variant.
Pure apart from the recipe validation it calls."""

from __future__ import annotations

import itertools
import re

from ..capabilities import cell_support, input_support
from ..cells import AXES, FASTEST_FIRST, REFERENCE_CELL, Cell, parse_axis_values
from ..config import Recipe, dotted_fields, get_field, set_field
from ..device import DeviceFacts
from ..errors import NandoctorError
from ..plan import quantized_without_adapter

BASELINE_AXES = {axis: getattr(REFERENCE_CELL, axis) for axis in AXES}  # every axis, the default optimizer too


# The factors that say what is trained rather than how it is computed: the batch an optimizer step sees
# (rows, micro-batches, ranks), the rows' length, the model, the data and the adapter's capacity. When two
# stable repairs are equally near the target, the one that keeps these as the user set them wins: for
# gradient_accumulation_steps=4 with loss_normalization=micro_batch, token normalisation with the
# accumulation kept, not a batch 4x smaller with the wrong normalisation kept.
WORKLOAD = (
    "batch_size",
    "gradient_accumulation_steps",
    "world_size",
    "seq_len",
    "data.max_length",
    "data.path",
    "data.tokenizer",
    "model.hub_id",
    "model.path",
    "model.arch",
    "adapter.type",
    "adapter.r",
    "adapter.target_modules",
    "adapter.modules_to_save",
)


def precision_ladder(good: dict, bad: dict, device: DeviceFacts | dict) -> dict[str, list[str]]:
    """{"dtype": the precisions faster than the baseline's and slower than the target's on this device,
    nearest the target first}: when the dtype is a culprit, bisect recommends the first of them that is
    stable rather than the baseline's. Empty where the baseline's precision is the faster (fp32 on a CPU)."""
    order = FASTEST_FIRST["cuda" if DeviceFacts.of(device).device == "cuda" else "cpu"]["dtype"]
    target, baseline = bad.get("dtype"), good.get("dtype")
    if target not in order or baseline not in order or order.index(target) >= order.index(baseline):
        return {}
    return {"dtype": list(order[order.index(target) + 1 : order.index(baseline)])}


def fastest_cell(device: DeviceFacts | dict) -> Cell:
    """The first cell of cells.FASTEST_FIRST the device supports, and whose pinned SDPA kernel takes what
    transformers gives it on unpadded rows (input_support: flash under torch.compile before torch 2.14
    gets a materialised mask); the reference cell where it supports none."""
    device = DeviceFacts.of(device)
    order = FASTEST_FIRST["cuda" if device.device == "cuda" else "cpu"]
    for values in itertools.product(*(order[axis] for axis in AXES)):
        cell = Cell(**dict(zip(AXES, values)))
        if cell_support(cell, device) is None and input_support(cell, {}, False, device) is None:
            return cell
    return REFERENCE_CELL


def parse_assignments(text: str, flag: str) -> dict[str, str]:
    """'dtype=bf16-pure,optimizer.eps=1e-8' -> {'dtype': 'bf16-pure', 'optimizer.eps': '1e-8'}. A comma
    starts a new assignment only when NAME= follows, so tuple values like q_proj,v_proj survive."""
    out = {}
    for item in re.split(r",(?=\s*[A-Za-z_][\w.]*\s*=)", text):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise NandoctorError(
                f"bad {flag} {item!r}: expected NAME=VALUE[,NAME=VALUE], e.g. dtype=bf16-pure,optimizer.eps=1e-8"
            )
        out[name.strip()] = value.strip()
    return out


def typed_value(recipe: Recipe, name: str, value: str, flag: str):
    """An axis value checked against its axis, or a recipe field typed like its default."""
    if name in AXES:
        if "," in value:
            raise NandoctorError(f"{flag}: {name} takes one value, got {value!r}")
        return parse_axis_values(name, [value])[0]
    try:
        return get_field(set_field(recipe, name, value).validate(), name)
    except NandoctorError as e:
        if name not in dotted_fields():
            raise NandoctorError(
                f"{flag}: unknown factor {name!r}; valid: {', '.join(AXES)} or a recipe field "
                f"({', '.join(dotted_fields())})"
            ) from None
        raise NandoctorError(f"{flag}: {e}") from None


def parse_configurations(
    recipe: Recipe, device: DeviceFacts | dict, good: str | None, bad: str | None, factors: list[str]
) -> tuple[dict, dict]:
    """(good, bad) as full configurations. The baseline defaults to fp32/eager/off with the recipe's
    own fields; the target to the baseline with the given --bad values, or to the fastest cell the
    device supports when --bad is absent. --factor NAME=VALUE adds one more target value. Only the
    values that differ between the two are factors of the search."""
    good_set = (
        {k: typed_value(recipe, k, v, "--good") for k, v in parse_assignments(good, "--good").items()} if good else {}
    )
    bad_set = (
        {k: typed_value(recipe, k, v, "--bad") for k, v in parse_assignments(bad, "--bad").items()}
        if bad
        else {axis: getattr(fastest_cell(device), axis) for axis in AXES}
    )
    for item in factors:
        bad_set.update(
            {k: typed_value(recipe, k, v, "--factor") for k, v in parse_assignments(item, "--factor").items()}
        )
    fields = [k for k in {**good_set, **bad_set} if k not in AXES]
    good_cfg = {**BASELINE_AXES, **{k: get_field(recipe, k) for k in fields}, **good_set}
    bad_cfg = {**good_cfg, **bad_set}
    if bad_cfg == good_cfg:  # a value equal in both is not a factor; with none left there is nothing to search
        raise NandoctorError(
            "the target and the baseline are the same configuration "
            f"({', '.join(f'{k}={v}' for k, v in bad_set.items())}); "
            "give --bad / --factor values that differ from the baseline"
        )
    for label, cfg in (("target", bad_cfg), ("baseline", good_cfg)):
        # every combination is validated when it is probed; fail early on these two
        quantized_without_adapter(variant(recipe, cfg), [Cell.of(cfg)])
        why = cell_support(Cell.of(cfg), device)
        if why:
            raise NandoctorError(f"the {label} {Cell.of(cfg).id} cannot run on this device: {why}")
    return good_cfg, bad_cfg


def variant(recipe: Recipe, config: dict) -> Recipe:
    for name, value in config.items():
        if name not in AXES:
            recipe = set_field(recipe, name, value)
    return recipe.validate()


def fmt_value(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)

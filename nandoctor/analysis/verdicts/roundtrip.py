"""`check --roundtrip`: whether the saved (merged, reloaded) model is the model that was trained."""

from __future__ import annotations

import math

from ...record import ProbeRecord
from ...thresholds import THRESHOLDS, Thresholds
from .figures import _fmt


def roundtrip_differs(rt: dict, t: Thresholds = THRESHOLDS) -> list[str]:
    """What makes a round trip (child/roundtrip.py) fail, one phrase each, each naming its tensors and
    their cause; [] when the live, merged and reloaded model agree within the thresholds."""
    if rt.get("error"):
        return [f"the round trip raised {rt['error']}"]
    live = rt["loss"]["live"]
    out = []
    for stage in ("merged", "reloaded"):
        loss, logits = rt["loss"][stage], rt["logits_rel_change"][stage]
        if not math.isfinite(loss) or abs(loss - live) > t.roundtrip_loss_rel * abs(live):
            out.append(f"{stage} loss {_fmt(loss)} against {_fmt(live)} live")
        elif logits > t.roundtrip_logits_rel:
            out.append(f"{stage} logits moved {logits:.3g} of their largest live value")
    evaluated = rt.get("evaluated")
    if evaluated:
        saved, scored = rt["loss"]["reloaded"], evaluated["loss"]
        loss_off = not (math.isfinite(saved) and math.isfinite(scored)) or abs(
            saved - scored
        ) > t.roundtrip_loss_rel * abs(scored)
        if loss_off or evaluated["logits_rel_change"] > t.roundtrip_logits_rel:
            fix = (
                "call optimizer.eval() before trainer.save_model() (optimizer.train() after)"
                if evaluated["saved_in"] == "train"
                else "the eval-mode weights were saved and still differ"
            )
            out.append(
                f"the saved model is not the one evaluate() scores: loss {_fmt(saved)} saved against {_fmt(scored)} "
                f"evaluated (a schedule-free optimizer saved in {evaluated['saved_in']} mode; "
                f"{_tensor_list([r for r in evaluated['tensors'] if _changed(r, t)])}): {fix}"
            )
    if rt.get("unmerged"):
        out.append(f"adapter left unmerged: {', '.join(rt['unmerged'][:4])} still in the merged model")
    merge = [r for r in rt["tensors"]["merge"] if _changed(r, t)]
    if merge:
        cause = "4-bit or 8-bit merge rounding" if rt.get("quantized") else "changed by the merge"
        out.append(f"{cause}: {_tensor_list(merge)}")
    reload = [r for r in rt["tensors"]["reload"] if _changed(r, t)]
    tied = rt["tied"]["reloaded"] and not rt["tied"]["merged"]
    heads = [r for r in reload if "lm_head" in r["tensor"] or "embed" in r["tensor"]] if tied else []
    if heads:
        out.append(f"trained head tied to the embeddings on reload: {_tensor_list(heads)}")
    rest = [r for r in reload if r not in heads]
    if rest:
        out.append(f"changed by save and reload: {_tensor_list(rest)}")
    return out


def _changed(row: dict, t: Thresholds) -> bool:
    if row.get("missing") or row.get("added") or row.get("shape"):
        return True
    if "update_lost" in row:
        return row["update_lost"] > t.roundtrip_update_lost
    return row["rel_change"] > t.roundtrip_tensor_rel


def _tensor_list(rows: list[dict], most: int = 3) -> str:
    def one(r: dict) -> str:
        if r.get("missing") or r.get("added"):
            return f"{r['tensor']} ({'missing' if r.get('missing') else 'added'})"
        if r.get("shape"):
            return f"{r['tensor']} (shape {r['shape'][0]} -> {r['shape'][1]})"
        if "update_lost" in r:
            return f"{r['tensor']} ({r['update_lost']:.0%} of its update lost)"
        return f"{r['tensor']} (changed {r['rel_change']:.2g} of its norm)"

    more = f" and {len(rows) - most} more" if len(rows) > most else ""
    return ", ".join(one(r) for r in rows[:most]) + more


def roundtrip_check(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> tuple[str, bool, str]:
    """`check --roundtrip`'s check: the saved model is the model that was trained."""
    return roundtrip_result(record.roundtrip, record.status == "ok" and not record.first_nonfinite, t)


def roundtrip_result(rt: dict | None, trained: bool, t: Thresholds = THRESHOLDS) -> tuple[str, bool, str]:
    """(check, passed, detail) of a round trip's figures (child/roundtrip.py); `trained`: whether its probe
    trained to the end (a round trip runs only then)."""
    name = "the saved model is the model that was trained"
    if not rt:
        return name, False, f"no round trip: {'no figures' if trained else 'the probe did not train to the end'}"
    differs = roundtrip_differs(rt, t)
    if rt.get("error"):
        return name, False, differs[0]
    loss = rt["loss"]
    how = "merged" if rt["adapter"] else "nothing to merge (a full fine-tune)"
    scored = f", evaluated {rt['evaluated']['loss']:.4f}" if rt.get("evaluated") else ""
    figures = (
        f"loss live {loss['live']:.4f}, merged {loss['merged']:.4f}, reloaded {loss['reloaded']:.4f}{scored} ({how}); "
        f"logits moved {rt['logits_rel_change']['merged']:.2g} / {rt['logits_rel_change']['reloaded']:.2g} "
        f"of their largest live value"
    )
    if differs:
        return name, False, f"{figures}; {'; '.join(differs)}"
    return name, True, f"{figures}; equal within {t.roundtrip_loss_rel:.0%} of the loss"

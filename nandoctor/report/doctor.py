"""The doctor section: environment facts, GPU capabilities and known-issue findings, as rows shared
by the `nandoctor doctor` terminal output and the grid reports (Markdown, HTML, summary.json)."""

from __future__ import annotations

from tabulate import tabulate

from .. import jsonio
from ..capabilities import GPU_FEATURES, gpu_capabilities, sdpa_backends
from ..device import DeviceFacts
from .data import data_text
from .formatting import fmt_bytes


def stack_facts(env: DeviceFacts) -> list[dict]:
    """The facts the doctor adds to the run's environment table: NVML, CPU, libraries, kernels."""
    nvml = env.nvml
    rows = [
        (
            "NVML",
            f"driver {nvml.driver}, CUDA driver {nvml.cuda_driver}, {len(nvml.devices)} GPU(s)"
            if nvml is not None and nvml.available
            else f"not available: {(nvml.reason if nvml is not None else None) or 'not checked'}",
        ),
        (
            "CPU",
            f"{env.cpu_name or '?'}, {env.cpu_count} cores usable, SIMD {env.cpu_capability or '?'}",
        ),
        ("RAM", f"{fmt_bytes(env.ram_bytes)} total, {fmt_bytes(env.ram_available_bytes)} available"),
        ("NCCL", env.nccl or "-"),
        ("SDPA backends", ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in sdpa_backends(env).items()) or "-"),
        ("C++ compiler (inductor on CPU)", env.cxx or "none on PATH"),
    ]
    for name, pkg in env.packages.items():
        rows.append((name, pkg.version if pkg.importable else "not installed"))
    return [{"fact": k, "value": v} for k, v in rows]


def environment_facts(env: DeviceFacts) -> list[dict]:
    core = [
        ("device", "cuda" if env.gpus else "cpu (no CUDA device visible to torch)"),
        ("python / torch", f"{env.python} / {env.torch}"),
        ("transformers / peft", f"{env.transformers} / {env.peft}"),
        ("CUDA / cuDNN", f"{env.cuda or '-'} / {env.cudnn or '-'}"),
    ]
    return [{"fact": k, "value": v} for k, v in core] + stack_facts(env)


def capability_rows(env: DeviceFacts) -> list[dict]:
    return [
        {
            "GPU": f"{c['index']}: {c['name']}",
            "cc": c["capability"],
            "arch": c["architecture"],
            "memory": fmt_bytes(c["memory_bytes"]),
            **{f: "yes" if c["native"][f] else "no" for f in GPU_FEATURES},
        }
        for c in gpu_capabilities(env)
    ]


def finding_rows(findings: list[dict], max_cells: int = 6) -> list[dict]:
    rows = []
    for f in findings:
        cells = f.get("cells") or []
        shown = ", ".join(cells[:max_cells]) + (f" (+{len(cells) - max_cells} more)" if len(cells) > max_cells else "")
        rows.append(
            {
                "severity": f["severity"],
                "rule": f["id"],
                "finding": f["title"],
                "cells": shown or "-",
                "figure": f.get("figure") or "",
                "why": f["why"],
                "fix": f["fix"],
                "evidence": "; ".join(f["evidence"]),
                "verified_by": "; ".join(f.get("verified_by") or []),
            }
        )
    return rows


def _table(rows: list[dict], fmt: str) -> str:
    return tabulate(rows, headers="keys", tablefmt=fmt) if rows else "_none_" if fmt == "github" else "none"


def doctor_markdown(env: DeviceFacts, findings: list[dict]) -> list[str]:
    """The '## Doctor' section of report.md, as lines."""
    parts = [
        "## Doctor",
        "",
        "Known issues for this setup (rules in nandoctor/knowledge/rules.yaml, each with its evidence):",
        "",
    ]
    parts += [
        _table(
            [{k: r[k] for k in ("severity", "rule", "finding", "cells", "fix")} for r in finding_rows(findings)],
            "github",
        ),
        "",
    ]
    for r in finding_rows(findings):
        parts.append(
            f"- **{r['rule']}**: {r['why']} Evidence: {r['evidence']}"
            + (f" Verified by: {r['verified_by']}" if r["verified_by"] else "")
        )
    caps = capability_rows(env)
    parts += [
        "",
        "GPU capabilities: " + ("" if caps else "no GPU visible to torch or NVML; probes run on the CPU."),
        "",
    ]
    if caps:
        parts += [_table(caps, "github"), ""]
    parts += [_table(stack_facts(env), "github"), ""]
    return parts


def render_doctor_text(report: dict) -> str:
    """What `nandoctor doctor` prints."""
    env = DeviceFacts.from_dict(report["environment"])
    out = ["Environment", tabulate([(r["fact"], r["value"]) for r in environment_facts(env)], tablefmt="plain"), ""]
    caps = capability_rows(env)
    out += [
        "GPU capabilities (native support)",
        tabulate(caps, headers="keys")
        if caps
        else "no GPU visible to torch or NVML: probes run on the CPU (fp32 native; bf16/fp16 in software)",
        "",
    ]
    setup = report.get("setup")
    if setup:
        out.append(
            f"Planned setup: {setup['recipe']}, cells {', '.join(setup['cells']) or '-'}"
            + (f", trainer args {setup['trainer_args']}" if setup.get("trainer_args") else "")
            + (f", accelerate config {setup['accelerate_config']}" if setup.get("accelerate_config") else "")
            + (f", {setup['world_size']} ranks" if setup.get("world_size") else "")
            + (f", tokenizer {setup['tokenizer']}" if setup.get("tokenizer") else "")
        )
        for cell, why in (setup.get("unsupported") or {}).items():
            out.append(f"  {cell} cannot run here: {why}")
        probed = setup.get("probed")
        if probed:
            out.append(f"  grid probes: {probed['model']}; {probed['why']}")
            out += [f"  stand-in: {probed['stand_in']}"] if probed.get("stand_in") else []
        out += router_lines(setup.get("router"))
        out.append("")
    if report.get("data"):
        out += data_text(report["data"])
    findings = report["findings"]
    own = [f for f in findings if f.get("scope", "setup") == "setup"]
    grid = [f for f in findings if f.get("scope", "setup") == "grid"]
    out.append(f"Findings: {len(own)}" + ("" if own else " (no known issue applies)"))
    out += _finding_lines(own)
    if grid:
        out += [
            "",
            f"What the grid will find: {len(grid)} known issue(s) that only some planned cells walk into "
            "(the grid probes them to show it; not a problem of this setup)",
        ]
        out += _finding_lines(grid)
    return "\n".join(out)


def router_lines(router: dict | None) -> list[str]:
    """A mixture of experts' routing as planned (models.router_facts), a line each; [] for a dense model."""
    if not router:
        return []
    coef = router.get("aux_loss_coef")
    family = router.get("aux_loss_family")
    return [
        f"Router ({router['model_type']}): {router['experts']} experts, each token routed to {router.get('top_k')}",
        f"  load-balancing loss: {router['aux_loss']} (the family's config: {family}; output_router_logits), "
        f"router_aux_loss_coef {coef}",
        f"  router weights trained: {'yes' if router.get('router_trained') else 'no (frozen under the adapter)'}; "
        f"router logits in: {'fp32' if router.get('router_dtype') == 'fp32' else 'the compute dtype'}"
        + (f"; weights stored in {router['quant_method']}" if router.get("quant_method") else ""),
    ]


def _finding_lines(findings: list[dict]) -> list[str]:
    out = []
    for r in finding_rows(findings):
        out += [
            f"  [{r['severity']}] {r['rule']}: {r['finding']}"
            + (f" (cells: {r['cells']})" if r["cells"] != "-" else ""),
            *([f"      measured: {r['figure']}"] if r["figure"] else []),
            f"      why: {r['why']}",
            f"      fix: {r['fix']}",
            f"      evidence: {r['evidence']}",
        ]
        if r["verified_by"]:
            out.append(f"      verified by: {r['verified_by']}")
    return out


def render_doctor_json(report: dict) -> str:
    return jsonio.dumps(report, indent=2)

"""What every run prints while it goes (the run directory, the model, a line per probe, heartbeats, a
scheduler's queue, the re-timing), and the closing line for reports that could not be written."""

from __future__ import annotations

import sys

from ..api import Listener
from ..thresholds import THRESHOLDS


def finish(analysis, exit_code: int | None = None) -> int:
    """After the terminal report: name each report file that was not written, in one line. A file the
    OS refused (full disk, read-only) is an output error, exit 2; a renderer that failed is a warning
    and the run's own exit code stands."""
    refused = False
    for line, output_error in analysis.unwritten:
        print(f"nandoctor: {'error' if output_error else 'WARNING'}: {line}", file=sys.stderr, flush=True)
        refused = refused or output_error
    return 2 if refused else (analysis.exit_code if exit_code is None else exit_code)


def say(line: str) -> None:
    print(line, flush=True)


def opened(run_dir) -> None:
    """The first line, at once: where the run goes."""
    say(f"run directory: {run_dir}")


def started(run_dir, plan, warnings: list[str]) -> None:
    """Before any probe runs: which model is built and why, and what the user must know."""
    say(f"model: {plan.describe()}; {plan.why}")
    if plan.stand_in():
        say(f"       stand-in: {plan.stand_in()}")
    for warning in warnings:
        print(f"nandoctor: WARNING: {warning}", file=sys.stderr, flush=True)


def alive_line(probe_id: str, elapsed_s: float, step: dict | None) -> str:
    last = f"step {step['step']} loss {step['loss']:.4g}" if step else "no step yet"
    return f"  ... {probe_id} running {elapsed_s:.0f} s, {last}"


def queue_line(queued: int, running: int, done: int, job_ids: list[str], queue_wait: int, retries: int) -> str:
    shown = ", ".join(job_ids[:3]) + (f" and {len(job_ids) - 3} more" if len(job_ids) > 3 else "")
    jobs = f" (job{'s' if len(job_ids) > 1 else ''} {shown})" if job_ids else ""
    then = "placed again (queue_wait)" if retries else "recorded lost (queue_wait, retries=0)"
    wait = f"; one not started within {queue_wait} s while none runs is {then}" if queued else ""
    return f"  ... queue: {queued} queued, {running} running, {done} done{jobs}{wait}"


def retiming_line(news) -> str:
    """One line of the re-timing's progress (retime.RetimeNews); each differs from the one before it."""
    cells, (first, last) = ", ".join(news.cells), news.rounds
    spent = f"{news.elapsed_s:.0f} s of its {news.budget_s:.1f} s"
    budget = f"{news.budget_s:.1f} s, {100 * news.share:g}% of the grid's {news.train_s:.1f} s of training"
    if news.kind == "start":
        return (
            f"re-timing {cells} back to back, interleaved ({last} rounds of {news.steps} steps, about "
            f"{news.estimate_s:.1f} s; budget {budget}): speed decides between them"
        )
    if news.kind == "over budget":
        return (
            f"not re-timing {cells}: {last} interleaved rounds would take about {news.estimate_s:.1f} s, more "
            f"than the re-timing's budget ({budget}); their grid probes decide"
        )
    if news.kind == "running":
        return f"  ... re-timing {cells}, round {first}: {spent} budget spent"
    gaps = "; ".join(
        f"{a} over {b} {i.ratio:.2f}x, 95% lower bound {i.low:.2f}x" for a, b, i in news.open if i is not None
    )
    return (
        f"re-timing rounds {first}-{last} of {cells} ({spent} budget spent): "
        f"{gaps or 'a gap'} is neither proven above {1 + THRESHOLDS.speed_margin:.2f}x nor within it yet"
    )


def stale_line(probe_ids: list[str]) -> str:
    return (
        f"resume: rerunning {len(probe_ids)} recorded probe(s) whose inputs changed since (checkpoint, tokenizer, "
        f"template or data files, environment or nandoctor version): {', '.join(probe_ids)}"
    )


def uncached_line(threads: dict) -> str:
    """The one line for the probes --cache did not keep since they gave up CPU threads to a busy host."""
    said = ", ".join(f"{probe_id} ({t} threads)" for probe_id, t in threads.items())
    return (
        f"nandoctor: WARNING: --cache stored none of {len(threads)} probe(s) that trained with fewer CPU threads "
        f"than planned while other processes held cores, as their last digits depend on the load: {said}; "
        "on an idle host, or with OMP_NUM_THREADS set, they are stored"
    )


def listener(probe) -> Listener:
    """What a run prints: the run directory, the model line, `probe(...)` per finished probe, a heartbeat
    per running one, a scheduler's queue as it changes, a line before a grid re-times its leading cells, one
    when a resumed run reruns records whose inputs changed, one before the first probe of a dtype this CPU
    emulates, and one when --cache kept no record of probes that gave up threads to a busy host."""
    return Listener(
        opened=opened,
        started=started,
        probe=probe,
        alive=lambda *a: say(alive_line(*a)),
        queue=lambda *a: say(queue_line(*a)),
        retiming=lambda news: say(retiming_line(news)),
        stale=lambda ids: say(stale_line(ids)),
        note=say,
        uncached=lambda threads: print(uncached_line(threads), file=sys.stderr, flush=True),
    )

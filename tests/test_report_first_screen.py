"""The report at a glance (issue 13, section 3): report.html and report.md answer "what should I
train with?" and "why did the others fail?" first, from real runs of tiny-llama."""

import json
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from conftest import result_lines, run_cli

from nandoctor.analysis.outcomes import analyze
from nandoctor.report.html import render_html
from nandoctor.report.matrix import VERDICT_COLORS

pytestmark = pytest.mark.slow  # end to end: real probe processes

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.fixture(scope="module")
def small_grid_run(tmp_path_factory):
    """fp32 and fp16-pure x eager and sdpa, 3 steps: fp16-pure fails at step 1 with NaN (AdamW eps=1e-8
    is 0 in fp16), fp32 is stable. (the run directory, what the grid printed)"""
    out = tmp_path_factory.mktemp("report") / "grid"
    proc = run_cli(
        "grid", "--axis", "dtype=fp32,fp16-pure", "--axis", "attn=eager,sdpa", "--axis", "compile=off", "--steps", "3",
        "--out", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr  # 0: fp32 is stable and nonfinite is a verdict, not a crash
    return out, proc.stdout


@pytest.fixture(scope="module")
def small_grid(small_grid_run):
    return small_grid_run[0]


def test_the_terminal_ends_with_the_answer_in_three_short_lines_then_the_details(small_grid_run):
    out, stdout = small_grid_run
    answer, details = (part.splitlines() for part in stdout.rstrip("\n").split("\n\n")[-2:])
    recommended = json.loads((out / "summary.json").read_text())["recommended"]
    assert answer[0].startswith(f"Recommended: {recommended} (fidelity ")
    # fp32 eager and sdpa share the top bucket: speed decides, and the line says how it was measured
    assert answer[1].startswith("Why: 2 configurations share the top fidelity bucket; it is ")
    assert answer[2].startswith(f"reports: {out}/report.md") and len(answer) == 3
    assert details[0] == "Verdicts: 2 stable, 2 nonfinite"
    assert "per round" not in stdout and "Why each is a tie" not in stdout  # said in report.md


def _matrix_cells(html: str) -> dict[str, str]:
    """probe id -> the classes of its matrix cell."""
    return {
        probe: classes for classes, probe in re.findall(r'<td class="([^"]*)" title="[^"]*" data-probe="([^"]*)"', html)
    }


def test_matrix_has_a_cell_per_probe_coloured_by_its_verdict(small_grid):
    cells = _matrix_cells((small_grid / "report.html").read_text())
    assert set(cells) == {"fp32/eager/off", "fp32/sdpa/off", "fp16-pure/eager/off", "fp16-pure/sdpa/off"}
    assert all("v-stable" in cells[p] for p in ("fp32/eager/off", "fp32/sdpa/off"))
    assert all("v-nonfinite" in cells[p] for p in ("fp16-pure/eager/off", "fp16-pure/sdpa/off"))
    recommended = json.loads((small_grid / "summary.json").read_text())["recommended"]
    assert [p for p, c in cells.items() if " rec" in c] == [recommended]


def test_recommendation_and_matrix_come_before_any_chart_or_table(small_grid):
    html = (small_grid / "report.html").read_text()
    assert html.index('id="recommendation"') < html.index('id="matrix"') < html.index('id="why"') < html.index("<svg")
    assert html.index('id="why"') < html.index("Stable configurations, ranked")


def test_fp16_pure_probes_are_one_failure_class_with_where_it_broke_and_the_fix(small_grid):
    html = (small_grid / "report.html").read_text()
    why = html[html.index('id="why"') : html.index("</ul>", html.index('id="why"'))]
    assert why.count("<li") == 1
    assert "fp16-pure with every attention</b> (2 probes)" in why
    assert "loss is nan at step 1" in why and "eps=1e-08 is 0.0 in float16" in why
    assert "fp16-adamw-eps-below-smallest-normal" in why and "Keep fp32 master weights" in why


def test_report_md_has_the_same_order_and_grouping_without_html(small_grid):
    md = (small_grid / "report.md").read_text()
    order = [
        md.index(h)
        for h in (
            "**Recommended: ",
            "## Verdict per configuration",
            "## Why the others failed",
            "## Stable configurations, ranked",
        )
    ]
    assert order == sorted(order)
    assert re.search(
        r"\| fp16-pure +\| ❌ nonfinite at step 1 +\| ❌ nonfinite at step 1 +\|", md
    )  # widths follow tok/s digits
    lines = [line for line in md.splitlines() if line.startswith("- fp16-pure with every attention (2 probes)")]
    assert len(lines) == 1 and "eps=1e-08 is 0.0 in float16" in lines[0]
    assert not re.search(r"</?(br|span|div|details|summary|table|td|tr|b|p|svg)\b", md)


def test_no_tokens_per_s_and_no_empty_chart_for_a_probe_that_failed_at_step_1(small_grid):
    html = (small_grid / "report.html").read_text()
    for probe in ("fp16-pure/eager/off", "fp16-pure/sdpa/off"):
        card = html[html.index(f"<b>{probe}</b>") :]
        card = card[: card.index("</details>\n")]
        assert "tokens/s" not in card and "<svg" not in card and "No loss curve" in card
        cell = re.search(rf'data-probe="{re.escape(probe)}">(.*?)</td>', html).group(1)
        assert "tok/s" not in cell and "at step 1" in cell


def test_numbers_mean_something(small_grid):
    html, md = (small_grid / "report.html").read_text(), (small_grid / "report.md").read_text()
    for text in (html, md):
        assert not re.search(r"e\+3\dx", text)  # fp32's range over an activation is no headroom
        assert not re.search(r"hooked steps? 0\.\d+x", text)  # a ratio below 1 is timing noise
    assert "no activation reached fp16's range" in md and "no activation reached fp16&#39;s range" in html


def test_overview_draws_coinciding_curves_once_and_failures_up_to_their_step(small_grid):
    html = (small_grid / "report.html").read_text()
    overview = re.search(r"<svg[^>]*>(?:(?!</svg>).)*loss per step, every probe that ran.*?</svg>", html, re.S).group(0)
    assert "fp32 with every attention (recommended)" in overview
    assert "fp16-pure with every attention: nonfinite at step 1" in overview and "×" in overview
    assert overview.count("<polyline") == 1  # the two fp32 curves are one line; fp16-pure has one finite point


def test_interrupted_run_shows_the_cells_it_did_not_reach(small_grid, tmp_path):
    run = tmp_path / "interrupted"
    shutil.copytree(small_grid, run)
    lines = result_lines(run)
    (run / "results.jsonl").write_text("\n".join(lines[:2]) + "\n")
    html = render_html(analyze(run))
    assert html.count('<td class="v-pending"') == 2 and "Interrupted run: 2 of 4 planned probes" in html


def test_check_run_gets_a_one_cell_matrix(fp32_check):
    out, proc, _ = fp32_check
    assert proc.returncode == 0, proc.stderr
    assert list(_matrix_cells((out / "report.html").read_text())) == ["fp32/eager/off"]


def read_png(path: Path) -> tuple[int, int, list[list[tuple[int, int, int]]]]:
    """Width, height and RGB rows of an 8-bit RGB(A), non-interlaced PNG (what Chromium writes)."""
    data = path.read_bytes()
    pos, idat = 8, b""
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            w, h, _, color = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    bpp = {2: 3, 6: 4}[color]
    raw, stride, prev, rows = zlib.decompress(idat), w * bpp, bytearray(w * bpp), []
    for y in range(h):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):  # undo the PNG row filters
            a, b, c = (line[i - bpp] if i >= bpp else 0), prev[i], (prev[i - bpp] if i >= bpp else 0)
            p = a + b - c
            paeth = a if abs(p - a) <= abs(p - b) and abs(p - a) <= abs(p - c) else b if abs(p - b) <= abs(p - c) else c
            line[i] = (line[i] + (0, a, b, (a + b) // 2, paeth)[kind]) & 255
        rows.append([tuple(line[x : x + 3]) for x in range(0, stride, bpp)])
        prev = line
    return w, h, rows


def _rgb(hex_color: str) -> tuple[int, int, int]:
    return tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (CI installs Debian's chromium where it can)")
def test_first_1200_px_of_report_html_show_the_matrix_and_the_recommendation(small_grid, tmp_path):
    shot = tmp_path / "first-screen.png"
    subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--screenshot={shot}",
            "--window-size=1280,1200",
            (small_grid / "report.html").resolve().as_uri(),
        ],
        capture_output=True,
        timeout=180,
        check=True,
    )
    w, h, rows = read_png(shot)
    assert (w, h) == (1280, 1200)
    counts: dict[tuple, int] = {}
    for row in rows:
        for px in row:
            counts[px] = counts.get(px, 0) + 1
    assert counts.get((255, 255, 255), 0) < 0.97 * w * h  # not blank
    cell = 60 * 20  # a matrix cell is ~120 x 40 px: half of one, at least, for each verdict in the run
    assert counts.get(_rgb(VERDICT_COLORS["stable"][0]), 0) > cell
    assert counts.get(_rgb(VERDICT_COLORS["nonfinite"][0]), 0) > cell
    assert counts.get(_rgb("#1f5fbf"), 0) > 200  # the recommendation's frame and the recommended cell's outline

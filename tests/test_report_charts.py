"""The report's building blocks that need no probe: round chart ticks, legends that fit their canvas,
coinciding curves found once, and sets of cells said in words."""

import math
import re

from nandoctor.cells import Cell
from nandoctor.report.charts import CHAR_W, coincident_groups, fmt_tick, line_chart, log_ticks, nice_ticks
from nandoctor.report.formatting import cells_text


def test_ticks_are_round_numbers_covering_the_range():
    ticks = nice_ticks(5.6282, 8.3953)
    assert ticks == [5.0, 6.0, 7.0, 8.0, 9.0]
    assert [fmt_tick(t, 0.25) for t in nice_ticks(0.0, 0.9)] == ["0", "0.25", "0.50", "0.75", "1.00"]
    assert all(fmt_tick(t, 0.0005) != "0.0005000000000000001" for t in nice_ticks(0, 0.0019))


def test_log_ticks_are_decades_or_one_two_five():
    assert [round(10**t, 6) for t in log_ticks(math.log10(2.1), math.log10(9.7))] == [2.0, 5.0, 10.0]
    assert [round(10**t, 6) for t in log_ticks(math.log10(1.5), math.log10(60))] == [2.0, 5.0, 10.0, 20.0, 50.0]
    assert log_ticks(-3.0, 2.0) == [-3.0, -2.0, -1.0, 0.0, 1.0, 2.0]


def _legend_texts(svg: str) -> list[tuple[float, str]]:
    return [
        (float(x), text)
        for x, text in re.findall(r'<text x="([0-9.]+)" y="[0-9.]+" font-size="10" fill="#333">([^<]*)</text>', svg)
    ]


def test_every_legend_label_is_drawn_whole_inside_the_canvas():
    labels = [
        "fp32 with every attention (recommended)",
        "bf16-amp/sdpa:math/off",
        "bf16-pure with every attention but eager",
        "fp16-pure with every attention: nonfinite at step 1",
        "fp16-amp/eager/off",
        "bf16-amp/sdpa/off",
        "fp32/sdpa:flash/off",
        "a label far too long for one row of a small chart, " * 3,
    ]
    series = [{"label": label, "points": [(0, 8.3 - i * 0.1), (1, 8.0 - i * 0.1)]} for i, label in enumerate(labels)]
    width = 420
    svg = line_chart(series, "loss", width=width)
    texts = _legend_texts(svg)
    assert all(x + CHAR_W * 10 * len(text) <= width for x, text in texts)
    drawn = " ".join(text for _, text in texts)
    assert all(" ".join(label.split()) in drawn for label in labels)
    assert int(re.search(r'height="(\d+)"', svg).group(1)) > 180  # the canvas grew to hold the legend rows


def test_curves_within_a_pixel_are_one_group_and_different_ones_are_not():
    same = [(0, 8.3086), (1, 8.2), (2, 7.9)]
    series = [
        {"points": same},
        {"points": [(x, y + 1e-4) for x, y in same]},
        {"points": [(x, y - 0.5) for x, y in same]},
        {"points": [(0, 8.3086), (1, math.nan)]},
        {"points": [(0, 8.3086), (1, math.nan)]},
    ]
    assert coincident_groups(series, tolerance=0.01) == [[0, 1], [2], [3, 4]]


def test_a_failed_series_is_marked_at_its_failing_step():
    fp32 = {"label": "fp32/sdpa/off", "points": [(k, 8.3 - 0.1 * k) for k in range(5)]}
    fp16 = {
        "label": "fp16-pure/eager/off",
        "points": [(0, 8.3), (1, 8.1), (2, math.nan)],
        "fail_step": 2,
        "fail_label": "fp16-pure/eager/off: nonfinite at step 2",
    }
    svg = line_chart([fp32, fp16], "loss")
    step_x = {
        int(step): float(x)
        for x, step in re.findall(
            r'<text x="([0-9.]+)" y="[0-9.]+" font-size="10" text-anchor="middle">(\d+)</text>', svg
        )
    }
    assert sorted(step_x) == [0, 1, 2, 3, 4]
    [(x, y, title)] = re.findall(r'<text x="([0-9.]+)" y="([0-9.]+)" [^>]*>×<title>([^<]*)</title></text>', svg)
    assert float(x) == step_x[2] and title == "fp16-pure/eager/off: nonfinite at step 2"  # under the axis' step-2 tick
    top = float(re.search(r'<rect x="[0-9.]+" y="([0-9.]+)"', svg).group(1))
    assert top <= float(y) <= top + 12  # on the plot's top edge, where no curve is
    # a dashed line leads from the series' last finite point (step 1) to the cross
    [(x1, _, x2, y2)] = re.findall(
        r'<line x1="([0-9.]+)" y1="([0-9.]+)" x2="([0-9.]+)" y2="([0-9.]+)" [^>]*stroke-dasharray="2 2"/>', svg
    )
    assert (float(x1), float(x2)) == (step_x[1], step_x[2]) and top <= float(y2) <= float(y)


def test_cells_said_in_words_name_what_they_share():
    ran = [Cell(d, a, "off") for d in ("fp32", "fp16-pure") for a in ("eager", "sdpa", "sdpa:math")]
    assert (
        cells_text([Cell("fp16-pure", a, "off") for a in ("eager", "sdpa", "sdpa:math")], ran)
        == "fp16-pure with every attention"
    )
    assert (
        cells_text([Cell("fp16-pure", a, "off") for a in ("sdpa", "sdpa:math")], ran)
        == "fp16-pure with every attention but eager"
    )
    assert cells_text([Cell("fp16-pure", "eager", "off")], ran) == "fp16-pure/eager/off"
    mixed = [Cell("fp32", "eager", "off"), Cell("fp32", "sdpa", "off"), Cell("fp16-pure", "eager", "off")]
    assert cells_text(mixed, ran) == "fp32 with every attention but sdpa:math; fp16-pure/eager/off"
    five = (
        ran + [Cell(d, "sdpa:flash", "off") for d in ("fp32", "fp16-pure")] + [Cell("fp32", "flash_attention_2", "off")]
    )
    assert cells_text(mixed[:2], five) == "fp32 with attention eager, sdpa"

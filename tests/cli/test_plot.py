"""plot.py: metrics.jsonl -> a valid hand-written SVG with one polyline point per logged step."""

import json
import xml.etree.ElementTree as ET

import pytest

from megatrain_cli.metrics.logs import JsonlLog
from megatrain_cli.metrics.record import StepMetrics
from megatrain_cli.plot import (CHART_HEIGHT, MARGIN_BOTTOM, MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, WIDTH, nice_ticks,
                                plot_run)

SVG = "{http://www.w3.org/2000/svg}"


def step_metrics(step: int, loss: float | None = None, tflops: float | None = 1.0) -> StepMetrics:
    return StepMetrics(step=step, total_steps=100, loss=3.0 / step if loss is None else loss, lr=1e-5,
                       grad_norm=1.0, tokens=1024, loss_tokens=1000, step_time_s=1.0, tokens_per_s=1024.0,
                       model_tflops=tflops)


def write_run(run_dir, metrics: list[StepMetrics]) -> None:
    with JsonlLog(run_dir / "metrics.jsonl") as log:
        for m in metrics:
            log.write(m)


def polylines(svg_path) -> list[list[tuple[float, float]]]:
    root = ET.parse(svg_path).getroot()  # raises if the SVG is not well-formed XML
    assert root.tag == SVG + "svg"
    return [[tuple(map(float, p.split(","))) for p in line.get("points").split()]
            for line in root.iter(SVG + "polyline")]


def test_plot_run_writes_two_charts_with_a_point_per_step(tmp_path):
    write_run(tmp_path, [step_metrics(s, tflops=10.0 + s) for s in range(1, 8)])
    target = plot_run(str(tmp_path))
    assert target == tmp_path / "metrics.svg"
    lines = polylines(target)
    assert [len(points) for points in lines] == [7, 7]
    loss_points, tflops_points = lines
    xs = [x for x, _ in loss_points]
    assert xs == sorted(xs) and len(set(xs)) == 7  # steps left to right
    # Loss falls: SVG y grows downwards, so the polyline's y must rise. TFLOPS rises: y falls.
    assert [y for _, y in loss_points] == sorted(y for _, y in loss_points)
    assert [y for _, y in tflops_points] == sorted((y for _, y in tflops_points), reverse=True)
    # Every point inside its own chart's plot area (the second chart sits CHART_HEIGHT lower).
    for index, points in enumerate(lines):
        top = index * CHART_HEIGHT
        for x, y in points:
            assert MARGIN_LEFT <= x <= WIDTH - MARGIN_RIGHT
            assert top + MARGIN_TOP <= y <= top + CHART_HEIGHT - MARGIN_BOTTOM
    text = target.read_text()
    assert "loss" in text and "model TFLOPS" in text


def test_series_that_is_all_none_is_skipped(tmp_path):
    write_run(tmp_path, [step_metrics(s, tflops=None) for s in range(1, 6)])
    lines = polylines(plot_run(str(tmp_path)))
    assert [len(points) for points in lines] == [5]
    assert "model TFLOPS" not in (tmp_path / "metrics.svg").read_text()


def test_a_missing_value_splits_the_line(tmp_path):
    # Step 3 was skipped (NaN loss -> null): the loss line breaks there instead of bridging it.
    write_run(tmp_path, [step_metrics(s, loss=float("nan") if s == 3 else None) for s in range(1, 7)])
    loss_lines = polylines(plot_run(str(tmp_path)))[:2]
    assert [len(points) for points in loss_lines] == [2, 3]


def test_resumed_run_keeps_last_record_of_a_repeated_step(tmp_path):
    write_run(tmp_path, [step_metrics(s) for s in range(1, 6)] + [step_metrics(s) for s in range(4, 9)])
    assert [len(points) for points in polylines(plot_run(str(tmp_path)))] == [8, 8]


def test_truncated_last_line_is_ignored_but_bad_middle_line_is_an_error(tmp_path):
    write_run(tmp_path, [step_metrics(s) for s in range(1, 4)])
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 4, "loss": 1.')  # a crash mid-write
    assert [len(p) for p in polylines(plot_run(str(tmp_path)))] == [3, 3]
    with open(path, "a") as f:
        f.write("\n" + json.dumps(step_metrics(5).to_json()) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:4"):
        plot_run(str(tmp_path))


def test_missing_or_empty_log_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        plot_run(str(tmp_path))
    assert not (tmp_path / "metrics.svg").exists()


def test_single_step_still_plots(tmp_path):
    write_run(tmp_path, [step_metrics(1, loss=2.0, tflops=5.0)])
    assert [len(p) for p in polylines(plot_run(str(tmp_path)))] == [1, 1]


def test_nice_ticks_cover_the_range_with_round_steps():
    assert nice_ticks(0.0, 1.0) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert nice_ticks(1.0, 7.0, integer=True) == [0.0, 2.0, 4.0, 6.0, 8.0]
    ticks = nice_ticks(2.3, 2.3)
    assert ticks[0] < 2.3 < ticks[-1]


def test_validation_loss_is_a_second_series_of_the_loss_chart(tmp_path):
    """Measured every few steps only, the validation loss joins its own points (marked) across the steps
    between, on the loss chart's axes, with a legend; the training loss and TFLOPS lines are unchanged."""
    metrics = [step_metrics(s, tflops=10.0 + s) for s in range(1, 11)]
    for m in metrics:
        if m.step % 4 == 0 or m.step == 10:
            m.val_loss = 4.0 / m.step
    write_run(tmp_path, metrics)
    target = plot_run(str(tmp_path))
    train, val, tflops = polylines(target)
    assert (len(train), len(val), len(tflops)) == (10, 3, 10)
    by_step = dict(zip(range(1, 11), train))
    assert [x for x, _ in val] == [by_step[s][0] for s in (4, 8, 10)]  # the same x axis
    assert [y for _, y in val] == sorted(y for _, y in val)  # falling loss: y grows downwards
    for x, y in val:  # inside the loss chart, the first one
        assert MARGIN_LEFT <= x <= WIDTH - MARGIN_RIGHT and MARGIN_TOP <= y <= CHART_HEIGHT - MARGIN_BOTTOM
    root = ET.parse(target).getroot()
    circles = {(float(c.get("cx")), float(c.get("cy"))) for c in root.iter(SVG + "circle")}
    assert set(val) <= circles  # every validation point marked
    assert "validation" in target.read_text() and "training" in target.read_text()


def test_a_run_without_validation_has_no_validation_series_or_legend(tmp_path):
    write_run(tmp_path, [step_metrics(s) for s in range(1, 5)])
    text = plot_run(str(tmp_path)).read_text()
    assert "validation" not in text and "training" not in text

"""dashboard.py: frames rendered into a recording console, plain lines, mode choice."""

import io

import pytest
from rich.console import Console

from megatrain_cli.dashboard import PLAIN_COLUMNS, Dashboard, fmt_bytes, fmt_duration, sparkline
from megatrain_cli.metrics.record import StepMetrics


def cpu_step(step: int = 3, **overrides) -> StepMetrics:
    """What a CPU run reports: no transfer rates, overlap, device memory, pinned bytes or MFU."""
    values = dict(step=step, total_steps=10, loss=2.3456, lr=1e-5, grad_norm=0.75, tokens=4096, loss_tokens=4000,
                  step_time_s=2.0, tokens_per_s=2048.0, model_tflops=0.0123, executed_tflops=0.0164,
                  host_rss_bytes=3 * 2**30, time_forward_s=0.5, time_backward_s=1.2, time_optimizer_s=0.3,
                  eta_s=14.0)
    values.update(overrides)
    return StepMetrics(**values)


def gpu_step(step: int = 40) -> StepMetrics:
    return StepMetrics(step=step, total_steps=100, loss=1.2345, lr=2e-5, grad_norm=1.5, tokens=32768,
                       loss_tokens=30000, step_time_s=4.0, tokens_per_s=8192.0, model_tflops=371.4,
                       executed_tflops=495.2, mfu=0.3755, h2d_gbps=41.2, d2h_gbps=12.5, link_peak_gbps=55.3,
                       overlap=0.93, time_forward_s=1.0, time_backward_s=2.6, time_optimizer_s=0.12,
                       time_wait_weights_s=0.16, time_wait_optimizer_s=0.08, gpu_mem_bytes=40 * 2**30,
                       host_rss_bytes=118 * 2**30, pinned_bytes=6 * 2**30, skipped_steps=2, eta_s=2 * 3600 + 61)


def frame_text(dash: Dashboard, m: StepMetrics) -> str:
    console = Console(record=True, width=140)
    console.print(dash.render(m))
    return console.export_text()


def row_label(label: str) -> str:
    # A row starts at a panel's left border and its label is followed by the column gap, so
    # 'loss' does not match 'loss trend' and 'optimizer' does not match 'wait optimizer'.
    return f"│ {label}  "


def line_with(text: str, label: str) -> str:
    """The rendered line holding the panel row `label`."""
    lines = [line for line in text.splitlines() if row_label(label) in line]
    assert len(lines) == 1, f"row {label!r} found {len(lines)} times in frame:\n{text}"
    return lines[0]


def panel_cell(line: str, label: str) -> str:
    """The text of one panel row: from its label to the panel's right border."""
    return line[line.index(row_label(label)) + 2:].split("│")[0]


# ---------------------------------------------------------------- rich frame
def test_gpu_frame_shows_every_measured_value():
    text = frame_text(Dashboard(mode="plain", console=Console(file=io.StringIO())), gpu_step())
    assert "step 40/100" in text and "40%" in text and "ETA 2:01:01" in text
    expected = {
        "loss": "1.2345", "lr": "2.000e-05", "grad norm": "1.5", "tokens/s": "8,192",
        "model TFLOPS": "371.4", "MFU": "37.5%", "executed TFLOPS": "495.2",
        "H2D": "41.2 GB/s of 55.3  75%", "D2H": "12.5 GB/s of 55.3  23%", "link peak": "55.3 GB/s",
        "overlap": "93.0%", "forward": "1.000 s   25%", "backward": "2.600 s   65%",
        "wait weights": "0.160 s    4%", "wait optimizer": "0.080 s    2%", "optimizer": "0.120 s    3%",
        "GPU memory": "40.0 GiB", "host RSS": "118.0 GiB", "pinned": "6.0 GiB", "skipped steps": "2",
        "tokens / step": "32,768 (30,000 with loss)",
    }
    for label, value in expected.items():
        assert value in panel_cell(line_with(text, label), label), (label, value)
    assert "n/a" not in text


def test_cpu_frame_shows_na_for_gpu_only_fields_and_no_invented_number():
    text = frame_text(Dashboard(mode="plain", console=Console(file=io.StringIO())), cpu_step())
    for label in ("MFU", "H2D", "D2H", "link peak", "overlap", "GPU memory", "pinned", "wait weights",
                  "wait optimizer"):
        cell = panel_cell(line_with(text, label), label)
        assert cell[len(label):].strip() == "n/a", (label, cell)
    # What a CPU does measure is still shown; a small TFLOPS figure must not round to 0.0.
    assert "0.0123" in panel_cell(line_with(text, "model TFLOPS"), "model TFLOPS")
    assert "2.3456" in panel_cell(line_with(text, "loss"), "loss")
    assert "3.0 GiB of" in panel_cell(line_with(text, "host RSS"), "host RSS")
    assert "0.500 s   25%" in panel_cell(line_with(text, "forward"), "forward")


def test_loss_trend_follows_updates():
    dash = Dashboard(mode="off")
    for step, loss in enumerate([4.0, 3.0, 2.0, 1.0], start=1):
        dash.update(cpu_step(step=step, loss=loss))
    text = frame_text(dash, cpu_step(step=4, loss=1.0))
    assert "█▆▃▁" in line_with(text, "loss trend")
    assert sparkline([1.0, float("nan"), 2.0]) == "▁█"


def test_unknown_total_and_unknown_link_peak():
    m = gpu_step()
    m.total_steps, m.link_peak_gbps, m.eta_s = 0, None, None
    text = frame_text(Dashboard(mode="off"), m)
    assert "step 40 " in text and "ETA n/a" in text
    assert "41.2 GB/s  (peak unknown)" in line_with(text, "H2D")


# ---------------------------------------------------------------- plain lines
def test_plain_mode_prints_header_once_and_one_fixed_width_line_per_update():
    out = io.StringIO()
    dash = Dashboard(mode="plain", total_steps=100, console=Console(file=out, width=60))
    steps = [cpu_step(step=1, loss=10.5), gpu_step(step=2), cpu_step(step=100, loss=float("nan"), skipped_steps=1)]
    for m in steps:
        dash.update(m)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 + len(steps)  # no wrapping at the narrow console width either
    header = lines[0].split("|")
    assert [h.strip() for h in header] == [name for name, _, _ in PLAIN_COLUMNS]
    separators = [[i for i, ch in enumerate(line) if ch == "|"] for line in lines]
    assert all(s == separators[0] for s in separators), "columns must line up"
    assert all(len(line) == len(lines[0]) for line in lines)

    cells = [[c.strip() for c in line.split("|")] for line in lines[1:]]
    col = {name: i for i, (name, _, _) in enumerate(PLAIN_COLUMNS)}
    assert cells[0][col["step"]] == "1/10" and cells[0][col["loss"]] == "10.5000"
    assert cells[0][col["H2D GB/s"]] == "n/a" and cells[0][col["MFU"]] == "n/a"
    assert cells[0][col["gpu mem"]] == "n/a" and cells[0][col["host rss"]] == "3.0 GiB"
    assert cells[1][col["H2D GB/s"]] == "41.2" and cells[1][col["MFU"]] == "37.5%"
    assert cells[1][col["TFLOPS"]] == "371.4" and cells[1][col["overlap"]] == "93.0%"
    assert cells[1][col["eta"]] == "2:01:01"
    assert cells[2][col["loss"]] == "nan" and cells[2][col["skipped"]] == "1"


def test_plain_step_uses_dashboard_total_when_metrics_have_none():
    dash = Dashboard(mode="plain", total_steps=50, console=Console(file=io.StringIO()))
    assert dash.format_plain(cpu_step(step=7, total_steps=0)).split("|")[0].strip() == "7/50"


def test_log_prints_literal_text_between_lines():
    out = io.StringIO()
    dash = Dashboard(mode="plain", console=Console(file=out, width=80))
    dash.update(cpu_step(step=1))
    dash.log("saved checkpoint [step 1] to runs/x")
    dash.update(cpu_step(step=2))
    lines = out.getvalue().splitlines()
    assert lines[2] == "saved checkpoint [step 1] to runs/x"
    assert len(lines) == 4


# ---------------------------------------------------------------- modes
def test_auto_picks_plain_on_a_non_terminal_and_rich_on_a_terminal():
    assert Dashboard(mode="auto", console=Console(file=io.StringIO())).mode == "plain"
    assert Dashboard(mode="auto", console=Console(file=io.StringIO(), force_terminal=True)).mode == "rich"


def test_off_prints_nothing():
    out = io.StringIO()
    with Dashboard(mode="off", console=Console(file=out)) as dash:
        dash.update(cpu_step())
        dash.log("hello")
    assert out.getvalue() == ""


def test_rich_mode_leaves_the_last_frame_on_screen():
    out = io.StringIO()
    with Dashboard(mode="rich", console=Console(file=out, width=140)) as dash:
        dash.update(cpu_step(step=1, loss=3.25))
        dash.update(cpu_step(step=2, loss=2.75))
    text = out.getvalue()
    assert "step 2/10" in text and "2.7500" in text
    assert "tok/s |" not in text  # the plain header never appears in rich mode


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="dashboard mode"):
        Dashboard(mode="fancy")


def test_formatters():
    assert fmt_bytes(None) == "n/a" and fmt_bytes(512) == "512 B" and fmt_bytes(3 * 2**30) == "3.0 GiB"
    assert fmt_duration(None) == "n/a" and fmt_duration(3725) == "1:02:05"


# ---------------------------------------------------------------- validation loss
def test_plain_lines_gain_a_val_loss_column_when_validation_is_on():
    out = io.StringIO()
    dash = Dashboard(mode="plain", total_steps=10, console=Console(file=out, width=60), val_every=2)
    dash.update(cpu_step(step=1))
    dash.update(cpu_step(step=2, val_loss=1.875))
    lines = out.getvalue().splitlines()
    assert [c.strip() for c in lines[0].split("|")][-1] == "val loss"
    assert [line.split("|")[-1].strip() for line in lines[1:]] == ["n/a", "1.8750"]  # none measured at step 1
    assert len({len(line) for line in lines}) == 1  # still aligned
    off = io.StringIO()
    Dashboard(mode="plain", console=Console(file=off)).update(cpu_step(step=1))
    assert "val loss" not in off.getvalue()  # validation off: no column


def test_rich_frame_shows_the_latest_validation_loss_its_step_and_trend():
    dash = Dashboard(mode="off", val_every=20)
    assert "(every 20 steps; none yet)" in line_with(frame_text(dash, cpu_step(step=3)), "val loss")
    for step, val in ((20, 3.0), (40, 2.0), (60, 1.5)):
        dash.update(cpu_step(step=step, val_loss=val))
    text = frame_text(dash, cpu_step(step=61))  # a later step without a pass: the last one's value, said so
    assert "1.5000  (step 60)" in panel_cell(line_with(text, "val loss"), "val loss")
    assert "█▃▁" in line_with(text, "val trend")
    assert "val loss" not in frame_text(Dashboard(mode="off"), cpu_step())  # validation off: no row

"""Per-step figures: FLOP counts, device peaks, the StepMetrics record, and the sinks it goes to (JSONL,
TensorBoard: logs.py; W&B, MLflow: trackers.py)."""

from megatrain_cli.metrics.flops import executed_flops, model_flops
from megatrain_cli.metrics.logs import JsonlLog, MetricsSink, TensorBoardLog
from megatrain_cli.metrics.peaks import PEAK_BF16_TFLOPS, peak_tflops
from megatrain_cli.metrics.record import StepMetrics

__all__ = ["PEAK_BF16_TFLOPS", "JsonlLog", "MetricsSink", "StepMetrics", "TensorBoardLog", "executed_flops",
           "model_flops", "peak_tflops"]

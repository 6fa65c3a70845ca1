"""`pd report`: a trained run's measurements against its plan's predictions, drift, charts."""

from pdcli.report.build import ReportResult, locate_run, make_report
from pdcli.report.compare import DEFAULT_DRIFT_THRESHOLD_PCT, Comparison, Drift, ReplanCommands, StageComparison, compare
from pdcli.report.measured import Measured, MeasuredStage, load_measured, read_trace
from pdcli.report.predicted import Predicted, PredictedStage, predict, stage_costs
from pdcli.report.render import render, to_json

__all__ = [
    "DEFAULT_DRIFT_THRESHOLD_PCT", "Comparison", "Drift", "Measured", "MeasuredStage", "Predicted", "PredictedStage",
    "ReplanCommands", "ReportResult", "StageComparison", "compare", "load_measured", "locate_run", "make_report",
    "predict", "read_trace", "render", "stage_costs", "to_json",
]

"""A run's picture, report.png: the training loss, the evaluation, the learning rate and the memory at the peak
beside its estimate, drawn from the run's own files (docs/report.md).

Modules:
    series    `run_series`: the series a run directory's metrics.jsonl, summary.json and run_config.json hold
    drawing   `write_report` / `report_after_run`: the figure on matplotlib's Agg canvas, written atomically
    __main__  `python -m looptrain.report RUN_DIR` (the command line lives in `looptrain.cli.report`)

A leaf: the command line's run draws its picture through it when it finishes; matplotlib is an optional extra
(`pip install 'looptrain[report]'`).
"""

from looptrain.report.drawing import REPORT_FILE, ReportUnavailable, draw_report, report_after_run, write_report
from looptrain.report.series import NotARunError, RunSeries, Series, run_series

__all__ = [
    "REPORT_FILE",
    "NotARunError",
    "ReportUnavailable",
    "RunSeries",
    "Series",
    "draw_report",
    "report_after_run",
    "run_series",
    "write_report",
]

"""report.png: a run's series (`looptrain.report.series`) drawn on matplotlib's Agg canvas, never a display, and
written through a temporary file and a rename, so that a reader never sees half a picture."""

from __future__ import annotations

from pathlib import Path

from looptrain import run_files
from looptrain.report.series import RunSeries, Series, run_series

REPORT_FILE = "report.png"
INSTALL = "pip install 'looptrain[report]'"
FIGURE_INCHES = (11.0, 7.5)
DPI = 100
MIB = 1 << 20
MARKED_POINTS = 40  # lines of fewer points mark each point


class ReportUnavailable(ImportError):
    """matplotlib is not installed; the message names the extra that brings it."""


def write_report(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Draws the run in `run_dir` into `output` (default: `run_dir/report.png`); returns the path written.

    Raises:
        NotARunError: `run_dir` holds no run (`looptrain.report.series.check_is_run`).
        ReportUnavailable: matplotlib is not installed.
        OSError: the picture cannot be written (nothing is left behind: no partial file, no temporary one).
    """
    series = run_series(run_dir)
    path = Path(output) if output is not None else Path(run_dir) / REPORT_FILE
    draw_report(series, path)
    return path


def report_after_run(run_dir: str | Path) -> str:
    """Draws a finished run's report.png; returns the line that says where it is, or the notice that says why there
    is none. Never raises: the picture is a report, never a reason to fail a run that finished."""
    try:
        path = write_report(run_dir)
    except ReportUnavailable as error:
        return f"notice: {error} (then: looptrain-report {run_dir})"
    except Exception as error:  # noqa: BLE001  the run has finished: its picture failing must not fail it
        return (f"notice: no report.png ({type(error).__name__}: {error}); the run itself is complete, and "
                f"looptrain-report {run_dir} draws it again")
    return f"the run's picture: {path}"


def draw_report(series: RunSeries, path: Path) -> None:
    """Four panels: the training loss, the evaluation, the learning rate (over updates) and the memory at the peak
    by category beside its estimate."""
    figure = agg_figure()
    (loss_axes, eval_axes), (lr_axes, memory_axes) = figure.subplots(2, 2)
    figure.suptitle(series.title)
    draw_lines(loss_axes, "training loss", [series.train_loss], "no train log line")
    draw_lines(eval_axes, "evaluation", series.evaluation, "no evaluation (no --eval-data, or --eval-every no)",
               baseline=series.baseline)
    draw_lines(lr_axes, "learning rate", [series.learning_rate], "no train log line")
    draw_memory(memory_axes, series)
    write_atomically(figure, path)


def agg_figure():
    """An empty figure on matplotlib's Agg canvas (pyplot and its display backends are never imported)."""
    try:
        import matplotlib  # noqa: F401  (the package itself: its absence is the error to name)
    except ImportError:
        raise ReportUnavailable(f"drawing report.png needs matplotlib, which is not installed: {INSTALL}") from None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=FIGURE_INCHES, dpi=DPI)
    # fixed margins: a layout engine would draw every picture twice
    figure.subplots_adjust(left=0.08, right=0.98, bottom=0.09, top=0.91, wspace=0.22, hspace=0.32)
    FigureCanvasAgg(figure)
    return figure


def draw_lines(axes, title: str, lines: list[Series] | tuple[Series, ...], empty: str,
               baseline: dict[str, float] | None = None) -> None:
    """Each series over updates; a dashed line at the majority class's score where `baseline` has one."""
    axes.set_title(title)
    axes.set_xlabel("update")
    drawn = [line for line in lines if line.steps]
    if not drawn:
        axes.text(0.5, 0.5, empty, ha="center", va="center", transform=axes.transAxes, color="0.4")
        return
    for index, line in enumerate(drawn):
        color = f"C{index}"
        marker = "o" if len(line.steps) < MARKED_POINTS else None
        axes.plot(line.steps, line.values, color=color, marker=marker, markersize=3, label=line.name)
        if baseline and line.name in baseline:
            axes.axhline(baseline[line.name], color=color, linestyle="--", linewidth=1,
                         label=f"{line.name}, majority class")
    if len(drawn) > 1 or baseline:
        axes.legend(fontsize="small")
    axes.grid(alpha=0.3)


def draw_memory(axes, series: RunSeries) -> None:
    """The measured peak as a bar stacked by category (params, grads, optimizer state, activations + temps), and the
    estimate's bar beside it, in MiB."""
    axes.set_title("memory at the peak")
    if not series.memory and series.estimated_peak_bytes is None:
        axes.text(0.5, 0.5, "no memory figures (summary.json has none: the run has not finished)", ha="center",
                  va="center", transform=axes.transAxes, color="0.4", wrap=True)
        return
    phase = f", {series.peak_phase}" if series.peak_phase else ""
    bottom = 0.0
    for index, (category, size) in enumerate(series.memory.items()):
        axes.bar(0, size / MIB, width=0.7, bottom=bottom, color=f"C{index}", label=category)
        bottom += size / MIB
    if series.memory:
        total = (series.peak_memory_bytes or sum(series.memory.values())) / MIB
        axes.annotate(mebibytes(total), (0, bottom), ha="center", va="bottom")
    if series.estimated_peak_bytes is not None:
        estimate = series.estimated_peak_bytes / MIB
        axes.bar(1, estimate, width=0.7, color="0.6", label="estimate (all categories)")
        axes.annotate(mebibytes(estimate), (1, estimate), ha="center", va="bottom")
    axes.set_xticks([0, 1], [f"measured\n({series.memory_meter or '?'}{phase})", "estimate"])
    axes.set_ylabel("MiB")
    axes.set_xlim(-0.5, 3.1)  # the legend's room, right of the bars
    axes.margins(y=0.15)
    axes.legend(fontsize="small", loc="upper right")


def mebibytes(size: float) -> str:
    return f"{size:.1f} MiB" if size >= 10 else f"{size:.2f} MiB"


def write_atomically(figure, path: Path) -> None:
    """The figure as PNG through a temporary file beside `path` and a rename: `path` is either the old picture or
    the new one, never half of one; a failed write leaves no temporary file."""
    run_files.write_atomically(path, lambda handle: figure.savefig(handle, format="png", dpi=DPI))

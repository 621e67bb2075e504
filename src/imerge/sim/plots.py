"""The projections' plots (matplotlib, headless)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from imerge.core.errors import IMergeError

from .profiles import SYNTHETIC
from .results import ComparisonReport, ProjectionReport, ProjectionRow

Lines = Callable[[str], list[tuple[str, list[ProjectionRow], str]]]  # a model's lines: (label, rows, key plotted)


def pyplot(command: str) -> Any:
    """matplotlib's pyplot, headless; a one-line error naming the extra that brings it where it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise IMergeError(f"{command} draws its figures with matplotlib, which is not installed: "
                          "pip install 'imerge[plots]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(rows: list[ProjectionRow], **match: Any) -> list[ProjectionRow]:
    return sorted((r for r in rows if all(getattr(r, k) == v for k, v in match.items())), key=lambda r: r.workers)


def _save(figure: Any, path: Path, plt: Any) -> str:
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path.name


def _by_model(plt: Any, lines: Lines, ylabel: str, title: str,
              path: Path, log_y: bool = False, legend_size: int = 8) -> str:
    """One panel per synthetic model, workers on a log2 axis; ``lines(model)`` gives each line's (label, rows, the
    rows' key plotted)."""
    figure, axes = plt.subplots(1, len(SYNTHETIC), figsize=(15, 3.8))
    for axis, model in zip(axes, SYNTHETIC):
        for label, series, key in lines(model):
            axis.plot([r.workers for r in series], [getattr(r, key) for r in series], marker="o", label=label)
        axis.set_xscale("log", base=2)
        if log_y:
            axis.set_yscale("log")
        axis.set_title(model)
        axis.set_xlabel("workers W")
    axes[0].set_ylabel(ylabel)
    axes[-1].legend(fontsize=legend_size)
    figure.suptitle(title)
    return _save(figure, path, plt)


def plot_projections(report: ProjectionReport, out: Path) -> list[str]:
    from .projections import BOUND_STRATEGIES, INCAST_QUEUE_KB, LINKS_GBIT, PERIODS

    plt, rows, written = pyplot("imerge simulate projections"), report.rows, []
    swept = {row.sweep for row in rows}
    for model in SYNTHETIC if "bound" in swept else ():
        figure, axes = plt.subplots(1, len(LINKS_GBIT), figsize=(13, 3.8), sharey=True)
        for axis, link in zip(axes, LINKS_GBIT):
            for strategy in BOUND_STRATEGIES:
                series = [r for r in _series(rows, sweep="bound", model=model, link_gbit=link, strategy=strategy)
                          if strategy == "ddp" or r.shards == max(1, r.workers // 2)]
                axis.plot([r.workers for r in series], [r.ratio_to_bound for r in series], marker="o",
                          label=strategy)
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.axhline(1.0, color="grey", linewidth=0.8)
            axis.set_title(f"{link:g} Gbit/s links, S = W/2")
            axis.set_xlabel("workers W")
        axes[0].set_ylabel("mean s/it over the strategy's bound")
        axes[-1].legend(fontsize=8)
        figure.suptitle(f"Simulated: {model}, where each strategy sits against its bound")
        written.append(_save(figure, out / f"scaling-bound-{model}.png", plt))
    plots: dict[str, tuple[Lines, str, str, str, dict[str, Any]]] = {
        "bound": (lambda model: [(label, [r for r in _series(rows, sweep="bound", model=model, link_gbit=25.0,
                                                             strategy="imerge")
                                          if r.shards == max(1, r.workers // fraction)], "ratio_to_bound")
                                 for fraction, label in ((4, "S = W/4"), (2, "S = W/2"), (1, "S = W"))],
                  "imerge: mean s/it over its bound", "Simulated: imerge at 25 Gbit/s, by shard count",
                  "scaling-shards.png", dict(log_y=True)),
        "incast": (lambda model: [(strategy, _series(rows, sweep="incast", model=model, strategy=strategy),
                                   "mean_iteration_s") for strategy in ("imerge-noslots", "imerge", "imerge-fixed")],
                   "mean s/it", f"Simulated: shard port queue {INCAST_QUEUE_KB:g} kB, S = W/4, 25 Gbit/s: slots "
                                "against incast", "scaling-incast.png", {}),
        "period": (lambda model: [(f"T = {period} ({period - 1} local steps between syncs)",
                                   _series(rows, sweep="period", model=model, period=period), "mean_iteration_s")
                                  for period in PERIODS],
                   "mean s/it", "Simulated: imerge, S = W/2, 25 Gbit/s: the interleave period T trades staleness "
                                "for time", "scaling-period.png", dict(legend_size=7)),
    }
    for sweep, (lines, ylabel, title, name, options) in plots.items():
        if sweep in swept:
            written.append(_by_model(plt, lines, ylabel, title, out / name, **options))
    return written


def plot_comparison(report: ComparisonReport, path: Path) -> str | None:
    """Predicted against measured mean s/it, one point per (strategy, worker count); the 15% band."""
    points = [(r.measured_mean_s, r.mean_iteration_s, name, workers)
              for workers, sized in report.sizes.items() for name, r in sized.strategies.items()
              if r.measured_mean_s is not None]
    if not points:
        return None
    plt = pyplot("imerge simulate compare")
    figure, axis = plt.subplots(figsize=(5.5, 5))
    low, high = min(min(p[:2]) for p in points) * 0.8, max(max(p[:2]) for p in points) * 1.2
    axis.plot([low, high], [low, high], color="grey", linewidth=0.8)
    axis.fill_between([low, high], [low * 0.85, high * 0.85], [low * 1.15, high * 1.15], color="grey", alpha=0.15,
                      label="within 15%")
    names = sorted({p[2] for p in points})
    for name in names:
        mine = [p for p in points if p[2] == name]
        axis.scatter([p[0] for p in mine], [p[1] for p in mine], label=name, s=18)
    axis.set_xscale("log")
    axis.set_yscale("log")
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    for scale in (axis.xaxis, axis.yaxis):  # ticks at 1, 2 and 5 of each decade, in seconds; no crowded minor labels
        scale.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        scale.set_major_formatter(ScalarFormatter())
        scale.set_minor_formatter(NullFormatter())
    axis.set_xlabel("measured on the testbed, mean s/it")
    axis.set_ylabel("simulated, mean s/it")
    axis.set_title(f"{report.scenario}: simulated against measured")
    axis.legend(fontsize=6, ncol=2)
    return _save(figure, path, plt)

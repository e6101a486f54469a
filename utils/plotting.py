"""One plot style for the whole workbook.

Every chapter plots *measured* against *predicted*: measured values are solid markers
joined by a line, predictions (formulas, ceilings) are dashed grey lines, so a reader
can tell them apart at a glance in every chapter. Phase colours are fixed:
prefill is blue, decode is orange.
"""

from __future__ import annotations

from typing import Any, Sequence

import matplotlib.pyplot as plt

COLORS = {
    "prefill": "#1f77b4",
    "decode": "#ff7f0e",
    "measured": "#2ca02c",
    "predicted": "#7f7f7f",
    "ceiling": "#d62728",
}

STYLE = {
    "figure.figsize": (7.0, 4.0),
    "figure.dpi": 100,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.frameon": False,
    "font.size": 10,
}


def use_style() -> None:
    """Apply the workbook's matplotlib style (call once per notebook)."""
    plt.rcParams.update(STYLE)


def new_axes(title: str, xlabel: str, ylabel: str, *, logx: bool = False,
             logy: bool = False, ncols: int = 1) -> tuple[Any, Any]:
    """A titled, labelled figure and axes in the workbook style."""
    use_style()
    fig, ax = plt.subplots(1, ncols, figsize=(7.0 * ncols, 4.0))
    for a in (ax if ncols > 1 else [ax]):
        a.set_xlabel(xlabel)
        a.set_ylabel(ylabel)
        a.set_xscale("log" if logx else "linear")
        a.set_yscale("log" if logy else "linear")
    fig.suptitle(title)
    return fig, ax


def plot_measured(ax: Any, x: Sequence[float], y: Sequence[float], label: str = "measured",
                  color: str | None = None, **kw: Any) -> None:
    """Measured values: markers joined by a solid line."""
    ax.plot(x, y, "o-", label=label, color=color or COLORS["measured"], **kw)


def plot_predicted(ax: Any, x: Sequence[float], y: Sequence[float], label: str = "predicted",
                   color: str | None = None, **kw: Any) -> None:
    """A prediction from a formula: dashed, no markers."""
    ax.plot(x, y, "--", label=label, color=color or COLORS["predicted"], **kw)


def plot_ceiling(ax: Any, value: float, label: str = "ceiling") -> None:
    """A horizontal roofline ceiling."""
    ax.axhline(value, ls=":", color=COLORS["ceiling"], label=label)


def finish(fig: Any, ax: Any | None = None) -> None:
    """Legend on every axes, tight layout, show."""
    for a in fig.axes:
        if a.get_legend_handles_labels()[0]:
            a.legend()
    fig.tight_layout()
    plt.show()

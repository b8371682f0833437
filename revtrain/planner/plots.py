"""Figures of a batch-size sweep, in the kind of Jiang et al. 2021's Fig. 4 and Fig. 5.

* :func:`plot_decision_heatmap` — the plan's mode per block (x) at each batch size (y);
* :func:`plot_step_times` — time per iteration and per sample of baseline-M, baseline-C and the
  plan across batch sizes, predicted (lines) and measured (markers); baseline-C where it does
  not fit the budget is drawn hollow and labelled "over budget", as the paper truncates it.

Matplotlib's object API with the Agg canvas is used directly, so nothing here touches pyplot's
global state or the interactive backend.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from revtrain.memory import format_bytes
from revtrain.planner.sweep_result import SweepResult

__all__ = ["plot_decision_heatmap", "plot_step_times", "write_sweep_plots"]

_M_COLOR, _C_COLOR, _NONE_COLOR = "#4878a8", "#e8a33d", "#d9d9d9"


def plot_decision_heatmap(result: SweepResult, path: str | os.PathLike[str]) -> Path:
    """Draw the mode of every block at every batch size (Fig. 4) to a PNG; returns the path."""
    names = result.block_names
    sizes = [p.batch_size for p in result.points]
    # 0: M, 1: C, 2: no plan fits at this batch size.
    grid = np.full((len(sizes), len(names)), 2, dtype=np.int64)
    for r, p in enumerate(result.points):
        if p.modes is not None:
            grid[r] = [1 if p.modes[n] == "C" else 0 for n in names]
    fig = Figure(figsize=(max(5.0, 0.28 * len(names) + 2.5), max(3.0, 0.32 * len(sizes) + 1.8)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.imshow(
        grid, cmap=ListedColormap([_M_COLOR, _C_COLOR, _NONE_COLOR]), vmin=0, vmax=2,
        aspect="auto", interpolation="nearest", origin="lower",
    )
    ax.set_xlabel("reversible block (index, module order)")
    ax.set_ylabel("batch size")
    ax.set_yticks(range(len(sizes)), [str(b) for b in sizes])
    step = max(1, len(names) // 20)
    ax.set_xticks(range(0, len(names), step))
    if result.best_batch_size in sizes:
        row = sizes.index(result.best_batch_size)
        ax.annotate("best", xy=(len(names) - 0.5, row), xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=8, annotation_clip=False)
    ax.set_title(f"{result.model}: plan per block, budget {format_bytes(result.budget_bytes)}", fontsize=10)
    ax.legend(
        handles=[Patch(color=_M_COLOR, label="M (rebuild)"), Patch(color=_C_COLOR, label="C (keep)"),
                 Patch(color=_NONE_COLOR, label="no plan fits")],
        loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize=8, frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    return Path(path)


def plot_step_times(result: SweepResult, path: str | os.PathLike[str]) -> Path:
    """Draw time per iteration and per sample for baseline-M, baseline-C and the plan (Fig. 5)."""
    pts = result.points
    b = np.array([p.batch_size for p in pts], dtype=np.float64)
    fig = Figure(figsize=(10.0, 4.0))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, per_sample in zip(axes, (False, True)):
        scale = 1 / b if per_sample else np.ones_like(b)
        m_pred = np.array([p.baseline_M_step_time_s for p in pts]) * scale
        m_ok = np.array([p.feasible for p in pts])
        c_pred = np.array([p.baseline_C_step_time_s for p in pts]) * scale
        c_ok = np.array([p.baseline_C_fits for p in pts])
        plan = np.array([np.nan if p.predicted_step_time_s is None else p.predicted_step_time_s for p in pts]) * scale

        ax.plot(b, np.where(m_ok, m_pred, np.nan), "-", marker=".", color="#c0392b", label="baseline-M (predicted)")
        ax.plot(b[~m_ok], m_pred[~m_ok], "x", color="#c0392b", label="baseline-M over budget")
        ax.plot(b, np.where(c_ok, c_pred, np.nan), "-", marker=".", color="#2c7fb8", label="baseline-C (predicted)")
        if (~c_ok).any():
            ax.plot(b[~c_ok], c_pred[~c_ok], "o", mfc="none", color="#2c7fb8", label="baseline-C over budget")
        ax.plot(b, plan, "--", marker=".", color="#1a9850", lw=2, label="plan (predicted)")

        def measured(attr: str, peak_attr: str, key: str, over: bool) -> tuple[np.ndarray, ...]:
            xs = [
                (p.batch_size, getattr(p, attr), p.measured_intervals.get(key))
                for p in pts
                if getattr(p, attr) is not None
                and ((getattr(p, peak_attr) or 0) > result.budget_bytes) == over
            ]
            x = np.array([x for x, _, _ in xs], dtype=np.float64)
            y = np.array([y for _, y, _ in xs], dtype=np.float64)
            # The 95% interval of each measured median, as error bars (none where not recorded).
            lo = np.array([y - iv[0] if iv else 0.0 for _, y, iv in xs], dtype=np.float64)
            hi = np.array([iv[1] - y if iv else 0.0 for _, y, iv in xs], dtype=np.float64)
            div = x if per_sample else np.ones_like(x)
            return x, y / div, lo / div, hi / div

        for attr, peak_attr, key, marker, color, label in (
            ("measured_baseline_M_step_time_s", "measured_baseline_M_peak_bytes", "baseline-M", "s", "#c0392b", "baseline-M"),
            ("measured_baseline_C_step_time_s", "measured_baseline_C_peak_bytes", "baseline-C", "^", "#2c7fb8", "baseline-C"),
            ("measured_step_time_s", "measured_peak_bytes", "plan", "D", "#1a9850", "plan"),
        ):
            for over in (False, True):
                x, y, lo, hi = measured(attr, peak_attr, key, over)
                if len(x):
                    ax.errorbar(x, y, yerr=np.vstack([np.maximum(lo, 0), np.maximum(hi, 0)]), fmt=marker,
                                color=color, mfc="none" if over else color, capsize=3, ls="none",
                                label=f"{label} (measured, 95% interval{', over budget' if over else ''})")
        if result.best_batch_size is not None:
            ax.axvline(result.best_batch_size, color="0.6", lw=0.8, ls=":")
        ax.set_xlabel("batch size")
        ax.set_ylabel("seconds per sample" if per_sample else "seconds per iteration")
        ax.set_title("time per sample" if per_sample else "time per iteration", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"{result.model} on {result.device}, budget {format_bytes(result.budget_bytes)}"
        + (f", best batch size {result.best_batch_size} ({result.best_basis})" if result.best_batch_size else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    return Path(path)


def write_sweep_plots(result: SweepResult, directory: str | os.PathLike[str]) -> list[Path]:
    """Write ``plan_heatmap.png`` and ``plan_step_times.png`` into ``directory`` (created)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_decision_heatmap(result, out / "plan_heatmap.png"),
        plot_step_times(result, out / "plan_step_times.png"),
    ]

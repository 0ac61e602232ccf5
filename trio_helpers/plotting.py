"""Small plotting helpers for training curves (matplotlib is imported only when a plot is drawn).

Introduced in: chapter 04 (notebooks/04_grpo_sync).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def rolling_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average: entry ``i`` is the mean of ``values[max(0, i - window + 1) : i + 1]``.

    The first ``window - 1`` entries average fewer values (no padding), so the curve starts at the first value.
    ``None`` and NaN entries are ignored (an entry whose whole window is missing is NaN).

    Raises:
        ValueError: ``window < 1``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    x = np.array([np.nan if v is None else float(v) for v in values], dtype=float)
    out = np.full(x.shape, np.nan)
    for i in range(len(x)):
        chunk = x[max(0, i - window + 1) : i + 1]
        chunk = chunk[~np.isnan(chunk)]
        if chunk.size:
            out[i] = chunk.mean()
    return out


def plot_metric(ax, history: Sequence[dict], key: str, window: int = 5, label: str | None = None, color=None):
    """Plot one metric of a run's history against the step: the raw values (thin) and their rolling mean (bold).

    Args:
        ax: a matplotlib ``Axes``.
        history: rows with ``"step"`` and ``key`` (``GRPOResult.history`` or ``read_metrics(run_dir)``).
        key: the metric, e.g. ``"reward/mean"``.
        window: rolling-mean window in steps (1 = no smoothing line).
        label: the metric's name in the legend (default: the key); the raw line is labelled
            ``"<label> (each step)"`` and the smoothed one ``"<label> (<window>-step mean)"``, so every line drawn
            has a legend entry.
        color: matplotlib colour for both lines.

    Returns:
        The ``Axes``.

    Raises:
        KeyError: a row lacks ``key``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    steps = [row["step"] for row in history]
    values = [row[key] for row in history]
    raw = np.array([np.nan if v is None else v for v in values], dtype=float)
    name = label or key
    line = ax.plot(steps, raw, lw=0.8, alpha=0.45, color=color, marker=".", ms=3, label=f"{name} (each step)")[0]
    if window > 1:
        ax.plot(steps, rolling_mean(values, window), lw=2, color=line.get_color(),
                label=f"{name} ({window}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    return ax

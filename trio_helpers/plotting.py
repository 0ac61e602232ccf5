"""What a page shows: small plotting helpers for training curves (matplotlib is imported only when a plot is drawn),
and :func:`glue` for the numbers a sentence quotes.

Introduced in: chapter 04 (notebooks/04_grpo_sync); :func:`glue` in chapter 01.
"""

from __future__ import annotations

from collections.abc import Sequence

import math

import numpy as np

SIGNIFICANT = 6
"""Significant digits a glued float keeps: more than any sentence of the book shows."""


def rounded(value, significant: int = SIGNIFICANT):
    """``value`` as a page should store it: a float (Python or numpy) rounded to ``significant`` significant digits
    (a whole number from ``10**significant`` on is kept whole, so counts stay exact); anything else unchanged.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (float, np.floating)):
        return value
    value = float(value)
    if not math.isfinite(value) or value == 0.0:
        return value
    if abs(value) >= 10.0**significant:
        return float(round(value))
    return float(f"{value:.{significant}g}")


def glue(name: str, value, display: bool = False):
    """``myst_nb.glue`` for the book's pages: a float is stored at :data:`SIGNIFICANT` significant digits
    (:func:`rounded`), not the 17 of its ``repr``, so the notebook records what the prose reads (``{glue:text}``
    formats it further) and not noise in the last digits.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    from myst_nb import glue as myst_glue

    return myst_glue(name, rounded(value), display=display)


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

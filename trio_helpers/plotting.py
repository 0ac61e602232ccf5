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


HEALTH_PANELS = (
    ("reward/mean", "reward (GRPO) or KL to the teacher (OPD)", ("kl/teacher_mean",)),
    ("completion/entropy", "entropy estimate (nats/token): collapse shows as a fall to ~0", ()),
    ("completion/tokens_mean", "completion length (mean, and max dashed)", ()),
    ("completion/frac_max_tokens", "share cut at max_tokens: the budget binds", ()),
    ("reward/frac_degenerate", "share of degenerate groups: no signal", ()),
    ("train/clip_frac", "share of tokens clipped; policy lag dashed", ()),
    ("optim/grad_norm", "gradient norm (as optim_step reports it)", ()),
    ("kl/ref_mean", "KL to the reference (with a KL penalty)", ()),
)
"""The panels of :func:`plot_health`: ``(metric key, title, fallback keys)``, in reading order."""


def plot_health(history: Sequence[dict], window: int = 5, title: str | None = None):
    """A run's health panel: one small plot per signal that gives a sick run away, from its ``metrics.jsonl`` rows
    (``read_metrics(run_dir)``, the same file on the service and offline).

    Panels (:data:`HEALTH_PANELS`) whose metric the run never logged (an OPD run has no reward, a run without a KL
    penalty no ``kl/ref_mean``) are left out; a step that lacks a panel's metric or logged it as null (a step
    that trained nothing has no ``train/*`` ratios and no ``optim/*``) is a gap in its line. Each panel shows the
    raw values and a ``window``-step rolling mean (:func:`plot_metric`).

    Returns:
        The matplotlib ``Figure`` (call ``plt.show()`` in a notebook).

    Raises:
        ValueError: ``history`` is empty or logs none of the panels' metrics.

    Introduced in: chapter 11 (notebooks/11_tuning_and_monitoring).
    """
    import matplotlib.pyplot as plt

    rows = list(history)
    if not rows:
        raise ValueError("history is empty: pass the rows of a run's metrics.jsonl (trio_helpers.tracking."
                         "read_metrics(run_dir)) or a result's .history")
    present = []
    for key, label, fallbacks in HEALTH_PANELS:
        for candidate in (key, *fallbacks):
            if any(candidate in row for row in rows):
                present.append((candidate, label))
                break
    keys = {key for key, _ in present} | {"completion/tokens_max", "train/policy_lag"}
    rows = [{**dict.fromkeys(keys), **row} for row in rows]  # a missing value is a gap
    if not present:
        raise ValueError(f"none of the health metrics is in these rows (keys: {sorted(rows[0])[:8]} ...); "
                         "pass the rows of a training run's metrics.jsonl")
    cols = 2
    nrows = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(7.5, 2.1 * nrows), squeeze=False, sharex=True)
    for ax, (key, label) in zip(axes.flat, present):
        plot_metric(ax, rows, key, window=window, label=key.split("/", 1)[1])
        extra = {"completion/tokens_mean": "completion/tokens_max", "train/clip_frac": "train/policy_lag"}.get(key)
        if extra and any(row[extra] is not None for row in rows):
            ax.plot([row["step"] for row in rows], [np.nan if row[extra] is None else row[extra] for row in rows],
                    ls="--", lw=1, color="0.4", label=extra.split("/", 1)[1])
        ax.set_title(label, fontsize=8)
        ax.set_ylabel("")
        ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(present):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig

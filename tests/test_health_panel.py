"""trio_helpers.plotting.plot_health: a run's health panel from its metrics.jsonl rows (issue: tuning and watching a
run). The loop logs every signal the panel reads (entropy estimate, completion length mean and max, share cut at
max_tokens, degenerate groups, clipped tokens, the optimizer's gradient norm) for every run."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from trio_helpers import connect  # noqa: E402
from trio_helpers.data import load_gsm8k  # noqa: E402
from trio_helpers.grpo import GRPOConfig, run_grpo  # noqa: E402
from trio_helpers.plotting import HEALTH_PANELS, plot_health  # noqa: E402
from trio_helpers.tracking import read_metrics  # noqa: E402


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("health") / "run"
    config = GRPOConfig(steps=3, batch_size=2, group_size=4, max_tokens=256, seed=0, loss_fn="ppo",
                        run_dir=str(run_dir))
    run_grpo(connect("offline", latency=0.0), load_gsm8k("train", source="offline")[:16], config)
    return read_metrics(run_dir)


def test_every_recipe_run_logs_the_health_metrics(rows):
    sampled = {"reward/mean", "completion/entropy", "completion/tokens_mean", "completion/frac_max_tokens",
               "reward/frac_degenerate"}
    trained = {"train/clip_frac", "optim/grad_norm"}  # only on steps that sent datums
    assert any(row["train/datums"] > 0 for row in rows), "no step trained: the test needs one that did"
    for row in rows:
        assert sampled <= set(row), sorted(sampled - set(row))
        assert row["train/datums"] == 0 or trained <= set(row), sorted(trained - set(row))
        assert row["completion/tokens_max"] >= row["completion/tokens_mean"] > 0
        assert 0.0 <= row["completion/frac_max_tokens"] <= 1.0 and 0.0 <= row["reward/frac_degenerate"] <= 1.0
        assert row["completion/entropy"] > 0.0
    assert any(row.get("optim/grad_norm", 0.0) > 0 and not math.isnan(row["optim/grad_norm"]) for row in rows)


def test_the_panel_draws_what_the_run_logged(rows):
    fig = plot_health(rows, window=2, title="3-step run")
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert len(titles) == 7  # every panel but the KL penalty's
    assert all(ax.lines for ax in fig.axes if ax.get_visible())


def test_a_step_without_a_metric_is_a_gap_not_an_error():
    rows = [{"step": 0, "reward/mean": 0.1, "train/datums": 0},
            {"step": 1, "reward/mean": 0.3, "train/datums": 4, "train/clip_frac": 0.02, "train/policy_lag": 0.01}]
    fig = plot_health(rows, window=1)
    assert sorted(ax.get_title() for ax in fig.axes if ax.get_visible()) == sorted(
        label for key, label, _ in HEALTH_PANELS if key in ("reward/mean", "train/clip_frac"))


def test_bad_input_is_one_clear_error():
    with pytest.raises(ValueError, match="history is empty"):
        plot_health([])
    with pytest.raises(ValueError, match="none of the health metrics"):
        plot_health([{"step": 0, "eval/accuracy": 0.5}])

"""trio_helpers.tracking: SwanLab is checked before anything is written, and a torn metrics.jsonl still resumes.

No test logs in to SwanLab or reaches the network: "logged in" and "not logged in" are monkeypatched answers of
``tracking._swanlab_logged_in``.
"""

from __future__ import annotations

import json

import pytest

from trio_helpers import tracking
from trio_helpers.tracking import METRICS_FILE, MetricsLogger, check_swanlab, read_metrics


def _write_rows(run_dir, n, tail=""):
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"step": i, "reward/mean": i / 10}) + "\n" for i in range(n)) + tail
    (run_dir / METRICS_FILE).write_text(text, encoding="utf-8")


def test_check_swanlab_modes(monkeypatch):
    check_swanlab("disabled")
    check_swanlab("offline")  # the package is pinned in requirements.txt
    with pytest.raises(ValueError, match="one of 'online', 'offline', 'disabled'") as info:
        check_swanlab("local")
    assert "\n" not in str(info.value)


def test_online_without_login_is_one_line_naming_the_flags(monkeypatch):
    monkeypatch.setattr(tracking, "_swanlab_logged_in", lambda: False)
    with pytest.raises(ValueError) as info:
        check_swanlab("online")
    message = str(info.value)
    assert "\n" not in message and "--no-swanlab" in message and "--swanlab offline" in message
    monkeypatch.setattr(tracking, "_swanlab_logged_in", lambda: True)
    check_swanlab("online")


def test_logged_in_reads_the_environment_key(monkeypatch, tmp_path):
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "empty-root"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    assert tracking._swanlab_logged_in() is False
    monkeypatch.setenv("SWANLAB_API_KEY", "  ")
    assert tracking._swanlab_logged_in() is False  # blank does not count


def test_a_refused_swanlab_mode_leaves_the_old_metrics_untouched(monkeypatch, tmp_path):
    run = tmp_path / "run"
    _write_rows(run, 3)
    before = (run / METRICS_FILE).read_text()
    monkeypatch.setattr(tracking, "_swanlab_logged_in", lambda: False)
    started = []
    monkeypatch.setattr(tracking, "_start_swanlab", lambda *a, **k: started.append(a))
    with pytest.raises(ValueError, match="--no-swanlab"):
        MetricsLogger(run, swanlab="online")  # a fresh run would reset metrics.jsonl: it must not get that far
    assert (run / METRICS_FILE).read_text() == before and started == []


def test_torn_last_line_is_dropped_and_the_run_resumes(tmp_path, capsys):
    run = tmp_path / "run"
    _write_rows(run, 3, tail='{"step": 3, "reward/me')  # killed mid-write: no closing brace, no newline
    log = MetricsLogger(run, resume=True)
    assert [r["step"] for r in log.history()] == [0, 1, 2]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(run / METRICS_FILE) in err and "partial last row" in err
    log.log(3, {"reward/mean": 0.3})
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]  # the new row is not glued to the torn one
    assert capsys.readouterr().err == ""


def test_read_metrics_skips_a_torn_last_line_without_changing_the_file(tmp_path, capsys):
    run = tmp_path / "run"
    _write_rows(run, 2, tail='{"step": 2')
    before = (run / METRICS_FILE).read_text()
    assert [r["step"] for r in read_metrics(run)] == [0, 1]
    assert "partial last row" in capsys.readouterr().err
    assert (run / METRICS_FILE).read_text() == before


def test_a_corrupt_middle_line_is_an_error_naming_file_and_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / METRICS_FILE).write_text('{"step": 0}\n{"step": 1, oops}\n{"step": 2}\n', encoding="utf-8")
    with pytest.raises(ValueError) as info:
        MetricsLogger(run, resume=True)
    message = str(info.value)
    assert "\n" not in message and f"{run / METRICS_FILE}: line 2" in message
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(run)


def test_plot_metric_labels_every_line():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trio_helpers.plotting import plot_metric

    history = [{"step": i, "reward/mean": i / 10} for i in range(8)]
    for window in (1, 4):
        fig, ax = plt.subplots()
        plot_metric(ax, history, "reward/mean", window=window, label="reward")
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels and all(not label.startswith("_") for label in labels), labels
        assert labels[0] == "reward (each step)"
        plt.close(fig)

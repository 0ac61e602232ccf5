"""Tests of ``python -m trio_helpers.recipes.evaluate``: flag validation, a tiny run, and a paired comparison."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trio_helpers.evaluation import load_records
from trio_helpers.recipes import evaluate as recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--backend", "offline", "--base-model", "offline/tiny", "--max-tokens", "8", "--n-boot", "200"]


@pytest.fixture(autouse=True)
def offline_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIO_OFFLINE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--eval-samples", "0"], "argument --eval-samples: must be an integer >= 1, got 0"),
        (["--samples-per-problem", "x"], "argument --samples-per-problem: must be an integer >= 1, got 'x'"),
        (["--max-tokens", "-5"], "argument --max-tokens: must be an integer >= 1"),
        (["--temperature", "-1"], "argument --temperature: must be a number >= 0"),
        (["--split", "validation"], "argument --split: invalid choice"),
        (["--n-boot", "10"], "argument --n-boot: must be an integer >= 100"),
        (["--samples-per-problem", "4", "--temperature", "0"], "--samples-per-problem > 1 with --temperature 0"),
        (["--compare-to", "missing.jsonl"], "--compare-to: no such file 'missing.jsonl'"),
        (["--model-path", " "], "--model-path is empty"),
    ],
)
def test_bad_flags_exit_with_status_2_and_name_the_flag(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        recipe.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_compare_to_rejects_pass_at_k_and_the_same_file(capsys) -> None:
    Path("a.jsonl").write_text("")
    for argv, message in ((["--compare-to", "a.jsonl", "--samples-per-problem", "2"], "use it with --samples-per-problem 1"),
                          (["--compare-to", "a.jsonl", "--out", "a.jsonl"], "name the same file")):
        with pytest.raises(SystemExit):
            recipe.main(argv)
        assert message in capsys.readouterr().err


def test_run_saves_records_and_compares_two_runs(capsys) -> None:
    assert recipe.main([*TINY, "--eval-samples", "6", "--out", "base.jsonl"]) == 0
    out = capsys.readouterr().out
    assert "records: base.jsonl" in out and "95% CI" in out
    assert len(load_records("base.jsonl")) == 6
    assert recipe.main([*TINY, "--eval-samples", "6", "--compare-to", "base.jsonl", "--label", "again"]) == 0
    out = capsys.readouterr().out
    assert "paired on 6 problems" in out and "McNemar exact: p = 1" in out  # greedy twice: identical answers
    assert recipe.main([*TINY, "--eval-samples", "5", "--compare-to", "base.jsonl"]) == 1
    assert "do not cover the same problems" in capsys.readouterr().err


def test_pass_at_k_mode_prints_every_k(capsys) -> None:
    assert recipe.main([*TINY, "--eval-samples", "3", "--samples-per-problem", "3"]) == 0
    out = capsys.readouterr().out
    assert "temperature 1" in out and "k=1:" in out and "k=3:" in out


def test_python_dash_m_runs() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "trio_helpers.recipes.evaluate", *TINY, "--eval-samples", "2"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "base" in done.stdout and "accuracy" in done.stdout


def test_offline_backend_flags(capsys) -> None:
    """Faults cost time, not answers; an outage mid-evaluation is one line, exit 1, and no records file (the
    recipe runs pytrio's own client against the offline server, with its 2-s retry windows)."""
    assert recipe.main([*TINY, "--eval-samples", "4", "--out", "clean.jsonl"]) == 0
    assert recipe.main([*TINY, "--eval-samples", "4", "--out", "faulty.jsonl", "--fault-rate", "0.3",
                        "--latency", "0.001"]) == 0
    assert load_records("faulty.jsonl") == load_records("clean.jsonl")
    capsys.readouterr()
    assert recipe.main([*TINY, "--eval-samples", "4", "--out", "down.jsonl", "--outage-after", "2"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(f"{recipe.build_parser().prog}: error: sample (problem ") and "HTTP 503" in err[0]
    assert not Path("down.jsonl").exists()

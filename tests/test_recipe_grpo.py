"""Tests of the command-line recipe ``python -m trio_helpers.recipes.grpo``: flag validation and a tiny run.

Flag errors are checked in-process through ``main(argv)`` (argparse exits with status 2 and names the flag); one
subprocess run checks that ``python -m`` works end to end on the offline backend.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trio_helpers.recipes import grpo as recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--backend", "offline", "--base-model", "offline/tiny", "--lora-rank", "8", "--batch-size", "2",
        "--group-size", "2", "--max-tokens", "8"]


@pytest.fixture(autouse=True)
def offline_home(tmp_path, monkeypatch):
    """Checkpoints of these runs go to a temporary offline home; relative run dirs to tmp_path."""
    monkeypatch.setenv("TRIO_OFFLINE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
        (["--batch-size", "-2"], "argument --batch-size: must be an integer >= 1"),
        (["--group-size", "0"], "argument --group-size: must be an integer >= 1"),
        (["--max-tokens", "ten"], "argument --max-tokens: must be an integer >= 1, got 'ten'"),
        (["--max-concurrency", "0"], "argument --max-concurrency"),
        (["--save-every", "-1"], "argument --save-every: must be an integer >= 0"),
        (["--lora-rank", "2"], "argument --lora-rank: must be an integer in [4, 64]"),
        (["--learning-rate", "0"], "argument --learning-rate: must be a number > 0"),
        (["--temperature", "-1"], "argument --temperature"),
        (["--top-p", "1.5"], "argument --top-p: must be a number in (0, 1]"),
        (["--seed", "-1"], "argument --seed"),
        (["--advantage", "median"], "argument --advantage: invalid choice"),
        (["--lr-schedule", "linear"], "argument --lr-schedule: invalid choice"),
        (["--swanlab", "local"], "argument --swanlab: invalid choice"),
        (["--weights-name", "a/b"], "weights_name must be a non-empty name without '/'"),
    ],
)
def test_bad_flags_exit_with_status_2_and_name_the_flag(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        recipe.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_async_without_rollouts_module_exits_with_a_clear_message(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "trio_helpers.rollouts", None)  # makes the import fail
    with pytest.raises(SystemExit) as exc:
        recipe.main(["--async", *TINY])
    assert exc.value.code == 2
    assert "--async needs trio_helpers.rollouts" in capsys.readouterr().err


def test_flags_map_onto_the_config() -> None:
    args = recipe.build_parser().parse_args(
        ["--steps", "7", "--advantage", "std", "--lr-schedule", "cosine", "--keep-degenerate", "--async",
         "--swanlab", "--save-every", "3", "--run-dir", "runs/x", "--top-p", "0.9"])
    c = recipe.config_from_args(args)
    assert (c.steps, c.advantage, c.lr_schedule, c.skip_degenerate, c.rollout) == (7, "std", "cosine", False, "async")
    assert (c.swanlab, c.save_every, c.run_dir, c.top_p) == ("online", 3, "runs/x", 0.9)
    no = recipe.config_from_args(recipe.build_parser().parse_args(["--swanlab", "offline", "--no-swanlab"]))
    assert no.swanlab == "disabled"


def test_tiny_run_prints_a_line_per_step_and_resumes(capsys) -> None:
    assert recipe.main([*TINY, "--steps", "3", "--save-every", "2", "--run-dir", "runs/t"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["1/3", "2/3", "3/3"]
    assert "final weights: trio-offline://" in out
    assert recipe.main([*TINY, "--steps", "4", "--save-every", "2", "--run-dir", "runs/t", "--resume"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["4/4"]
    lines = (Path("runs/t") / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4


def test_resume_without_a_checkpoint_fails_with_status_1(capsys) -> None:
    assert recipe.main([*TINY, "--resume", "--run-dir", "runs/none"]) == 1
    assert "no saved state" in capsys.readouterr().err


def test_python_dash_m_runs(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "trio_helpers.recipes.grpo", *TINY, "--steps", "2", "--run-dir", "runs/m"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "step 2/2" in done.stdout and "final weights: trio-offline://" in done.stdout


def test_pipeline_without_rollouts_module_exits_with_a_clear_message(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "trio_helpers.rollouts", None)
    with pytest.raises(SystemExit) as exc:
        recipe.main(["--pipeline", *TINY])
    assert exc.value.code == 2
    assert "--pipeline needs trio_helpers.rollouts.run_grpo_pipelined" in capsys.readouterr().err

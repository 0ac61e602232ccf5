"""Tests of the command-line recipe ``python -m trio_helpers.recipes.grpo``: flag validation, a tiny run, and the
issue's done-when for this recipe (faults, an outage, Ctrl-C, a torn metrics row; defined once, for both recipes,
in ``test_loop_failures.py``).

Flag errors are checked in-process through ``main(argv)`` (argparse exits with status 2 and names the flag); one
subprocess run checks that ``python -m`` works end to end on the offline backend, another sends it a real SIGINT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_loop_failures import GRPO_RECIPE, RecipeDoneWhen

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
        (["--weights-name", "a/b"], "weights_name must be a name without '/'"),
        (["--group-size", "1"], "group_size=1: GRPO compares completions of the same prompt"),
        (["--temperature", "0"], "temperature=0 samples the same completion group_size times"),
        (["--max-staleness", "0"], "argument --max-staleness: must be an integer >= 1, got 0"),
        (["--pipeline", "--sampler-refresh-steps", "2"], "sampler_refresh_steps=2 with rollout='pipeline'"),
        (["--loss-config", "clip"], "argument --loss-config: must be KEY=VALUE"),
    ],
)
def test_bad_flags_exit_with_status_2_and_name_the_flag(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        recipe.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_flags_map_onto_the_config() -> None:
    args = recipe.build_parser().parse_args(
        ["--steps", "7", "--advantage", "std", "--lr-schedule", "cosine", "--keep-degenerate", "--async",
         "--swanlab", "--save-every", "3", "--run-dir", "runs/x", "--top-p", "0.9", "--loss-fn", "ppo",
         "--loss-config", "clip_low_threshold=0.8", "--loss-config", "clip_high_threshold=1.2",
         "--max-concurrency", "5", "--weights-name", ""])
    c = recipe.config_from_args(args)
    assert (c.steps, c.advantage, c.lr_schedule, c.skip_degenerate, c.rollout) == (7, "std", "cosine", False, "async")
    assert (c.swanlab, c.save_every, c.run_dir, c.top_p, c.max_concurrency) == ("online", 3, "runs/x", 0.9, 5)
    assert c.loss_fn == "ppo" and c.loss_fn_config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert c.weights_name is None  # an empty name: no final sampler weights
    no = recipe.config_from_args(recipe.build_parser().parse_args(["--swanlab", "offline", "--no-swanlab"]))
    assert no.swanlab == "disabled"
    piped = recipe.config_from_args(recipe.build_parser().parse_args(["--pipeline", "--max-staleness", "3"]))
    assert (piped.rollout, piped.max_staleness) == ("pipeline", 3)
    defaults = recipe.config_from_args(recipe.build_parser().parse_args([]))
    assert (defaults.steps, defaults.batch_size, defaults.group_size, defaults.rollout) == (10, 4, 4, "sync")


def _step_lines(out: str) -> list[str]:
    return [line.split()[1] for line in out.splitlines() if line.startswith("step ")]


def test_tiny_run_prints_a_line_per_step_and_resumes(capsys) -> None:
    assert recipe.main([*TINY, "--steps", "3", "--save-every", "2", "--run-dir", "runs/t"]) == 0
    out = capsys.readouterr().out
    assert _step_lines(out) == ["0", "1", "2"]  # 0-based, as in metrics.jsonl
    assert all("reward" in line and "datums" in line for line in out.splitlines() if line.startswith("step "))
    assert "rollout sync" in out and "final weights: trio-offline://" in out
    assert "last saved state (resume with --resume --run-dir runs/t)" in out
    assert recipe.main([*TINY, "--steps", "4", "--save-every", "2", "--run-dir", "runs/t", "--resume"]) == 0
    out = capsys.readouterr().out
    assert _step_lines(out) == ["3"] and ", resuming" in out
    rows = [json.loads(line) for line in (Path("runs/t") / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert {"reward/mean", "train/datums", "sampler/version", "time/step_s"} <= set(rows[0])


def test_resume_without_a_checkpoint_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as info:  # checked before any client: argparse's status 2
        recipe.main([*TINY, "--resume", "--run-dir", "runs/none"])
    assert info.value.code == 2 and "no saved state" in capsys.readouterr().err


def test_interrupted_without_checkpoints_says_so(monkeypatch, capsys) -> None:
    from trio_helpers import grpo

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(recipe, "run_grpo", interrupted)
    assert recipe.main([*TINY, "--steps", "2", "--run-dir", "runs/i", "--save-every", "0"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [(f"{recipe.build_parser().prog}: interrupted; finished steps are in metrics.jsonl; no state "
                    "was saved (--save-every 0): rerun it")]
    assert grpo.run_grpo is not interrupted


def test_recipes_save_a_state_every_20_steps_by_default() -> None:
    """A long run on the service that fails should resume from a recent state (tinker-cookbook saves every 20)."""
    from trio_helpers.recipes import opd

    assert recipe.build_parser().parse_args([]).save_every == 20
    assert opd.build_parser().parse_args([]).save_every == 20
    assert recipe.build_parser().parse_args(["--save-every", "0"]).save_every == 0


def test_python_dash_m_runs(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "trio_helpers.recipes.grpo", *TINY, "--steps", "2", "--run-dir", "runs/m"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert _step_lines(done.stdout) == ["0", "1"] and "final weights: trio-offline://" in done.stdout


class TestDoneWhen(RecipeDoneWhen):
    """Faults, an outage, Ctrl-C and a torn metrics row, for the GRPO recipe (see ``test_loop_failures.py``)."""

    recipe = GRPO_RECIPE
    outage_mode = "pipeline"

"""Tests of the OPD recipe (``python -m trio_helpers.recipes.opd``): flag validation, a tiny offline run, and the
issue's done-when for this recipe (faults, an outage, Ctrl-C, a torn metrics row; defined once, for both recipes,
in ``test_loop_failures.py``)."""

from __future__ import annotations

import json
import re

import pytest
from test_loop_failures import OPD_RECIPE, RecipeDoneWhen

from trio_helpers.recipes import opd


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "0"], "--steps: .*integer >= 1, got 0"),
        (["--batch-size", "-1"], "--batch-size: .*integer >= 1"),
        (["--group-size", "two"], "--group-size: .*got 'two'"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--sampler-refresh-steps", "0"], "--sampler-refresh-steps"),
        (["--num-shards", "0"], r"--num-shards: must be an integer in \[1, 10\], got 0"),
        (["--num-shards", "11"], r"--num-shards: must be an integer in \[1, 10\], got 11"),
        (["--kl-penalty-coef", "0"], "--kl-penalty-coef: .*> 0"),
        (["--learning-rate", "nan"], "--learning-rate"),
        (["--lora-rank", "128"], r"--lora-rank: must be an integer in \[4, 64\], got 128"),
        (["--swanlab", "cloud"], "--swanlab: invalid choice"),
        (["--top-k", "0"], "top_k must be -1"),
        (["--max-staleness", "0"], "--max-staleness: must be an integer >= 1, got 0"),
        (["--teacher-model-path", " "], "teacher_model_path must be a saved sampler path or None"),
    ],
)
def test_bad_flags_exit_with_a_message_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        opd.main(flags)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_flags_map_onto_the_config():
    args = opd.build_parser().parse_args(
        ["--steps", "3", "--batch-size", "5", "--group-size", "6", "--max-tokens", "7", "--async",
         "--sampler-refresh-steps", "2", "--kl-penalty-coef", "0.5", "--teacher-model-path", "x/y",
         "--enable-thinking", "--seed", "9", "--learning-rate", "1e-4"])
    config = opd.config_from_args(args)
    assert type(config).__name__ == "OPDConfig"
    assert (config.steps, config.batch_size, config.group_size, config.max_tokens) == (3, 5, 6, 7)
    assert config.rollout == "async" and config.sampler_refresh_steps == 2 and config.kl_penalty_coef == 0.5
    assert config.teacher_model_path == "x/y" and config.enable_thinking and config.seed == 9
    assert config.learning_rate == 1e-4
    defaults = opd.config_from_args(opd.build_parser().parse_args([]))
    assert (defaults.steps, defaults.batch_size, defaults.group_size, defaults.max_tokens) == (10, 2, 2, 512)
    assert defaults.rollout == "sync" and defaults.sampler_refresh_steps == 1 and defaults.kl_penalty_coef == 1.0
    assert defaults.teacher_base_model == "Qwen/Qwen3.6-27B" and defaults.teacher_model_path is None
    piped = opd.config_from_args(opd.build_parser().parse_args(["--pipeline", "--max-staleness", "2"]))
    assert (piped.rollout, piped.max_staleness) == ("pipeline", 2)


def test_tiny_offline_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRIO_OFFLINE_HOME", str(tmp_path / "home"))
    run_dir = tmp_path / "run"
    code = opd.main(["--steps", "2", "--batch-size", "2", "--group-size", "2", "--max-tokens", "12",
                     "--base-model", "offline/tiny", "--lora-rank", "8", "--backend", "offline",
                     "--run-dir", str(run_dir), "--sample-size", "10"])
    assert code == 0
    out = capsys.readouterr().out
    assert "load_deepmath: source=offline records=10" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["0", "1"] and all(" kl " in line for line in steps)
    assert "reverse KL to the teacher (sampled, per token): first step" in out
    assert "final weights: trio-offline://" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["train/datums"] == 4 and r["kl/teacher_mean"] is not None for r in rows)


def test_no_prompts_is_a_flag_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRIO_OFFLINE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("trio_helpers.data.load_deepmath", lambda **kwargs: [])
    with pytest.raises(SystemExit) as exit_info:
        opd.main(["--backend", "offline", "--run-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert "no prompts loaded (--sample-size 1000, --num-shards 1)" in capsys.readouterr().err


class TestDoneWhen(RecipeDoneWhen):
    """Faults, an outage, Ctrl-C and a torn metrics row, for the OPD recipe (see ``test_loop_failures.py``)."""

    recipe = OPD_RECIPE
    outage_mode = "async"
    sigint_mode = "pipeline"

"""Tests of trio_helpers.grpo (config, the GSM8K reward and scorer, one step, a whole run, resume), the loop's
batch/seed/schedule helpers it uses, and trio_helpers.tracking.

Runs use the offline backend with no simulated latency and a temporary offline home for checkpoints. The steps
that must learn use the fitted student ("Qwen/Qwen3.5-4B", cached by conftest) with small batches; runs that only
exercise the mechanics use ``offline/tiny``. The loop's modes, resume and failures are tested for both scorers in
``test_loop.py`` and ``test_loop_failures.py``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict, replace

import numpy as np
import pytest

from trio_helpers.datums import IGNORE
from trio_helpers.grpo import (
    GRPOConfig,
    GRPOScorer,
    grade_groups,
    grpo_step,
    gsm8k_reward,
    run_grpo,
)
from trio_helpers.loop import (
    adam_params_at,
    batch_for_step,
    config_from_dict,
    format_row,
    learning_rate_at,
    read_checkpoints,
    request_seed,
    sampling_params_for,
    total_steps_for,
)
from trio_helpers.rl import step_datums
from trio_helpers.tracking import MetricsLogger, read_metrics

STUDENT = "Qwen/Qwen3.5-4B"
RECORDS = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(10)]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from trio_helpers import connect

    return connect("offline", latency=0.0, home=tmp_path_factory.mktemp("offline-home"))


@pytest.fixture(scope="module")
def train_records():
    from trio_helpers.data import load_gsm8k

    return load_gsm8k("train", source="offline")


def small(**overrides) -> GRPOConfig:
    base = dict(base_model=STUDENT, steps=3, batch_size=2, group_size=4, max_tokens=256, seed=0, learning_rate=4e-5)
    return GRPOConfig(**{**base, **overrides})


# --- configuration -------------------------------------------------------------------------------------------


def test_defaults_are_the_tutorials() -> None:
    c = GRPOConfig()
    assert (c.base_model, c.lora_rank, c.steps, c.batch_size, c.group_size) == ("Qwen/Qwen3.5-4B", 32, 10, 4, 4)
    assert (c.temperature, c.top_p, c.seed, c.learning_rate) == (1.0, 1.0, 42, 4e-5)
    assert (c.lr_schedule, c.advantage, c.swanlab, c.rollout) == ("constant", "mean", "disabled", "sync")
    c.validate()


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("steps", 0, "steps must be an integer >= 1"),
        ("batch_size", -1, "batch_size"),
        ("group_size", 0, "group_size"),
        ("max_tokens", 0, "max_tokens"),
        ("max_concurrency", 0, "max_concurrency"),
        ("steps", 2.5, "steps"),
        ("save_every", -1, "save_every"),
        ("lora_rank", 128, "lora_rank"),
        ("learning_rate", 0.0, "learning_rate"),
        ("learning_rate", float("nan"), "learning_rate"),
        ("temperature", -0.1, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("lr_schedule", "linear", "lr_schedule"),
        ("advantage", "median", "advantage"),
        ("rollout", "threads", "rollout"),
        ("swanlab", "local", "swanlab"),
        ("weights_name", "a/b", "weights_name"),
        ("seed", -3, "seed"),
        ("top_k", 0, "top_k"),
        ("beta1", 1.0, "beta1"),
        ("loss_fn", "mse", "loss_fn"),
        ("loss_fn_config", [0.8], "loss_fn_config"),
        ("base_model", " ", "base_model"),
        ("max_staleness", 0, "max_staleness"),
        ("sampler_refresh_steps", 0, "sampler_refresh_steps"),
        ("group_size", 1, "group_size"),
        ("lora_rank", "32", "lora_rank"),
    ],
)
def test_validate_names_the_field(field: str, value, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        replace(GRPOConfig(), **{field: value}).validate()


def test_save_every_needs_a_run_dir() -> None:
    with pytest.raises(ValueError, match="run_dir"):
        GRPOConfig(save_every=2).validate()
    GRPOConfig(save_every=2, run_dir="runs/x").validate()


def test_config_round_trips_through_a_dict() -> None:
    c = small(lr_schedule="cosine", run_dir="runs/x", loss_fn_config={"clip_low_threshold": 0.8})
    assert config_from_dict(GRPOConfig, {**asdict(c), "unknown": 1}) == c
    assert config_from_dict(GRPOConfig, json.loads(json.dumps(asdict(c)))) == c  # what config.json holds


# --- batches, seeds and the schedule --------------------------------------------------------------------------


def test_batches_wrap_around_without_all_data() -> None:
    assert [i for i, _ in batch_for_step(RECORDS, 0, 4, False)] == [0, 1, 2, 3]
    assert [i for i, _ in batch_for_step(RECORDS, 2, 4, False)] == [8, 9, 0, 1]
    assert batch_for_step(RECORDS, 2, 4, False)[0][1] is RECORDS[8]


def test_all_data_is_one_pass_with_a_short_last_batch() -> None:
    c = GRPOConfig(batch_size=4, all_data=True, steps=99)
    assert total_steps_for(c, len(RECORDS)) == 3
    seen = [i for s in range(3) for i, _ in batch_for_step(RECORDS, s, 4, True)]
    assert seen == list(range(10))
    with pytest.raises(ValueError, match="past the end"):
        batch_for_step(RECORDS, 3, 4, True)
    assert total_steps_for(GRPOConfig(steps=7), len(RECORDS)) == 7
    with pytest.raises(ValueError, match="empty"):
        total_steps_for(c, 0)


def test_sampling_params_are_seeded_per_step_and_prompt() -> None:
    c = GRPOConfig(max_tokens=64, temperature=0.7, top_p=0.9, seed=3)
    p = sampling_params_for(c, 5, 2, stop=[7])
    assert (p.max_tokens, p.temperature, p.top_p, p.stop) == (64, 0.7, 0.9, [7])
    assert p.seed == sampling_params_for(c, 5, 2).seed == request_seed(3, 5, 2)
    seeds = {request_seed(3, s, i) for s in range(50) for i in range(16)}
    assert len(seeds) == 800 and all(0 <= s < 2**31 for s in seeds)
    assert request_seed(4, 5, 2) != request_seed(3, 5, 2)


def test_learning_rate_schedules() -> None:
    assert learning_rate_at(GRPOConfig(learning_rate=1e-5), 7, 10) == 1e-5
    cosine = GRPOConfig(learning_rate=1e-5, lr_schedule="cosine", beta1=0.8, beta2=0.9)
    assert learning_rate_at(cosine, 0, 10) == pytest.approx(1e-5)
    assert learning_rate_at(cosine, 5, 10) == pytest.approx(0.5e-5)
    adam = adam_params_at(cosine, 5, 10)
    assert (adam.learning_rate, adam.beta1, adam.beta2) == (pytest.approx(0.5e-5), 0.8, 0.9)


def test_format_row_shows_headline_metrics_and_no_wall_clock() -> None:
    row = {"step": 3, "reward/mean": 0.25, "reward/frac_degenerate": 0.5, "train/datums": 4.0,
           "train/tokens": 812.0, "train/loss": -0.0123, "train/lr": 4e-5, "time/step_s": 1.7}
    line = format_row(row, GRPOScorer.headline)
    assert line == ("step   3  reward 0.2500  degenerate 0.5000  datums   4  tokens    812  loss -0.0123  "
                    "lr 4.0e-05")
    assert "loss -" in format_row({**row, "train/loss": None})  # nothing was trained


def test_gsm8k_reward_and_group_advantages() -> None:
    record = {"question": "What is 6 * 7?", "answer": "6 * 7 = 42\n#### 42"}
    assert gsm8k_reward("so the answer is \\boxed{42}", record) == 1.0
    assert gsm8k_reward("\\boxed{41}", record) == 0.0 and gsm8k_reward("42", record) == 0.0  # boxed only

    class Seq:
        def __init__(self, text):
            self.text, self.tokens, self.logprobs = text, [1], [-1.0]

    groups = grade_groups([(0, record)], [None], [[Seq("\\boxed{42}"), Seq("\\boxed{7}")]], advantage="std")
    np.testing.assert_allclose(groups[0].rewards, [1.0, 0.0])
    np.testing.assert_allclose(groups[0].advantages, [1.0, -1.0], rtol=1e-6)


# --- one step ------------------------------------------------------------------------------------------------


def test_grpo_step_datums_and_metrics_are_consistent(service, train_records) -> None:
    config = small(batch_size=4, max_tokens=160)
    tc = service.create_lora_training_client(STUDENT, rank=32, seed=0)
    tokenizer = tc.get_tokenizer()
    result = grpo_step(tc, batch_for_step(train_records, 0, 4, False), config, 0, tokenizer)
    m = result.metrics
    assert len(result.groups) == 4 and all(len(g.sequences) == 4 for g in result.groups)
    data = step_datums(result.groups)
    assert m["step"] == 0 and m["sampler/version"] == 0 and m["sampler/staleness"] == 0
    assert m["train/datums"] == len(data) == 4 * sum(not g.degenerate for g in result.groups) > 0
    assert m["train/tokens"] == sum(len(d.model_input) for d in data)
    assert m["reward/frac_degenerate"] == np.mean([g.degenerate for g in result.groups])
    assert m["reward/mean"] == np.mean([r for g in result.groups for r in g.rewards])
    assert 0 < m["completion/tokens_mean"] <= m["completion/tokens_max"] <= config.max_tokens
    assert result.sampler is not None and m["train/lr"] == config.learning_rate
    for g in result.groups:
        p = len(g.prompt.to_ints())
        assert g.advantages.sum() == pytest.approx(0.0, abs=1e-9)
        for d, s in zip(step_datums([g]), g.sequences):
            f = {k: v.data for k, v in d.loss_fn_inputs.items()}
            assert len(d.model_input) == p + len(s.tokens) - 1
            assert {len(v) for v in f.values()} == {len(d.model_input)}
            assert f["target_tokens"][: p - 1] == [IGNORE] * (p - 1)  # the prompt is masked
            assert f["target_tokens"][p - 1 :] == s.tokens
            assert not any(f["advantages"][: p - 1]) and not any(f["logprobs"][: p - 1])


def test_async_rollout_samples_what_sync_samples(service, train_records) -> None:
    pytest.importorskip("trio_helpers.rollouts")
    batch = batch_for_step(train_records, 0, 3, False)
    rows = []
    for rollout in ("sync", "async"):
        tc = service.create_lora_training_client(STUDENT, rank=32, seed=0)
        result = grpo_step(tc, batch, small(batch_size=3, max_tokens=64, rollout=rollout), 0, tc.get_tokenizer())
        rows.append([(s.tokens, float(r)) for g in result.groups for s, r in zip(g.sequences, g.rewards)])
    assert rows[0] == rows[1]


def test_custom_reward_function(service) -> None:
    tc = service.create_lora_training_client("offline/tiny", rank=8, seed=0)
    config = GRPOConfig(base_model="offline/tiny", steps=1, batch_size=2, group_size=3, max_tokens=8, seed=0)
    result = grpo_step(tc, batch_for_step(RECORDS, 0, 2, False), config, 0, tc.get_tokenizer(),
                       reward_fn=lambda text, record: float(len(text) % 2))
    for g in result.groups:
        assert list(g.rewards) == [float(len(s.text) % 2) for s in g.sequences]


# --- whole runs, checkpoints, resume -----------------------------------------------------------------------


def _logprobs_of(sampler, tokens) -> np.ndarray:
    from pytrio import ModelInput

    return np.array(sampler.compute_logprobs(ModelInput.from_ints(tokens)).result()[1:])


def test_three_step_run_changes_the_adapter(service, train_records, tmp_path) -> None:
    config = small(steps=3, batch_size=2, group_size=4, max_tokens=128, run_dir=str(tmp_path / "run"))
    result = run_grpo(service, train_records, config, progress=False)
    assert [r["step"] for r in result.history] == [0, 1, 2]
    assert sum(r["train/datums"] for r in result.history) > 0, "no non-degenerate group: nothing was trained"
    assert result.final_path.startswith("trio-offline://") and result.final_path.endswith("/weights/final")
    base = service.create_sampling_client(STUDENT)
    trained = service.create_sampling_client(STUDENT, model_path=result.final_path)
    tokens = list(range(40, 120))
    assert not np.allclose(_logprobs_of(base, tokens), _logprobs_of(trained, tokens))
    assert read_metrics(tmp_path / "run") == result.history
    assert json.loads((tmp_path / "run" / "config.json").read_text())["steps"] == 3


class CrashAfter(MetricsLogger):
    """A logger that raises while logging step ``crash_at``: an interruption in the middle of a run."""

    def __init__(self, run_dir, crash_at: int) -> None:
        super().__init__(run_dir)
        self.crash_at = crash_at

    def log(self, step, metrics):
        if step == self.crash_at:
            raise KeyboardInterrupt(f"simulated interruption at step {step}")
        return super().log(step, metrics)


def test_an_interruption_while_logging_resumes_exactly(service, tmp_path) -> None:
    """Ctrl-C inside the logger (the row of step 3 never written): resume redoes steps 2.. from checkpoint 2."""
    config = small(base_model="offline/tiny", lora_rank=8, steps=5, batch_size=1, group_size=3, max_tokens=8,
                   seed=1, save_every=2, run_dir=str(tmp_path / "interrupted"))
    def reward(text, record):  # signal for the untrained tiny model
        return float(len(text) % 2)

    with pytest.raises(KeyboardInterrupt):
        run_grpo(service, RECORDS, config, logger=CrashAfter(config.run_dir, crash_at=3), reward_fn=reward)
    assert [c["step"] for c in read_checkpoints(config.run_dir)] == [2]
    assert [r["step"] for r in read_metrics(config.run_dir)] == [0, 1, 2]

    resumed = run_grpo(service, RECORDS, config, resume=True, reward_fn=reward)
    assert resumed.start_step == 2
    steps = [r["step"] for r in read_metrics(config.run_dir)]
    assert steps == [0, 1, 2, 3, 4], "each step exactly once, none missing"
    assert [r["step"] for r in resumed.history] == steps
    assert [c["step"] for c in resumed.checkpoints] == [2, 4, 5]  # one more every 2 steps, and the final state

    straight = run_grpo(service, RECORDS, replace(config, run_dir=str(tmp_path / "straight")), reward_fn=reward)
    timeless = [[{k: v for k, v in row.items() if not k.startswith("time/")} for row in r.history]
                for r in (straight, resumed)]
    assert timeless[0] == timeless[1]
    assert sum(row["train/datums"] for row in straight.history) > 0


def test_resume_errors(service, train_records, tmp_path) -> None:
    with pytest.raises(ValueError, match="needs config.run_dir"):
        run_grpo(service, train_records, small(), resume=True, progress=False)
    with pytest.raises(ValueError, match="no saved state"):
        run_grpo(service, train_records, small(run_dir=str(tmp_path / "empty")), resume=True, progress=False)
    config = small(steps=2, save_every=1, run_dir=str(tmp_path / "r"), base_model="offline/tiny", lora_rank=8,
                   max_tokens=8)
    run_grpo(service, train_records, config, progress=False)
    with pytest.raises(ValueError, match="batch_size: saved 2, now 3"):
        run_grpo(service, train_records, replace(config, batch_size=3), resume=True, progress=False)
    # the settings a resumed run may change
    run_grpo(service, train_records, replace(config, steps=3, max_concurrency=2), resume=True, progress=False)
    assert [r["step"] for r in read_metrics(tmp_path / "r")] == [0, 1, 2]


def test_a_fresh_run_replaces_old_metrics(service, tmp_path) -> None:
    config = GRPOConfig(base_model="offline/tiny", lora_rank=8, steps=2, batch_size=1, group_size=2, max_tokens=4,
                        run_dir=str(tmp_path / "r"))
    run_grpo(service, RECORDS, config, progress=False)
    run_grpo(service, RECORDS, replace(config, steps=1), progress=False)
    assert [r["step"] for r in read_metrics(tmp_path / "r")] == [0]


# --- metrics logger ------------------------------------------------------------------------------------------


def test_a_torn_last_row_is_dropped_with_a_message_and_a_corrupt_middle_row_is_an_error(tmp_path, capsys) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text('{"step": 0, "reward/mean": 0.5}\n{"step": 1, "reward/me')
    assert read_metrics(tmp_path / "run") == [{"step": 0, "reward/mean": 0.5}]
    assert str(path) in capsys.readouterr().err
    resumed = MetricsLogger(tmp_path / "run", resume=True)  # a resumed run continues after the whole rows
    resumed.log(1, {"reward/mean": 1.0})
    assert read_metrics(tmp_path / "run") == [{"step": 0, "reward/mean": 0.5}, {"step": 1, "reward/mean": 1.0}]
    path.write_text('{"step": 0}\n{"step": 1, "rew\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not a JSON row"):
        read_metrics(tmp_path / "run")


def test_metrics_logger_writes_jsonl_and_truncates(tmp_path) -> None:
    log = MetricsLogger(tmp_path / "run")
    for step in range(4):
        log.log(step, {"reward": step / 4, "loss": float("nan"), "n": np.int64(3)})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[1]) == {"step": 1, "reward": 0.25, "loss": None, "n": 3}
    assert log.truncate(2) == 2
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1]
    again = MetricsLogger(tmp_path / "run", resume=True)
    again.log(2, {"reward": 1.0})
    assert [r["step"] for r in again.history()] == [0, 1, 2]
    assert [r["step"] for r in MetricsLogger(tmp_path / "run").history()] == []  # not resuming: a fresh file
    with pytest.raises(ValueError, match="swanlab"):
        MetricsLogger(None, swanlab="local")


def test_memory_logger_and_read_metrics_error(tmp_path) -> None:
    log = MetricsLogger(None)
    log.log(0, {"reward": 0.5})
    assert log.history() == [{"step": 0, "reward": 0.5}]
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path)


def test_disabled_swanlab_is_never_imported() -> None:
    code = (
        "import sys, tempfile\n"
        "from trio_helpers.tracking import MetricsLogger\n"
        "log = MetricsLogger(tempfile.mkdtemp(), swanlab='disabled')\n"
        "log.log(0, {'reward': 1.0}); log.close()\n"
        "assert 'swanlab' not in sys.modules, 'swanlab was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- plotting helper -------------------------------------------------------------------------------------


def test_rolling_mean_is_trailing_and_skips_missing_values() -> None:
    from trio_helpers.plotting import rolling_mean

    np.testing.assert_allclose(rolling_mean([1, 2, 3, 4], 2), [1.0, 1.5, 2.5, 3.5])
    np.testing.assert_allclose(rolling_mean([1, None, 3], 3), [1.0, 1.0, 2.0])
    assert math.isnan(rolling_mean([None], 2)[0])
    with pytest.raises(ValueError, match="window"):
        rolling_mean([1.0], 0)


def test_offline_swanlab_mirrors_into_the_run_dir(tmp_path) -> None:
    pytest.importorskip("swanlab")
    log = MetricsLogger(tmp_path / "run", swanlab="offline", config={"steps": 2}, experiment_name="test")
    log.log(0, {"reward": 0.5, "loss": float("nan")})
    log.close()
    log.close()  # idempotent
    assert list((tmp_path / "run" / "swanlog").glob("run-*")), "SwanLab wrote no offline run"
    assert read_metrics(tmp_path / "run") == [{"step": 0, "reward": 0.5, "loss": None}]

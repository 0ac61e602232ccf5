"""GRPO on multi-turn episodes through the one loop (chapter 12): ``GRPOConfig.env`` / ``run_grpo(make_env=...)``.

Without an environment nothing changes (tests/test_grpo_variants.py's ``BEFORE`` digests); with one, each group
member is an episode whose datum masks the environment's tokens, the run is reproducible and the same in every
rollout mode, and the episode metrics count what the environment saw. ``offline/tiny`` plays a scripted
environment; the fitted tool model (``offline/tool``) plays the calculator.
"""

from __future__ import annotations

import numpy as np
import pytest

from trio_helpers import connect
from trio_helpers.episodes import StepResult
from trio_helpers.grpo import GRPOConfig, GRPOScorer, run_grpo
from trio_helpers.loop import episode_seed

from test_loop import records, weights_fingerprint, without_timing

TINY = "offline/tiny"


class Echo:
    """After the first model turn, replies ``[ok]`` in a user turn; the second turn ends the episode with a
    parity reward (its text's length is odd), so about half the episodes earn 1."""

    stop = ["."]

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.turns = tokenizer, 0

    def reset(self, record: dict) -> list[int]:
        self.turns = 0
        return self.tokenizer.encode(f"<|im_start|>user\n{record['question'][:40]}<|im_end|>\n"
                                     "<|im_start|>assistant\n", add_special_tokens=False)

    def step(self, text: str, tokens: list[int]) -> StepResult:
        self.turns += 1
        if self.turns >= 2:
            return StepResult([], done=True, reward=float(len(text) % 2))
        reply = "<|im_end|>\n<|im_start|>user\n[ok]<|im_end|>\n<|im_start|>assistant\n"
        return StepResult(self.tokenizer.encode(reply, add_special_tokens=False), info={"tool_calls": 1})


def small(**overrides) -> GRPOConfig:
    return GRPOConfig(**{**dict(base_model=TINY, lora_rank=8, steps=3, batch_size=2, group_size=3, max_tokens=10,
                                seed=1, learning_rate=1e-3, max_turns=3), **overrides})


def echo_run(tmp_path, **overrides):
    service = connect("offline", latency=0.0, home=tmp_path / "home")
    steps = []
    result = run_grpo(service, list(records("grpo")), small(**overrides), make_env=Echo, on_step=steps.append)
    return service, result, steps


def test_episode_run_masks_the_environment_and_counts_it(tmp_path) -> None:
    _, result, steps = echo_run(tmp_path)
    for out in steps:
        episodes = [e for g in out.groups for e in g.extras["episodes"]]
        assert len(episodes) == 2 * 3 and all(e.turns == 2 and e.done for e in episodes)
        row = out.metrics
        assert row["episode/turns_mean"] == 2.0 and row["episode/tool_calls_mean"] == 1.0
        assert row["episode/frac_tool_use"] == 1.0 and row["episode/frac_truncated"] == 0.0
        trained = [g for g in out.groups if not g.degenerate]
        # one datum per episode of a trained group, each as long as its episode minus one token
        assert row["train/datums"] == 3 * len(trained)
        assert row["train/tokens"] == sum(len(e.tokens) - 1 for g in trained for e in g.extras["episodes"])
        # the model's tokens only: the completion lengths leave the prompt and the reply out
        assert row["completion/tokens_total"] == sum(e.model_tokens for e in episodes)
        for g in out.groups:
            assert list(g.rewards) == [e.reward for e in g.extras["episodes"]]
    assert any(out.metrics["train/datums"] > 0 for out in steps)


def test_episode_datums_mask_every_environment_token(tmp_path) -> None:
    from trio_helpers.episodes import ENV
    from trio_helpers.rl import group_datums

    _, _, steps = echo_run(tmp_path, steps=1)
    for g in steps[0].groups:
        for e, d in zip(g.extras["episodes"], group_datums(g, skip_degenerate=False)):
            targets = d.loss_fn_inputs["target_tokens"].to_numpy()
            sources = e.sources[1:]
            assert len(targets) == len(sources)
            assert all((t == -100) == (s != "model") for t, s in zip(targets, sources))
            assert any(s == ENV for s in sources)


def test_episode_runs_are_reproducible_and_equal_in_every_mode(tmp_path) -> None:
    service, sync, _ = echo_run(tmp_path / "a")
    rows = without_timing(sync.history)
    again = echo_run(tmp_path / "b")[1]
    assert without_timing(again.history) == rows
    other_service, concurrent, _ = echo_run(tmp_path / "c", rollout="async")
    assert without_timing(concurrent.history) == rows
    np.testing.assert_array_equal(weights_fingerprint(other_service, concurrent.final_path),
                                  weights_fingerprint(service, sync.final_path))


def test_episode_seeds_differ_per_member() -> None:
    seeds = {episode_seed(1, s, i, j) for s in range(3) for i in range(4) for j in range(8)}
    assert len(seeds) == 96 and all(0 <= x < 2**31 for x in seeds)


@pytest.mark.parametrize("overrides, match", [
    ({"env": "abacus"}, "env must be None or one of 'calculator'"),
    ({"env": "calculator", "max_turns": 1}, "max_turns must be an integer >= 2"),
    ({"env": "calculator", "tis_cap": 2.0}, "tis_cap=2.0 is not implemented for episodes"),
    ({"env": "calculator", "ref_kl_coef": 0.1}, "ref_kl_coef=0.1 is not implemented for episodes"),
    ({"env": "calculator", "overlong": "drop"}, "overlong='drop' is not implemented for episodes"),
])
def test_episode_options_are_checked(overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        small(**overrides).validate()


def test_without_env_the_scorer_samples_single_completions() -> None:
    assert GRPOScorer(small()).make_env is None
    assert GRPOScorer(small(env="calculator")).make_env is not None


def test_calculator_run_on_the_tool_model(tmp_path) -> None:
    """The fitted tool model calls the calculator in its episodes; one step trains on them."""
    service = connect("offline", latency=0.0, home=tmp_path / "home")
    config = GRPOConfig(base_model="offline/tool", lora_rank=8, steps=1, batch_size=2, group_size=2,
                        max_tokens=120, seed=0, env="calculator", max_turns=8)
    steps = []
    run_grpo(service, list(records("grpo"))[:2], config, on_step=steps.append)
    row = steps[0].metrics
    assert row["episode/tool_calls_mean"] >= 1.0 and row["episode/frac_tool_use"] > 0
    assert 0.0 <= row["reward/mean"] <= 1.0


# ------------------------------------------------------------------------------- the recipe's flag
RECIPE_ARGS = ["--backend", "offline", "--base-model", "offline/tool", "--lora-rank", "8", "--batch-size", "1",
               "--group-size", "2", "--max-tokens", "120", "--steps", "1", "--env", "calculator"]


@pytest.fixture
def recipe_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIO_OFFLINE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


def test_the_recipe_runs_grpo_with_the_calculator(recipe_home, monkeypatch) -> None:
    from test_loop_failures import GRPO_RECIPE, run_recipe

    done = run_recipe(GRPO_RECIPE, [*RECIPE_ARGS, "--max-turns", "8", "--run-dir", "calc"], monkeypatch)
    assert done.code == 0, done.err
    import json
    from pathlib import Path

    saved = json.loads(Path("calc/config.json").read_text())
    assert saved["env"] == "calculator" and saved["max_turns"] == 8
    row = json.loads(Path("calc/metrics.jsonl").read_text().splitlines()[0])
    assert row["episode/tool_calls_mean"] > 0


@pytest.mark.parametrize("extra, message", [
    (["--env", "abacus"], "argument --env: invalid choice: 'abacus'"),
    (["--max-turns", "1"], "argument --max-turns: must be an integer >= 2, got 1"),
    (["--tis-cap", "2"], "tis_cap=2.0 is not implemented for episodes"),
])
def test_the_recipe_refuses_bad_episode_flags_in_one_line(recipe_home, monkeypatch, extra, message) -> None:
    from test_loop_failures import GRPO_RECIPE, run_recipe

    done = run_recipe(GRPO_RECIPE, [*RECIPE_ARGS, *extra], monkeypatch)
    assert done.code == 2 and done.services == [] and "Traceback" not in done.err
    errors = [line for line in done.err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and message in errors[0], done.err


def test_the_calculator_prompt_offline_is_chapter_01s() -> None:
    """``CalculatorEnv`` declares the tool (``tools=[TOOL_SCHEMA]``) for a real chat template; the offline
    template ignores it, so the offline prompt is chapter 01's."""
    from trio_helpers.calculator import CalculatorEnv
    from trio_helpers.offline.tokenizer import get_offline_tokenizer

    tok = get_offline_tokenizer()
    record = {"question": "Ann has 3 apples and buys 4 more. How many now?", "answer": "#### 7"}
    assert CalculatorEnv(tok).reset(record) == CalculatorEnv(tok, declare_tool=False).reset(record)


def test_config_bill_bounds_episodes_by_hand() -> None:
    from trio_helpers.costs import config_bill

    single = config_bill(small(steps=2), prompt_tokens=100)
    assert "requests" not in single and single["sampled"] == 2 * 2 * 3 * 10
    # 12 episodes of at most 3 turns of 10 tokens; replies of at most 5 tokens
    bill = config_bill(small(steps=2, env="calculator"), prompt_tokens=100, reply_tokens=5)
    assert bill["sampled"] == 12 * 3 * 10 and bill["requests"] == 12 * 3
    assert bill["prompt"] == 12 * (100 + 115 + 130)  # turn k re-sends 100 + k * (10 + 5)
    assert bill["training"] == 12 * (100 + 3 * 10 + 2 * 5 - 1)


def test_the_dry_run_of_episodes_probes_the_tool_model(recipe_home, monkeypatch) -> None:
    from test_loop_failures import GRPO_RECIPE, run_recipe

    done = run_recipe(GRPO_RECIPE, ["--env", "calculator", "--steps", "2", "--batch-size", "1", "--group-size",
                                    "2", "--max-tokens", "120", "--dry-run"], monkeypatch)
    assert done.code == 0, done.err
    assert "offline stand-in 'Qwen/Qwen3.5-9B', which calls tools" in done.out
    assert "one sampling request each" in done.out


def test_the_offline_chat_template_renders_tool_messages_as_the_environment_writes_them() -> None:
    """Qwen3's rendering of an assistant ``tool_calls`` message and a ``tool`` message, byte for byte what
    ``CalculatorEnv`` builds (a turn that stops at ``</tool_call>``, then ``tool_reply_text``)."""
    from trio_helpers.calculator import tool_call_text, tool_reply_text
    from trio_helpers.offline.tokenizer import get_offline_tokenizer

    tok = get_offline_tokenizer()
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "22*7"}}}
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "He earns 22*7 = $", "tool_calls": [call]},
                {"role": "tool", "content": "154"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    head = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    assert text == head + "He earns 22*7 = $\n" + tool_call_text("22*7") + tool_reply_text("154")
    # without tool calls or tool messages the template renders what it always did
    plain = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert tok.apply_chat_template(plain, tokenize=False) == head + "a<|im_end|>\n"

"""Chapter 10's loop options (issue 26, item 1): the datums each builds on small hand-computed cases, their
one-line validation errors, and that with every option at its default a run is bit-for-bit the run of before.

Runs use the offline backend with ``offline/tiny`` and the parity reward of ``test_loop.py``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from trio_helpers import connect
from trio_helpers.datums import importance_sampling_datum
from trio_helpers.grpo import GRPOConfig, apply_overlong, run_grpo
from trio_helpers.loop import LoopConfig, extra_prompt_indices, run_loop
from trio_helpers.rl import (
    Group,
    aggregation_scales,
    group_advantages,
    group_datums,
    minibatches,
    scale_advantages,
    soft_overlong_penalty,
    train_on_groups,
    truncated_importance_weights,
)

from test_loop import parity_reward, records, weights_fingerprint, without_timing

TINY = "offline/tiny"


def small(**overrides) -> GRPOConfig:
    return GRPOConfig(**{**dict(base_model=TINY, lora_rank=8, steps=4, batch_size=2, group_size=3, max_tokens=12,
                                seed=1, learning_rate=1e-3), **overrides})


def digest(config: GRPOConfig, tmp_path) -> str:
    service = connect("offline", latency=0.0, home=tmp_path / "home")
    result = run_grpo(service, list(records("grpo")), config, reward_fn=parity_reward)
    fp = weights_fingerprint(service, result.final_path)
    rows = json.dumps(without_timing(result.history), sort_keys=True).encode()
    return hashlib.sha256(rows + fp.tobytes()).hexdigest()[:16]


def seq(tokens, logprobs=None):
    return SimpleNamespace(tokens=list(tokens), logprobs=list(logprobs or [-1.0] * len(tokens)), text="")


def group(lengths, rewards, prompt=(1, 2)):
    from pytrio import ModelInput

    r = np.asarray(rewards, dtype=np.float64)
    return Group(0, ModelInput.from_ints(list(prompt)), [seq(range(10, 10 + n)) for n in lengths], r,
                 group_advantages(r))


def advs(datum) -> np.ndarray:
    mask = datum.loss_fn_inputs["target_tokens"].to_numpy() != -100
    return datum.loss_fn_inputs["advantages"].to_numpy()[mask].astype(np.float64)


# ------------------------------------------------------------------------------- defaults change nothing
# `digest` of these configs, recorded by the same code run on commit df46dc6, before these options existed.
BEFORE = {"importance_sampling": "e35a268c27748676", "cispo": "ff302c5c355f9bc6", "std": "b013b96086e88fd0"}


@pytest.mark.parametrize("name, overrides", [("importance_sampling", {}), ("cispo", {"loss_fn": "cispo"}),
                                             ("std", {"advantage": "std"})])
def test_defaults_reproduce_the_run_before_the_options(name, overrides, tmp_path) -> None:
    assert digest(small(**overrides), tmp_path) == BEFORE[name]


def test_options_explicitly_off_equal_the_defaults(tmp_path) -> None:
    off = small(loss_aggregation="token", num_substeps=1, clip_higher=None, dynamic_sampling=0, tis_cap=None,
                overlong="keep", overlong_buffer=0)
    assert digest(off, tmp_path / "a") == digest(small(), tmp_path / "b") == BEFORE["importance_sampling"]


# ------------------------------------------------------------------------------- advantage normalisation
def test_advantage_normalisations_by_hand() -> None:
    r = [1.0, 0.0, 0.0, 1.0]
    np.testing.assert_allclose(group_advantages(r, "mean"), [0.5, -0.5, -0.5, 0.5])
    np.testing.assert_allclose(group_advantages(r, "std"), [1.0, -1.0, -1.0, 1.0], rtol=1e-7)  # std 0.5
    np.testing.assert_array_equal(group_advantages(r, "none"), r)
    g = group([2, 1], [1.0, 0.0])
    g.advantages = group_advantages(g.rewards, "none")
    assert [advs(d).tolist() for d in group_datums(g)] == [[1.0, 1.0], [0.0]]


# ------------------------------------------------------------------------------- loss aggregation
def test_loss_aggregation_scales_by_hand() -> None:
    # two completions of 1 and 3 tokens: N = 4 active tokens, n = 2 datums
    g = group([1, 3], [1.0, 0.0])  # advantages +0.5, -0.5
    data = group_datums(g)
    assert aggregation_scales(data, "token") == [1.0, 1.0]
    # per-sequence mean: N / (n * L_i) = 4/2 = 2 and 4/6
    np.testing.assert_allclose(aggregation_scales(data, "sequence"), [2.0, 4 / 6])
    # Dr. GRPO: N / (n * max_tokens) = 4 / (2 * 8)
    np.testing.assert_allclose(aggregation_scales(data, "constant", max_tokens=8), [0.25, 0.25])
    scaled = [scale_advantages(d, f) for d, f in zip(data, aggregation_scales(data, "sequence"))]
    np.testing.assert_allclose(advs(scaled[0]), [1.0])
    np.testing.assert_allclose(advs(scaled[1]), [-1 / 3] * 3, rtol=1e-6)
    # the service's 1/N times the scaled sum = per-completion means averaged: (0.5/1 + -0.5*3/3) / 2 = 0
    assert abs(sum(advs(d).sum() for d in scaled) / 4 - (0.5 + -0.5) / 2) < 1e-6
    assert scaled[0].loss_fn_inputs["advantages"].to_numpy()[0] == 0.0  # prompt position stays 0


def test_loss_aggregation_is_applied_per_forward_backward() -> None:
    sent = []

    class Client:
        def forward_backward(self, data, loss_fn, config):
            sent.append([advs(d).tolist() for d in data])
            return SimpleNamespace(result=lambda: SimpleNamespace(metrics={"loss_mean": 0.0}, loss_fn_outputs=[]))

        def optim_step(self, adam):
            return SimpleNamespace(result=lambda: SimpleNamespace(metrics={}))

    g = group([1, 3], [1.0, 0.0])
    m = train_on_groups(Client(), [g], None, loss_aggregation="constant", max_tokens=8)
    assert sent == [[[0.125], [-0.125] * 3]] and "train/substeps" not in m


# ------------------------------------------------------------------------------- substeps
def test_minibatches_split_in_order() -> None:
    assert minibatches(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert minibatches(list(range(2)), 4) == [[0], [1]]
    assert minibatches([], 3) == []


def test_substeps_send_one_forward_backward_and_optim_step_each() -> None:
    calls = []

    class Client:
        def forward_backward(self, data, loss_fn, config):
            calls.append(("fb", len(data)))
            return SimpleNamespace(result=lambda: SimpleNamespace(metrics={"loss_mean": float(len(calls))},
                                                                  loss_fn_outputs=[]))

        def optim_step(self, adam):
            calls.append(("optim",))
            return SimpleNamespace(result=lambda: SimpleNamespace(metrics={}))

    g = group([1, 2, 3], [1.0, 0.0, 0.0])
    m = train_on_groups(Client(), [g], None, num_substeps=2)
    assert calls == [("fb", 2), ("optim",), ("fb", 1), ("optim",)]
    assert m["train/substeps"] == 2 and m["train/loss"] == 2.0  # mean of 1 and 3


def test_substeps_run_keeps_one_version_per_step(tmp_path) -> None:
    service = connect("offline", latency=0.0, home=tmp_path / "home")
    result = run_grpo(service, list(records("grpo")), small(num_substeps=2, steps=2), reward_fn=parity_reward)
    assert [r["sampler/version"] for r in result.history] == [0, 1]
    assert all(r["train/substeps"] == 2 for r in result.history if r["train/datums"] >= 2)


# ------------------------------------------------------------------------------- clip-higher
def test_clip_higher_sets_the_upper_bound_only() -> None:
    from trio_helpers.losses import check_loss_config, clipped_mask

    c = small(loss_fn="ppo", clip_higher=1.28)
    c.validate()
    assert check_loss_config("ppo", c.effective_loss_config()) == {"clip_low_threshold": 0.8,
                                                                   "clip_high_threshold": 1.28}
    # ratio 1.25 with a positive advantage: clipped by the symmetric 1.2, not by 1.28
    assert clipped_mask("ppo", [1.25], [1.0])[0] and not clipped_mask("ppo", [1.25], [1.0],
                                                                      c.effective_loss_config())[0]
    cc = small(loss_fn="cispo", clip_higher=5.0)
    assert check_loss_config("cispo", cc.effective_loss_config()) == {"clip_low_threshold": 0.0,
                                                                      "clip_high_threshold": 5.0}
    assert small().effective_loss_config() is None


# ------------------------------------------------------------------------------- overlong
def test_soft_overlong_penalty_by_hand() -> None:
    # max_tokens 10, buffer 4: no penalty up to 6 tokens, then -1/4 per token, -1 at 10
    np.testing.assert_allclose(soft_overlong_penalty([3, 6, 7, 8, 10], 10, 4), [0, 0, -0.25, -0.5, -1.0])


def test_overlong_drop_and_penalty_datums() -> None:
    g = apply_overlong(group([2, 4], [1.0, 0.0]), "drop", max_tokens=4)
    data = group_datums(g)
    assert len(data) == 1 and advs(data[0]).tolist() == [0.5, 0.5]  # advantages kept from the full group
    g = apply_overlong(group([2, 4], [1.0, 1.0]), "penalty", max_tokens=4, buffer=2)
    # rewards 1 + 0 and 1 - 1 = 0: mean 0.5, advantages +0.5 / -0.5 (the group is no longer degenerate)
    assert g.rewards.tolist() == [1.0, 0.0] and not g.degenerate
    assert [advs(d).tolist() for d in group_datums(g)] == [[0.5, 0.5], [-0.5] * 4]


# ------------------------------------------------------------------------------- dynamic sampling
def test_extra_prompts_are_outside_the_batch_and_reproducible() -> None:
    a = extra_prompt_indices(10, 3, 1, exclude=[6, 7])
    assert a == extra_prompt_indices(10, 3, 1, exclude=[6, 7]) and sorted(a) == [0, 1, 2, 3, 4, 5, 8, 9]


def test_dynamic_sampling_replaces_degenerate_groups_and_counts_them(tmp_path) -> None:
    def reward(text, record):  # degenerate for every other prompt (even question length)
        return float(len(text) % 2) if len(record["question"]) % 2 else 0.0

    service = connect("offline", latency=0.0, home=tmp_path / "home")
    recs = list(records("grpo"))
    base = run_grpo(service, recs, small(steps=3, batch_size=4, weights_name=None), reward_fn=reward)
    dyn = run_grpo(service, recs, small(steps=3, batch_size=4, weights_name=None, dynamic_sampling=6),
                   reward_fn=reward)
    for b, d in zip(base.history, dyn.history):
        assert "dynamic/extra_prompts" not in b
        assert 0 < d["dynamic/extra_prompts"] <= 6
        assert d["dynamic/extra_samples"] == 3 * d["dynamic/extra_prompts"]
        assert d["reward/frac_degenerate"] == d["dynamic/unfilled"] / 4
    # step 0 samples the same batch from the same weights in both runs: each degenerate group of the plain run
    # was either replaced or left unfilled
    b, d = base.history[0], dyn.history[0]
    assert d["dynamic/replaced"] + d["dynamic/unfilled"] == b["reward/frac_degenerate"] * 4 > 0
    assert d["dynamic/replaced"] > 0


# ------------------------------------------------------------------------------- truncated importance sampling
def test_truncated_importance_weights_by_hand() -> None:
    w, capped = truncated_importance_weights(np.log([1.0, 3.0, 0.5]), [0.0, 0.0, 0.0], 2.0)
    np.testing.assert_allclose(w, [1.0, 2.0, 0.5])
    assert capped.tolist() == [False, True, False]


# ------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("overrides, match", [
    ({"loss_aggregation": "seq"}, "loss_aggregation must be one of 'token', 'sequence', 'constant', got 'seq'"),
    ({"loss_aggregation": "sequence", "loss_fn": "dro"}, "use loss_aggregation='token' with dro"),
    ({"num_substeps": 0}, "num_substeps must be an integer >= 1"),
    ({"clip_higher": 1.28}, "clip_higher=1.28 needs loss_fn 'ppo' or 'cispo'"),
    ({"clip_higher": 0.9, "loss_fn": "ppo"}, "clip_higher must be a finite number >= 1"),
    ({"clip_higher": 1.3, "loss_fn": "ppo", "loss_fn_config": {"clip_high_threshold": 1.2}}, "keep one of them"),
    ({"dynamic_sampling": -1}, "dynamic_sampling must be an integer >= 0"),
    ({"tis_cap": 0.5}, "tis_cap must be None .off. or a finite number >= 1"),
    ({"advantage": "zscore"}, "advantage must be one of 'mean', 'std', 'none'"),
    ({"overlong": "cut"}, "overlong must be one of 'keep', 'drop', 'penalty', got 'cut'"),
    ({"overlong": "penalty"}, r"overlong_buffer must be an integer in \[1, max_tokens=12\]"),
    ({"overlong_buffer": 3}, "only used with overlong='penalty'"),
])
def test_each_option_names_field_value_and_fix(overrides, match) -> None:
    with pytest.raises(ValueError, match=match) as info:
        small(**overrides).validate()
    assert "\n" not in str(info.value)


def test_tis_folds_the_capped_ratio_into_the_datum() -> None:
    from trio_helpers.loop import apply_tis, tis_metrics
    from trio_helpers.rollouts import RequestLimiter, run_sync

    g = group([2, 1], [1.0, 0.0])  # advantages +0.5, -0.5; sampler logprobs -1 everywhere
    g.sequences[0].logprobs = [-1.0, -1.0]
    sent = []

    class Sampler:  # "current weights": the prompt's logprobs, then log 3 ratio on token 0, log 0.5 on token 1
        async def compute_logprobs_async(self, model_input):
            ids = model_input.to_ints()
            sent.append(ids)
            tail = [-1.0 + np.log(3.0), -1.0 + np.log(0.5)][: len(ids) - 2]
            return [None, -0.1] + tail

    cfg = small(tis_cap=2.0)
    scorer = SimpleNamespace(skip_degenerate=True)
    run_sync(apply_tis([g], Sampler(), cfg, scorer, RequestLimiter(1, None)))
    d0, d1 = group_datums(g)
    np.testing.assert_allclose(advs(d0), [0.5 * 2.0, 0.5 * 0.5], rtol=1e-6)  # capped at 2, then 0.5
    np.testing.assert_allclose(advs(d1), [-0.5 * 2.0], rtol=1e-6)
    mask = d0.loss_fn_inputs["target_tokens"].to_numpy() != -100
    np.testing.assert_allclose(d0.loss_fn_inputs["logprobs"].to_numpy()[mask], [-1 + np.log(3), -1 + np.log(.5)],
                               rtol=1e-6)  # the datum carries the recomputed logprobs
    assert sent == [[1, 2, 10, 11], [1, 2, 10]]
    assert tis_metrics([g]) == {"tis/capped_frac": 2 / 3, "tis/requests": 2.0}


def test_tis_run_logs_how_often_the_cap_binds(tmp_path) -> None:
    service = connect("offline", latency=0.0, home=tmp_path / "home")
    cfg = small(steps=3, tis_cap=1.5, rollout="pipeline", max_staleness=2, learning_rate=3e-2, weights_name=None)
    result = run_grpo(service, list(records("grpo")), cfg, reward_fn=parity_reward)
    rows = [r for r in result.history if r["train/datums"] > 0]
    assert rows and all(r["tis/requests"] == r["train/datums"] for r in rows)
    assert all(0.0 <= r["tis/capped_frac"] <= 1.0 for r in rows)
    assert rows[0]["tis/capped_frac"] == 0.0  # step 0 samples the trained weights themselves
    assert max(r["tis/capped_frac"] for r in rows if r["sampler/staleness"] > 0) > 0  # stale: the cap binds
    # after a TIS step the loss's own ratio starts at 1: logprobs recomputed on the trained weights
    assert all(abs(r["train/ratio_mean"] - 1.0) < 1e-3 for r in rows)

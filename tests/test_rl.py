"""Tests of trio_helpers.rl: advantages, degenerate groups, datums of a group and a step, metrics, the training call.

Pure functions are tested on hand-made groups (``SampleSequence`` objects built directly); the training call runs
on the offline backend's ``offline/tiny`` model (random weights, no fitting), so the file runs in about a second.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from pytrio import AdamParams, ModelInput
from pytrio.types import SampleSequence

from trio_helpers.datums import IGNORE
from trio_helpers.rl import (
    Group,
    cosine_lr,
    datum_tokens,
    group_advantages,
    group_datums,
    is_degenerate,
    make_group,
    prob_degenerate,
    rollout_metrics,
    sample_groups,
    step_datums,
    train_on_groups,
)

PROMPT = ModelInput.from_ints([10, 11, 12, 13])


def seq(tokens: list[int], text: str) -> SampleSequence:
    return SampleSequence(stop_reason="stop", tokens=tokens, text=text, logprobs=[-0.5] * len(tokens))


def group(rewards: list[float], lengths: list[int] | None = None, normalize: str = "mean") -> Group:
    lengths = lengths or [3] * len(rewards)
    sequences = [seq(list(range(20, 20 + n)), str(r)) for r, n in zip(rewards, lengths)]
    return make_group(0, PROMPT, sequences, reward_fn=float, normalize=normalize)


# --- advantages ----------------------------------------------------------------------------------------------


def test_mean_centred_advantages_of_one_right_three_wrong() -> None:
    np.testing.assert_allclose(group_advantages([1, 0, 0, 0]), [0.75, -0.25, -0.25, -0.25])


def test_std_normalised_advantages_of_one_right_three_wrong() -> None:
    adv = group_advantages([1, 0, 0, 0], normalize="std")
    std = math.sqrt(0.1875)  # population std of (1, 0, 0, 0)
    np.testing.assert_allclose(adv, [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rtol=1e-6)
    assert adv.std() == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("normalize", ["mean", "std"])
def test_advantages_sum_to_zero(normalize: str) -> None:
    assert group_advantages([1, 0, 1, 1, 0, -0.5], normalize=normalize).sum() == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("normalize", ["mean", "std"])
@pytest.mark.parametrize("rewards", [[1, 1, 1, 1], [0, 0, 0], [-0.5, -0.5], [1.0]])
def test_all_equal_and_single_completion_groups_have_zero_advantages(rewards, normalize: str) -> None:
    adv = group_advantages(rewards, normalize=normalize)
    assert adv.shape == (len(rewards),)
    assert np.all(adv == 0.0) and np.all(np.isfinite(adv))
    assert is_degenerate(rewards)


def test_std_advantages_of_a_rare_success_equal_those_of_a_rare_failure_in_size() -> None:
    one_right = group_advantages([1, 0, 0, 0], normalize="std")
    one_wrong = group_advantages([0, 1, 1, 1], normalize="std")
    np.testing.assert_allclose(one_right, -one_wrong, rtol=1e-9)
    # mean-centring keeps the asymmetry: the rare success gets the larger push
    assert group_advantages([1, 0, 0, 0])[0] == pytest.approx(0.75)
    assert group_advantages([0, 1, 1, 1])[0] == pytest.approx(-0.75)


@pytest.mark.parametrize(
    "rewards, normalize, match",
    [([], "mean", "non-empty"), ([1.0, float("nan")], "mean", "finite"), ([1, 0], "median", "normalize")],
)
def test_advantage_errors(rewards, normalize, match) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, normalize=normalize)


def test_is_degenerate() -> None:
    assert is_degenerate([]) and is_degenerate([0.5]) and is_degenerate([1, 1])
    assert not is_degenerate([1, 0]) and not is_degenerate([0, 0, 0, 1e-9])


# --- probability of degenerate groups and the schedule --------------------------------------------------------


@pytest.mark.parametrize(
    "p, g, expected",
    [(0.5, 4, 0.125), (0.5, 1, 1.0), (0.0, 8, 1.0), (1.0, 8, 1.0), (0.9, 2, 0.82), (0.25, 3, 0.4375)],
)
def test_prob_degenerate(p: float, g: int, expected: float) -> None:
    assert prob_degenerate(p, g) == pytest.approx(expected)


def test_prob_degenerate_matches_simulation() -> None:
    rng = np.random.default_rng(0)
    draws = rng.random((200_000, 4)) < 0.7
    simulated = np.mean(draws.all(axis=1) | (~draws).all(axis=1))
    assert simulated == pytest.approx(prob_degenerate(0.7, 4), abs=0.005)


@pytest.mark.parametrize("p, g", [(-0.1, 4), (1.1, 4), (0.5, 0)])
def test_prob_degenerate_errors(p: float, g: int) -> None:
    with pytest.raises(ValueError):
        prob_degenerate(p, g)


def test_cosine_lr() -> None:
    assert cosine_lr(0, 10, 1e-5) == pytest.approx(1e-5)
    assert cosine_lr(5, 10, 1e-5) == pytest.approx(0.5e-5)
    assert cosine_lr(10, 10, 1e-5) == pytest.approx(0.0, abs=1e-20)
    assert cosine_lr(10, 10, 1e-5, min_ratio=0.1) == pytest.approx(1e-6)
    lrs = [cosine_lr(s, 10, 1.0) for s in range(11)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))
    with pytest.raises(ValueError, match="total_steps"):
        cosine_lr(0, 0, 1.0)


# --- groups and datums -------------------------------------------------------------------------------------------


def test_make_group_grades_and_centres() -> None:
    g = group([1, 0, 0, 0])
    np.testing.assert_allclose(g.rewards, [1, 0, 0, 0])
    np.testing.assert_allclose(g.advantages, [0.75, -0.25, -0.25, -0.25])
    assert not g.degenerate


def test_group_datums_shapes_and_masking() -> None:
    g = group([1, 0, 0, 1], lengths=[3, 1, 5, 2])
    data = group_datums(g)
    assert len(data) == 4
    p = len(PROMPT.to_ints())
    for d, s, a in zip(data, g.sequences, g.advantages):
        n = len(d.model_input)
        assert n == p + len(s.tokens) - 1
        f = {k: v.data for k, v in d.loss_fn_inputs.items()}
        assert all(len(v) == n for v in f.values())
        assert f["target_tokens"][: p - 1] == [IGNORE] * (p - 1)
        assert f["target_tokens"][p - 1 :] == s.tokens
        assert f["advantages"][: p - 1] == [0.0] * (p - 1)
        assert f["advantages"][p - 1 :] == pytest.approx([a] * len(s.tokens))
    assert datum_tokens(g) == sum(len(d.model_input) for d in data)


def test_degenerate_group_is_skipped_or_sent_with_zero_advantages() -> None:
    g = group([1, 1, 1])
    assert group_datums(g) == []
    kept = group_datums(g, skip_degenerate=False)
    assert len(kept) == 3
    assert all(not any(d.loss_fn_inputs["advantages"].data) for d in kept)


def test_group_of_one_is_always_skipped() -> None:
    assert group_datums(group([1.0])) == []


def test_empty_completion_gets_no_datum() -> None:
    sequences = [seq([20, 21], "1"), seq([], "0")]
    g = make_group(0, PROMPT, sequences, reward_fn=float)
    assert len(group_datums(g)) == 1
    assert datum_tokens(g) == len(PROMPT.to_ints()) + 1


def test_step_datums_concatenates_non_degenerate_groups() -> None:
    groups = [group([1, 0]), group([0, 0]), group([0, 1, 1])]
    assert len(step_datums(groups)) == 5
    assert len(step_datums(groups, skip_degenerate=False)) == 7


def test_rollout_metrics() -> None:
    groups = [group([1, 0], lengths=[4, 8]), group([0, 0], lengths=[8, 2])]
    m = rollout_metrics(groups, max_tokens=8)
    assert m == {
        "reward": 0.25,
        "frac_degenerate": 0.5,
        "completion_tokens_mean": 5.5,
        "completion_tokens_max": 8.0,
        "frac_max_tokens": 0.5,
    }
    with pytest.raises(ValueError, match="at least one completion"):
        rollout_metrics([], max_tokens=8)


# --- the training call, on the offline backend ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from trio_helpers import connect

    service = connect("offline", latency=0.0, home=tmp_path_factory.mktemp("offline-home"))
    return service, service.create_lora_training_client("offline/tiny", rank=8, seed=0)


def _sampled_groups(training_client, rewards_by_group):
    import pytrio as trio

    sampler = training_client.save_weights_and_get_sampling_client()
    prompts = [ModelInput.from_ints([40 + i, 41, 42]) for i in range(len(rewards_by_group))]
    seqs = sample_groups(sampler, prompts, len(rewards_by_group[0]),
                         lambda i: trio.SamplingParams(max_tokens=6, seed=i))
    groups = []
    for i, (p, s, rewards) in enumerate(zip(prompts, seqs, rewards_by_group)):
        it = iter(rewards)
        groups.append(make_group(i, p, s, reward_fn=lambda _text, it=it: next(it)))
    return groups


def test_train_on_groups_counts_sent_and_skipped_tokens(tiny) -> None:
    _, tc = tiny
    groups = _sampled_groups(tc, [[1, 0, 0], [1, 1, 1], [0, 1, 0]])
    m = train_on_groups(tc, groups, AdamParams(learning_rate=1e-3))
    sent = step_datums(groups)
    assert m["datums"] == 6.0
    assert m["train_tokens"] == sum(len(d.model_input) for d in sent)
    assert m["train_tokens_skipped"] == datum_tokens(groups[1])
    assert math.isfinite(m["loss"]) and m["optim/grad_norm"] > 0


def test_train_on_groups_sends_nothing_when_every_group_is_degenerate(tiny) -> None:
    _, tc = tiny
    groups = _sampled_groups(tc, [[0, 0], [1, 1]])
    m = train_on_groups(tc, groups, AdamParams(learning_rate=1e-3))
    assert m["datums"] == 0.0 and m["train_tokens"] == 0.0 and math.isnan(m["loss"])
    assert m["train_tokens_skipped"] == sum(datum_tokens(g) for g in groups)
    kept = train_on_groups(tc, groups, AdamParams(learning_rate=1e-3), skip_degenerate=False)
    assert kept["datums"] == 4.0 and kept["train_tokens_skipped"] == 0.0
    assert kept["loss"] == pytest.approx(0.0, abs=1e-12)  # zero advantages: zero loss, but tokens were spent

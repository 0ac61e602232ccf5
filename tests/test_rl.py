"""Tests of trio_helpers.rl: advantages, degenerate groups, datums of a group and a step, metrics, the training call.

Pure functions are tested on hand-made groups (``SampleSequence`` objects built directly); the training call runs
on the offline backend's ``offline/tiny`` model (random weights, no fitting), and its ordering (no ``optim_step``
before ``forward_backward`` succeeded) on a recording fake client, so the file runs in about a second.
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
    completion_metrics,
    cosine_lr,
    datum_tokens,
    group_advantages,
    group_datums,
    is_degenerate,
    make_group,
    prob_degenerate,
    ratio_metrics,
    reward_metrics,
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


def test_completion_and_reward_metrics() -> None:
    groups = [group([1, 0], lengths=[4, 8]), group([0, 0], lengths=[8, 2])]
    expected = {
        "completion/tokens_mean": 5.5,
        "completion/tokens_max": 8.0,
        "completion/tokens_total": 22.0,
        "completion/frac_max_tokens": 0.5,
    }
    m = completion_metrics(groups, max_tokens=8)
    assert {k: m[k] for k in expected} == expected and all(k.startswith("completion/") for k in m)
    assert reward_metrics(groups) == {"reward/mean": 0.25, "reward/frac_degenerate": 0.5}
    with pytest.raises(ValueError, match="at least one completion"):
        completion_metrics([], max_tokens=8)
    with pytest.raises(ValueError, match="graded groups"):
        reward_metrics([Group(0, PROMPT, [seq([1], "x")], None, [np.zeros(1)])])  # a distillation group


def test_a_group_without_rewards_is_degenerate_only_when_every_advantage_is_zero() -> None:
    sequences = [seq([20, 21], "a"), seq([22], "b")]
    assert Group(0, PROMPT, sequences, None, [np.zeros(2), np.zeros(1)]).degenerate
    assert not Group(0, PROMPT, sequences, None, [np.array([0.0, 0.5]), np.zeros(1)]).degenerate


def test_per_token_advantages_reach_the_datum() -> None:
    sequences = [seq([20, 21, 22], "a")]
    g = Group(0, PROMPT, sequences, None, [np.array([0.5, -1.0, 2.0])])
    (d,) = group_datums(g, skip_degenerate=False)
    p = len(PROMPT.to_ints())
    assert d.loss_fn_inputs["advantages"].data == pytest.approx([0.0] * (p - 1) + [0.5, -1.0, 2.0])


class _FB:
    def __init__(self, logprobs) -> None:
        from pytrio.types import TensorData

        self.loss_fn_outputs = [{"logprobs": TensorData.from_numpy(np.asarray(lp, dtype=np.float32))}
                                for lp in logprobs]


def test_ratio_metrics_compare_trainer_and_sampler_logprobs_on_trained_tokens() -> None:
    g = group([1, 0], lengths=[2, 1])  # sampler logprobs are -0.5 everywhere
    data = group_datums(g)
    p = len(PROMPT.to_ints())
    # the trainer's logprobs: garbage on the masked prompt positions, then log-ratios of +0.5 / -0.25 / 0
    trainer = [[9.0] * (p - 1) + [0.0, -0.75], [9.0] * (p - 1) + [-0.5]]
    m = ratio_metrics(data, _FB(trainer))
    assert m["train/ratio_mean"] == pytest.approx((math.exp(0.5) + math.exp(-0.25) + 1.0) / 3, rel=1e-6)
    assert m["train/ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)
    assert m["train/policy_lag"] == pytest.approx(0.25, rel=1e-6)
    assert all(math.isnan(v) for v in ratio_metrics(data, _FB(trainer[:1])).values())  # one output missing


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
    assert m["train/datums"] == 6.0
    assert m["train/tokens"] == sum(len(d.model_input) for d in sent)
    assert m["train/tokens_skipped"] == datum_tokens(groups[1])
    assert math.isfinite(m["train/loss"]) and m["optim/grad_norm"] > 0
    assert m["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m["train/policy_lag"] < 1e-5  # a fresh sampler


def test_train_on_groups_sends_nothing_when_every_group_is_degenerate(tiny) -> None:
    _, tc = tiny
    groups = _sampled_groups(tc, [[0, 0], [1, 1]])
    m = train_on_groups(tc, groups, AdamParams(learning_rate=1e-3))
    assert m["train/datums"] == 0.0 and m["train/tokens"] == 0.0 and math.isnan(m["train/loss"])
    assert m["train/tokens_skipped"] == sum(datum_tokens(g) for g in groups)
    assert not any(k.startswith("optim/") for k in m)  # nothing sent: no optimizer step either
    kept = train_on_groups(tc, groups, AdamParams(learning_rate=1e-3), skip_degenerate=False)
    assert kept["train/datums"] == 4.0 and kept["train/tokens_skipped"] == 0.0
    assert kept["train/loss"] == pytest.approx(0.0, abs=1e-12)  # zero advantages: zero loss, tokens spent


class RecordingClient:
    """A training client whose futures record when they are submitted and when their result is read."""

    def __init__(self, fail_forward_backward: bool = False) -> None:
        self.events: list[str] = []
        self.fail = fail_forward_backward

    def _future(self, name, value):
        client = self

        class Future:
            def result(self, timeout=None):
                client.events.append(f"{name} result")
                if isinstance(value, BaseException):
                    raise value
                return value

        self.events.append(f"{name} submitted")
        return Future()

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        from pytrio.errors.actor import ActorEventSubmitError
        from pytrio.types import ForwardBackwardOutput

        if self.fail:
            return self._future("forward_backward", ActorEventSubmitError(
                "Actor request failed with HTTP 503", status_code=503, code="", operation="POST /v1/events"))
        return self._future("forward_backward", ForwardBackwardOutput(loss_fn_outputs=[],
                                                                      metrics={"loss_mean": 0.5}))

    def optim_step(self, adam_params):
        from pytrio.types import OptimStepResponse

        return self._future("optim_step", OptimStepResponse(metrics={"step": 1.0}))


def test_optim_step_is_submitted_only_after_forward_backward_succeeded() -> None:
    client = RecordingClient()
    m = train_on_groups(client, [group([1, 0])], AdamParams(learning_rate=1e-3))
    assert client.events == ["forward_backward submitted", "forward_backward result", "optim_step submitted",
                             "optim_step result"]
    assert m["train/loss"] == 0.5 and m["optim/step"] == 1.0


def test_a_failed_forward_backward_sends_no_optim_step() -> None:
    from pytrio.errors.actor import ActorEventSubmitError

    client = RecordingClient(fail_forward_backward=True)
    with pytest.raises(ActorEventSubmitError, match="HTTP 503"):
        train_on_groups(client, [group([1, 0])], AdamParams(learning_rate=1e-3))
    assert client.events == ["forward_backward submitted", "forward_backward result"]

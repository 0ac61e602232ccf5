"""Tests of trio_helpers.distillation: teacher-logprob slicing, reverse-KL advantages, the OPD loop (offline)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trio_helpers.distillation import (
    OPDConfig,
    Rollout,
    batch_for_step,
    exact_reverse_kl_offline,
    final_line_start,
    opd_datum,
    opd_prompt,
    reverse_kl_advantages,
    rollout_metrics,
    run_opd,
    sampled_reverse_kl,
    teacher_completion_logprobs,
    token_kl_html,
)

# --- teacher_completion_logprobs -----------------------------------------------------------------------------


def test_slices_the_completion_part_after_the_leading_none():
    scored = [None, -0.5, -0.25, -1.0, -2.0, -0.125]  # prompt of 3 tokens, completion of 3
    assert teacher_completion_logprobs(scored, 3, 3) == [-1.0, -2.0, -0.125]


def test_one_token_prompt_and_completion():
    assert teacher_completion_logprobs([None, -0.75], 1, 1) == [-0.75]


def test_wrong_total_length_is_rejected_with_the_expected_count():
    with pytest.raises(ValueError, match=r"has 5 entries but prompt_len \+ completion_len = 3 \+ 3 = 6"):
        teacher_completion_logprobs([None, -1.0, -1.0, -1.0, -1.0], 3, 3)


def test_scoring_the_completion_alone_is_diagnosed():
    with pytest.raises(ValueError, match="not the completion alone"):
        teacher_completion_logprobs([None, -1.0, -1.0], 4, 3)


def test_none_inside_the_completion_part_points_at_prompt_len():
    # a list with a None where a completion token should be (e.g. two sequences' results concatenated)
    with pytest.raises(ValueError, match=r"teacher_logprobs\[1\] \(completion token 0\) is None.*prompt_len"):
        teacher_completion_logprobs([None, None, -1.0, -1.0], 1, 3)


def test_lengths_must_be_positive_ints():
    with pytest.raises(ValueError, match="prompt_len must be >= 1"):
        teacher_completion_logprobs([None, -1.0], 0, 2)
    with pytest.raises(TypeError, match="completion_len must be an int"):
        teacher_completion_logprobs([None, -1.0], 1, 1.0)


def test_non_finite_and_non_numeric_entries_are_rejected():
    with pytest.raises(ValueError, match="not finite"):
        teacher_completion_logprobs([None, -1.0, float("nan")], 2, 1)
    with pytest.raises(TypeError, match="not a number"):
        teacher_completion_logprobs([None, -1.0, "x"], 2, 1)
    with pytest.raises(TypeError, match="the list compute_logprobs returned"):
        teacher_completion_logprobs("abc", 2, 1)


# --- reverse_kl_advantages -------------------------------------------------------------------------------------


def test_advantages_on_a_hand_computed_example():
    student = [-0.1, -2.0, -0.5]
    teacher = [-0.3, -0.5, -0.5]
    # student - teacher = [0.2, -1.5, 0.0]  ->  advantages = -coef * that
    np.testing.assert_allclose(reverse_kl_advantages(student, teacher), [-0.2, 1.5, 0.0], atol=1e-12)
    np.testing.assert_allclose(reverse_kl_advantages(student, teacher, coef=0.5), [-0.1, 0.75, 0.0], atol=1e-12)


def test_student_more_confident_than_teacher_is_pushed_down():
    adv = reverse_kl_advantages([math.log(0.9)], [math.log(0.3)])
    assert adv[0] == pytest.approx(-math.log(3.0))


def test_advantage_length_mismatch_names_the_leading_none():
    with pytest.raises(ValueError, match="one longer.*leading None"):
        reverse_kl_advantages([-1.0, -1.0], [-1.0, -1.0, -1.0])
    with pytest.raises(ValueError, match="teacher_completion_logprobs"):
        reverse_kl_advantages([-1.0], [-1.0, -1.0, -1.0])


def test_advantage_inputs_are_checked():
    with pytest.raises(ValueError, match="contains None"):
        reverse_kl_advantages([-1.0, -1.0], [None, -1.0])
    with pytest.raises(ValueError, match="empty"):
        reverse_kl_advantages([], [])
    with pytest.raises(ValueError, match="coef"):
        reverse_kl_advantages([-1.0], [-1.0], coef=0.0)
    with pytest.raises(ValueError, match="non-finite"):
        reverse_kl_advantages([-1.0], [float("-inf")])


class _Seq:
    def __init__(self, tokens, logprobs):
        self.tokens, self.logprobs = tokens, logprobs


def test_opd_datum_carries_per_token_advantages_on_completion_positions():
    seq = _Seq([7, 8, 9], [-0.1, -2.0, -0.5])
    datum = opd_datum([1, 2, 3, 4], seq, [-0.3, -0.5, -0.5], coef=2.0)
    adv = datum.loss_fn_inputs["advantages"].to_numpy()
    np.testing.assert_allclose(adv, [0.0, 0.0, 0.0, -0.4, 3.0, 0.0], atol=1e-6)
    assert datum.loss_fn_inputs["target_tokens"].to_numpy().tolist() == [-100, -100, -100, 7, 8, 9]


def test_rollout_metrics_on_hand_computed_rollouts():
    rollouts = [Rollout(0, None, _Seq([1, 2], [-1.0, -1.0]), [-1.5, -0.5]),  # kl [0.5, -0.5]
                Rollout(0, None, _Seq([3], [-2.0]), [-3.0])]  # kl [1.0]
    m = rollout_metrics(rollouts, max_tokens=2)
    assert m["reverse_kl_mean"] == pytest.approx(1.0 / 3)
    assert m["reverse_kl_seq_mean"] == pytest.approx(0.5)
    assert m["completion_tokens_total"] == 3 and m["frac_max_tokens"] == 0.5


def test_batches_wrap_around():
    records = [{"question": str(i)} for i in range(5)]
    assert [r["question"] for r in batch_for_step(records, 2, 2)] == ["4", "0"]


def test_config_validation_names_the_field():
    for field, value in (("steps", 0), ("group_size", 0), ("sampler_refresh_steps", 0), ("lora_rank", 3),
                         ("kl_penalty_coef", 0.0), ("rollout", "threads"), ("top_p", 0.0)):
        with pytest.raises(ValueError, match=field):
            OPDConfig(**{field: value}).validate()
    OPDConfig().validate()


def test_token_kl_html_is_deterministic_and_escaped():
    class Tok:
        def decode(self, ids):
            return {1: "<", 2: "a", 3: "\n"}[ids[0]]

    html = token_kl_html(Tok(), [1, 2, 3], [0.5, -3.0, 0.0], vmax=1.0)
    assert html == token_kl_html(Tok(), [1, 2, 3], [0.5, -3.0, 0.0], vmax=1.0)
    assert "&lt;" in html and "rgba(214,39,40,0.50)" in html and "rgba(31,119,180,1.00)" in html
    with pytest.raises(ValueError, match="one value per token"):
        token_kl_html(Tok(), [1, 2], [0.1], vmax=1.0)


# --- on the offline backend ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def offline():
    from trio_helpers import connect
    from trio_helpers.data import load_deepmath

    service = connect("offline", latency=0.0)
    records = load_deepmath(source="offline", sample_size=0, seed=0)
    return service, records[:-64], records[-64:]


def test_teacher_scoring_matches_sampling_logprobs_of_the_same_model(offline):
    """Scoring a sample with a sampler of the *same* weights reproduces its logprobs: the slicing is aligned."""
    import pytrio as trio

    from trio_helpers.distillation import score_completion

    service, train, _ = offline
    student = service.create_sampling_client("Qwen/Qwen3.5-4B")
    prompt = opd_prompt(student.get_tokenizer(), train[0])
    seq = student.sample(prompt, 1, trio.SamplingParams(max_tokens=40, seed=3)).result().sequences[0]
    np.testing.assert_allclose(score_completion(student, prompt, seq), seq.logprobs, atol=1e-9)


def test_exact_kl_refuses_non_offline_clients():
    with pytest.raises(TypeError, match="sampled_reverse_kl"):
        exact_reverse_kl_offline(object(), object(), [])


def test_final_line_start():
    class Tok:
        def decode(self, ids):
            return chr(ids[0])

    assert final_line_start(Tok(), [ord(c) for c in "ab\ncd\nef"]) == 6
    assert final_line_start(Tok(), [ord(c) for c in "abc"]) == 0


def _small_config(**overrides):
    base = dict(steps=3, batch_size=2, group_size=2, max_tokens=48, seed=5, weights_name=None)
    return OPDConfig(**{**base, **overrides})


def test_async_rollouts_give_the_same_datums_as_sync(offline):
    service, train, _ = offline
    runs = {}
    for mode in ("sync", "async"):
        datums = []
        run_opd(service, train, _small_config(rollout=mode, max_concurrency=3),
                on_step=lambda out, keep=datums: keep.append(out.datums))
        runs[mode] = datums
    assert len(runs["sync"]) == 3 and all(len(d) == 4 for d in runs["sync"])
    assert runs["sync"] == runs["async"]


def test_sampler_refresh_steps_makes_the_sampler_stale(offline):
    service, train, _ = offline
    result = run_opd(service, train, _small_config(steps=4, sampler_refresh_steps=2))
    assert result.series("sampler_age").tolist() == [0.0, 1.0, 0.0, 1.0]
    lag = result.series("policy_lag")
    assert lag[0] < 1e-6 and lag[2] < 1e-6  # fresh sampler: trainer and sampler logprobs agree (float32 rounding)
    assert lag[1] > 1e-4 and lag[3] > 1e-4  # one update old: they differ


def test_loss_equals_the_sampled_reverse_kl_at_a_fresh_sampler(offline):
    service, train, _ = offline
    result = run_opd(service, train, _small_config(steps=1, kl_penalty_coef=2.0))
    h = result.history[0]
    assert h["loss"] == pytest.approx(2.0 * h["reverse_kl_mean"], rel=1e-4, abs=1e-6)


def test_a_step_without_datums_raises(offline):
    from trio_helpers.distillation import train_on_rollouts

    service, _, _ = offline
    client = service.create_lora_training_client("Qwen/Qwen3.5-4B", rank=4, seed=0)
    with pytest.raises(RuntimeError, match="step 7 produced no datums"):
        train_on_rollouts(client, [], OPDConfig(), None, step=7)


def test_short_opd_run_lowers_the_reverse_kl_at_fixed_held_out_states(offline):
    """10 steps of 4 prompts x 2 at lr 4e-5 (about 2 s), measured exactly at fixed states: the untrained student's
    samples of 16 held-out prompts x 2. Over seeds 0-5 the mean fell by 17-26% and the final-answer-line part by
    52-56%; the asserted bounds are looser than the worst seed. (On-policy measures on so few samples are too noisy
    to assert on: one unlucky held-out sample can dominate them.)"""
    import pytrio as trio

    from trio_helpers.distillation import collect_rollouts, exact_rollout_kl_offline

    service, train, held = offline
    config = _small_config(steps=10, batch_size=4, group_size=2, max_tokens=256, seed=3, learning_rate=4e-5)
    base = service.create_sampling_client(config.base_model)
    teacher = service.create_sampling_client(config.teacher_base_model)
    tokenizer = base.get_tokenizer()
    prompts = [opd_prompt(tokenizer, r) for r in held[:16]]
    fixed = collect_rollouts(base, teacher, prompts, 2, lambda i: trio.SamplingParams(max_tokens=256, seed=777 + i))
    before = exact_rollout_kl_offline(base, teacher, fixed)
    result = run_opd(service, train, config, teacher=teacher)
    after = exact_rollout_kl_offline(result.training_client.save_weights_and_get_sampling_client(), teacher, fixed)
    assert after["mean"] < 0.95 * before["mean"]
    assert after["final_line"] < 0.7 * before["final_line"]


def test_sampled_estimate_is_near_zero_when_teacher_is_the_student(offline):
    service, _, held = offline
    student = service.create_sampling_client("Qwen/Qwen3.5-4B")
    prompts = [opd_prompt(student.get_tokenizer(), r) for r in held[:2]]
    est = sampled_reverse_kl(student, student, prompts, samples=2, max_tokens=32)
    assert abs(est["mean"]) < 1e-9 and est["tokens"] > 0

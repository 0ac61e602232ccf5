"""Tests of trio_helpers.distillation: teacher-logprob slicing, reverse-KL advantages, the OPD scorer, and OPD
runs on the offline backend. The loop itself (modes, resume, failures) is tested for both scorers in
``test_loop.py`` and ``test_loop_failures.py``."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from trio_helpers.distillation import (
    OPDConfig,
    OPDScorer,
    exact_reverse_kl_offline,
    final_line_start,
    opd_datum,
    opd_prompt,
    reverse_kl_advantages,
    run_opd,
    sampled_reverse_kl,
    teacher_completion_logprobs,
    teacher_kl,
    token_kl_html,
)
from trio_helpers.rl import Group
from trio_helpers.rollouts import RequestLimiter, run_sync

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


def _scored_group(index, prompt, pairs) -> Group:
    """A scored OPD group from ``(student_logprobs, teacher_logprobs)`` pairs (tokens 1, 2, ...)."""
    seqs = [_Seq(list(range(1, len(s) + 1)), s) for s, _ in pairs]
    advantages = [reverse_kl_advantages(s, t) for s, t in pairs]
    return Group(index, prompt, seqs, None, advantages, {"teacher_logprobs": [list(t) for _, t in pairs]})


def test_scorer_metrics_on_hand_computed_groups():
    groups = [_scored_group(0, None, [([-1.0, -1.0], [-1.5, -0.5])]),  # kl [0.5, -0.5]
              _scored_group(1, None, [([-2.0], [-3.0])])]  # kl [1.0]
    m = OPDScorer(OPDConfig()).metrics(groups)
    assert m["kl/teacher_mean"] == pytest.approx(1.0 / 3)
    assert m["kl/teacher_std"] == pytest.approx(np.std([0.5, -0.5, 1.0]))
    assert m["kl/teacher_seq_mean"] == pytest.approx(0.5)  # (0 + 1) / 2 completions
    np.testing.assert_allclose(teacher_kl(groups[0]), [0.5, -0.5])
    empty = OPDScorer(OPDConfig()).metrics([Group(0, None, [], None, [], {"teacher_logprobs": []})])
    assert all(math.isnan(v) for v in empty.values())


class _Teacher:
    """A teacher whose logprob of every token is -1 (entry 0 is None, as compute_logprobs returns it)."""

    def __init__(self) -> None:
        self.scored: list[list[int]] = []

    async def compute_logprobs_async(self, model_input):
        tokens = model_input.to_ints()
        self.scored.append(tokens)
        await asyncio.sleep(0)
        return [None] + [-1.0] * (len(tokens) - 1)


def test_the_scorer_asks_the_teacher_about_every_non_empty_completion():
    import pytrio as trio

    teacher = _Teacher()
    scorer = OPDScorer(OPDConfig(kl_penalty_coef=2.0), teacher=teacher)
    scorer.setup(service=None)  # a teacher was given: nothing to create
    assert scorer.teacher is teacher
    prompt = trio.ModelInput.from_ints([5, 6, 7])
    sequences = [_Seq([8, 9], [-0.25, -3.0]), _Seq([], []), _Seq([10], [-1.0])]
    group = run_sync(scorer.score(4, prompt, {"question": "q"}, sequences, RequestLimiter(2)))
    assert teacher.scored == [[5, 6, 7, 8, 9], [5, 6, 7, 10]]  # prompt + completion, the empty one dropped
    assert group.index == 4 and [s.tokens for s in group.sequences] == [[8, 9], [10]]
    assert group.rewards is None and not group.degenerate
    np.testing.assert_allclose(group.advantages[0], [-1.5, 4.0])  # -2 * (student - teacher)
    np.testing.assert_allclose(group.advantages[1], [0.0])
    assert group.extras["teacher_logprobs"] == [[-1.0, -1.0], [-1.0]]


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


def test_loss_equals_the_sampled_reverse_kl_at_a_fresh_sampler(offline):
    service, train, _ = offline
    result = run_opd(service, train, _small_config(steps=1, kl_penalty_coef=2.0))
    h = result.history[0]
    assert h["train/loss"] == pytest.approx(2.0 * h["kl/teacher_mean"], rel=1e-4, abs=1e-6)
    assert h["train/datums"] == 4 and h["train/policy_lag"] < 1e-6
    assert result.scorer.teacher is not None  # run_opd created the teacher and returns it with the result


def test_a_step_without_datums_raises(offline):
    from trio_helpers.loop import train_step_metrics

    service, _, _ = offline
    client = service.create_lora_training_client("Qwen/Qwen3.5-4B", rank=4, seed=0)
    import pytrio as trio

    config = OPDConfig(max_tokens=64)
    prompt = trio.ModelInput.from_ints([5, 6, 7])
    empty = [Group(0, prompt, [], None, [], {"teacher_logprobs": []})]  # every completion was empty
    with pytest.raises(RuntimeError, match=r"step 7 produced no datums .*max_tokens \(64\)"):
        train_step_metrics(client, OPDScorer(config), empty, config, 7, 10)


def test_short_opd_run_lowers_the_reverse_kl_at_fixed_held_out_states(offline):
    """6 steps of 4 prompts x 2 at lr 8e-5, measured exactly at fixed states: the untrained student's samples of
    16 held-out prompts x 2 (sampled by the loop's own rollout_batch, seed 777). Over seeds 0-3 the mean fell by
    9-11% and the final-answer-line part by 12-14%; the asserted bounds are looser than the worst seed.
    (On-policy measures on so few samples are too noisy to assert on: one unlucky held-out sample can dominate
    them.)"""
    from trio_helpers.distillation import exact_rollout_kl_offline
    from trio_helpers.loop import rollout_batch

    service, train, held = offline
    config = _small_config(steps=6, batch_size=4, group_size=2, max_tokens=256, seed=3, learning_rate=8e-5)
    base = service.create_sampling_client(config.base_model)
    teacher = service.create_sampling_client(config.teacher_base_model)
    tokenizer = base.get_tokenizer()
    fixed_config = _small_config(max_tokens=256, seed=777)
    fixed = run_sync(rollout_batch(base, OPDScorer(fixed_config, teacher=teacher), tokenizer,
                                   list(enumerate(held[:16])), fixed_config, 0, RequestLimiter(8)))
    before = exact_rollout_kl_offline(base, teacher, fixed)
    result = run_opd(service, train, config, teacher=teacher)
    assert result.scorer.teacher is teacher
    after = exact_rollout_kl_offline(result.training_client.save_weights_and_get_sampling_client(), teacher, fixed)
    assert after["mean"] < 0.95 * before["mean"]
    assert after["final_line"] < 0.92 * before["final_line"]


def test_sampled_estimate_is_near_zero_when_teacher_is_the_student(offline):
    service, _, held = offline
    student = service.create_sampling_client("Qwen/Qwen3.5-4B")
    prompts = [opd_prompt(student.get_tokenizer(), r) for r in held[:2]]
    est = sampled_reverse_kl(student, student, prompts, samples=2, max_tokens=32)
    assert abs(est["mean"]) < 1e-9 and est["tokens"] > 0

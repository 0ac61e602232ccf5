"""Tests of ``trio_helpers.evaluation``: the statistics against hand computations, and ``evaluate`` under faults."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from trio_helpers import connect
from trio_helpers.evaluation import (
    FAILURE_CATEGORIES,
    RECORD_KEYS,
    accuracy_with_ci,
    check_same_problems,
    correctness,
    evaluate,
    failure_category,
    failure_counts,
    grading_note,
    load_records,
    mcnemar_exact,
    paired_bootstrap,
    pass_at_k,
    pass_at_k_curve,
    save_records,
)

TINY = "offline/tiny"
RECORDS = [
    {"question": f"Tom has {i} apples and buys {i + 1} more. How many apples does he have?",
     "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"}
    for i in range(12)
]


# ------------------------------------------------------------------------------------------------ pass@k
def _pass_at_k_brute(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (c of them correct) that contain at least one correct sample."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_equals_brute_force_enumeration(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_brute(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_edge_cases_and_large_n() -> None:
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 0, 10) == 0.0 and pass_at_k(10, 10, 1) == 1.0
    # Large n: the product form stays finite where C(n, k) would overflow a float.
    value = pass_at_k(2000, 20, 500)
    assert value == pytest.approx(1 - math.comb(1980, 500) / math.comb(2000, 500), rel=1e-9)
    for bad in [(0, 0, 1), (4, 5, 1), (4, 2, 0), (4, 2, 5), (4, -1, 1)]:
        with pytest.raises(ValueError, match="need n >= 1"):
            pass_at_k(*bad)


def test_pass_at_k_curve_averages_problems_and_checks_sizes() -> None:
    recs = [{"problem_id": p, "correct": ok} for p, oks in enumerate([[1, 0, 0, 0], [1, 1, 0, 0]]) for ok in oks]
    curve = pass_at_k_curve(recs)
    assert list(curve) == [1, 2, 3, 4]
    assert curve[1] == pytest.approx((0.25 + 0.5) / 2)
    assert curve[4] == 1.0
    with pytest.raises(ValueError, match="same number of samples"):
        pass_at_k_curve(recs[:-1])


# ------------------------------------------------------------------------------------------------ bootstrap
def test_bootstrap_ci_covers_the_true_accuracy_about_95_percent_of_the_time() -> None:
    """Over 400 seeded synthetic evaluations (n = 200, p = 0.7) the 95% interval holds p in 92-98% of them."""
    p, n, reps = 0.7, 200, 400
    rng = np.random.default_rng(123)
    hits = 0
    for rep in range(reps):
        sample = (rng.random(n) < p).astype(int)
        est = accuracy_with_ci(sample, n_boot=1000, seed=rep)
        assert est.low <= est.value <= est.high
        hits += est.low <= p <= est.high
    assert 0.92 <= hits / reps <= 0.98, hits / reps


def test_bootstrap_ci_is_seeded_and_width_matches_the_normal_approximation() -> None:
    correct = [1] * 223 + [0] * 33  # tutorial C's base model: 223/256
    a, b = accuracy_with_ci(correct, seed=5), accuracy_with_ci(correct, seed=5)
    assert a == b
    half = 1.96 * math.sqrt(a.value * (1 - a.value) / a.n)
    assert (a.high - a.low) / 2 == pytest.approx(half, rel=0.1)
    assert a.value == pytest.approx(223 / 256) and a.n == 256
    with pytest.raises(ValueError, match="confidence"):
        accuracy_with_ci(correct, confidence=95)
    with pytest.raises(ValueError, match="non-empty"):
        accuracy_with_ci([])


def test_paired_bootstrap_is_narrower_than_unpaired_when_models_agree() -> None:
    rng = np.random.default_rng(0)
    a = (rng.random(300) < 0.6).astype(int)
    b = a.copy()
    b[np.flatnonzero(a == 0)[:15]] = 1  # B fixes 15 of A's misses and breaks nothing
    out = paired_bootstrap(a, b, seed=1)
    d = out["difference"]
    assert d.value == pytest.approx(15 / 300)
    assert d.low > 0 and out["p_value"] < 0.01
    unpaired_half = 1.96 * math.sqrt(2 * 0.6 * 0.4 / 300)
    assert (d.high - d.low) / 2 < unpaired_half / 2
    with pytest.raises(ValueError, match="same problems"):
        paired_bootstrap(a, b[:-1])


# ------------------------------------------------------------------------------------------------ McNemar
def test_mcnemar_on_hand_computed_tables() -> None:
    # 1 vs 9 discordant: P[X <= 1] = (1 + 10) / 1024, two-sided 22/1024.
    a = [1] * 5 + [1] * 1 + [0] * 9 + [0] * 3
    b = [1] * 5 + [0] * 1 + [1] * 9 + [0] * 3
    m = mcnemar_exact(a, b)
    assert (m["both"], m["a_only"], m["b_only"], m["neither"]) == (5, 1, 9, 3)
    assert m["p_value"] == pytest.approx(22 / 1024)
    # Balanced discordance gives p = 1; none gives p = 1 too.
    assert mcnemar_exact([1, 0, 1, 0], [0, 1, 0, 1])["p_value"] == 1.0
    assert mcnemar_exact([1, 1, 0], [1, 1, 0])["p_value"] == 1.0
    # 0 vs 6: two-sided 2 / 64; symmetric in the order of the models.
    assert mcnemar_exact([0] * 6, [1] * 6)["p_value"] == pytest.approx(2 / 64)
    assert mcnemar_exact([1] * 6, [0] * 6)["p_value"] == pytest.approx(2 / 64)
    with pytest.raises(ValueError, match="0/1"):
        mcnemar_exact([0, 2], [1, 1])
    with pytest.raises(ValueError, match="same problems"):
        mcnemar_exact([0, 1], [1])


# ------------------------------------------------------------------------------------------------ failures
def _rec(response: str, gold: str = "42", correct: bool = False, tokens: int = 10, stop: str = "stop") -> dict:
    return {"problem_id": 0, "sample": 0, "question": "q", "gold": gold, "response": response, "extracted": None,
            "correct": correct, "stop_reason": stop, "tokens": tokens, "max_tokens": 64}


def test_failure_categories() -> None:
    assert failure_category(_rec("so \\boxed{42}", correct=True)) == "correct"
    assert failure_category(_rec("so \\boxed{41}")) == "wrong_number"
    assert failure_category(_rec("6 * 7 = 42\n#### 42")) == "format"
    assert failure_category(_rec("The answer is 42.")) == "format"
    assert failure_category(_rec("I do not know.")) == "no_answer"
    assert failure_category(_rec("6 * 7 = ", tokens=64, stop="length")) == "truncated"
    counts = failure_counts([_rec("\\boxed{42}", correct=True), _rec("#### 42"), _rec("#### 41")])
    assert list(counts) == list(FAILURE_CATEGORIES) and counts["format"] == 2 and counts["correct"] == 1
    assert "lenient reader finds '42' (right)" in grading_note(_rec("#### 42"))
    assert "holds '41', gold '42': no match" in grading_note(_rec("\\boxed{41}"))


# ------------------------------------------------------------------------------------------------ evaluate()
@pytest.fixture(scope="module")
def tiny():
    service = connect("offline", latency=0.0)
    sampler = service.create_sampling_client(TINY)
    return sampler, sampler.get_tokenizer()


def test_evaluate_keeps_dataset_order_and_loses_nothing_under_faults(tmp_path) -> None:
    clean = connect("offline", latency=0.0, home=tmp_path)
    faulty = connect("offline", latency=0.002, fault_rate=0.3, seed=7, home=tmp_path)
    results = []
    for service in (clean, faulty):
        sampler = service.create_sampling_client(TINY)
        results.append(evaluate(sampler, RECORDS, sampler.get_tokenizer(), max_tokens=12, samples_per_problem=2,
                                temperature=1.0, max_concurrency=4, seed=3))
    base, noisy = results
    assert [(r["problem_id"], r["sample"]) for r in noisy] == [(i, k) for i in range(len(RECORDS)) for k in range(2)]
    assert [r["question"] for r in noisy[::2]] == [r["question"] for r in RECORDS]
    # Same seeds: the faulty run, after its retries, returns exactly the clean run's answers.
    assert [r["response"] for r in noisy] == [r["response"] for r in base]
    assert all(set(r) == set(RECORD_KEYS) for r in noisy)
    assert all(r["gold"] == str(2 * r["problem_id"] + 1) for r in noisy)


def test_evaluate_validates_arguments(tiny) -> None:
    sampler, tok = tiny
    with pytest.raises(ValueError, match="max_tokens"):
        evaluate(sampler, RECORDS[:1], tok, max_tokens=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        evaluate(sampler, RECORDS[:1], tok, max_concurrency=0)
    with pytest.raises(ValueError, match="temperature"):
        evaluate(sampler, RECORDS[:1], tok, temperature=-1)
    with pytest.raises(ValueError, match=r"records\[0\]"):
        evaluate(sampler, [{"question": "q"}], tok)


def test_greedy_is_reproducible_and_correctness_is_in_problem_order(tiny) -> None:
    sampler, tok = tiny
    a = evaluate(sampler, RECORDS[:5], tok, max_tokens=8, seed=0)
    b = evaluate(sampler, RECORDS[:5], tok, max_tokens=8, seed=99)
    assert [r["response"] for r in a] == [r["response"] for r in b]  # greedy ignores the seed
    assert correctness(a).tolist() == [int(r["correct"]) for r in a]
    with pytest.raises(ValueError, match="several samples"):
        correctness(a + a)


def test_jsonl_round_trip(tiny, tmp_path) -> None:
    sampler, tok = tiny
    recs = evaluate(sampler, RECORDS[:4], tok, max_tokens=8)
    path = save_records(recs, tmp_path / "runs" / "base.jsonl")
    assert load_records(path) == recs
    check_same_problems(recs, load_records(path))
    with pytest.raises(ValueError, match="same problems"):
        check_same_problems(recs, recs[:3])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem_id": 0}) + "\n")
    with pytest.raises(ValueError, match="line 1 lacks"):
        load_records(bad)


def test_wilson_interval_known_values_and_edges() -> None:
    from trio_helpers.evaluation import wilson_interval

    est = wilson_interval(8, 10)
    assert (round(est.low, 4), round(est.high, 4)) == (0.4902, 0.9433) and est.value == 0.8 and est.n == 10
    zero = wilson_interval(0, 50)
    z2 = 1.959963984540054 ** 2
    assert zero.low == 0.0 and zero.high == pytest.approx(z2 / (50 + z2)) and zero.high > 0.07  # never zero width
    full = wilson_interval(50, 50)
    assert full.high == 1.0 and full.low == pytest.approx(1 - zero.high)
    for k in range(0, 31):  # mirror symmetry
        a, b = wilson_interval(k, 30), wilson_interval(30 - k, 30)
        assert a.low == pytest.approx(1 - b.high) and a.high == pytest.approx(1 - b.low)
    assert wilson_interval(5, 10, confidence=0.5).high < wilson_interval(5, 10).high
    for bad in ((11, 10), (-1, 10), (0, 0), (1.0, 10), (True, 10)):
        with pytest.raises(ValueError):
            wilson_interval(*bad)
    with pytest.raises(ValueError, match="confidence"):
        wilson_interval(1, 10, confidence=95)


def test_wilson_interval_covers_about_95_percent() -> None:
    from trio_helpers.evaluation import wilson_interval

    rng = np.random.default_rng(0)
    for p in (0.02, 0.5, 0.9):
        ks = rng.binomial(30, p, size=4000)
        covered = np.mean([wilson_interval(int(k), 30).low <= p <= wilson_interval(int(k), 30).high for k in ks])
        assert 0.92 <= covered <= 0.99, (p, covered)


def test_format_summary_fits_the_page() -> None:
    from trio_helpers.evaluation import format_summary

    row = {"model": "trained", "n": 256, "correct": 256, "accuracy": 1.0, "low": 1.0, "high": 1.0,
           "wrong_number": 0, "format": 0, "truncated": 0, "no_answer": 0}
    text = format_summary([row, dict(row, model="base", correct=7, accuracy=7 / 256)])
    assert max(len(line) for line in text.splitlines()) <= 92
    assert "256/256" in text and "[100.0%, 100.0%]" in text


def test_summary_rows_auto_interval_is_never_zero_width_at_0_or_100_percent() -> None:
    from trio_helpers.evaluation import summary_rows

    rows = [{"problem_id": i, "sample": 0, "question": "q", "gold": "2", "response": "\\boxed{1}",
             "extracted": "1", "correct": False, "stop_reason": "stop", "tokens": 5, "max_tokens": 64}
            for i in range(100)]
    boot = summary_rows({"m": rows}, n_boot=200)[0]
    auto = summary_rows({"m": rows}, n_boot=200, interval="auto")[0]
    assert boot["high"] == 0.0  # the bootstrap interval collapses at 0 of 100
    assert auto["low"] == 0.0 and 0.03 < auto["high"] < 0.04  # Wilson: [0, z^2 / (n + z^2)]


def test_mean_se_and_paired_mean_se_by_hand():
    from trio_helpers.evaluation import mean_se, paired_mean_se

    m, se = mean_se([1.0, 2.0, 3.0, 6.0])  # mean 3, sample variance (4+1+0+9)/3 = 14/3
    assert m == 3.0 and se == pytest.approx(np.sqrt(14 / 3) / 2)
    m, se = mean_se(np.array([[0.0, 1.0], [2.0, 1.0], [4.0, 1.0]]))  # per column (step)
    assert list(m) == [2.0, 1.0] and se[0] == pytest.approx(2 / np.sqrt(3)) and se[1] == 0.0
    d, dse = paired_mean_se([0.5, 0.7, 0.9], [0.4, 0.5, 0.9])  # differences 0.1, 0.2, 0.0
    assert d == pytest.approx(0.1) and dse == pytest.approx(0.1 / np.sqrt(3))
    with pytest.raises(ValueError, match="at least 2 values"):
        mean_se([1.0])
    with pytest.raises(ValueError, match="same seeds"):
        paired_mean_se([1.0, 2.0], [1.0, 2.0, 3.0])

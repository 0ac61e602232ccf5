"""Evaluating a model on GSM8K: sampling answers concurrently, grading them, and honest uncertainty.

- :func:`evaluate` (and :func:`evaluate_async`): sample every problem's answer(s) with a concurrency limit, retrying
  transient errors, and return one plain-dict record per sample, in dataset order;
- :func:`save_records` / :func:`load_records`: keep those records as JSONL, so two runs can be compared later
  without sampling again;
- :func:`accuracy_with_ci`, :func:`wilson_interval`, :func:`paired_bootstrap`, :func:`mcnemar_exact`: a bootstrap
  confidence interval for an accuracy, the Wilson score interval for ``k`` of ``n`` (better for small ``n`` and for
  accuracies near 0% or 100%, where the bootstrap interval collapses to a point), and two paired comparisons of two
  models on the same problems;
- :func:`pass_at_k` and :func:`pass_at_k_curve`: the unbiased pass@k estimator from ``n`` samples per problem;
- :func:`failure_category` and :func:`grading_note`: why a response earned no reward;
- :func:`mean_se` and :func:`paired_mean_se`: the mean over seeds with its standard error, and the same for per-seed
  differences between two arms (chapter 8's seeded comparisons, used again in chapters 10-12).

Introduced in: chapter 07 (notebooks/07_evaluation).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trio_helpers.grading import extract_answer_flexible, extract_boxed, extract_gsm8k_answer, grade_answer

FAILURE_CATEGORIES = ("correct", "wrong_number", "format", "truncated", "no_answer")
"""What :func:`failure_category` returns, in the order the book's tables show them."""

RECORD_KEYS = ("problem_id", "sample", "question", "gold", "response", "extracted", "correct", "stop_reason",
               "tokens", "max_tokens")
"""The keys of every record :func:`evaluate` returns (and :func:`load_records` checks)."""


# ------------------------------------------------------------------------------------------------ sampling
def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _record(problem_id: int, sample: int, rec: dict, gold: str, seq, max_tokens: int) -> dict:
    text = seq.text or ""
    return {
        "problem_id": problem_id,
        "sample": sample,
        "question": rec["question"],
        "gold": gold,
        "response": text,
        "extracted": extract_boxed(text),
        "correct": bool(grade_answer(text, gold) == 1.0),
        "stop_reason": str(seq.stop_reason),
        "tokens": len(seq.tokens),
        "max_tokens": max_tokens,
    }


async def evaluate_async(
    sampling_client,
    records: Sequence[dict],
    tokenizer,
    max_tokens: int = 512,
    samples_per_problem: int = 1,
    temperature: float = 0.0,
    max_concurrency: int = 16,
    seed: int = 0,
    progress: bool | str | None = False,
    retries=None,
) -> list[dict]:
    """The coroutine behind :func:`evaluate` (same arguments and result); ``await`` it inside an event loop.

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    import pytrio as trio

    from trio_helpers.prompts import build_prompt, gsm8k_messages, stop_token_ids
    from trio_helpers.rollouts import RetryPolicy, with_retries

    _check_int("max_tokens", max_tokens, 1)
    _check_int("samples_per_problem", samples_per_problem, 1)
    _check_int("max_concurrency", max_concurrency, 1)
    _check_int("seed", seed, 0)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    records = list(records)
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or "question" not in rec or "answer" not in rec:
            raise ValueError(f"records[{i}] must be a GSM8K record with 'question' and 'answer' "
                             "(trio_helpers.data.load_gsm8k); got " + repr(rec)[:80])
    golds = [extract_gsm8k_answer(rec["answer"]) for rec in records]
    stop = stop_token_ids(tokenizer)
    policy = RetryPolicy() if retries is None else retries
    limit = asyncio.Semaphore(max_concurrency)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(records), desc=progress if isinstance(progress, str) else "evaluating", unit="problem")

    async def one(i: int) -> list[dict]:
        prompt = build_prompt(tokenizer, gsm8k_messages(records[i]["question"]))
        params = trio.SamplingParams(max_tokens=max_tokens, temperature=float(temperature), seed=seed + i, stop=stop)
        async with limit:
            response = await with_retries(
                lambda: sampling_client.sample_async(prompt, num_samples=samples_per_problem, sampling_params=params),
                policy, what=f"sample (problem {i})")
        sequences = list(response.sequences)
        if len(sequences) != samples_per_problem:
            raise RuntimeError(f"problem {i}: asked for {samples_per_problem} samples, got {len(sequences)}")
        if bar is not None:
            bar.update(1)
        return [_record(i, k, records[i], golds[i], s, max_tokens) for k, s in enumerate(sequences)]

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(records))]
    try:
        per_problem = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return [r for rows in per_problem for r in rows]


def evaluate(
    sampling_client,
    records: Sequence[dict],
    tokenizer,
    max_tokens: int = 512,
    samples_per_problem: int = 1,
    temperature: float = 0.0,
    max_concurrency: int = 16,
    seed: int = 0,
    progress: bool | str | None = False,
    retries=None,
) -> list[dict]:
    """Sample and grade answers to GSM8K problems, concurrently; one record per sample, in dataset order.

    Every problem is one ``sample_async`` request (``num_samples=samples_per_problem``) with chapter 01's prompt,
    the stop tokens of ``tokenizer`` and the seed ``seed + problem index``; at most ``max_concurrency`` requests
    are in flight. Transient pytrio errors (``retryable=True``) are retried
    (:func:`trio_helpers.rollouts.with_retries`). Each sample is graded with chapter 02's
    :func:`~trio_helpers.grading.grade_answer` (the last ``\\boxed{}`` must equal the gold answer).

    Args:
        sampling_client: the model to evaluate (``service.create_sampling_client(base_model, model_path=...)``).
        records: GSM8K ``{"question", "answer"}`` records (``trio_helpers.data.load_gsm8k``).
        tokenizer: the model's tokenizer (``sampling_client.get_tokenizer()``).
        max_tokens: sampling budget per answer; longer answers are cut off (and count as wrong).
        samples_per_problem: answers per problem (1 for accuracy; ``n`` for pass@k).
        temperature: 0 is greedy decoding; 1 samples from the model's distribution.
        max_concurrency: most requests in flight at once (>= 1).
        seed: base of the per-problem seeds, so a rerun samples the same answers.
        progress: ``True`` (or a description) shows a ``tqdm.auto`` bar over problems; ``False`` hides it.
        retries: a :class:`trio_helpers.rollouts.RetryPolicy` (default: 4 attempts).

    Returns:
        ``len(records) * samples_per_problem`` dicts with the keys of :data:`RECORD_KEYS`: ``problem_id`` (the
        record's position in ``records``), ``sample`` (0-based), ``question``, ``gold``, ``response``,
        ``extracted`` (the last box's content or None), ``correct`` (bool), ``stop_reason``, ``tokens``
        (completion tokens) and ``max_tokens``; sorted by ``(problem_id, sample)`` whatever order responses came in.

    Raises:
        ValueError: an argument out of range or a record without ``question``/``answer``.
        trio_helpers.rollouts.RetriesExhausted: a request failed on all its attempts.
        Exception: the first non-retryable error (e.g. ``pytrio.errors.base.ValidationError``).

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    from trio_helpers.rollouts import run_sync

    return run_sync(evaluate_async(sampling_client, records, tokenizer, max_tokens=max_tokens,
                                   samples_per_problem=samples_per_problem, temperature=temperature,
                                   max_concurrency=max_concurrency, seed=seed, progress=progress, retries=retries))


def correctness(records: Sequence[dict]) -> np.ndarray:
    """The ``correct`` flags of greedy records (one sample per problem) as a 0/1 array in problem order.

    Raises:
        ValueError: a problem with more than one sample (use :func:`pass_at_k_curve` for those).

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    ids = [r["problem_id"] for r in records]
    if len(set(ids)) != len(ids):
        raise ValueError("records hold several samples per problem; pass one sample per problem "
                         "(samples_per_problem=1) or use pass_at_k_curve")
    return np.array([1 if r["correct"] else 0 for r in sorted(records, key=lambda r: r["problem_id"])])


# ------------------------------------------------------------------------------------------------ storage
def save_records(records: Sequence[dict], path: str | os.PathLike) -> Path:
    """Write evaluation records to ``path`` as JSONL (one record per line, UTF-8), atomically
    (:func:`trio_helpers.tracking.write_atomic`: a failure leaves the previous file and no temporary one).

    Raises:
        OSError: the file could not be written (a full disk, a read-only folder, a directory at ``path``).

    Returns:
        The path written.

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    from trio_helpers.tracking import write_atomic

    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def load_records(path: str | os.PathLike) -> list[dict]:
    """Read records written by :func:`save_records`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not JSON or lacks one of :data:`RECORD_KEYS` (the message names the line).

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    out = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {number} is not JSON ({err.msg}); was it written by save_records?") from None
            missing = [k for k in RECORD_KEYS if k not in rec]
            if missing:
                raise ValueError(f"{path}: line {number} lacks {missing}; evaluation records come from evaluate()")
            out.append(rec)
    return out


# ------------------------------------------------------------------------------------------------ uncertainty
@dataclass(frozen=True)
class Estimate:
    """A mean with a confidence interval: ``value`` in ``[low, high]`` from ``n`` items.

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """

    value: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        return f"{self.value:.1%} [{self.low:.1%}, {self.high:.1%}]"


def _as_values(values, name: str) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of per-problem scores, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must be finite")
    return x


def mean_se(values, axis: int = 0):
    """``(mean, standard error)`` over seeds along ``axis``: the sample standard deviation (``ddof=1``) over
    ``sqrt(n)``. With a 2-D ``[seeds, steps]`` array and ``axis=0``, one mean and one error per step.

    Raises:
        ValueError: fewer than 2 values along ``axis`` (no spread to estimate).

    Introduced in: chapter 08 (notebooks/08_losses), which defines it in the page; used in chapters 10-12.
    """
    v = np.asarray(values, dtype=float)
    n = v.shape[axis] if v.ndim else 0
    if n < 2:
        raise ValueError(f"mean_se needs at least 2 values along axis {axis}, got {n}: run more seeds")
    return v.mean(axis), v.std(axis=axis, ddof=1) / np.sqrt(n)


def paired_mean_se(a, b, axis: int = 0):
    """:func:`mean_se` of the per-seed differences ``a - b`` (the same seeds, in the same order, in both): a paired
    comparison of two arms, whose standard error is usually far smaller than the arms' own.

    Raises:
        ValueError: ``a`` and ``b`` differ in shape, or fewer than 2 seeds.

    Introduced in: chapter 08 (notebooks/08_losses); used in chapters 10 and 11.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired_mean_se needs the same seeds in both arms; got shapes {a.shape} and {b.shape}")
    return mean_se(a - b, axis)


def _check_boot(confidence: float, n_boot: int) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), e.g. 0.95; got {confidence!r}")
    _check_int("n_boot", n_boot, 100)


def accuracy_with_ci(correct, confidence: float = 0.95, n_boot: int = 10_000, seed: int = 0) -> Estimate:
    """Mean of per-problem scores with a percentile-bootstrap confidence interval (Efron, 1979).

    The bootstrap resamples the ``n`` problems with replacement ``n_boot`` times, recomputes the mean each time and
    takes the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of those means. It answers: how much
    would this accuracy move if we had drawn another ``n`` problems from the same distribution?

    Args:
        correct: per-problem scores, usually 0/1 flags (:func:`correctness`); any numbers work (e.g. pass@k).
        confidence: the interval's coverage.
        n_boot: bootstrap resamples (>= 100).
        seed: seeds the resampling, so the interval is reproducible.

    Returns:
        :class:`Estimate` (``value``, ``low``, ``high``, ``n``).

    Raises:
        ValueError: empty or non-finite scores, ``confidence`` outside (0, 1), ``n_boot < 100``.

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    x = _as_values(correct, "correct")
    _check_boot(confidence, n_boot)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return Estimate(float(x.mean()), float(low), float(high), int(x.size))


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> Estimate:
    """The Wilson score interval (Wilson, 1927) for a success rate of ``k`` successes in ``n`` trials.

    It inverts the normal test of a proportion: the interval holds every rate ``p`` for which ``k / n`` is within
    ``z`` standard errors ``sqrt(p (1 - p) / n)`` of ``p``, which gives

    ``(p_hat + z^2 / (2n) +- z * sqrt(p_hat (1 - p_hat) / n + z^2 / (4 n^2))) / (1 + z^2 / n)``.

    Unlike the bootstrap and the plain normal interval, it never has zero width: at ``k = 0`` it is
    ``[0, z^2 / (n + z^2)]`` (about ``[0%, 7.1%]`` for ``n = 50``), so "0 of 50" is not read as "exactly 0%". Use it
    when ``n`` is small or the rate is near 0 or 1.

    Args:
        k: successes (0..n), e.g. correct answers.
        n: trials (>= 1), e.g. problems.
        confidence: the interval's coverage, in (0, 1).

    Returns:
        :class:`Estimate` with ``value = k / n``.

    Raises:
        ValueError: ``n < 1``, ``k`` outside [0, n], non-integers, or ``confidence`` outside (0, 1).

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    from statistics import NormalDist

    for name, v in (("k", k), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"need n >= 1 and 0 <= k <= n; got k={k}, n={n}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), e.g. 0.95; got {confidence!r}")
    z = NormalDist().inv_cdf((1 + confidence) / 2)
    p = k / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return Estimate(float(p), float(max(0.0, centre - half)), float(min(1.0, centre + half)), int(n))


def paired_bootstrap(a, b, confidence: float = 0.95, n_boot: int = 10_000, seed: int = 0) -> dict:
    """Bootstrap interval for the difference ``mean(b) - mean(a)`` of two models scored on the same problems.

    Problems are resampled *together* (the same indices for both models), so what the two models share (easy and
    hard problems) cancels, and the interval is usually much narrower than the two separate ones suggest.

    Args:
        a, b: per-problem scores of model A and model B, same length and problem order.
        confidence, n_boot, seed: as in :func:`accuracy_with_ci`.

    Returns:
        ``{"difference": Estimate, "p_value": float}``, where ``p_value`` is the two-sided share of resampled
        differences on the far side of 0 (a rough bootstrap p-value; at most ``1 / n_boot`` resolution).

    Raises:
        ValueError: different lengths, empty or non-finite scores, bad ``confidence`` or ``n_boot``.

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    x, y = _as_values(a, "a"), _as_values(b, "b")
    if x.size != y.size:
        raise ValueError(f"a and b must score the same problems, got {x.size} and {y.size} scores")
    _check_boot(confidence, n_boot)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    diffs = y[idx].mean(axis=1) - x[idx].mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(diffs, [alpha, 1 - alpha])
    p = min(1.0, 2 * min(np.mean(diffs <= 0), np.mean(diffs >= 0)))
    return {"difference": Estimate(float(y.mean() - x.mean()), float(low), float(high), int(x.size)),
            "p_value": float(p)}


def mcnemar_exact(a, b) -> dict:
    """McNemar's exact test (McNemar, 1947) of two models' 0/1 outcomes on the same problems.

    Only *discordant* problems carry information about which model is better: ``a_only`` (A right, B wrong) and
    ``b_only`` (B right, A wrong). If the models were equally good, each discordant problem would fall either way
    with probability 1/2, so ``b_only ~ Binomial(a_only + b_only, 1/2)``. The two-sided exact p-value is
    ``min(1, 2 * P[X <= min(a_only, b_only)])`` for ``X ~ Binomial(a_only + b_only, 1/2)`` (1 when there are no
    discordant problems).

    Args:
        a, b: 0/1 (or bool) outcomes of model A and model B, same length and problem order.

    Returns:
        ``{"both", "a_only", "b_only", "neither", "p_value"}`` (counts are ints).

    Raises:
        ValueError: different lengths, or values other than 0/1.

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    x, y = np.asarray(a), np.asarray(b)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"a and b must be 1-D outcomes of the same problems, got shapes {x.shape} and {y.shape}")
    for name, v in (("a", x), ("b", y)):
        if not np.all((v == 0) | (v == 1)):
            raise ValueError(f"{name} must hold only 0/1 (or bool) outcomes")
    x, y = x.astype(bool), y.astype(bool)
    a_only, b_only = int(np.sum(x & ~y)), int(np.sum(~x & y))
    m = a_only + b_only
    if m == 0:
        p = 1.0
    else:
        tail = sum(math.comb(m, i) for i in range(min(a_only, b_only) + 1)) / 2**m
        p = min(1.0, 2 * tail)
    return {"both": int(np.sum(x & y)), "a_only": a_only, "b_only": b_only, "neither": int(np.sum(~x & ~y)),
            "p_value": float(p)}


# ------------------------------------------------------------------------------------------------ pass@k
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct (Chen et al., 2021).

    pass@k is the chance that at least one of ``k`` samples is correct. Drawing ``k`` of the ``n`` samples without
    replacement, all ``k`` are wrong with probability ``C(n - c, k) / C(n, k)``, so the estimate is
    ``1 - C(n - c, k) / C(n, k)``, computed as the stable product ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``
    (no huge binomial coefficients). It is 1 when ``n - c < k``.

    Args:
        n: samples drawn for the problem (>= 1).
        c: how many were correct (0..n).
        k: the budget of attempts (1..n).

    Returns:
        A probability in [0, 1].

    Raises:
        ValueError: ``n < 1``, ``c`` outside [0, n] or ``k`` outside [1, n].

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_k_curve(records: Sequence[dict], ks: Sequence[int] | None = None) -> dict[int, float]:
    """Mean pass@k over problems for each ``k``, from records with the same number of samples per problem.

    Args:
        records: :func:`evaluate` records with ``samples_per_problem = n``.
        ks: the budgets to report (default ``1..n``).

    Returns:
        ``{k: mean pass@k}``.

    Raises:
        ValueError: no records, or problems with different numbers of samples.

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    if not records:
        raise ValueError("records is empty: evaluate some problems first")
    per = defaultdict(list)
    for r in records:
        per[r["problem_id"]].append(bool(r["correct"]))
    sizes = {len(v) for v in per.values()}
    if len(sizes) != 1:
        raise ValueError(f"every problem needs the same number of samples, got sizes {sorted(sizes)}")
    n = sizes.pop()
    ks = list(range(1, n + 1)) if ks is None else list(ks)
    return {k: float(np.mean([pass_at_k(n, sum(v), k) for v in per.values()])) for k in ks}


# ------------------------------------------------------------------------------------------------ failures
def is_truncated(record: dict) -> bool:
    """True when the answer was cut off by ``max_tokens`` (stop reason ``"length"``, or every token used).

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    return record.get("stop_reason") == "length" or record["tokens"] >= record["max_tokens"]


def failure_category(record: dict) -> str:
    """Why a graded answer earned (or did not earn) its reward: one of :data:`FAILURE_CATEGORIES`.

    Rules, first match wins: ``"correct"``; ``"truncated"`` (cut off at ``max_tokens``: the model never got to
    finish); ``"wrong_number"`` (a final ``\\boxed{}`` holding the wrong answer); ``"format"`` (no box, but an
    answer in another form: ``#### N``, "The answer is N", or a last number; see
    :func:`~trio_helpers.grading.extract_answer_flexible`); ``"no_answer"`` (no box and no number at all).

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    if record["correct"]:
        return "correct"
    if is_truncated(record):
        return "truncated"
    if extract_boxed(record["response"]) is not None:
        return "wrong_number"
    if extract_answer_flexible(record["response"]) is not None:
        return "format"
    return "no_answer"


def failure_counts(records: Sequence[dict]) -> dict[str, int]:
    """How many records fall in each of :data:`FAILURE_CATEGORIES` (all keys present, in that order).

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    counts = Counter(failure_category(r) for r in records)
    return {c: counts.get(c, 0) for c in FAILURE_CATEGORIES}


def grading_note(record: dict) -> str:
    """One line saying what the grader saw: the last box (or its absence), the gold answer and the verdict.

    For format failures it also says what a lenient reader would have found and whether that was right; for
    truncations, where the answer was cut off. Under 92 characters for answers of a few digits.

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    from trio_helpers.grading import answers_match

    box = extract_boxed(record["response"])
    gold = record["gold"]
    category = failure_category(record)
    if box is not None:
        verdict = "match" if record["correct"] else "no match"
        note = f"last \\boxed{{}} holds {box.strip()!r}, gold {gold!r}: {verdict}"
    else:
        note = f"no \\boxed{{}} (gold {gold!r}): reward 0"
    if category == "truncated":
        note += f"; cut off at max_tokens={record['max_tokens']}"
    elif category == "format":
        lenient = extract_answer_flexible(record["response"])
        right = "right" if answers_match(lenient, gold) else "wrong"
        note += f"; a lenient reader finds {lenient!r} ({right})"
    return f"[{category}] {note}"


# ------------------------------------------------------------------------------------------------ reporting
def summary_rows(runs: dict[str, Sequence[dict]], confidence: float = 0.95, n_boot: int = 10_000,
                 seed: int = 0, interval: str = "bootstrap") -> list[dict]:
    """One summary row per named greedy run: problems, correct, accuracy with its CI, failure counts.

    Args:
        interval: ``"bootstrap"`` (:func:`accuracy_with_ci`), ``"wilson"`` (:func:`wilson_interval`) or
            ``"auto"``: Wilson when a run has at most 50 problems or is all right or all wrong (where the
            bootstrap interval has zero width), else the bootstrap.

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    if interval not in ("bootstrap", "wilson", "auto"):
        raise ValueError(f"interval must be 'bootstrap', 'wilson' or 'auto', got {interval!r}")
    rows = []
    for name, recs in runs.items():
        c = correctness(recs)
        k, n = int(c.sum()), len(c)
        use_wilson = interval == "wilson" or (interval == "auto" and (n <= 50 or k in (0, n)))
        est = wilson_interval(k, n, confidence) if use_wilson else accuracy_with_ci(c, confidence, n_boot, seed)
        rows.append({"model": name, "n": est.n, "correct": int(c.sum()), "accuracy": est.value, "low": est.low,
                     "high": est.high, **failure_counts(recs)})
    return rows


def format_summary(rows: Sequence[dict], confidence: float = 0.95) -> str:
    """The rows of :func:`summary_rows` as an aligned text table, at most 92 characters wide for short model names.

    Columns: the model, ``correct`` as ``k/n``, the accuracy, its bootstrap interval, then the count of each failure
    category (:data:`FAILURE_CATEGORIES` after ``correct``).

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    width = max(5, *(len(r["model"]) for r in rows))
    ci = f"{confidence:.0%} CI"
    fails = FAILURE_CATEGORIES[1:]
    head = f"{'model':<{width}}  {'correct':>7}  {'accuracy':>8}  {ci:>16}  " + "  ".join(fails)
    lines = [head]
    for r in rows:
        interval = f"[{r['low']:.1%}, {r['high']:.1%}]"
        counts = "  ".join(f"{r[c]:>{len(c)}}" for c in fails)
        lines.append(f"{r['model']:<{width}}  {str(r['correct']) + '/' + str(r['n']):>7}  {r['accuracy']:>8.1%}  "
                     f"{interval:>16}  {counts}")
    return "\n".join(lines)


def format_paired(a_name: str, a: Sequence[dict], b_name: str, b: Sequence[dict], n_boot: int = 10_000,
                  seed: int = 0) -> str:
    """A paired comparison of two greedy runs on the same problems: the 2x2 table, McNemar and the paired bootstrap.

    Raises:
        ValueError: the runs do not cover the same problems (same ids and questions).

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    check_same_problems(a, b)
    x, y = correctness(a), correctness(b)
    m = mcnemar_exact(x, y)
    pb = paired_bootstrap(x, y, n_boot=n_boot, seed=seed)
    d = pb["difference"]
    return "\n".join([
        f"paired on {len(x)} problems: both right {m['both']}, only {a_name} {m['a_only']}, "
        f"only {b_name} {m['b_only']}, neither {m['neither']}",
        f"McNemar exact: p = {m['p_value']:.3g} (discordant {m['a_only']} vs {m['b_only']})",
        f"paired bootstrap: {b_name} - {a_name} = {d.value:+.1%} [{d.low:+.1%}, {d.high:+.1%}]",
    ])


def check_same_problems(a: Sequence[dict], b: Sequence[dict]) -> None:
    """Raise ValueError unless two runs hold the same problems (ids and questions) in the same order.

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    ka = [(r["problem_id"], r["question"]) for r in sorted(a, key=lambda r: (r["problem_id"], r["sample"]))]
    kb = [(r["problem_id"], r["question"]) for r in sorted(b, key=lambda r: (r["problem_id"], r["sample"]))]
    if ka != kb:
        raise ValueError(f"the two runs do not cover the same problems ({len(ka)} vs {len(kb)} records, or different "
                         "questions); evaluate both with the same split and --eval-samples")

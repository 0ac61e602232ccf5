"""On-policy distillation (OPD): a teacher grades every token the student writes.

The student samples completions of a prompt; the teacher scores those same tokens with ``compute_logprobs``; the
per-token difference ``student_logprob - teacher_logprob`` is a one-sample estimate of the student's reverse KL to
the teacher at that position; its negative (times ``kl_penalty_coef``) becomes the token's advantage in an
``importance_sampling`` datum (chapter 03's builder), and one ``forward_backward`` + ``optim_step`` per batch lowers
the student's reverse KL on the states it actually visits.

- scoring: :func:`teacher_completion_logprobs`, :func:`reverse_kl_advantages`, :func:`score_completion`,
  :func:`opd_datum`;
- the loop: :class:`OPDConfig`, :func:`opd_step` (sync or async rollouts), :func:`run_opd`;
- measuring: :func:`sampled_reverse_kl` (works on any backend) and :func:`exact_reverse_kl_offline` (offline only),
  :func:`token_kl_html` (a per-token view).

Every function takes and returns PyTRIO's own types, so the same code runs offline and on the service.

Introduced in: chapter 06 (notebooks/06_opd).
"""

from __future__ import annotations

import asyncio
import html
import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from trio_helpers.datums import importance_sampling_datum

ROLLOUT_MODES = ("sync", "async")


# --------------------------------------------------------------------------------------------------- scoring
def _check_length(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int (a number of tokens), got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def teacher_completion_logprobs(teacher_logprobs: Sequence, prompt_len: int, completion_len: int) -> list[float]:
    """The completion's part of ``SamplingClient.compute_logprobs(prompt + completion)``.

    ``compute_logprobs`` returns one entry per input token: entry ``j`` is the logprob of token ``j`` given tokens
    ``0..j-1``, so entry 0 is ``None`` (nothing precedes the first token). The completion's tokens are entries
    ``prompt_len .. prompt_len + completion_len - 1``.

    Args:
        teacher_logprobs: the list ``compute_logprobs`` returned for ``prompt + completion``.
        prompt_len: number of prompt tokens (>= 1).
        completion_len: number of completion tokens (>= 1).

    Returns:
        ``completion_len`` floats, aligned with the completion's tokens (and with ``SampleSequence.logprobs``).

    Raises:
        ValueError: the list does not have ``prompt_len + completion_len`` entries (it was computed for another
            sequence, or for the completion alone), or a completion entry is ``None`` or not finite.
        TypeError: the lengths are not ints, or an entry is not a number.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    p = _check_length("prompt_len", prompt_len, 1)
    c = _check_length("completion_len", completion_len, 1)
    if isinstance(teacher_logprobs, (str, bytes)) or not isinstance(teacher_logprobs, Sequence):
        raise TypeError(
            f"teacher_logprobs must be the list compute_logprobs returned, got {type(teacher_logprobs).__name__}"
        )
    n = len(teacher_logprobs)
    if n != p + c:
        hint = ""
        if n == c:
            hint = " It has exactly completion_len entries: score prompt + completion, not the completion alone."
        elif n == c + 1:
            hint = " It has completion_len + 1 entries: score prompt + completion, not the completion alone."
        raise ValueError(
            f"teacher_logprobs has {n} entries but prompt_len + completion_len = {p} + {c} = {p + c}; pass the "
            f"output of teacher.compute_logprobs(ModelInput.from_ints(prompt + completion)) for this very "
            f"sequence.{hint}"
        )
    out = []
    for j in range(p, p + c):
        v = teacher_logprobs[j]
        if v is None:
            raise ValueError(
                f"teacher_logprobs[{j}] (completion token {j - p}) is None; only entry 0 may be None. "
                "Check that prompt_len is the prompt's length in tokens"
            )
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"teacher_logprobs[{j}] = {v!r} is a {type(v).__name__}, not a number")
        if not math.isfinite(float(v)):
            raise ValueError(f"teacher_logprobs[{j}] = {v} is not finite; a logprob must be a finite number")
        out.append(float(v))
    return out


def _float_array(name: str, values) -> np.ndarray:
    if values is None:
        raise ValueError(f"{name} is None; pass one logprob per completion token")
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of numbers, got a {type(values).__name__}")
    if any(v is None for v in values):
        raise ValueError(
            f"{name} contains None; a compute_logprobs result must be sliced with teacher_completion_logprobs first"
        )
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be a sequence of numbers: {err}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one logprob per completion token), got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} has non-finite entries at positions {np.flatnonzero(~np.isfinite(arr)).tolist()}")
    return arr


def reverse_kl_advantages(student_logprobs, teacher_logprobs, coef: float = 1.0) -> np.ndarray:
    """Per-token OPD advantages: ``-coef * (student_logprob - teacher_logprob)``.

    ``student_logprob - teacher_logprob`` of a token the student sampled is a one-sample estimate of the reverse KL
    ``KL(student || teacher)`` at that position. A token the student likes more than the teacher gets a negative
    advantage (pushed down), one the teacher likes more a positive one (pushed up).

    Args:
        student_logprobs: the sampler's logprobs of the completion (``SampleSequence.logprobs``).
        teacher_logprobs: the teacher's logprobs of the same tokens (see :func:`teacher_completion_logprobs`).
        coef: ``kl_penalty_coef`` (> 0, finite).

    Returns:
        float64 array, one advantage per completion token.

    Raises:
        ValueError: lengths differ, empty input, ``None`` or non-finite values, or ``coef`` not > 0.
        TypeError: non-numeric values.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    if isinstance(coef, bool) or not isinstance(coef, numbers.Real) or not math.isfinite(coef) or coef <= 0:
        raise ValueError(f"coef (kl_penalty_coef) must be a finite number > 0, got {coef!r}")
    s = _float_array("student_logprobs", student_logprobs)
    t = _float_array("teacher_logprobs", teacher_logprobs)
    if len(s) != len(t):
        extra = ""
        if len(t) == len(s) + 1:
            extra = " The teacher list is one longer: did you keep compute_logprobs' leading None position?"
        elif len(t) > len(s):
            extra = " Slice the teacher's list with teacher_completion_logprobs(values, prompt_len, completion_len)."
        raise ValueError(
            f"student_logprobs has {len(s)} entries but teacher_logprobs has {len(t)}; both must hold one logprob "
            f"per completion token.{extra}"
        )
    if len(s) == 0:
        raise ValueError("student_logprobs is empty: an empty completion has no tokens to score")
    return -float(coef) * (s - t)


def _model_input(tokens):
    from pytrio import ModelInput

    return ModelInput.from_ints(list(tokens))


def _prompt_tokens(prompt) -> list[int]:
    return prompt.to_ints() if hasattr(prompt, "to_ints") else [int(t) for t in prompt]


def score_completion(teacher, prompt, sequence) -> list[float]:
    """The teacher's logprob of each token of one sampled completion (one ``compute_logprobs`` call).

    Args:
        teacher: a ``SamplingClient`` of the teacher model.
        prompt: the prompt the completion was sampled from (``ModelInput`` or token ids).
        sequence: the ``SampleSequence`` (or anything with ``.tokens``), at least one token.

    Returns:
        One float per completion token.

    Raises:
        ValueError: an empty completion, or a response of the wrong length (see :func:`teacher_completion_logprobs`).

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    p = _prompt_tokens(prompt)
    c = list(sequence.tokens)
    if not c:
        raise ValueError("the completion is empty: there is nothing for the teacher to score")
    full = teacher.compute_logprobs(_model_input(p + c)).result()
    return teacher_completion_logprobs(full, len(p), len(c))


def opd_datum(prompt, sequence, teacher_logprobs, coef: float = 1.0):
    """The ``importance_sampling`` datum of one completion, with per-token reverse-KL advantages.

    Args:
        prompt: the prompt (``ModelInput`` or token ids).
        sequence: the student's ``SampleSequence`` (its ``tokens`` and ``logprobs`` are used).
        teacher_logprobs: the teacher's logprobs of the completion's tokens (already sliced).
        coef: ``kl_penalty_coef``.

    Returns:
        ``pytrio.Datum`` from :func:`trio_helpers.datums.importance_sampling_datum`.

    Raises:
        ValueError, TypeError: as :func:`reverse_kl_advantages` and the datum builder.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    advantages = reverse_kl_advantages(sequence.logprobs, teacher_logprobs, coef)
    return importance_sampling_datum(prompt, sequence.tokens, sequence.logprobs, advantages)


# --------------------------------------------------------------------------------------------------- config
@dataclass
class OPDConfig:
    """Settings of an on-policy distillation run (tutorial B's flags and defaults).

    Attributes:
        base_model: the student (LoRA-trained).
        teacher_base_model: the teacher's base model.
        teacher_model_path: optional sampler weights of a fine-tuned teacher (``save_weights_for_sampler(...).path``).
        lora_rank: LoRA rank of the student (4..64).
        steps: training steps (>= 1).
        batch_size: prompts per step (>= 1).
        group_size: completions per prompt (>= 1).
        max_tokens: most tokens per completion (>= 1).
        temperature, top_p, top_k: student sampling parameters (the per-token KL estimate uses the logprobs of the
            distribution actually sampled from, so keep them at 1.0 / 1.0 / -1 for an unbiased reverse KL).
        seed: seeds the LoRA initialisation and, per (step, prompt), the sampler.
        learning_rate, beta1, beta2: Adam settings.
        kl_penalty_coef: the advantage is ``-kl_penalty_coef * (student_lp - teacher_lp)`` (> 0).
        sampler_refresh_steps: rebuild the student sampler from the current weights every this many steps (>= 1);
            1 = every step (fully on-policy), k = samples come from weights up to k - 1 updates old.
        enable_thinking: render prompts with the chat template's thinking switch on.
        rollout: ``"sync"`` (one request after another) or ``"async"`` (prompts concurrent, a prompt's teacher
            scoring concurrent, at most ``max_concurrency`` requests in flight).
        max_concurrency: async only (>= 1).
        weights_name: save the final weights for a sampler under this name (``None``: do not save).

    Introduced in: chapter 06 (notebooks/06_opd).
    """

    base_model: str = "Qwen/Qwen3.5-4B"
    teacher_base_model: str = "Qwen/Qwen3.6-27B"
    teacher_model_path: str | None = None
    lora_rank: int = 32
    steps: int = 10
    batch_size: int = 2
    group_size: int = 2
    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 42
    learning_rate: float = 4e-5
    beta1: float = 0.9
    beta2: float = 0.95
    kl_penalty_coef: float = 1.0
    sampler_refresh_steps: int = 1
    enable_thinking: bool = False
    rollout: str = "sync"
    max_concurrency: int = 8
    weights_name: str | None = "final"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field that is out of range, its value and what it must be.

        Introduced in: chapter 06 (notebooks/06_opd).
        """
        for name in ("steps", "batch_size", "group_size", "max_tokens", "sampler_refresh_steps", "max_concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, numbers.Integral) or not (
            4 <= self.lora_rank <= 64
        ):
            raise ValueError(f"lora_rank must be an integer from 4 to 64 (PyTRIO's range), got {self.lora_rank!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        for name in ("learning_rate", "kl_penalty_coef", "temperature"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if not isinstance(self.top_p, numbers.Real) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or (
            self.top_k != -1 and self.top_k < 1
        ):
            raise ValueError(f"top_k must be -1 (no truncation) or an integer >= 1, got {self.top_k!r}")
        if self.rollout not in ROLLOUT_MODES:
            raise ValueError(f"rollout must be one of {ROLLOUT_MODES}, got {self.rollout!r}")
        for name in ("base_model", "teacher_base_model"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty model name, got {getattr(self, name)!r}")


def batch_for_step(records: Sequence[dict], step: int, batch_size: int) -> list[dict]:
    """The records of one step: ``batch_size`` consecutive records, wrapping around the end of the data.

    Raises:
        ValueError: no records, or ``batch_size < 1``.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    if not records:
        raise ValueError("records is empty: load some prompts first (trio_helpers.data.load_deepmath)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [records[(step * batch_size + i) % len(records)] for i in range(batch_size)]


def sampling_params_for(config: OPDConfig, step: int, index: int, stop=None):
    """``SamplingParams`` of prompt ``index`` at ``step``: the config's settings, a seed fixed by (seed, step, index).

    The per-request seed makes a run reproducible whatever order concurrent requests finish in.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    from pytrio import SamplingParams

    return SamplingParams(
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        seed=config.seed * 1_000_003 + step * 1_000 + index,
        stop=stop,
    )


def opd_prompt(tokenizer, record: dict, enable_thinking: bool = False):
    """The distillation prompt of a record (``question`` + tutorial B's instruction, chat template).

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    from trio_helpers.prompts import build_prompt, deepmath_messages

    if not isinstance(record, dict) or "question" not in record:
        raise ValueError(f"each record needs a 'question' field, got {type(record).__name__} {str(record)[:60]!r}")
    return build_prompt(tokenizer, deepmath_messages(record["question"]), enable_thinking=enable_thinking)


# --------------------------------------------------------------------------------------------------- rollouts
@dataclass
class Rollout:
    """One scored completion: the prompt, the student's sequence, the teacher's logprobs of its tokens.

    Introduced in: chapter 06 (notebooks/06_opd).
    """

    prompt_index: int
    prompt: object  # pytrio.ModelInput
    sequence: object  # pytrio.SampleSequence
    teacher_logprobs: list[float]

    @property
    def reverse_kl(self) -> np.ndarray:
        """Per-token sampled reverse-KL estimate ``student_lp - teacher_lp`` (float64 array).

        Introduced in: chapter 06 (notebooks/06_opd).
        """
        return np.asarray(self.sequence.logprobs, dtype=np.float64) - np.asarray(self.teacher_logprobs)


def collect_rollouts(sampler, teacher, prompts: Sequence, group_size: int, params_for: Callable[[int], object]):
    """Sample each prompt's group, then score every completion with the teacher, one request after another.

    Args:
        sampler: the student's ``SamplingClient``.
        teacher: the teacher's ``SamplingClient``.
        prompts: ``ModelInput`` prompts.
        group_size: completions per prompt.
        params_for: ``params_for(i)`` gives prompt ``i``'s ``SamplingParams``.

    Returns:
        ``list[Rollout]`` in prompt order, then sample order; empty completions are left out.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    out = []
    for i, prompt in enumerate(prompts):
        response = sampler.sample(prompt, num_samples=group_size, sampling_params=params_for(i)).result()
        for seq in response.sequences:
            if seq.tokens:
                out.append(Rollout(i, prompt, seq, score_completion(teacher, prompt, seq)))
    return out


async def collect_rollouts_async(sampler, teacher, prompts: Sequence, group_size: int,
                                 params_for: Callable[[int], object], max_concurrency: int = 8, retries=None):
    """:func:`collect_rollouts` with every prompt in flight at once and a prompt's completions scored concurrently.

    One ``asyncio.Semaphore(max_concurrency)`` bounds the requests in flight (sampling and scoring alike); each
    request holds a slot only while it runs, so a prompt waiting for its scores never blocks another's request.
    Results come back in the same order as :func:`collect_rollouts` (prompt order, then sample order), and with
    per-request seeds they are the same rollouts.

    Raises:
        ValueError: ``max_concurrency < 1``.
        Exception: the first error of any request (after retries), the others cancelled.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    from trio_helpers.rollouts import with_retries

    if not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ValueError(f"max_concurrency must be an integer >= 1, got {max_concurrency!r}")
    limit = asyncio.Semaphore(max_concurrency)

    async def bounded(make_call, what):
        async with limit:
            return await with_retries(make_call, retries, what=what)

    async def score(prompt, seq):
        p, c = _prompt_tokens(prompt), list(seq.tokens)
        full = await bounded(lambda: teacher.compute_logprobs_async(_model_input(p + c)), "teacher compute_logprobs")
        return teacher_completion_logprobs(full, len(p), len(c))

    async def one(i: int, prompt) -> list[Rollout]:
        params = params_for(i)
        response = await bounded(
            lambda: sampler.sample_async(prompt, num_samples=group_size, sampling_params=params), f"sample (prompt {i})"
        )
        seqs = [s for s in response.sequences if s.tokens]
        scores = await asyncio.gather(*(score(prompt, s) for s in seqs))
        return [Rollout(i, prompt, s, lp) for s, lp in zip(seqs, scores)]

    tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
    try:
        groups = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return [r for group in groups for r in group]


def rollout_metrics(rollouts: Sequence[Rollout], max_tokens: int) -> dict[str, float]:
    """Reverse-KL and length statistics of a step's rollouts.

    Returns:
        ``reverse_kl_mean`` / ``reverse_kl_std`` (over all completion tokens of the step), ``reverse_kl_seq_mean``
        (mean over completions of the summed per-token estimate: the sequence-level reverse KL),
        ``completion_tokens_mean``, ``completion_tokens_total``, ``frac_max_tokens``.

    Raises:
        ValueError: no rollouts.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    if not rollouts:
        raise ValueError("no rollouts: every completion was empty")
    per_token = np.concatenate([r.reverse_kl for r in rollouts])
    lengths = np.array([len(r.sequence.tokens) for r in rollouts])
    return {
        "reverse_kl_mean": float(per_token.mean()),
        "reverse_kl_std": float(per_token.std()),
        "reverse_kl_seq_mean": float(np.mean([r.reverse_kl.sum() for r in rollouts])),
        "completion_tokens_mean": float(lengths.mean()),
        "completion_tokens_total": float(lengths.sum()),
        "frac_max_tokens": float(np.mean(lengths >= max_tokens)),
    }


# --------------------------------------------------------------------------------------------------- the loop
@dataclass
class StepOutput:
    """What one OPD step did: its metrics, its rollouts, the datums it trained on and the sampler it used.

    Introduced in: chapter 06 (notebooks/06_opd).
    """

    step: int
    metrics: dict[str, float]
    rollouts: list[Rollout]
    datums: list
    sampler: object = None


def _policy_lag(datums, fb_output) -> float:
    """Mean |trainer logprob - sampler logprob| over the trained tokens (0 when the sampler is fresh)."""
    diffs = []
    for d, out in zip(datums, getattr(fb_output, "loss_fn_outputs", None) or []):
        lp = out.get("logprobs") if isinstance(out, dict) else None
        if lp is None:
            return float("nan")
        new = lp.to_numpy() if hasattr(lp, "to_numpy") else np.asarray(lp)
        old = d.loss_fn_inputs["logprobs"].to_numpy()
        mask = d.loss_fn_inputs["target_tokens"].to_numpy() != -100
        diffs.append(np.abs(new[mask] - old[mask]))
    return float(np.concatenate(diffs).mean()) if diffs else float("nan")


def train_on_rollouts(training_client, rollouts: Sequence[Rollout], config: OPDConfig, adam_params, step: int = 0):
    """Build the step's datums and submit ``forward_backward`` and ``optim_step`` back to back.

    Returns:
        ``(datums, metrics)``: ``datums``, ``loss`` (the importance-sampling loss, which at a fresh sampler equals
        ``kl_penalty_coef`` times the step's mean sampled reverse KL), ``policy_lag`` and the optimizer's metrics
        prefixed ``optim/``.

    Raises:
        RuntimeError: the step produced no datums (nothing would be trained).

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    data = [opd_datum(r.prompt, r.sequence, r.teacher_logprobs, config.kl_penalty_coef) for r in rollouts]
    if not data:
        raise RuntimeError(
            f"step {step} produced no datums (every completion was empty); check max_tokens "
            f"({config.max_tokens}) and the stop tokens"
        )
    fb = training_client.forward_backward(data, "importance_sampling")
    opt = training_client.optim_step(adam_params)  # submitted before waiting: both run back to back
    out = fb.result()
    metrics = {"datums": float(len(data)), "loss": float(out.metrics["loss_mean"]),
               "policy_lag": _policy_lag(data, out)}
    for k, v in opt.result().metrics.items():
        metrics[f"optim/{k}"] = float(v)
    return data, metrics


def opd_step(training_client, teacher, sampler, records: Sequence[dict], config: OPDConfig, step: int, tokenizer,
             adam_params, stop=None, sampler_age: int = 0) -> StepOutput:
    """One OPD step: sample the batch with ``sampler``, score with ``teacher``, train once.

    Args:
        training_client: the student's ``TrainingClient``.
        teacher: the teacher's ``SamplingClient``.
        sampler: the student's current ``SamplingClient`` (refreshed by the caller).
        records: this step's records (``question`` fields).
        config: the run's :class:`OPDConfig` (``rollout`` chooses sync or async).
        step: the step number (seeds the sampling).
        tokenizer: renders the prompts.
        adam_params: ``pytrio.AdamParams``.
        stop: stop token ids for sampling.
        sampler_age: optimizer steps since ``sampler`` was saved (logged as ``sampler_age``).

    Returns:
        :class:`StepOutput`. Its metrics hold the rollout and training metrics plus ``step``, ``sampler_age``,
        ``lr``, and wall-clock ``rollout_time``, ``step_time`` and ``completion_tokens_per_s`` (keep these out of
        compared outputs).

    Raises:
        RuntimeError: the step produced no datums.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    t0 = time.perf_counter()
    prompts = [opd_prompt(tokenizer, r, config.enable_thinking) for r in records]

    def params_for(i):
        return sampling_params_for(config, step, i, stop)

    if config.rollout == "async":
        from trio_helpers.rollouts import run_sync

        rollouts = run_sync(collect_rollouts_async(sampler, teacher, prompts, config.group_size, params_for,
                                                   config.max_concurrency))
    else:
        rollouts = collect_rollouts(sampler, teacher, prompts, config.group_size, params_for)
    t1 = time.perf_counter()
    if not rollouts:
        raise RuntimeError(f"step {step} produced no datums: every completion was empty")
    metrics: dict[str, float] = {"step": float(step), "sampler_age": float(sampler_age)}
    metrics.update(rollout_metrics(rollouts, config.max_tokens))
    datums, train_metrics = train_on_rollouts(training_client, rollouts, config, adam_params, step)
    metrics.update(train_metrics)
    metrics["lr"] = float(adam_params.learning_rate)
    t2 = time.perf_counter()
    metrics["rollout_time"] = t1 - t0
    metrics["step_time"] = t2 - t0
    metrics["completion_tokens_per_s"] = metrics["completion_tokens_total"] / max(t1 - t0, 1e-9)
    return StepOutput(step, metrics, rollouts, datums, sampler)


TIMING_KEYS = ("rollout_time", "step_time", "completion_tokens_per_s")
"""Wall-clock metrics of :func:`opd_step`: they vary from run to run (never print them in compared outputs)."""


@dataclass
class OPDResult:
    """A finished run: per-step metrics, the final weights' path, and the clients to keep using.

    Introduced in: chapter 06 (notebooks/06_opd).
    """

    history: list[dict] = field(default_factory=list)
    final_path: str | None = None
    training_client: object = None
    teacher: object = None
    config: OPDConfig | None = None

    def series(self, key: str) -> np.ndarray:
        """One metric over the steps as a float64 array, e.g. ``result.series("reverse_kl_mean")``.

        Raises:
            KeyError: no step logged that metric.

        Introduced in: chapter 06 (notebooks/06_opd).
        """
        return np.array([h[key] for h in self.history], dtype=np.float64)


def format_step(metrics: dict, timing: bool = False) -> str:
    """A one-line summary of a step's metrics (wall-clock numbers only when ``timing``).

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    line = (f"step {int(metrics['step']):>3}  reverse_kl {metrics['reverse_kl_mean']:.4f} "
            f"(std {metrics['reverse_kl_std']:.3f})  loss {metrics['loss']:.4f}  datums {int(metrics['datums'])}  "
            f"tokens {metrics['completion_tokens_mean']:.0f}/completion  sampler_age {int(metrics['sampler_age'])}")
    if timing:
        line += f"  step_time {metrics['step_time']:.2f}s  {metrics['completion_tokens_per_s']:.0f} tok/s"
    return line


def run_opd(service, records: Sequence[dict], config: OPDConfig, logger=None,
            on_step: Callable[[StepOutput], None] | None = None, training_client=None, teacher=None,
            print_every: int = 0, timing: bool = False) -> OPDResult:
    """Distil the teacher into the student for ``config.steps`` steps (the chapter's loop and the recipe's).

    Per step: refresh the student's sampler if ``step % sampler_refresh_steps == 0``; take ``batch_size`` records
    (:func:`batch_for_step`); sample ``group_size`` completions each; score them with the teacher; train once on
    the per-token reverse-KL advantages. At the end, save the weights for a sampler (``config.weights_name``).

    Args:
        service: a service client (``trio_helpers.connect()``).
        records: prompt records with a ``question`` field (``trio_helpers.data.load_deepmath``).
        config: :class:`OPDConfig` (validated here).
        logger: optional object with ``log(step, metrics)`` (e.g. ``trio_helpers.tracking.MetricsLogger``).
        on_step: optional callback receiving each :class:`StepOutput` (rollouts and datums included).
        training_client: continue training this client instead of creating a fresh LoRA client.
        teacher: use this teacher ``SamplingClient`` instead of creating one from the config.
        print_every: print :func:`format_step` every this many steps (0: never).
        timing: include wall-clock numbers in the printed lines.

    Returns:
        :class:`OPDResult` (history of metric dicts, final sampler path or ``None``, the clients).

    Raises:
        ValueError: an invalid config or no records.
        RuntimeError: a step produced no datums.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    from pytrio import AdamParams

    from trio_helpers.prompts import stop_token_ids

    config.validate()
    if not records:
        raise ValueError("records is empty: load some prompts first (trio_helpers.data.load_deepmath)")
    if training_client is None:
        training_client = service.create_lora_training_client(config.base_model, rank=config.lora_rank,
                                                               seed=config.seed)
    if teacher is None:
        teacher = service.create_sampling_client(config.teacher_base_model, model_path=config.teacher_model_path)
    tokenizer = training_client.get_tokenizer()
    stop = stop_token_ids(tokenizer)
    adam = AdamParams(learning_rate=config.learning_rate, beta1=config.beta1, beta2=config.beta2)
    result = OPDResult(training_client=training_client, teacher=teacher, config=config)
    sampler, refreshed_at = None, 0
    for step in range(config.steps):
        if step % config.sampler_refresh_steps == 0:
            sampler, refreshed_at = training_client.save_weights_and_get_sampling_client(), step
        out = opd_step(training_client, teacher, sampler, batch_for_step(records, step, config.batch_size), config,
                       step, tokenizer, adam, stop=stop, sampler_age=step - refreshed_at)
        result.history.append(out.metrics)
        if logger is not None:
            logger.log(step, out.metrics)
        if on_step is not None:
            on_step(out)
        if print_every and (step % print_every == 0 or step == config.steps - 1):
            print(format_step(out.metrics, timing=timing))
    if config.weights_name:
        result.final_path = training_client.save_weights_for_sampler(config.weights_name).result().path
    return result


def config_dict(config: OPDConfig) -> dict:
    """The config as a plain dict (for loggers and run records).

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    return asdict(config)


# --------------------------------------------------------------------------------------------------- measuring
def _heldout_samples(student_sampler, prompts, seed, max_tokens, samples, stop):
    from pytrio import SamplingParams

    futures = [
        student_sampler.sample(p, num_samples=samples,
                               sampling_params=SamplingParams(max_tokens=max_tokens, seed=seed + i, stop=stop))
        for i, p in enumerate(prompts)
    ]
    return [(p, [s for s in f.result().sequences if s.tokens]) for p, f in zip(prompts, futures)]


def sampled_reverse_kl(student_sampler, teacher, prompts: Sequence, seed: int = 777, max_tokens: int = 256,
                       samples: int = 4, stop=None) -> dict[str, float]:
    """Held-out reverse KL estimated from sampled tokens: works on any backend.

    The student samples ``samples`` completions of each prompt (fixed seeds ``seed + i``, temperature 1); the
    teacher scores them; the estimate is the mean over all tokens of ``student_lp - teacher_lp``. It is unbiased
    for the per-token reverse KL but noisy (a single token's estimate can be far below zero).

    Returns:
        ``{"mean": per-token mean, "seq_mean": mean summed estimate per completion, "tokens": count}``.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    per_token, per_seq = [], []
    futures = []
    for p, seqs in _heldout_samples(student_sampler, prompts, seed, max_tokens, samples, stop):
        pt = _prompt_tokens(p)
        futures += [(s, len(pt), teacher.compute_logprobs(_model_input(pt + list(s.tokens)))) for s in seqs]
    for s, plen, fut in futures:
        t = teacher_completion_logprobs(fut.result(), plen, len(s.tokens))
        d = np.asarray(s.logprobs) - np.asarray(t)
        per_token.append(d)
        per_seq.append(d.sum())
    allt = np.concatenate(per_token)
    return {"mean": float(allt.mean()), "seq_mean": float(np.mean(per_seq)), "tokens": float(len(allt))}


def final_line_start(tokenizer, tokens: Sequence[int]) -> int:
    """Index of the first token of the completion's last line (after the last token that contains a newline).

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    start = 0
    for i, t in enumerate(tokens):
        if "\n" in tokenizer.decode([int(t)]):
            start = i + 1
    return min(start, len(tokens))


def _require_offline(**clients) -> None:
    for name, client in clients.items():
        if not hasattr(client, "_model") or type(client).__name__ != "OfflineSamplingClient":
            raise TypeError(
                f"{name} is a {type(client).__name__}; the exact reverse KL reads the offline backend's internal "
                "model and works only with trio_helpers.connect('offline') sampling clients. On the real service use "
                "sampled_reverse_kl (the sampled-token estimate)."
            )


def _exact_kl_of(student_sampler, teacher_sampler, pairs) -> dict[str, float]:
    """Exact per-position reverse KL over ``(prompt_tokens, completion_tokens)`` pairs, split at the final line."""
    from trio_helpers.offline.model import log_softmax, sequence_features

    tokenizer = student_sampler.get_tokenizer()
    kls, sampled, final = [], [], []
    for pt, ct in pairs:
        tokens = list(pt) + list(ct)
        keys, _ = sequence_features(tokens)
        rows = keys[len(pt) - 1 : len(tokens) - 1]
        ls = log_softmax(student_sampler._model.forward(rows)[1])
        lt = log_softmax(teacher_sampler._model.forward(rows)[1])
        kls.append((np.exp(ls) * (ls - lt)).sum(axis=-1))
        picked = np.arange(len(ct)), np.asarray(ct)
        sampled.append(ls[picked] - lt[picked])
        mask = np.zeros(len(ct), dtype=bool)
        mask[final_line_start(tokenizer, ct):] = True
        final.append(mask)
    kl, est, mask = np.concatenate(kls), np.concatenate(sampled), np.concatenate(final)
    return {
        "mean": float(kl.mean()),
        "final_line": float(kl[mask].mean()) if mask.any() else float("nan"),
        "rest": float(kl[~mask].mean()) if (~mask).any() else float("nan"),
        "sampled": float(est.mean()),
        "tokens": float(len(kl)),
        "final_line_tokens": float(mask.sum()),
    }


def exact_reverse_kl_offline(student_sampler, teacher_sampler, prompts: Sequence, seed: int = 777,
                             max_tokens: int = 256, samples: int = 4, stop=None) -> dict[str, float]:
    """OFFLINE ONLY: the exact mean per-token reverse KL(student || teacher) on the student's own samples.

    The student samples ``samples`` completions of each prompt (fixed seeds ``seed + i``, temperature 1). At every
    position the two models' *full* next-token distributions are compared, ``sum_v p_s(v) (log p_s(v) -
    log p_t(v))``, reading them from the offline sampling clients' internal models. The real service cannot do this
    (it returns logprobs of given tokens, not whole distributions): there, use :func:`sampled_reverse_kl`. Same
    measure as ``trio_helpers.offline.report.reverse_kl``.

    Returns:
        ``{"mean", "final_line", "rest", "sampled", "tokens", "final_line_tokens"}``: the exact KL's mean over all
        positions, over the positions that write the completion's last line (the final answer, see
        :func:`final_line_start`) and over the others; ``sampled``, the sampled-token estimate ``student_lp -
        teacher_lp`` on the same tokens (what :func:`sampled_reverse_kl` reports); and the position counts.

    Raises:
        TypeError: a client is not an offline sampling client.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    _require_offline(student_sampler=student_sampler, teacher_sampler=teacher_sampler)
    pairs = [(_prompt_tokens(p), list(s.tokens))
             for p, seqs in _heldout_samples(student_sampler, prompts, seed, max_tokens, samples, stop) for s in seqs]
    return _exact_kl_of(student_sampler, teacher_sampler, pairs)


def exact_rollout_kl_offline(student_sampler, teacher_sampler, rollouts: Sequence[Rollout]) -> dict[str, float]:
    """OFFLINE ONLY: the exact reverse KL at the positions of given rollouts (no new samples).

    With the sampler the rollouts came from (``StepOutput.sampler``) this is the on-policy reverse KL of those
    samples. With another sampler it is that model's KL at the *same* states: e.g. a trained student measured on the
    untrained student's samples, a comparison free of sampling noise. Otherwise as :func:`exact_reverse_kl_offline`.

    Raises:
        TypeError: a client is not an offline sampling client.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    _require_offline(student_sampler=student_sampler, teacher_sampler=teacher_sampler)
    pairs = [(_prompt_tokens(r.prompt), list(r.sequence.tokens)) for r in rollouts]
    return _exact_kl_of(student_sampler, teacher_sampler, pairs)


# --------------------------------------------------------------------------------------------------- viewing
def _colour(value: float, vmax: float) -> str:
    """Red for positive values (student above teacher), blue for negative; opacity grows with |value| / vmax."""
    alpha = min(abs(value) / vmax, 1.0) if vmax > 0 else 0.0
    rgb = "214,39,40" if value > 0 else "31,119,180"
    return f"rgba({rgb},{alpha:.2f})"


def token_kl_html(tokenizer, tokens: Sequence[int], values: Sequence[float], vmax: float = 2.0,
                  title: str = "") -> str:
    """An HTML rendering of a completion with each token's background coloured by a per-token value.

    Red: positive ``student_lp - teacher_lp`` (the student is surer than the teacher: pushed down); blue:
    negative (the teacher prefers the token: pushed up); white: agreement. Hovering a token shows its value.
    Deterministic (fixed formatting, no ids), so it can sit in a compared notebook output.

    Args:
        tokenizer: decodes single tokens.
        tokens: the completion's token ids.
        values: one number per token.
        vmax: the value shown at full colour (larger values are clipped).
        title: an optional caption.

    Raises:
        ValueError: lengths differ.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    if len(tokens) != len(values):
        raise ValueError(f"tokens has {len(tokens)} entries but values has {len(values)}; give one value per token")
    spans = []
    for t, v in zip(tokens, values):
        text = tokenizer.decode([int(t)])
        shown = html.escape(text).replace("\n", "\u21b5\n") if text else "\u2205"
        spans.append(f'<span title="{html.escape(repr(text))}: {v:+.3f}" '
                     f'style="background:{_colour(float(v), vmax)}">{shown}</span>')
    head = f"<div><b>{html.escape(title)}</b></div>" if title else ""
    return (f'{head}<div style="font-family:monospace;white-space:pre-wrap;line-height:1.6;'
            f'border:1px solid #ccc;padding:6px">{"".join(spans)}</div>')

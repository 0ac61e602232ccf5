"""On-policy distillation (OPD): a teacher grades every token the student writes.

The student samples completions of a prompt; the teacher scores those same tokens with ``compute_logprobs``; the
per-token difference ``student_logprob - teacher_logprob`` is a one-sample estimate of the student's reverse KL to
the teacher at that position; its negative (times ``kl_penalty_coef``) becomes the token's advantage in an
``importance_sampling`` datum (chapter 03's builder), and one ``forward_backward`` + ``optim_step`` per batch lowers
the student's reverse KL on the states it actually visits.

- scoring: :func:`teacher_completion_logprobs`, :func:`reverse_kl_advantages`, :func:`score_completion`,
  :func:`opd_datum`;
- the loop's scorer: :class:`OPDConfig`, :class:`OPDScorer`, :func:`run_opd` (the shared loop of
  :mod:`trio_helpers.loop`, so OPD gets GRPO's rollout modes, resume, failure handling and metric names);
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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trio_helpers.datums import importance_sampling_datum
from trio_helpers.loop import LoopConfig, RunResult, run_loop
from trio_helpers.rl import Group


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


# --------------------------------------------------------------------------------------------------- the scorer
@dataclass
class OPDConfig(LoopConfig):
    """Settings of an on-policy distillation run: the loop's (:class:`trio_helpers.loop.LoopConfig`) plus the
    teacher's. Defaults follow the *On-Policy Distillation* example (batch 2 x group 2, lr 4e-5, coef 1).

    Attributes:
        teacher_base_model: the teacher's base model.
        teacher_model_path: optional sampler weights of a fine-tuned teacher (``save_weights_for_sampler(...).path``).
        kl_penalty_coef: the advantage is ``-kl_penalty_coef * (student_lp - teacher_lp)`` (> 0).
        enable_thinking: render prompts with the chat template's thinking switch on.

    The per-token KL estimate uses the logprobs of the distribution actually sampled from, so keep
    ``temperature``/``top_p``/``top_k`` at 1.0 / 1.0 / -1 for an unbiased reverse KL.

    Introduced in: chapter 06 (notebooks/06_opd).
    """

    batch_size: int = 2
    group_size: int = 2
    weights_name: str | None = "final"
    teacher_base_model: str = "Qwen/Qwen3.6-27B"
    teacher_model_path: str | None = None
    kl_penalty_coef: float = 1.0
    enable_thinking: bool = False

    def validate(self) -> None:
        """The loop's checks plus the teacher's settings; raises ``ValueError`` naming the field.

        Introduced in: chapter 06 (notebooks/06_opd).
        """
        super().validate()
        coef = self.kl_penalty_coef
        if isinstance(coef, bool) or not isinstance(coef, numbers.Real) or not math.isfinite(coef) or coef <= 0:
            raise ValueError(f"kl_penalty_coef must be a finite number > 0, got {coef!r}")
        if not isinstance(self.teacher_base_model, str) or not self.teacher_base_model.strip():
            raise ValueError(f"teacher_base_model must be a model name, got {self.teacher_base_model!r}")
        if self.teacher_model_path is not None and (not isinstance(self.teacher_model_path, str)
                                                    or not self.teacher_model_path.strip()):
            raise ValueError(f"teacher_model_path must be a saved sampler path or None, got "
                             f"{self.teacher_model_path!r}")


def opd_prompt(tokenizer, record: dict, enable_thinking: bool = False):
    """The distillation prompt of a record (``question`` + the *On-Policy Distillation* example's instruction).

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    from trio_helpers.prompts import build_prompt, deepmath_messages

    if not isinstance(record, dict) or "question" not in record:
        raise ValueError(f"each record needs a 'question' field, got {type(record).__name__} {str(record)[:60]!r}")
    return build_prompt(tokenizer, deepmath_messages(record["question"]), enable_thinking=enable_thinking)


def teacher_kl(group) -> np.ndarray:
    """Per-token sampled reverse-KL estimates ``student_lp - teacher_lp`` of a scored OPD group, concatenated.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    return np.concatenate([np.asarray(s.logprobs, dtype=np.float64) - np.asarray(t)
                           for s, t in zip(group.sequences, group.extras["teacher_logprobs"])])


class OPDScorer:
    """The loop's distillation scorer: the teacher scores every sampled token; advantage ``-coef * k``.

    One ``compute_logprobs`` request per completion (through the loop's limiter, so concurrent with ``"async"``).
    Empty completions are dropped (there is nothing to score). ``setup`` creates the teacher's sampling client
    unless one is given.

    Introduced in: chapter 06 (notebooks/06_opd).
    """

    name = "opd"
    headline = {"kl/teacher_mean": "kl"}
    skip_degenerate = False
    require_datums = True  # the *On-Policy Distillation* example raises if a step produced no datums

    def __init__(self, config: OPDConfig, teacher=None) -> None:
        self.config = config
        self.teacher = teacher

    def check_records(self, records: Sequence[dict]) -> None:
        """Every record needs a non-empty ``question``.

        Raises:
            ValueError: naming the first bad record (its index).
        """
        for i, record in enumerate(records):
            if not isinstance(record, dict) or not isinstance(record.get("question"), str) \
                    or not record["question"].strip():
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"record {i} has no 'question' text ({keys}); distillation prompts need it "
                                 "(trio_helpers.data.load_deepmath)")

    def setup(self, service) -> None:
        """Create the teacher's sampling client (once)."""
        if self.teacher is None:
            self.teacher = service.create_sampling_client(self.config.teacher_base_model,
                                                          model_path=self.config.teacher_model_path)

    def prompt(self, tokenizer, record: dict):
        """The distillation chat prompt (:func:`opd_prompt`)."""
        return opd_prompt(tokenizer, record, self.config.enable_thinking)

    async def score(self, index: int, prompt, record: dict, sequences: list, limiter):
        """Teacher logprobs of every non-empty completion, then ``-coef * (student_lp - teacher_lp)``."""
        p = _prompt_tokens(prompt)
        kept = [s for s in sequences if s.tokens]

        async def teacher_lp(seq):
            full = await limiter.call(lambda: self.teacher.compute_logprobs_async(_model_input(p + list(seq.tokens))),
                                      what="teacher compute_logprobs", index=index)
            return teacher_completion_logprobs(full, len(p), len(seq.tokens))

        scored = await asyncio.gather(*(teacher_lp(s) for s in kept))
        advantages = [reverse_kl_advantages(s.logprobs, t, self.config.kl_penalty_coef) for s, t in zip(kept, scored)]
        return Group(index, prompt, kept, None, advantages, {"teacher_logprobs": list(scored)})

    def metrics(self, groups: Sequence) -> dict:
        """``kl/teacher_mean``, ``kl/teacher_std`` (over tokens) and ``kl/teacher_seq_mean`` (per completion)."""
        kept = [g for g in groups if g.sequences]
        if not kept:
            nan = float("nan")
            return {"kl/teacher_mean": nan, "kl/teacher_std": nan, "kl/teacher_seq_mean": nan}
        per_token = np.concatenate([teacher_kl(g) for g in kept])
        per_seq = [float(np.sum(np.asarray(s.logprobs) - np.asarray(t)))
                   for g in kept for s, t in zip(g.sequences, g.extras["teacher_logprobs"])]
        return {"kl/teacher_mean": float(per_token.mean()), "kl/teacher_std": float(per_token.std()),
                "kl/teacher_seq_mean": float(np.mean(per_seq))}


def run_opd(service, records: Sequence[dict], config: OPDConfig, logger=None, resume: bool = False,
            progress: bool = False, *, teacher=None, **loop_options) -> RunResult:
    """Distil the teacher into the student: the training loop (:func:`trio_helpers.loop.run_loop`) with
    :class:`OPDScorer`.

    Args:
        service: a service client (``trio_helpers.connect()``).
        records: prompt records with a ``question`` field (``trio_helpers.data.load_deepmath``).
        config: :class:`OPDConfig` (validated first).
        logger, resume, progress: as in :func:`trio_helpers.loop.run_loop`.
        teacher: use this teacher ``SamplingClient`` instead of creating one from the config.
        **loop_options: ``on_step``, ``on_event``, ``retries``, ``training_client``, ``print_every``.

    Returns:
        :class:`trio_helpers.loop.RunResult` (``result.scorer.teacher`` is the teacher).

    Raises:
        ValueError: an invalid config or records; RuntimeError: a step produced no datums; RunStopped: a service
            call failed for good.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    return run_loop(service, records, config, OPDScorer(config, teacher), logger=logger, resume=resume,
                    progress=progress, **loop_options)


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


def _offline_models(**clients) -> dict:
    """The offline model behind each sampling client (``trio_helpers.offline.server.sampler_model``), by name."""
    from trio_helpers.offline.server import sampler_model

    models = {}
    for name, client in clients.items():
        try:
            models[name] = sampler_model(client)
        except TypeError:
            raise TypeError(
                f"{name} is a {type(client).__name__}; the exact reverse KL reads the offline backend's internal "
                "model and works only with trio_helpers.connect('offline') sampling clients. On the real service use "
                "sampled_reverse_kl (the sampled-token estimate)."
            ) from None
    return models


def _exact_kl_of(student_sampler, models: dict, pairs) -> dict[str, float]:
    """Exact per-position reverse KL over ``(prompt_tokens, completion_tokens)`` pairs, split at the final line;
    ``models``: :func:`_offline_models`'s."""
    from trio_helpers.offline import exact
    from trio_helpers.offline.model import log_softmax, sequence_rows

    tokenizer = student_sampler.get_tokenizer()
    kls, sampled, final = [], [], []
    for pt, ct in pairs:
        tokens = list(pt) + list(ct)
        rows = sequence_rows(tokens[:-1])[len(pt) - 1 :]
        ls = log_softmax(models["student_sampler"].forward(rows)[1])
        lt = log_softmax(models["teacher_sampler"].forward(rows)[1])
        kls.append((exact.exp(ls) * (ls - lt)).sum(axis=-1))
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
    models = _offline_models(student_sampler=student_sampler, teacher_sampler=teacher_sampler)
    pairs = [(_prompt_tokens(p), list(s.tokens))
             for p, seqs in _heldout_samples(student_sampler, prompts, seed, max_tokens, samples, stop) for s in seqs]
    return _exact_kl_of(student_sampler, models, pairs)


def exact_rollout_kl_offline(student_sampler, teacher_sampler, groups: Sequence) -> dict[str, float]:
    """OFFLINE ONLY: the exact reverse KL at the positions of given scored groups (no new samples).

    With the sampler the groups came from (``StepOutput.sampler``) this is the on-policy reverse KL of those
    samples. With another sampler it is that model's KL at the *same* states: e.g. a trained student measured on the
    untrained student's samples, a comparison free of sampling noise. Otherwise as :func:`exact_reverse_kl_offline`.

    Raises:
        TypeError: a client is not an offline sampling client.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    models = _offline_models(student_sampler=student_sampler, teacher_sampler=teacher_sampler)
    pairs = [(_prompt_tokens(g.prompt), list(s.tokens)) for g in groups for s in g.sequences]
    return _exact_kl_of(student_sampler, models, pairs)


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

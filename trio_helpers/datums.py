"""Datums: aligning a prompt, a sampled completion and per-token training signals into ``pytrio.Datum`` objects.

A causal LM predicts token ``t+1`` from the tokens up to ``t``. So for ``tokens = prompt + completion`` a datum's
``model_input`` is ``tokens[:-1]`` and its ``target_tokens`` are ``tokens[1:]``: position ``i`` of the input is
trained to predict target ``i``. Per-token signals (sampling logprobs, advantages, weights) are aligned with the
*targets*. Prompt positions carry target ``-100``, which pytrio's planner ignores: they are neither trained nor
counted in the loss's normalising token count (``total_active_tokens``).

Introduced in: chapter 03 (notebooks/03_datum_alignment).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

IGNORE = -100
"""Target id that pytrio's planner skips (not trained, not counted in ``total_active_tokens``)."""

_COMPUTE_LOGPROBS_HINT = (
    "If these values come from SamplingClient.compute_logprobs(prompt + completion), its first entry is always "
    "None (no token precedes the first one): keep only the completion's part, values[len(prompt):]."
)


def _tokens(name: str, value) -> list[int]:
    """Token ids from a list, a 1-D integer numpy array or a ``ModelInput``; rejects floats, bools and negatives."""
    if hasattr(value, "to_ints"):
        value = value.to_ints()
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(f"{name} must be a 1-D sequence of token ids, got an array of shape {value.shape}")
        if value.dtype.kind not in "iu":
            raise TypeError(
                f"{name} has dtype {value.dtype}; token ids must be integers. Convert with .astype(np.int64) "
                "(a float array usually comes from padding or concatenating with np.zeros(...), which is float64)."
            )
        value = value.tolist()
    elif isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{name} must be a list of token ids (or a pytrio.ModelInput), got {type(value).__name__}; "
            "encode text with the tokenizer first"
        )
    out = []
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TypeError(
                f"{name}[{i}] = {t!r} is a {type(t).__name__}; token ids must be integers (pass "
                "SampleSequence.tokens, not its logprobs or text, or convert with int(...))"
            )
        if t < 0:
            raise ValueError(
                f"{name}[{i}] = {int(t)} is negative; token ids are >= 0. The builder itself puts -100 on the "
                f"targets it ignores: do not pad {name} with -100 (or -1) yourself"
            )
        out.append(int(t))
    return out


def _floats(name: str, values, expected: int, hint: str, prompt_len: int = 0) -> list[float]:
    """One finite float per completion token; every error names ``name`` and says how to fix it."""
    if values is None:
        raise ValueError(f"{name} is None; {hint}")
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"{name} must be 1-D (one number per completion token), got shape {values.shape}; {hint}")
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(
            f"{name} must be a list with one number per completion token, got {type(values).__name__}; {hint}"
        )
    values = list(values)
    out = []
    for i, v in enumerate(values):
        if v is None:
            raise ValueError(f"{name}[{i}] is None; every entry must be a number. {_COMPUTE_LOGPROBS_HINT}")
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name}[{i}] = {v!r} is a {type(v).__name__}, not a number; {hint}")
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"{name}[{i}] = {v} is not finite; every per-token value must be a finite number")
        out.append(v)
    if len(out) != expected:
        extra = ""
        if prompt_len and len(out) == expected + prompt_len:
            extra = (
                " It has exactly len(prompt) extra entries, so it covers prompt + completion: "
                "slice values[len(prompt):]."
            )
        raise ValueError(f"{name} has {len(out)} entries but the completion has {expected} tokens; {hint}.{extra}")
    return out


def _prompt_and_completion(prompt, completion) -> tuple[list[int], list[int]]:
    p = _tokens("prompt", prompt)
    c = _tokens("completion", completion)
    if not p:
        raise ValueError("prompt is empty: a datum needs at least one prompt token to predict the completion from")
    if not c:
        raise ValueError(
            "completion is empty: there is nothing to train on. Skip this sample instead of sending it (a sample "
            "that stopped at once still holds its stop token, so an empty list means the tokens were lost)"
        )
    return p, c


def _datum(p: list[int], c: list[int], signals: dict[str, list[float]]):
    """``model_input = p + c[:-1]``; targets ``[-100] * (len(p) - 1) + c``; each signal padded with 0.0."""
    from pytrio import Datum, ModelInput

    pad = len(p) - 1
    loss_fn_inputs = {"target_tokens": np.array([IGNORE] * pad + c, dtype=np.int64)}
    for key, values in signals.items():
        loss_fn_inputs[key] = np.array([0.0] * pad + values, dtype=np.float32)
    return Datum(model_input=ModelInput.from_ints(p + c[:-1]), loss_fn_inputs=loss_fn_inputs)


def importance_sampling_datum(prompt, completion, logprobs, advantages):
    """Build an ``importance_sampling`` (or ``ppo``/``cispo``/``dro``) datum for one sampled completion.

    Args:
        prompt: prompt token ids (a list, a 1-D integer numpy array, or the ``ModelInput`` you sampled from),
            at least 1 token.
        completion: the sampled token ids (``SampleSequence.tokens``), at least 1 token.
        logprobs: the sampler's logprob of each completion token (``SampleSequence.logprobs``), same length.
        advantages: one number for the whole completion (GRPO) or one per completion token (distillation).

    Returns:
        ``pytrio.Datum`` with ``model_input = prompt + completion[:-1]`` and, aligned with it,
        ``target_tokens = [-100] * (len(prompt) - 1) + completion`` (int64) and ``logprobs``/``advantages``
        (float32) that are 0 on prompt positions.

    Raises:
        ValueError: empty prompt or completion, negative token ids, length mismatches, ``None`` or non-finite values.
        TypeError: non-integer token ids, non-numeric logprobs or advantages.

    Introduced in: chapter 03 (notebooks/03_datum_alignment).
    """
    p, c = _prompt_and_completion(prompt, completion)
    lp = _floats("logprobs", logprobs, len(c), "pass SampleSequence.logprobs of the same sequence", len(p))
    if isinstance(advantages, numbers.Real) and not isinstance(advantages, bool):
        value = float(advantages)
        if not math.isfinite(value):
            raise ValueError(f"advantages = {advantages} is not finite; give a finite number (check for 0/0)")
        adv = [value] * len(c)
    else:
        adv = _floats(
            "advantages", advantages, len(c), "give one advantage per completion token (or one number)", len(p)
        )
    return _datum(p, c, {"logprobs": lp, "advantages": adv})


def cross_entropy_datum(prompt, completion, weights=None):
    """Build a ``cross_entropy`` (supervised) datum: train on the completion, not on the prompt.

    Args:
        prompt: prompt token ids (list, 1-D integer numpy array or ``ModelInput``), at least 1 token.
        completion: target token ids, at least 1 token.
        weights: optional per-completion-token weights (default 1.0 each); weight 0 leaves a token out of the loss
            and out of its normalising count.

    Returns:
        ``pytrio.Datum`` with ``target_tokens`` (int64) and ``weights`` (float32) aligned to
        ``model_input = prompt + completion[:-1]`` (prompt positions: target ``-100``, weight 0).

    Raises:
        ValueError, TypeError: as :func:`importance_sampling_datum`.

    Introduced in: chapter 03 (notebooks/03_datum_alignment).
    """
    p, c = _prompt_and_completion(prompt, completion)
    w = [1.0] * len(c) if weights is None else _floats("weights", weights, len(c), "give one weight per token", len(p))
    return _datum(p, c, {"weights": w})


def alignment_rows(datum, tokenizer, start: int = 0, stop: int | None = None) -> list[dict]:
    """One dict per position of a datum: what the model sees, what it must predict, and the signals there.

    Args:
        datum: a ``pytrio.Datum`` (from the builders above or built by hand).
        tokenizer: anything with ``decode(list[int]) -> str`` (e.g. ``SamplingClient.get_tokenizer()``).
        start, stop: the range of positions to show (Python slice semantics, clipped to the datum).

    Returns:
        A list of dicts with keys ``pos``, ``input`` (the input token, decoded), ``target`` (decoded, or ``-``
        when ignored), then ``logprob``, ``advantage`` and/or ``weight`` for the fields the datum has, and
        ``trained``: the target counts as an active token (it is not ``-100`` and, when the datum has weights, its
        weight is non-zero). A trained position with advantage 0 is still counted, but gets no gradient.

    Raises:
        ValueError: the datum has no ``target_tokens``.

    Introduced in: chapter 03 (notebooks/03_datum_alignment).
    """
    inputs = datum.model_input.to_ints()
    fields = {k: v.data for k, v in datum.loss_fn_inputs.items()}
    if "target_tokens" not in fields:
        raise ValueError(f"datum has no target_tokens (its loss_fn_inputs are {sorted(fields)}); nothing to align")
    rows = []
    for i in range(*slice(start, stop).indices(len(inputs))):
        t = int(fields["target_tokens"][i])
        target = "-" if t == IGNORE else tokenizer.decode([t])
        row = {"pos": i, "input": tokenizer.decode([inputs[i]]), "target": target}
        for name, key in (("logprobs", "logprob"), ("advantages", "advantage"), ("weights", "weight")):
            if name in fields:
                row[key] = float(fields[name][i])
        row["trained"] = t != IGNORE and row.get("weight", 1.0) != 0.0
        rows.append(row)
    return rows


def format_alignment(rows: list[dict], digits: int = 3) -> str:
    """Render :func:`alignment_rows` output as a fixed-width text table (tokens shown with ``repr``).

    Args:
        rows: dicts as returned by :func:`alignment_rows` (all with the same keys).
        digits: significant digits for float columns (``format(value, ".{digits}g")``, so tiny logprobs stay
            visible as e.g. ``-1.2e-06`` instead of rounding to zero).

    Returns:
        The table as one string: a header line, then one line per row.

    Introduced in: chapter 03 (notebooks/03_datum_alignment).
    """
    if not rows:
        return "(no positions)"
    keys = list(rows[0])

    def cell(key: str, value) -> str:
        if key in ("input", "target"):
            return value if key == "target" and value == "-" else repr(value)
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, float):
            return f"{value:.{digits}g}"
        return str(value)

    table = [keys] + [[cell(k, r[k]) for k in keys] for r in rows]
    widths = [max(len(line[j]) for line in table) for j in range(len(keys))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)).rstrip() for line in table)

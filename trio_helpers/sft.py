"""Supervised fine-tuning (SFT) on boxed-format demonstrations: the warm start before RL.

A *demonstration* is a completion we want the model to imitate. Here it is a training record's own worked
solution with its final ``#### N`` line rewritten as ``\\boxed{N}``, the format the reward and the strict grader
ask for (:func:`boxed_demonstration`). On real GSM8K the worked solutions are the data set's ``answer`` field;
on the offline backend they are the generated records of ``trio_helpers/offline/data/gsm8k_train.jsonl``, with
the same ``{"question", "answer"}`` layout and the same ``#### N`` final line.

Each demonstration becomes one ``cross_entropy`` datum (:func:`sft_datum`): chapter 01's chat prompt followed by
the demonstration and the end-of-turn token, built by chapter 03's
:func:`trio_helpers.datums.cross_entropy_datum`. The prompt is masked with ``-100`` targets (pytrio's planner
ignores them for every loss: no gradient, and not counted in ``total_active_tokens``), and every completion token
carries weight 1, so the loss is the mean negative log-likelihood per demonstration token over the batch.
``weights`` are left for what only they can do (weighting some completion tokens more than others).

:func:`run_sft` runs a few ``forward_backward(datums, "cross_entropy")`` + ``optim_step`` steps on a training
client and returns the loss of each step; to follow SFT with RL, pass the same client to
``run_grpo(..., training_client=...)``. There is no second training loop here.

Introduced in: chapter 09 (notebooks/09_sft_and_kl).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

END_OF_TURN = "<|im_end|>"
"""The token that ends an assistant turn in Qwen3's chat template (and the offline one)."""


def boxed_demonstration(record: dict, index: int = 0) -> str:
    """A GSM8K record's worked solution with its final ``#### N`` line rewritten as ``\\boxed{N}``.

    Args:
        record: a ``{"question", "answer"}`` record (``trio_helpers.data.load_gsm8k``); ``answer`` ends with
            ``#### N``.
        index: the record's position, used in error messages.

    Returns:
        The solution lines, then ``\\boxed{N}`` with ``N`` as :func:`trio_helpers.grading.extract_gsm8k_answer`
        reads it (thousands commas removed), e.g. ``"...\\n\\\\boxed{616}"``.

    Raises:
        ValueError: the record is not a dict with a non-empty ``answer`` ending in ``#### N`` (naming the record).

    Introduced in: chapter 09 (notebooks/09_sft_and_kl).
    """
    from trio_helpers.grading import extract_gsm8k_answer

    if not isinstance(record, dict):
        raise ValueError(f"record {index} is a {type(record).__name__}, not a {{'question', 'answer'}} dict "
                         "(trio_helpers.data.load_gsm8k)")
    answer = record.get("answer")
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"record {index} has an empty 'answer', so its demonstration (the SFT completion) "
                         "would be empty; drop the record or give it a worked solution ending in '#### N'")
    body, sep, _ = answer.rpartition("####")
    try:
        final = extract_gsm8k_answer(answer)
    except ValueError:
        sep = ""
    if not sep:
        raise ValueError(f"record {index}: its 'answer' has no final '#### N' line (it ends "
                         f"{answer[-40:]!r}); a demonstration needs the gold answer to box")
    body = body.rstrip()
    return f"{body}\n\\boxed{{{final}}}" if body else f"\\boxed{{{final}}}"


def end_of_turn_id(tokenizer) -> int:
    """The id of ``<|im_end|>`` (or, for a tokenizer without it, ``eos_token_id``).

    Raises:
        ValueError: the tokenizer has neither.

    Introduced in: chapter 09 (notebooks/09_sft_and_kl).
    """
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if END_OF_TURN in vocab:
        return int(vocab[END_OF_TURN])
    if isinstance(tokenizer.eos_token_id, int):
        return tokenizer.eos_token_id
    raise ValueError("the tokenizer has no <|im_end|> token and no eos_token_id: a demonstration could not end "
                     "its turn, so the model would never learn to stop")


def sft_datum(tokenizer, question: str, demonstration: str, name: str = "record"):
    """One ``cross_entropy`` datum: chapter 01's prompt for ``question``, trained on ``demonstration``.

    Args:
        tokenizer: the model's tokenizer (``training_client.get_tokenizer()``).
        question: the problem text; the prompt is ``build_prompt(tokenizer, gsm8k_messages(question))``, exactly
            what sampling and evaluation use.
        demonstration: the completion to imitate (text); the end-of-turn token is appended, so the model also
            learns to stop.
        name: how errors name this example (e.g. ``"record 12"``).

    Returns:
        ``pytrio.Datum`` with ``model_input = prompt + completion[:-1]``, ``target_tokens`` ``-100`` on the prompt
        positions and the completion's tokens after, ``weights`` 0 on the prompt and 1 on the completion.

    Raises:
        ValueError: an empty question or an empty demonstration (its completion would be the end-of-turn token
            alone, which teaches the model to answer nothing), naming ``name``.

    Introduced in: chapter 09 (notebooks/09_sft_and_kl).
    """
    from trio_helpers.datums import cross_entropy_datum
    from trio_helpers.prompts import build_prompt, gsm8k_messages

    if not isinstance(demonstration, str) or not demonstration.strip():
        raise ValueError(f"{name}: the demonstration is empty ({demonstration!r}), so the SFT completion would "
                         "be the end-of-turn token alone and teach the model to answer nothing; drop it")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{name}: the question is empty ({question!r}); an SFT datum needs a prompt")
    prompt = build_prompt(tokenizer, gsm8k_messages(question))
    completion = tokenizer.encode(demonstration, add_special_tokens=False) + [end_of_turn_id(tokenizer)]
    return cross_entropy_datum(prompt, completion)


def gsm8k_sft_datums(tokenizer, records: Sequence[dict]) -> list:
    """SFT datums for GSM8K records: :func:`boxed_demonstration` of each, as :func:`sft_datum`.

    Raises:
        ValueError: no records, or a record without a question or a usable answer (naming it by its index).

    Introduced in: chapter 09 (notebooks/09_sft_and_kl).
    """
    records = list(records)
    if not records:
        raise ValueError("records is empty: SFT needs at least one demonstration")
    out = []
    for i, record in enumerate(records):
        demo = boxed_demonstration(record, i)
        out.append(sft_datum(tokenizer, record.get("question"), demo, name=f"record {i}"))
    return out


def run_sft(training_client, datums: Sequence, steps: int, learning_rate: float = 4e-5,
            batch_size: int | None = None, beta1: float = 0.9, beta2: float = 0.95) -> list[float]:
    """A few supervised steps: ``forward_backward(batch, "cross_entropy")``, awaited, then ``optim_step``.

    Batches run through ``datums`` in order and wrap around (step ``s`` takes datums ``s*B .. s*B+B-1`` modulo
    their number; ``batch_size=None``: all of them every step). As in :func:`trio_helpers.rl.train_on_groups`,
    ``optim_step`` is sent only once ``forward_backward`` has succeeded.

    Args:
        training_client: a ``TrainingClient`` (fresh, or already trained).
        datums: ``cross_entropy`` datums (:func:`sft_datum`, :func:`gsm8k_sft_datums`).
        steps: optimizer steps (>= 1).
        learning_rate, beta1, beta2: Adam's settings (the loop's defaults).
        batch_size: datums per step (``None``: all).

    Returns:
        The loss of each step: the trainer's ``loss_mean`` of its ``forward_backward`` (mean negative
        log-likelihood per demonstration token, nats), computed *before* that step's update.

    Raises:
        ValueError: no datums, or ``steps``, ``batch_size`` or ``learning_rate`` out of range.

    Introduced in: chapter 09 (notebooks/09_sft_and_kl).
    """
    import pytrio as trio

    datums = list(datums)
    if not datums:
        raise ValueError("datums is empty: SFT needs at least one demonstration datum (gsm8k_sft_datums)")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral)
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1 or None (all datums), got {batch_size!r}")
    if (isinstance(learning_rate, bool) or not isinstance(learning_rate, numbers.Real)
            or not math.isfinite(learning_rate) or learning_rate <= 0):
        raise ValueError(f"learning_rate must be a finite number > 0, got {learning_rate!r}")
    n = len(datums)
    size = n if batch_size is None else batch_size
    adam = trio.AdamParams(learning_rate=float(learning_rate), beta1=beta1, beta2=beta2)
    losses = []
    for step in range(steps):
        batch = [datums[(step * size + j) % n] for j in range(size)]
        out = training_client.forward_backward(batch, "cross_entropy").result()
        training_client.optim_step(adam).result()  # only after forward_backward succeeded
        losses.append(float(out.metrics["loss_mean"]))
    return losses

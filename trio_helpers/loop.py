"""The one training loop of the book: GRPO and on-policy distillation are two scorers plugged into it.

Per step: take a batch of records, sample a group of completions per prompt from a sampler of the current (or a
bounded-stale) policy, let the *scorer* turn each group into per-token advantages, build ``importance_sampling``
datums, run ``forward_backward`` and then ``optim_step``, log one row of metrics, and every ``save_every`` steps
save the training state so an interrupted run can resume. The scorer is the only part that differs:

- :class:`trio_helpers.grpo.GRPOScorer`: rewards -> group-relative advantages (chapter 04);
- :class:`trio_helpers.distillation.OPDScorer`: teacher logprobs -> ``-coef * reverse KL`` per token (chapter 06).

Rollouts (``config.rollout``): ``"sync"`` sends one request after another; ``"async"`` sends a batch's requests
concurrently (at most ``max_concurrency`` in flight); ``"pipeline"`` also samples the next batches while the
current one trains, from weights at most ``max_staleness`` updates old. Seeds are fixed per (seed, step, prompt),
so the three modes give the same numbers whenever their samplers hold the same weights.

**Sampler versions.** The weights' *version* is the number of steps trained (a step whose groups were all
degenerate sends nothing and applies no optimizer step, so its version holds the previous weights, and the loop
reuses that sampler instead of saving the same weights again). Batch ``s`` is sampled
from version ``v(s)``, a pure function of the config (never of timing): ``v(s) = max(b(s), s - max_staleness)``
when pipelining, else ``v(s) = b(s) + k * floor((s - b(s)) / k)`` with ``k = sampler_refresh_steps``, where
``b(s)`` is the last *resume point* at or before ``s`` (step 0, and every multiple of ``save_every``). The pipeline
therefore drains at each checkpoint: a run resumed there samples exactly what the uninterrupted run sampled.

**Failures.** pytrio retries transient errors inside its transport (for up to 15 minutes by default). What still
reaches the loop ends the run cleanly: sampling requests (which change nothing on the service) are retried once
more at user level (``retries``); a failed training call is never re-sent. The loop stops with
:class:`RunStopped`: ``metrics.jsonl`` holds every finished step, the checkpoints listed in ``checkpoints.json`` are
intact, and the message says how to resume. An interruption (Ctrl-C) leaves the same state behind.

**Metric keys** (one vocabulary for every scorer; ``step`` is 0-based, as in ``metrics.jsonl``):

=============================  ====================================================================
``reward/mean``                GRPO: mean reward over the step's completions
``reward/frac_degenerate``     GRPO: share of groups whose rewards are all equal (no signal)
``kl/teacher_mean``, ``_std``  OPD: per-token sampled reverse KL to the teacher, ``student_lp - teacher_lp``
``kl/teacher_seq_mean``        OPD: the same summed over each completion, averaged over completions
``kl/ref_mean``, ``_seq_mean`` with ``ref_kl_coef > 0``: ``logp - logp_ref`` per token (and per completion),
                               over the trained groups (skipped degenerate groups get no reference logprobs)
``completion/entropy``         mean ``-logprob`` of the sampled tokens (per-token entropy estimate, nats)
``completion/tokens_mean``     sampled tokens per completion (also ``_max`` and ``_total``)
``completion/frac_max_tokens`` share of completions cut off at ``max_tokens``
``train/datums``               datums sent to ``forward_backward``
``train/tokens``               model-input tokens sent; ``train/tokens_skipped``: not sent (degenerate)
``train/loss``                 the trainer's ``loss_mean`` (NaN when nothing was sent)
``train/ratio_mean``, ``_max`` importance ratio ``exp(logp_train - logp_sampler)`` over trained tokens
``train/policy_lag``           mean ``|logp_train - logp_sampler|`` (0 on-policy with identical numerics)
``train/kl_sampler_trainer``   mean ``logp_sampler - logp_train``: KL(sampler || trainer) estimate
``train/clip_frac``            share of trained tokens the loss clips (``ppo``, ``cispo``; else 0)
``train/lr``                   the learning rate of the step
``optim/*``                    what ``optim_step`` returned
``sampler/version``            the weights version the batch was sampled from; ``sampler/staleness``:
                               how many updates behind the trained weights it was
``time/*_s``                   wall clock: ``refresh``, ``sample``, ``wait``, ``train``, ``step``
``train/substeps``             ``num_substeps > 1``: minibatches sent (one ``forward_backward`` +
                               ``optim_step`` each); ``train/loss`` is then their mean
``dynamic/extra_prompts``      ``dynamic_sampling > 0``: extra prompts drawn (= extra sampling requests);
                               ``dynamic/extra_samples``: their completions; ``dynamic/replaced``:
                               degenerate groups replaced; ``dynamic/unfilled``: still degenerate
``train/frac_dropped_overlong`` GRPO ``overlong="drop"``: share of completions sent no datum
``reward/overlong_penalty``    GRPO ``overlong="penalty"``: mean soft length penalty (in ``reward/mean``)
``tis/capped_frac``            ``tis_cap``: share of trained tokens whose ratio ``exp(lp_train -
                               lp_sampler)`` exceeded the cap; ``tis/requests``: ``compute_logprobs`` sent
``episode/*``                  GRPO with ``env`` (chapter 12): ``turns_mean``, ``tool_calls_mean``,
                               ``tool_errors_mean``, ``frac_tool_use``, ``frac_truncated``, ``tokens_mean``
                               (:func:`trio_helpers.grpo.episode_metrics`); ``completion/*`` then count
                               the model's tokens of each episode
=============================  ====================================================================

**Chapter 10's refinements** (:class:`LoopConfig` and :class:`trio_helpers.grpo.GRPOConfig` fields, all off by
default): ``advantage`` ``"mean"``/``"std"``/``"none"``; ``loss_aggregation`` (the service divides the summed
per-token loss of one ``forward_backward`` by ``total_active_tokens``, pytrio's planner's count of targets that
are not ``-100``; ``"sequence"`` and ``"constant"`` rescale the advantages to change that normaliser);
``clip_higher``; ``dynamic_sampling``; ``overlong``; ``num_substeps``; ``tis_cap``. Their keys appear only
when they are on.

**Episodes** (chapter 12): a scorer with a ``make_env`` (GRPO with ``GRPOConfig.env``, e.g. ``"calculator"``)
samples each group member as a multi-turn episode with an environment (:func:`episode_group`) instead of one
``num_samples=group_size`` request; the datums mask the environment's tokens. Without it nothing changes.

Introduced in: chapter 04 (notebooks/04_grpo_sync); concurrency and failures in chapter 05, the distillation
scorer in chapter 06.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import math
import numbers
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from trio_helpers.rl import completion_metrics, cosine_lr, train_on_groups
from trio_helpers.rollouts import RequestLimiter, RetriesExhausted, RetryPolicy, gather_or_cancel, run_sync

ROLLOUTS = ("sync", "async", "pipeline")
LR_SCHEDULES = ("constant", "cosine")
SWANLAB_MODES = ("online", "offline", "disabled")
LOSSES = ("importance_sampling", "ppo", "cispo", "dro")
"""The policy-gradient losses pytrio accepts for datums with ``logprobs`` and ``advantages``."""

CHECKPOINTS_FILE = "checkpoints.json"
CONFIG_FILE = "config.json"
MAY_CHANGE_ON_RESUME = ("steps", "swanlab", "max_concurrency", "weights_name", "run_dir")
"""Settings a resumed run may change; every other setting must equal the saved ``config.json``."""
IDENTITY_KEYS = ("algorithm", "data", "run_id")
"""What ``config.json`` holds besides the config's fields: the scorer (``"grpo"``, ``"opd"``), the data's
fingerprint (``{"records": n, "sha256": ...}``) and a random run id that every ``checkpoints.json`` entry repeats."""
MAX_SEQ_LEN = 8192
"""The models' sequence limit (prompt + completion tokens), as the service reports it (``max_seq_len``) and the
offline backend enforces it: ``max_tokens`` must stay below it."""
TIMING_PREFIX = "time/"
"""Metric keys starting with this are wall-clock numbers: they differ on every run (keep them out of outputs)."""


def _is_int(value, low: int | None = None) -> bool:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return ok and (low is None or value >= low)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class LoopConfig:
    """The settings every run of the loop shares (GRPO and OPD add their own in subclasses).

    Attributes:
        base_model: model to fine-tune with LoRA.
        lora_rank: LoRA rank, in [4, 64].
        steps: training steps (ignored with ``all_data``: then one pass over the records).
        batch_size: prompts per step.
        group_size: completions sampled per prompt.
        max_tokens: sampling budget per completion; longer completions are cut off.
        temperature, top_p, top_k: sampling parameters (``top_k=-1``: no truncation).
        seed: seeds the LoRA initialisation and every sampling request (per step and prompt).
        learning_rate: Adam's learning rate (the peak one with ``lr_schedule="cosine"``).
        lr_schedule: ``"constant"`` or ``"cosine"`` (decay to 0 over the run, the *GSM8K* example's schedule).
        beta1, beta2: Adam's moment decay rates.
        all_data: one pass over the records without wrap-around (the last batch may be smaller).
        save_every: ``save_state`` every this many steps (0 = never); needs ``run_dir`` to resume from.
        weights_name: name of the final ``save_weights_for_sampler`` checkpoint (``None``: do not save one).
        run_dir: directory for ``metrics.jsonl``, ``checkpoints.json`` and ``config.json`` (None = memory only).
        swanlab: ``"online"``, ``"offline"`` or ``"disabled"``.
        rollout: ``"sync"``, ``"async"`` or ``"pipeline"`` (see the module docstring).
        max_concurrency: requests in flight at once with ``"async"`` and ``"pipeline"``.
        max_staleness: with ``"pipeline"``, how many updates a batch's sampler may lag behind (>= 1).
        sampler_refresh_steps: without pipelining, take a new sampler every this many steps (1 = every step).
        loss_fn: ``forward_backward``'s loss, one of :data:`LOSSES`.
        loss_fn_config: the loss's settings, checked against :data:`trio_helpers.losses.LOSS_CONFIG` and sent to
            ``forward_backward`` merged with its defaults (``None``: the defaults), so the service applies the
            bounds the clip metrics assume.
        ref_kl_coef: weight of the KL penalty to the reference model (0: off). Each sampled token's advantage
            gets ``- ref_kl_coef * (logp_policy - logp_ref)``, with ``logp_ref`` from ``compute_logprobs`` of a
            frozen sampler of the reference (chapter 09). Needs temperature 1: the policy logprobs are then
            those of the distribution sampled from (another temperature is refused).
        ref_model_path: sampler weights of the reference, trained from ``base_model`` (``None``: the base
            model itself).

    The refinements of chapter 10, each off by default (the earlier chapters run without them):

    Attributes:
        loss_aggregation: how per-token losses are averaged, through the advantages each datum carries
            (:data:`trio_helpers.rl.LOSS_AGGREGATIONS`): ``"token"`` (the service's own normaliser,
            ``total_active_tokens`` of the ``forward_backward`` call), ``"sequence"`` (per-completion mean, then
            mean over completions) or ``"constant"`` (Dr. GRPO: ``n_datums * max_tokens``). Not with ``dro``.
        num_substeps: split each sampled batch's datums into this many minibatches, each with its own
            ``forward_backward`` and ``optim_step`` (tinker-cookbook's ``num_substeps``); the weights version,
            the sampler refresh and ``save_every`` still count sampled batches (steps).
        clip_higher: DAPO's clip-higher, the upper ratio bound of ``ppo`` or ``cispo`` (``clip_high_threshold``),
            e.g. 1.28 with ``ppo``'s lower 0.8; ``None``: ``loss_fn_config``'s (or the default) bound.
        dynamic_sampling: DAPO's dynamic sampling: at most this many extra prompts per step, drawn to replace
            groups whose rewards are all equal until the batch holds ``batch_size`` groups with signal (0: off).
            Extra prompts are drawn from the records outside the step's batch by a generator seeded with
            ``(seed, step)``, so a resumed run draws the same ones.
        tis_cap: truncated importance sampling (TIS) with cap ``C`` (``None``: off). Before training, each
            completion's logprobs are recomputed with ``compute_logprobs`` on a sampler of the current weights
            (``lp_train``); each token's advantage is multiplied by ``min(exp(lp_train - lp_sampler), C)`` and
            the datum carries ``lp_train`` as its logprobs, so the loss's own ratio starts at 1. On the offline
            backend (and on the service) ``lp_train`` comes from the sampler's numerics, so this corrects
            staleness (pipelining, ``sampler_refresh_steps``) and sample-vs-score differences, not the trainer's
            own kernels.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    base_model: str = "Qwen/Qwen3.5-4B"
    lora_rank: int = 32
    steps: int = 10
    batch_size: int = 4
    group_size: int = 4
    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 42
    learning_rate: float = 4e-5
    lr_schedule: str = "constant"
    beta1: float = 0.9
    beta2: float = 0.95
    all_data: bool = False
    save_every: int = 0
    weights_name: str | None = "final"
    run_dir: str | None = None
    swanlab: str = "disabled"
    rollout: str = "sync"
    max_concurrency: int = 8
    max_staleness: int = 1
    sampler_refresh_steps: int = 1
    loss_fn: str = "importance_sampling"
    loss_fn_config: dict | None = None
    ref_kl_coef: float = 0.0
    ref_model_path: str | None = None
    loss_aggregation: str = "token"
    num_substeps: int = 1
    clip_higher: float | None = None
    dynamic_sampling: int = 0
    tis_cap: float | None = None

    def validate(self) -> None:
        """Check every field; raises ``ValueError`` naming the field, the value and the fix.

        Introduced in: chapter 04 (notebooks/04_grpo_sync).
        """
        for name in ("steps", "batch_size", "group_size", "max_tokens", "max_concurrency", "max_staleness",
                     "sampler_refresh_steps"):
            if not _is_int(getattr(self, name), 1):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("save_every", "seed"):
            if not _is_int(getattr(self, name), 0):
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if not _is_int(self.lora_rank) or not 4 <= self.lora_rank <= 64:
            raise ValueError(f"lora_rank must be an integer in [4, 64] (the service's LoRA ranks), got "
                             f"{self.lora_rank!r}")
        if not (_is_real(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be a finite number > 0, got {self.learning_rate!r}")
        if not (_is_real(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.max_tokens >= MAX_SEQ_LEN:
            raise ValueError(f"max_tokens must be < {MAX_SEQ_LEN} (the models' sequence limit, prompt + "
                             f"completion), got {self.max_tokens}; lower max_tokens (--max-tokens)")
        if not _is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"top_k must be -1 (no truncation) or an integer >= 1, got {self.top_k!r}")
        for name in ("beta1", "beta2"):
            if not (_is_real(getattr(self, name)) and 0 <= getattr(self, name) < 1):
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        for name, allowed in (("lr_schedule", LR_SCHEDULES), ("rollout", ROLLOUTS), ("swanlab", SWANLAB_MODES),
                              ("loss_fn", LOSSES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got "
                                 f"{getattr(self, name)!r}")
        if self.loss_fn_config is not None and not isinstance(self.loss_fn_config, dict):
            raise ValueError(f"loss_fn_config must be a dict or None, got {type(self.loss_fn_config).__name__}")
        from trio_helpers.losses import check_loss_config

        check_loss_config(self.loss_fn, self.loss_fn_config)
        if not (_is_real(self.ref_kl_coef) and self.ref_kl_coef >= 0):
            raise ValueError(f"ref_kl_coef must be a finite number >= 0 (0 = no KL penalty), got "
                             f"{self.ref_kl_coef!r}")
        self._validate_variants()
        if self.ref_model_path is not None and (not isinstance(self.ref_model_path, str)
                                                or not self.ref_model_path.strip()):
            raise ValueError(f"ref_model_path must be a save_weights_for_sampler path or None, got "
                             f"{self.ref_model_path!r}")
        if self.ref_kl_coef > 0 and self.temperature != 1.0:
            raise ValueError(f"ref_kl_coef > 0 needs temperature 1, got temperature {self.temperature!r}: the penalty "
                             "reads the sampler's logprobs as the policy's, and at another temperature they are the "
                             "logprobs of a sharpened or flattened distribution; sample at temperature 1 or set "
                             "ref_kl_coef 0")
        if self.ref_model_path is not None and not self.ref_kl_coef:
            raise ValueError("ref_model_path is set but ref_kl_coef is 0, so the reference would never be "
                             "used; set ref_kl_coef > 0 or drop ref_model_path")
        if not isinstance(self.base_model, str) or not self.base_model.strip():
            raise ValueError(f"base_model must be a model name such as 'Qwen/Qwen3.5-4B', got {self.base_model!r}")
        name = self.weights_name
        if name is not None and (not isinstance(name, str) or not name or "/" in name or name.startswith(".")):
            raise ValueError(f"weights_name must be a name without '/' (e.g. 'final') or None, got {name!r}")
        if self.save_every and self.run_dir is None:
            raise ValueError(f"save_every={self.save_every} needs run_dir: checkpoints.json (the list of saved "
                             "states that resume reads) lives there; set run_dir, e.g. 'runs/grpo'")
        if self.rollout == "pipeline" and self.sampler_refresh_steps != 1:
            raise ValueError(f"sampler_refresh_steps={self.sampler_refresh_steps} with rollout='pipeline': the "
                             "pipeline already bounds staleness with max_staleness; use one of the two")

    def _validate_variants(self) -> None:
        """The chapter-10 options (one line naming the field, the value and the fix)."""
        from trio_helpers.rl import LOSS_AGGREGATIONS

        if self.loss_aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_aggregation must be one of {', '.join(map(repr, LOSS_AGGREGATIONS))}, got "
                             f"{self.loss_aggregation!r}")
        if self.loss_aggregation != "token" and self.loss_fn == "dro":
            raise ValueError(f"loss_aggregation={self.loss_aggregation!r} rescales advantages, which does not "
                             "rescale dro's penalty; use loss_aggregation='token' with dro, or another loss_fn")
        if not _is_int(self.num_substeps, 1):
            raise ValueError(f"num_substeps must be an integer >= 1 (1 = one optim_step per batch), got "
                             f"{self.num_substeps!r}")
        if self.clip_higher is not None:
            if self.loss_fn not in ("ppo", "cispo"):
                raise ValueError(f"clip_higher={self.clip_higher!r} needs loss_fn 'ppo' or 'cispo' (the clipped "
                                 f"losses), got loss_fn={self.loss_fn!r}; set loss_fn or clip_higher=None")
            if not (_is_real(self.clip_higher) and self.clip_higher >= 1):
                raise ValueError(f"clip_higher must be a finite number >= 1 (the upper ratio bound, e.g. 1.28), "
                                 f"got {self.clip_higher!r}")
            if "clip_high_threshold" in (self.loss_fn_config or {}):
                raise ValueError(f"clip_higher={self.clip_higher!r} and loss_fn_config['clip_high_threshold'] "
                                 "both set the upper bound; keep one of them")
        if not _is_int(self.dynamic_sampling, 0):
            raise ValueError(f"dynamic_sampling must be an integer >= 0 (extra prompts per step; 0 = off), got "
                             f"{self.dynamic_sampling!r}")
        if self.tis_cap is not None and not (_is_real(self.tis_cap) and self.tis_cap >= 1):
            raise ValueError(f"tis_cap must be None (off) or a finite number >= 1 (the cap C on the per-token "
                             f"ratio, e.g. 2), got {self.tis_cap!r}")

    def effective_loss_config(self) -> dict | None:
        """``loss_fn_config`` with ``clip_higher`` folded in as ``clip_high_threshold`` (what is sent).

        Introduced in: chapter 10 (notebooks/10_grpo_variants).
        """
        if self.clip_higher is None:
            return self.loss_fn_config
        return {**(self.loss_fn_config or {}), "clip_high_threshold": float(self.clip_higher)}


# ------------------------------------------------------------------------------------------ steps and requests
def total_steps_for(config: LoopConfig, n_records: int) -> int:
    """Steps in the run: ``config.steps``, or with ``all_data`` one pass, ``ceil(n_records / batch_size)``.

    Raises:
        ValueError: no records.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if n_records < 1:
        raise ValueError("records is empty: a run needs at least one record")
    return math.ceil(n_records / config.batch_size) if config.all_data else config.steps


def batch_for_step(records: Sequence[dict], step: int, batch_size: int, all_data: bool = False
                   ) -> list[tuple[int, dict]]:
    """The ``(record index, record)`` pairs of one step's batch.

    Without ``all_data`` batches run through the records in order and wrap around (step ``s`` takes indices
    ``s*B .. s*B+B-1`` modulo the number of records), so any number of steps works. With ``all_data`` there is
    no wrap-around: the last batch holds what is left, and a step past the end is an error.

    Raises:
        ValueError: negative step or batch size < 1, no records, or (``all_data``) a step past the last batch.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    n = len(records)
    if n == 0:
        raise ValueError("records is empty: a run needs at least one record")
    if step < 0 or batch_size < 1:
        raise ValueError(f"step must be >= 0 and batch_size >= 1, got step={step}, batch_size={batch_size}")
    start = step * batch_size
    if all_data:
        if start >= n:
            raise ValueError(f"step {step} is past the end of the data: with all_data, {n} records make "
                             f"{math.ceil(n / batch_size)} steps of batch_size {batch_size}")
        return [(i, records[i]) for i in range(start, min(start + batch_size, n))]
    return [((start + j) % n, records[(start + j) % n]) for j in range(batch_size)]


def request_seed(seed: int, step: int, prompt_index: int) -> int:
    """A sampling seed for one request, a deterministic mix of ``(seed, step, prompt_index)`` below ``2**31``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    return int(np.random.SeedSequence([seed, step, prompt_index]).generate_state(1)[0] & 0x7FFFFFFF)


def sampling_params_for(config: LoopConfig, step: int, prompt_index: int, stop=None):
    """``SamplingParams`` of one prompt's request: the config's budget and sampling settings, a seed per request.

    Seeding every request by ``(config.seed, step, prompt_index)`` makes a run reproducible whatever order requests
    complete in, and makes a resumed run sample exactly what the interrupted one would have.

    Args:
        config: the run's settings.
        step, prompt_index: which request.
        stop: stop token ids or strings (``trio_helpers.prompts.stop_token_ids(tokenizer)``).

    Returns:
        ``pytrio.SamplingParams``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    import pytrio as trio

    return trio.SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, top_p=config.top_p,
                               top_k=config.top_k, seed=request_seed(config.seed, step, prompt_index), stop=stop)


def learning_rate_at(config: LoopConfig, step: int, total_steps: int) -> float:
    """The learning rate of ``step``: constant, or cosine-decayed over ``total_steps``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if config.lr_schedule == "cosine":
        return cosine_lr(step, total_steps, config.learning_rate)
    return float(config.learning_rate)


def adam_params_at(config: LoopConfig, step: int, total_steps: int):
    """``pytrio.AdamParams`` of ``step`` (the scheduled learning rate, the config's betas).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    import pytrio as trio

    return trio.AdamParams(learning_rate=learning_rate_at(config, step, total_steps), beta1=config.beta1,
                           beta2=config.beta2)


def sampler_version(config: LoopConfig, step: int, start: int = 0) -> int:
    """The weights version (optimizer steps applied) that batch ``step`` is sampled from (module docstring).

    Args:
        config: the run's settings (``rollout``, ``max_staleness``, ``sampler_refresh_steps``, ``save_every``).
        step: the batch.
        start: the step the run (or the resumed run) started at: a resume point too.

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    base = start
    if config.save_every and step >= start:
        base = max(start, step - step % config.save_every)
    if config.rollout == "pipeline":
        return max(base, step - config.max_staleness)
    k = config.sampler_refresh_steps
    return base + k * ((step - base) // k)


# ---------------------------------------------------------------------------------------------- one step
async def completion_logprobs(sampler, group, seq, limiter: RequestLimiter, what: str) -> np.ndarray:
    """``sampler.compute_logprobs(prompt + completion)`` through the limiter: the completion's part, as float64.

    Raises:
        RuntimeError: the sampler returned a list of the wrong length.

    Introduced in: chapter 09 (notebooks/09_sft_and_kl).
    """
    from pytrio import ModelInput

    p = group.prompt.to_ints()
    full = await limiter.call(lambda: sampler.compute_logprobs_async(ModelInput.from_ints(p + list(seq.tokens))),
                              what=what, index=group.index)
    if len(full) != len(p) + len(seq.tokens):
        raise RuntimeError(f"{what} returned {len(full)} logprobs for {len(p) + len(seq.tokens)} tokens")
    return np.asarray(full[len(p):], dtype=np.float64)


async def ref_kl_penalty(group, ref, coef: float, limiter: RequestLimiter):
    """Fold a KL penalty to the reference into a scored group: per token, ``A - coef * (logp - logp_ref)``.

    One ``compute_logprobs(prompt + completion)`` request to the reference sampler per non-empty completion; the
    reference's logprobs are kept in ``group.extras["ref_logprobs"]`` and the advantages become per-token arrays.

    Raises:
        RuntimeError: the reference returned a list of the wrong length.

    Introduced in: chapter 09 (notebooks/09_sft_and_kl).
    """
    kept = [i for i, s in enumerate(group.sequences) if s.tokens]
    refs = await asyncio.gather(*(completion_logprobs(ref, group, group.sequences[i], limiter,
                                                      "reference compute_logprobs") for i in kept))
    advantages = list(group.advantages)
    ref_lps: list = [None] * len(group.sequences)
    for i, ref_lp in zip(kept, refs):
        logp = np.asarray(group.sequences[i].logprobs, dtype=np.float64)
        advantages[i] = np.broadcast_to(np.asarray(advantages[i], dtype=np.float64), logp.shape) \
            - coef * (logp - ref_lp)
        ref_lps[i] = ref_lp
    group.advantages = advantages
    group.extras["ref_logprobs"] = ref_lps
    return group


async def truncated_importance(group, sampler, cap: float, limiter: RequestLimiter):
    """Fold truncated importance sampling (TIS) into a scored group, in place (``LoopConfig.tis_cap``).

    One ``compute_logprobs(prompt + completion)`` request per non-empty completion to ``sampler`` (a sampler of
    the weights about to be trained) gives ``lp_train``; each token's advantage becomes
    ``A * min(exp(lp_train - lp_sampler), cap)`` (:func:`trio_helpers.rl.truncated_importance_weights`) and the
    datum will carry ``lp_train`` as its logprobs (``group.extras["train_logprobs"]``), so the loss's own ratio
    starts at 1 and the capped weight alone corrects for the sampler. ``group.extras["tis_capped"]`` keeps where
    the cap bound.

    Introduced in: chapter 10 (notebooks/10_grpo_variants).
    """
    from trio_helpers.rl import truncated_importance_weights

    kept = [i for i, s in enumerate(group.sequences) if s.tokens]
    new = await asyncio.gather(*(completion_logprobs(sampler, group, group.sequences[i], limiter,
                                                     "TIS compute_logprobs") for i in kept))
    advantages = list(group.advantages)
    train_lps = [s.logprobs for s in group.sequences]
    capped: list = [None] * len(group.sequences)
    for i, lp in zip(kept, new):
        w, capped[i] = truncated_importance_weights(lp, group.sequences[i].logprobs, cap)
        advantages[i] = np.asarray(advantages[i], dtype=np.float64) * w
        train_lps[i] = lp.tolist()
    group.advantages = advantages
    group.extras.update(train_logprobs=train_lps, tis_capped=capped)
    return group


def tis_metrics(groups: Sequence) -> dict[str, float]:
    """``tis/capped_frac`` (share of corrected tokens whose ratio exceeded the cap) and ``tis/requests``
    (``compute_logprobs`` requests sent); empty when no group was corrected.

    Introduced in: chapter 10 (notebooks/10_grpo_variants).
    """
    masks = [m for g in groups for m in (g.extras.get("tis_capped") or []) if m is not None]
    if not masks:
        return {}
    return {"tis/capped_frac": float(np.concatenate(masks).mean()), "tis/requests": float(len(masks))}


async def apply_tis(groups, sampler, config: LoopConfig, scorer, limiter: RequestLimiter):
    """:func:`truncated_importance` on every group that will be trained (none for skipped degenerate groups)."""
    skip = getattr(scorer, "skip_degenerate", False)
    await gather_or_cancel(truncated_importance(g, sampler, config.tis_cap, limiter)
                           for g in groups if not (skip and g.degenerate))
    return groups


def ref_kl_metrics(groups: Sequence) -> dict[str, float]:
    """``kl/ref_mean`` (per-token ``logp - logp_ref`` over the sampled tokens, an estimate of KL(policy || ref))
    and ``kl/ref_seq_mean`` (summed per completion, averaged); empty when no group carries reference logprobs.

    Introduced in: chapter 09 (notebooks/09_sft_and_kl).
    """
    per_token, per_seq = [], []
    for g in groups:
        for s, ref_lp in zip(g.sequences, g.extras.get("ref_logprobs") or []):
            if ref_lp is not None:
                k = np.asarray(s.logprobs, dtype=np.float64) - ref_lp
                per_token.append(k)
                per_seq.append(k.sum())
    if not per_token:
        return {}
    return {"kl/ref_mean": float(np.concatenate(per_token).mean()), "kl/ref_seq_mean": float(np.mean(per_seq))}


async def rollout_batch(sampler, scorer, tokenizer, records_batch: Sequence[tuple[int, dict]],
                        config: LoopConfig, step: int, limiter: RequestLimiter, stop=None, ref=None,
                        records: Sequence[dict] = ()) -> list:
    """Sample a group per prompt of the batch and let ``scorer`` score it; returns the scored groups in order.

    Every request (sampling, and the scorer's own, e.g. teacher logprobs) goes through ``limiter``: at most its
    ``max_concurrency`` in flight, sampling retried per its policy. With a reference sampler ``ref`` and
    ``config.ref_kl_coef > 0``, :func:`ref_kl_penalty` is folded into each group that will be trained: a group the
    scorer skips (degenerate, with ``skip_degenerate``) sends no datums, so its reference logprobs would be
    requests that change nothing (chapter 09). With ``config.dynamic_sampling`` (chapter 10), degenerate groups are
    replaced by groups of extra prompts drawn from ``records`` (:func:`extra_prompt_indices`) and the result is a
    :class:`SampledBatch` whose ``metrics`` count the extra requests.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    prompts = [scorer.prompt(tokenizer, record) for _, record in records_batch]

    async def one(i: int, prompt, record, dynamic: bool = False):
        if getattr(scorer, "make_env", None) is not None:  # a group of multi-turn episodes (chapter 12)
            group = await episode_group(sampler, scorer, tokenizer, i, record, config, step, limiter)
        else:
            params = sampling_params_for(config, step, i, stop=stop)
            response = await limiter.call(
                lambda: sampler.sample_async(prompt, num_samples=config.group_size, sampling_params=params),
                what=f"sample (step {step}, prompt {i})", index=i)
            group = await scorer.score(i, prompt, record, list(response.sequences), limiter)
        skipped = getattr(scorer, "skip_degenerate", False) and group.degenerate  # no datums will be sent
        if dynamic and group.degenerate:  # a dynamic-sampling draw only counts if it brings signal
            skipped = True
        if ref is not None and config.ref_kl_coef > 0 and not skipped:
            group = await ref_kl_penalty(group, ref, config.ref_kl_coef, limiter)
        return group

    groups = await gather_or_cancel(one(i, prompts[i], records_batch[i][1]) for i in range(len(prompts)))
    if not config.dynamic_sampling:
        return groups
    return await _fill_degenerate(groups, records, records_batch, config, step,
                                  lambda i, r: one(i, scorer.prompt(tokenizer, r), r, dynamic=True))


def episode_seed(seed: int, step: int, prompt_index: int, member: int) -> int:
    """The sampling seed of episode ``member`` of a prompt's group (chapter 12): a deterministic mix of
    ``(seed, step, prompt_index, member)`` below ``2**31`` (each episode is its own ``num_samples=1`` request per
    turn; later turns move it on with :func:`trio_helpers.episodes.turn_seed`).

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    return int(np.random.SeedSequence([seed, step, prompt_index, member]).generate_state(1)[0] & 0x7FFFFFFF)


async def episode_group(sampler, scorer, tokenizer, index: int, record: dict, config: LoopConfig, step: int,
                        limiter: RequestLimiter):
    """Play ``config.group_size`` episodes of one record (a fresh ``scorer.make_env(tokenizer)`` each, concurrently
    through ``limiter``) and let ``scorer.score_episodes`` turn them into a group.

    Each model turn is one ``sample_async`` request with ``max_tokens = config.max_tokens`` (per turn), the
    environment's ``stop`` strings and :func:`episode_seed`; an episode has at most ``scorer.max_turns`` turns and
    :data:`MAX_SEQ_LEN` tokens.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    import pytrio as trio

    from trio_helpers.episodes import run_episode_async

    async def member(j: int):
        env = scorer.make_env(tokenizer)
        params = trio.SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature,
                                     top_p=config.top_p, top_k=config.top_k,
                                     seed=episode_seed(config.seed, step, index, j), stop=list(env.stop))
        return await run_episode_async(sampler, env, record, params, scorer.max_turns, MAX_SEQ_LEN, limiter,
                                       tokenizer, index)

    episodes = await gather_or_cancel(member(j) for j in range(config.group_size))
    return await scorer.score_episodes(index, trio.ModelInput.from_ints(episodes[0].prompt), record, episodes)


class SampledBatch(list):
    """A step's scored groups (a list) with the metrics of how they were drawn (dynamic sampling's ``dynamic/*``).

    Introduced in: chapter 10 (notebooks/10_grpo_variants).
    """

    metrics: dict

    def __init__(self, groups=(), metrics: dict | None = None) -> None:
        super().__init__(groups)
        self.metrics = dict(metrics or {})


def extra_prompt_indices(n_records: int, step: int, seed: int, exclude: Sequence[int]) -> list[int]:
    """The order in which dynamic sampling draws extra prompts at ``step``: the record indices outside the step's
    batch (``exclude``), shuffled by a generator seeded with ``(seed, step)`` (a pure function: resumes agree).

    Introduced in: chapter 10 (notebooks/10_grpo_variants).
    """
    order = np.random.default_rng([seed, step, 0xD5]).permutation(n_records)
    banned = set(exclude)
    return [int(i) for i in order if int(i) not in banned]


async def _fill_degenerate(groups, records, records_batch, config: LoopConfig, step: int, draw) -> SampledBatch:
    """DAPO's dynamic sampling: replace degenerate groups (in batch order) by groups of extra prompts, drawn in
    rounds of as many prompts as groups still to replace, until none is left or ``config.dynamic_sampling`` extra
    prompts were drawn. Extra prompt ``j`` of the step is sampled with request index ``batch_size + j``."""
    pool = extra_prompt_indices(len(records), step, config.seed, [i for i, _ in records_batch]) if records else []
    groups, drawn, replaced = list(groups), 0, 0
    while True:
        holes = [k for k, g in enumerate(groups) if g.degenerate]
        n = min(len(holes), config.dynamic_sampling - drawn, len(pool) - drawn)
        if n <= 0:
            break
        picks = pool[drawn:drawn + n]
        new = await gather_or_cancel(draw(len(records_batch) + drawn + j, records[r]) for j, r in enumerate(picks))
        drawn += n
        good = iter(g for g in new if not g.degenerate)
        for k in holes:
            g = next(good, None)
            if g is None:
                break
            g.index = groups[k].index
            groups[k] = g
            replaced += 1
    metrics = {"dynamic/extra_prompts": float(drawn), "dynamic/extra_samples": float(drawn * config.group_size),
               "dynamic/replaced": float(replaced),
               "dynamic/unfilled": float(sum(g.degenerate for g in groups))}
    return SampledBatch(groups, metrics)


@dataclass
class StepOutput:
    """What one step did: its logged ``metrics`` row, the scored ``groups`` and the ``sampler`` they came from.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    step: int
    metrics: dict
    groups: list
    sampler: object = None


def _limiter(config: LoopConfig, retries) -> RequestLimiter:
    return RequestLimiter(1 if config.rollout == "sync" else config.max_concurrency, retries)


def train_step_metrics(training_client, scorer, groups, config: LoopConfig, step: int, total_steps: int) -> dict:
    """Train on a step's scored groups and return the step's metrics (scorer's, completions', training's).

    Raises:
        RuntimeError: the scorer requires datums (``scorer.require_datums``) and the step produced none.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    adam = adam_params_at(config, step, total_steps)
    train = train_on_groups(training_client, groups, adam, skip_degenerate=scorer.skip_degenerate,
                            loss_fn=config.loss_fn, loss_fn_config=config.effective_loss_config(),
                            loss_aggregation=config.loss_aggregation, max_tokens=config.max_tokens,
                            num_substeps=config.num_substeps)
    if train["train/datums"] == 0 and scorer.require_datums:
        raise RuntimeError(f"step {step} produced no datums (every completion was empty); check max_tokens "
                           f"({config.max_tokens}) and the stop tokens")
    return {**scorer.metrics(groups), **ref_kl_metrics(groups), **completion_metrics(groups, config.max_tokens),
            **getattr(groups, "metrics", {}), **tis_metrics(groups), **train, "train/lr": float(adam.learning_rate)}


def one_step(training_client, scorer, records_batch, config: LoopConfig, step: int, tokenizer, *,
             total_steps: int | None = None, retries: RetryPolicy | None = RetryPolicy(),
             ref=None) -> StepOutput:
    """One on-policy step, in the open: refresh the sampler, sample and score the batch, train.

    The same pieces the run uses (:func:`rollout_batch`, :func:`train_step_metrics`), for one step.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    from trio_helpers.prompts import stop_token_ids

    config.validate()
    t0 = time.perf_counter()
    sampler = training_client.save_weights_and_get_sampling_client()
    t1 = time.perf_counter()
    groups = run_sync(rollout_batch(sampler, scorer, tokenizer, records_batch, config, step,
                                    _limiter(config, retries), stop=stop_token_ids(tokenizer), ref=ref))
    if config.tis_cap is not None:  # the sampler just saved holds the current weights
        run_sync(apply_tis(groups, sampler, config, scorer, _limiter(config, retries)))
    t2 = time.perf_counter()
    metrics = train_step_metrics(training_client, scorer, groups, config, step, total_steps or config.steps)
    t3 = time.perf_counter()
    metrics.update({"sampler/version": step, "sampler/staleness": 0, "time/refresh_s": t1 - t0,
                    "time/sample_s": t2 - t1, "time/train_s": t3 - t2, "time/step_s": t3 - t0})
    return StepOutput(step, {"step": step, **metrics}, groups, sampler)


# ------------------------------------------------------------------------------------------ runs, checkpoints
class RunStopped(RuntimeError):
    """A service call failed for good (after pytrio's retries, and ours for sampling); the run stopped cleanly.

    Attributes:
        step: the step that failed; ``completed``: steps logged before it; ``checkpoint``: the last saved state
            (``{"step", "path"}``) or None; ``call``: what failed; ``__cause__``: the error.

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """

    def __init__(self, step: int, call: str, error: BaseException, checkpoint: dict | None, completed: int):
        if isinstance(error, RetriesExhausted):
            call, error = f"{error.what} (after pytrio's retries and {error.attempts} attempts of ours)", \
                error.last_error
        self.step, self.call, self.checkpoint, self.completed = step, call, checkpoint, completed
        message = getattr(error, "message", None) or str(error)
        if isinstance(error, OSError) and error.strerror:
            from trio_helpers.tracking import os_fix

            message = (f"{error.strerror}" + (f" ({error.filename})" if error.filename else "")
                       + f"; {os_fix(error)} (--run-dir)")
        where = (f"resume from the saved state after step {checkpoint['step']} with resume=True "
                 "(recipes: --resume)" if checkpoint else "no state was saved, so the run cannot resume "
                 "(set save_every and run_dir to make it resumable; recipes: --save-every N --run-dir DIR)")
        super().__init__(f"step {step}: {call} failed: {type(error).__name__}: {message}. The run stopped "
                         f"cleanly after {completed} logged steps; {where}")


@dataclass
class RunResult:
    """What a run returns.

    Attributes:
        history: one row per step (``{"step": s, **metrics}``), steps 0..N-1, including the steps done before a
            resume (read back from ``metrics.jsonl``).
        final_path: the ``save_weights_for_sampler`` path of the final weights (load it with
            ``service.create_sampling_client(base_model, model_path=final_path)``), or None.
        checkpoints: ``[{"step": completed_steps, "path": save_state_path}, ...]`` of this run directory.
        start_step: 0 for a fresh run, the checkpoint's step for a resumed one.
        run_dir: the run directory (or None).
        training_client: the trained ``TrainingClient`` (e.g. to keep training or sampling).
        scorer: the scorer (e.g. ``result.scorer.teacher`` for OPD).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    history: list[dict]
    final_path: str | None
    checkpoints: list[dict] = field(default_factory=list)
    start_step: int = 0
    run_dir: str | None = None
    training_client: object = field(default=None, repr=False)
    scorer: object = field(default=None, repr=False)

    def series(self, key: str) -> np.ndarray:
        """One metric over the steps as a float64 array (NaN where a row lacks it), e.g. ``"reward/mean"``.

        Raises:
            KeyError: no row has that key.
        """
        if not any(key in row for row in self.history):
            raise KeyError(f"no step logged {key!r}; keys: {sorted(self.history[0]) if self.history else []}")
        return np.array([np.nan if row.get(key) is None else row[key] for row in self.history], dtype=np.float64)


@dataclass
class RunState:
    """The moving parts of a run between :func:`open_run` and :func:`finish_run`.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    config: LoopConfig
    training_client: object
    tokenizer: object
    logger: object
    start_step: int
    total_steps: int
    run_dir: Path | None
    checkpoints: list[dict]
    owns_logger: bool
    ref: object = None
    lock: int | None = None


def read_checkpoints(run_dir: str | os.PathLike) -> list[dict]:
    """The saved states listed in ``run_dir/checkpoints.json`` (oldest first); ``[]`` if there is none.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    path = Path(run_dir) / CHECKPOINTS_FILE
    if not path.exists():
        return []
    return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: Path, value) -> None:
    from trio_helpers.tracking import write_atomic

    write_atomic(path, json.dumps(value, indent=1) + "\n")


def data_fingerprint(records: Sequence[dict]) -> dict:
    """``{"records": n, "sha256": ...}`` of a run's records: what ``config.json`` says the run trained on.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps(record, sort_keys=True, default=str).encode() + b"\n")
    return {"records": len(records), "sha256": digest.hexdigest()[:16]}


def _metrics_digest(run_dir: Path, before_step: int) -> str | None:
    """A digest of the rows of steps ``< before_step`` in ``run_dir/metrics.jsonl`` (None: no such file)."""
    from trio_helpers.tracking import METRICS_FILE, _read_jsonl

    path = run_dir / METRICS_FILE
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    for row in _read_jsonl(path):
        if isinstance(row.get("step"), int) and row["step"] < before_step:
            digest.update(json.dumps(row).encode() + b"\n")
    return digest.hexdigest()[:16]


def lock_run_dir(run_dir: str | os.PathLike) -> int:
    """Take the run directory's lock; returns the descriptor that holds it (``os.close`` releases it).

    The lock is ``flock`` on the directory itself: the kernel releases it when the holding process exits, however
    it exits, so a run that was killed never leaves a stale lock behind; the next run simply takes it (atomically,
    so two runs racing for a dead run's directory cannot both get it). No lock file is written.

    Raises:
        ValueError: another live run holds the lock (one line, with the fix).

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"run_dir {str(run_dir)!r} is in use by another run that is still running; wait for it "
                         "to finish, or choose another run_dir (--run-dir)") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _identity_problem(run_dir: Path, saved: dict | None, config: LoopConfig, algorithm: str,
                      data: dict | None) -> str | None:
    if saved is None:
        return (f"it has run files but no {CONFIG_FILE}, so nothing says which run they belong to")
    if any(key not in saved for key in ("algorithm", "run_id")):
        return f"its {CONFIG_FILE} has no run identity (algorithm, run_id): it was not written by this loop"
    if saved["algorithm"] != algorithm:
        return f"it holds a run of algorithm {saved['algorithm']!r} and this run is {algorithm!r}"
    if data is not None and saved.get("data") is not None and saved["data"] != data:
        return (f"it was trained on other data (saved {saved['data']['records']} records, sha256 "
                f"{saved['data']['sha256']}; now {data['records']} records, sha256 {data['sha256']})")
    now = asdict(config)
    changed = {k: (saved[k], now[k]) for k in now
               if k in saved and k not in MAY_CHANGE_ON_RESUME and saved[k] != now[k]}
    defaults = {f.name: f.default for f in fields(config)}
    missing = [k for k in now if k not in saved and k not in MAY_CHANGE_ON_RESUME
               and now[k] != defaults.get(k)]  # a setting added since the run was saved, left at its default
    if changed or missing:
        detail = ", ".join([f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in changed.items()]
                           + [f"{k}: not saved" for k in missing])
        raise ValueError(f"cannot resume run_dir {str(run_dir)!r} with different settings ({detail}); use the "
                         "saved settings, or a new run_dir (--run-dir) with resume=False (no --resume)")
    return None


def check_run_dir(run_dir: str | os.PathLike, config: LoopConfig, algorithm: str,
                  records: Sequence[dict] | None = None, resume: bool = False) -> list[dict]:
    """Everything about ``run_dir`` that can be checked before a client is created or a sample drawn.

    The path must be a directory (created if missing) that a file can be written in, and no live run may hold
    it (:func:`lock_run_dir`). With ``resume``, the directory must belong to this run: its ``config.json`` has
    the same algorithm, data and settings (:data:`MAY_CHANGE_ON_RESUME` aside), ``checkpoints.json`` lists a
    state of that run (same ``run_id``), and ``metrics.jsonl`` holds the rows that run logged before that state.

    Returns:
        The saved states (``checkpoints.json``) with ``resume``, else ``[]``.

    Raises:
        ValueError: one line naming the directory, what is wrong and the fix.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    from trio_helpers.tracking import METRICS_FILE, check_writable_dir

    run_dir = Path(run_dir)
    if not resume:
        check_writable_dir(run_dir, "run_dir")
        if run_dir.is_dir():
            os.close(lock_run_dir(run_dir))
        return []
    if not run_dir.is_dir():
        what = "is a file" if run_dir.exists() else "does not exist"
        raise ValueError(f"resume=True, but run_dir {str(run_dir)!r} {what}, so it has no saved state; pass the "
                         "run_dir (--run-dir) of the run to continue, or start fresh without resume (--resume)")
    check_writable_dir(run_dir, "run_dir")
    os.close(lock_run_dir(run_dir))
    config_path = run_dir / CONFIG_FILE
    try:
        saved = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else None
        checkpoints = read_checkpoints(run_dir)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot resume run_dir {str(run_dir)!r}: its {CONFIG_FILE} or {CHECKPOINTS_FILE} is "
                         f"unreadable ({err}); start fresh in another run_dir (--run-dir) without --resume"
                         ) from None
    has_files = saved is not None or checkpoints or (run_dir / METRICS_FILE).exists()
    if not checkpoints:
        hint = ("start the run with save_every > 0 (--save-every N), or start fresh without resume "
                "(drop --resume)")
        if has_files:
            raise ValueError(f"resume=True, but run_dir {str(run_dir)!r} has no saved state in {CHECKPOINTS_FILE} "
                             f"(the run stopped before its first save_state); {hint}")
        raise ValueError(f"resume=True, but run_dir {str(run_dir)!r} has no saved state in {CHECKPOINTS_FILE}; "
                         f"{hint}")
    problem = _identity_problem(run_dir, saved, config, algorithm,
                                data_fingerprint(records) if records is not None else None)
    last = checkpoints[-1]
    if problem is None and last.get("run_id") != saved.get("run_id"):
        problem = (f"its {CHECKPOINTS_FILE} lists states of run {last.get('run_id')!r}, its {CONFIG_FILE} is of "
                   f"run {saved.get('run_id')!r}")
    if problem is None and last.get("metrics_sha256") is not None:
        if _metrics_digest(run_dir, int(last["step"])) != last["metrics_sha256"]:
            problem = (f"its {METRICS_FILE} does not hold the rows its run logged before the state of step "
                       f"{last['step']} (rows of another run were written there)")
    if problem is not None:
        raise ValueError(f"cannot resume run_dir {str(run_dir)!r}: {problem}; resume it with its own settings, or "
                         "start fresh in a new run_dir (--run-dir) without --resume")
    return checkpoints


def open_run(service, records: Sequence[dict], config: LoopConfig, scorer, logger=None, resume: bool = False,
             training_client=None) -> RunState:
    """Check everything, then create (or, with ``resume``, restore) the training client, logger and run directory.

    Every check that can fail (config, records, resume settings, SwanLab mode) runs before any client is created
    or any file of ``run_dir`` is touched. With ``ref_kl_coef > 0`` the frozen reference sampler is created next,
    before any training client, so a reference that cannot serve ``base_model`` (weights trained from another
    base) is refused before a training run exists (chapter 09). A fresh run creates a LoRA training client seeded
    with ``config.seed`` (or continues ``training_client``) and writes ``config.json``, replacing
    ``metrics.jsonl`` and ``checkpoints.json``. A resumed run restores weights *and* Adam's state from the last entry of
    ``checkpoints.json`` with ``create_training_client_from_state_with_optimizer``, continues at that entry's step,
    and drops logged rows of later steps (they are redone), so ``metrics.jsonl`` holds each step exactly once.

    Raises:
        ValueError: invalid config or records; ``resume`` without ``run_dir`` or checkpoint, with settings that
            differ from the saved ``config.json``, or together with ``training_client``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    from trio_helpers import tracking

    config.validate()
    records = list(records)
    total = total_steps_for(config, len(records))
    scorer.check_records(records)
    run_dir = Path(config.run_dir) if config.run_dir is not None else None
    if logger is None and hasattr(tracking, "check_swanlab"):
        tracking.check_swanlab(config.swanlab)
    if resume:
        if run_dir is None:
            raise ValueError("resume=True needs config.run_dir: it holds checkpoints.json and metrics.jsonl")
        if training_client is not None:
            raise ValueError("resume=True restores the training client from the run's last checkpoint; do not "
                             "pass training_client as well")
    lock, created = None, False
    if run_dir is not None:
        checkpoints = check_run_dir(run_dir, config, scorer.name, records, resume=resume)
        created = not run_dir.exists()
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"run_dir {str(run_dir)!r} cannot be created: {err.strerror}; choose another "
                             "run_dir (--run-dir)") from None
        lock = lock_run_dir(run_dir)  # held until the run ends (finish_run, or the run's failure)
    try:
        return _open_run(service, records, config, scorer, logger, resume, training_client, run_dir, total,
                         checkpoints if resume else [], lock)
    except BaseException:
        if lock is not None:
            os.close(lock)
        if created:  # a run refused before it wrote anything leaves no empty directory behind
            try:
                run_dir.rmdir()
            except OSError:
                pass
        raise


def _open_run(service, records, config, scorer, logger, resume, training_client, run_dir, total, checkpoints,
              lock) -> RunState:
    from trio_helpers import tracking

    # The frozen reference sampler of the KL penalty comes first: a reference that cannot serve this base
    # model (weights trained from another one) is refused before any training run is created.
    ref = None
    if config.ref_kl_coef > 0:
        ref = service.create_sampling_client(config.base_model, model_path=config.ref_model_path)
    run_id = None
    if resume:
        last = checkpoints[-1]
        scorer.setup(service)
        training_client = service.create_training_client_from_state_with_optimizer(last["path"])
        start = int(last["step"])
        run_id = last.get("run_id")
    else:
        checkpoints = []
        scorer.setup(service)
        if training_client is None:
            training_client = service.create_lora_training_client(config.base_model, rank=config.lora_rank,
                                                                   seed=config.seed)
        start = 0
        if run_dir is not None:
            _write_json(run_dir / CHECKPOINTS_FILE, [])
    if run_dir is not None:
        identity = {"algorithm": scorer.name, "data": data_fingerprint(records),
                    "run_id": run_id or secrets.token_hex(8)}
        _write_json(run_dir / CONFIG_FILE, {**asdict(config), **identity})
    owns = logger is None
    if owns:
        logger = tracking.MetricsLogger(run_dir, swanlab=config.swanlab, project=f"trio-book-{scorer.name}",
                                        config=asdict(config), resume=resume)
    if resume and hasattr(logger, "truncate"):
        logger.truncate(start)
    return RunState(config, training_client, training_client.get_tokenizer(), logger, start, total, run_dir,
                    checkpoints, owns, ref, lock)


def _close_run(run: RunState) -> None:
    """Close the logger if the run created it, and release the run directory's lock."""
    try:
        if run.owns_logger:
            run.logger.close()
    finally:
        if run.lock is not None:
            os.close(run.lock)
            run.lock = None


def save_checkpoint(run: RunState, done: int) -> dict:
    """``save_state`` after ``done`` completed steps (weights + optimizer) and append it to ``checkpoints.json``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    path = run.training_client.save_state(f"step-{done:06d}", overwrite=True).result().path
    entry = {"step": done, "path": path}
    if run.run_dir is not None:
        saved = json.loads((run.run_dir / CONFIG_FILE).read_text(encoding="utf-8"))
        entry.update(run_id=saved.get("run_id"), metrics_sha256=_metrics_digest(run.run_dir, done))
        _write_json(run.run_dir / CHECKPOINTS_FILE, [*run.checkpoints, entry])  # listed once it is on disk
    run.checkpoints.append(entry)
    return entry


def record_step(run: RunState, step: int, metrics: dict) -> dict:
    """Log one finished step and, every ``save_every`` steps, save the training state and list it.

    Returns:
        The logged row.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    row = run.logger.log(step, metrics)
    done = step + 1
    every = run.config.save_every
    if every and done % every == 0 and done < run.total_steps:
        save_checkpoint(run, done)
    return row


def finish_run(run: RunState, scorer=None) -> RunResult:
    """Save the final state (when checkpointing is on, so the run can be extended later) and the final sampler
    weights (``weights_name``), close the logger if the run created it, and return the result.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if run.config.save_every and (not run.checkpoints or run.checkpoints[-1]["step"] != run.total_steps):
        save_checkpoint(run, run.total_steps)
    final = None
    if run.config.weights_name:
        final = run.training_client.save_weights_for_sampler(run.config.weights_name).result().path
    history = sorted(run.logger.history(), key=lambda r: r["step"])
    _close_run(run)
    return RunResult(history=history, final_path=final, checkpoints=list(run.checkpoints),
                     start_step=run.start_step, run_dir=str(run.run_dir) if run.run_dir is not None else None,
                     training_client=run.training_client, scorer=scorer)


PHASE_KINDS = ("sample_start", "sample_end", "train_start", "train_end")
"""Kinds of ``on_event(kind, step, t)`` calls of :func:`run_loop` (for timelines)."""


def _service_error(error: BaseException) -> bool:
    """An error of a service call that pytrio (and, for sampling, we) already retried: the run stops cleanly."""
    from pytrio.errors.auth import AuthError
    from pytrio.errors.base import PyTrioError, ValidationError

    if isinstance(error, RetriesExhausted):
        return True
    return isinstance(error, PyTrioError) and not isinstance(error, (ValidationError, AuthError))


async def _steps(run: RunState, records: list, scorer, retries, on_step, on_event, bar, print_every) -> None:
    from trio_helpers.prompts import stop_token_ids

    config, start, total = run.config, run.start_step, run.total_steps
    stop = stop_token_ids(run.tokenizer)
    limiter = _limiter(config, retries)
    ahead = config.max_staleness if config.rollout == "pipeline" else 0
    samplers: dict[int, object] = {}  # by the version whose weights they hold (see `same`)
    same: dict[int, int] = {}  # version -> the earlier version with identical weights (a step trained nothing)
    pending: dict[int, tuple[int, object, asyncio.Task]] = {}
    sample_s: dict[int, float] = {}
    version, launched, t_prev = start, start, time.perf_counter()

    def emit(kind: str, step: int) -> None:
        if on_event is not None:
            on_event(kind, step, time.perf_counter())

    async def sample(step: int, sampler):
        t0 = time.perf_counter()
        batch = batch_for_step(records, step, config.batch_size, config.all_data)
        groups = await rollout_batch(sampler, scorer, run.tokenizer, batch, config, step, limiter, stop=stop,
                                     ref=run.ref, records=records)
        sample_s[step] = time.perf_counter() - t0
        emit("sample_end", step)
        return groups

    try:
        for step in range(start, total):
            refresh_s = 0.0
            while launched < total and launched <= step + ahead:
                v = sampler_version(config, launched, start)
                if v > version:
                    break  # this batch needs weights that are not trained yet
                held = same.get(v, v)  # no second save of weights already saved
                if held not in samplers:
                    t0 = time.perf_counter()
                    try:
                        samplers[held] = await run.training_client.save_weights_and_get_sampling_client_async()
                    except Exception as error:
                        if _service_error(error):
                            raise _Failed(step, "the sampler refresh (save_weights_and_get_sampling_client)",
                                          error) from error
                        raise
                    refresh_s += time.perf_counter() - t0
                emit("sample_start", launched)
                pending[launched] = (v, samplers[held], asyncio.ensure_future(sample(launched, samplers[held])))
                launched += 1
            v, sampler, task = pending.pop(step)
            t_wait = time.perf_counter()
            try:
                groups = await task
            except Exception as error:
                if _service_error(error):
                    raise _Failed(step, "sampling or scoring", error) from error
                raise
            wait_s = time.perf_counter() - t_wait
            if config.tis_cap is not None:  # TIS: logprobs of the weights about to be trained
                current = same.get(version, version)
                try:
                    if current not in samplers:
                        t0 = time.perf_counter()
                        samplers[current] = await run.training_client.save_weights_and_get_sampling_client_async()
                        refresh_s += time.perf_counter() - t0
                    groups = await apply_tis(groups, samplers[current], config, scorer, limiter)
                except Exception as error:
                    if _service_error(error):
                        raise _Failed(step, "truncated importance sampling (compute_logprobs)", error) from error
                    raise
            emit("train_start", step)
            t_train = time.perf_counter()
            try:
                metrics = await asyncio.to_thread(train_step_metrics, run.training_client, scorer, groups, config,
                                                  step, total)
            except Exception as error:
                if _service_error(error):
                    raise _Failed(step, "a training call (forward_backward or optim_step)", error) from error
                raise
            emit("train_end", step)
            if metrics["train/datums"] == 0:  # nothing sent, no optim_step: the next version has these weights
                same[version + 1] = same.get(version, version)
            version += 1
            now = time.perf_counter()
            metrics.update({"sampler/version": v, "sampler/staleness": step - v, "time/refresh_s": refresh_s,
                            "time/sample_s": sample_s.pop(step), "time/wait_s": wait_s,
                            "time/train_s": now - t_train, "time/step_s": now - t_prev})
            t_prev = now
            try:
                row = await asyncio.to_thread(record_step, run, step, metrics)  # may save_state: off the loop
            except Exception as error:
                if _service_error(error):
                    raise _Failed(step + 1, "save_state", error) from error
                if isinstance(error, OSError):  # a full disk, a read-only run_dir: the files stay consistent
                    raise _Failed(step, "writing the run directory (metrics.jsonl, checkpoints.json)",
                                  error) from error
                raise
            needed = {same.get(sampler_version(config, s, start), sampler_version(config, s, start))
                      for s in range(step + 1, min(total, step + ahead + 2))} | {same.get(version, version)}
            for old in [k for k in samplers if k not in needed and k < version]:
                del samplers[old]
            if bar is not None:
                bar.update(1)
                bar.set_postfix({label: f"{row[k]:.3f}" for k, label in scorer.headline.items() if k in row})
            if print_every and (step % print_every == 0 or step == total - 1):
                print(format_row(row, scorer.headline))
            if on_step is not None:
                on_step(StepOutput(step, row, groups, sampler))
    finally:
        for *_, task in pending.values():
            task.cancel()
        if pending:
            await asyncio.gather(*(task for *_, task in pending.values()), return_exceptions=True)


class _Failed(Exception):
    def __init__(self, step: int, call: str, error: BaseException) -> None:
        super().__init__(call)
        self.step, self.call, self.error = step, call, error


def run_loop(service, records: Sequence[dict], config: LoopConfig, scorer, *, logger=None, resume: bool = False,
             progress: bool = False, training_client=None, retries: RetryPolicy | None = RetryPolicy(),
             on_step: Callable[[StepOutput], None] | None = None,
             on_event: Callable[[str, int, float], None] | None = None, print_every: int = 0) -> RunResult:
    """Run the loop for every step: rollouts, scoring, training, logging, checkpoints, final weights.

    Args:
        service: a ``ServiceClient`` (``trio_helpers.connect()``).
        records: the run's records (the scorer says which fields they need).
        config: the run's settings (validated first).
        scorer: turns each sampled group into advantages (:class:`trio_helpers.grpo.GRPOScorer`,
            :class:`trio_helpers.distillation.OPDScorer`).
        logger: where metrics go; default a :class:`trio_helpers.tracking.MetricsLogger` on ``config.run_dir``.
        resume: continue from the last state in ``config.run_dir/checkpoints.json`` (see :func:`open_run`).
        progress: show a ``tqdm.auto`` progress bar over the steps.
        training_client: continue training this client instead of creating a fresh one.
        retries: user-level retry policy for sampling and scoring requests (pytrio retries first; ``None``: none).
        on_step: called with each step's :class:`StepOutput`.
        on_event: ``on_event(kind, step, t)`` with kinds :data:`PHASE_KINDS` (``t`` from ``time.perf_counter()``).
        print_every: print :func:`format_row` every this many steps (0: never).

    Returns:
        :class:`RunResult`.

    Raises:
        ValueError: invalid config or records, or an impossible resume (nothing is created or written then).
        RunStopped: a service call failed for good; the run stopped cleanly (see the module docstring).
        KeyboardInterrupt: interrupted; metrics of finished steps and the checkpoints are kept.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    from tqdm.auto import tqdm

    records = list(records)
    run = open_run(service, records, config, scorer, logger=logger, resume=resume, training_client=training_client)
    bar = tqdm(total=run.total_steps, initial=run.start_step, desc=scorer.name.upper(), unit="step",
               disable=not progress) if progress else None
    try:
        if run.total_steps > run.start_step:
            run_sync(_steps(run, records, scorer, retries, on_step, on_event, bar, print_every))
    except _Failed as failed:
        _close_run(run)
        last = run.checkpoints[-1] if run.checkpoints else None
        done = len(run.logger.history())
        raise RunStopped(failed.step, failed.call, failed.error, last, done) from failed.error
    except BaseException:
        _close_run(run)
        raise
    finally:
        if bar is not None:
            bar.close()
    try:
        return finish_run(run, scorer)
    except BaseException as error:
        _close_run(run)
        if not isinstance(error, Exception) or not (_service_error(error) or isinstance(error, OSError)):
            raise
        last = run.checkpoints[-1] if run.checkpoints else None
        raise RunStopped(run.total_steps, "saving the final state (save_state or save_weights_for_sampler)",
                         error, last, len(run.logger.history())) from error


def format_row(row: dict, keys: dict | None = None) -> str:
    """One printed line for a logged row: its step (0-based, as in ``metrics.jsonl``), the headline metrics
    (``{key: label}``, e.g. a scorer's ``headline``), datums, training tokens, loss and learning rate; no
    wall-clock numbers.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    loss = row.get("train/loss")
    parts = [f"step {row['step']:>3}"]
    parts += [f"{label} {row[k]:.4f}" for k, label in (keys or {}).items() if k in row]
    parts += [f"datums {int(row.get('train/datums', 0)):>3}", f"tokens {int(row.get('train/tokens', 0)):>6}",
              "loss " + (f"{loss:+.4f}" if isinstance(loss, float) and math.isfinite(loss) else "-"),
              f"lr {row.get('train/lr', float('nan')):.1e}"]
    return "  ".join(parts)


def config_from_dict(cls, values: dict):
    """A config of class ``cls`` from a dict (e.g. a saved ``config.json``), ignoring unknown keys.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})

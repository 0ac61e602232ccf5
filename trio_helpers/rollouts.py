"""Concurrent rollouts: sampling a batch's groups at once, retrying transient errors, and pipelined GRPO.

On the service a GRPO step spends most of its time *waiting*: for each sampling request to come back and for the
training call. Sending one request after another adds those waits up; sending them all at once (bounded by a
concurrency limit) overlaps them, so a step takes about as long as its slowest request plus the training call.
Pipelining goes one step further and samples batch ``t + 1`` while batch ``t`` trains, at the price of sampling
from weights that are one update old (bounded by ``max_staleness``; the importance ratio corrects for it).

- :func:`sample_groups_async`: every prompt's group requested concurrently, at most ``max_concurrency`` in flight,
  results in prompt order, an optional progress bar and per-request events for timelines;
- :class:`RetryPolicy`, :func:`with_retries`: exponential backoff with a cap for pytrio errors marked
  ``retryable``; everything else is raised at once;
- :func:`run_grpo_pipelined`: chapter 04's GRPO loop with sampling overlapped with training;
- :func:`run_sync`: run a coroutine from ordinary (synchronous) code, also inside Jupyter's running event loop.

Introduced in: chapter 05 (notebooks/05_grpo_async).
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

EventCallback = Callable[[str, int, float], None]
"""``on_event(kind, index, t)``: ``kind`` is ``"start"``, ``"end"`` or ``"error"`` (one per attempt), ``index`` the
prompt's position in the batch, ``t`` a ``time.perf_counter()`` reading."""


# --------------------------------------------------------------------------------------------------- retries
def is_retryable(error: BaseException) -> bool:
    """True for a pytrio error whose ``retryable`` flag is set (e.g. a 503 ``ActorAPIError``), False otherwise.

    Validation errors, authentication errors and anything that is not a ``pytrio.errors.base.PyTrioError`` (a bug
    in our own code, a ``KeyboardInterrupt``) are never retried: repeating them cannot succeed.

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    from pytrio.errors.base import PyTrioError

    return isinstance(error, PyTrioError) and getattr(error, "retryable", False) is True


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a transient error: exponential backoff with a cap, no jitter.

    Attempt ``k`` (1-based) that fails with a retryable error is followed by a wait of
    ``min(max_delay, initial_delay * multiplier ** (k - 1))`` seconds, then attempt ``k + 1``; after
    ``max_attempts`` failed attempts :func:`with_retries` gives up. The waits are deterministic: many clients
    retrying in lock-step would add random jitter (pytrio's own ``retry_jitter_ratio``), but a reproducible book
    keeps them fixed.

    Attributes:
        max_attempts: attempts in all, including the first (1 = never retry).
        initial_delay: seconds to wait after the first failure.
        multiplier: growth factor of the wait from one failure to the next (>= 1).
        max_delay: cap on any single wait, in seconds.

    Raises:
        ValueError: ``max_attempts < 1``, a negative delay, ``multiplier < 1`` or ``max_delay < initial_delay``.

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """

    max_attempts: int = 4
    initial_delay: float = 0.05
    multiplier: float = 2.0
    max_delay: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or isinstance(self.max_attempts, bool) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1 (1 = no retries), got {self.max_attempts!r}")
        if not (math.isfinite(self.initial_delay) and self.initial_delay >= 0):
            raise ValueError(f"initial_delay must be a finite number of seconds >= 0, got {self.initial_delay!r}")
        if not (math.isfinite(self.multiplier) and self.multiplier >= 1):
            raise ValueError(f"multiplier must be >= 1 (waits never shrink), got {self.multiplier!r}")
        if not (math.isfinite(self.max_delay) and self.max_delay >= self.initial_delay):
            raise ValueError(
                f"max_delay must be >= initial_delay ({self.initial_delay}), got {self.max_delay!r}; "
                "raise max_delay or lower initial_delay"
            )

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based) before the next one.

        Introduced in: chapter 05 (notebooks/05_grpo_async).
        """
        if attempt < 1:
            raise ValueError(f"attempt is 1-based, got {attempt}")
        return min(self.max_delay, self.initial_delay * self.multiplier ** (attempt - 1))

    def delays(self) -> list[float]:
        """Every wait of a request that fails all its attempts: ``max_attempts - 1`` numbers.

        Introduced in: chapter 05 (notebooks/05_grpo_async).
        """
        return [self.delay(k) for k in range(1, self.max_attempts)]


class RetriesExhausted(RuntimeError):
    """A call failed with a retryable error on every one of its attempts.

    Attributes:
        attempts: how many attempts were made.
        last_error: the error of the last attempt (also the ``__cause__``).

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """

    def __init__(self, attempts: int, last_error: BaseException, what: str = "call") -> None:
        self.attempts = attempts
        self.last_error = last_error
        message = getattr(last_error, "message", None) or str(last_error)
        super().__init__(
            f"{what} gave up after {attempts} attempt{'' if attempts == 1 else 's'}; last error: {type(last_error).__name__}: {message}. "
            "The error is transient, so the service may just be busy: retry later, or allow more attempts "
            "(RetryPolicy(max_attempts=...))"
        )


async def with_retries(
    make_call: Callable[[], Awaitable],
    policy: RetryPolicy | None = None,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
    what: str = "call",
):
    """Await ``make_call()``; on a retryable pytrio error wait (per ``policy``) and call it again.

    Args:
        make_call: a function with no arguments that *starts a new request* and returns its awaitable (e.g.
            ``lambda: sampler.sample_async(prompt, ...)``). It is called once per attempt: an awaitable cannot be
            awaited twice.
        policy: attempts and waits; default ``RetryPolicy()`` (4 attempts, waits 0.05, 0.1, 0.2 s).
        on_retry: called as ``on_retry(attempt, error, delay)`` after each failed attempt that will be retried,
            before the wait; use it to count or log retries.
        what: names the call in the error message (e.g. ``"sample (prompt 3)"``).

    Returns:
        What the first successful attempt returned.

    Raises:
        RetriesExhausted: every attempt failed with a retryable error; its message has the number of attempts and
            the last error, which is also its ``__cause__``.
        Exception: any non-retryable error (see :func:`is_retryable`), unchanged, at its first occurrence.

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    policy = RetryPolicy() if policy is None else policy
    if not isinstance(policy, RetryPolicy):
        raise TypeError(f"policy must be a RetryPolicy (or None for the default), got {type(policy).__name__}")
    for attempt in range(1, policy.max_attempts + 1):
        try:
            return await make_call()
        except Exception as error:  # noqa: BLE001 - filtered right below; non-retryable errors re-raised unchanged
            if not is_retryable(error):
                raise
            if attempt == policy.max_attempts:
                raise RetriesExhausted(attempt, error, what) from error
            delay = policy.delay(attempt)
            if on_retry is not None:
                on_retry(attempt, error, delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


# --------------------------------------------------------------------------------------------------- rollouts
def _progress_bar(progress, total: int):
    """A ``tqdm.auto`` bar, or ``None`` for no bar. ``None`` = on only when stderr is a terminal."""
    if progress is None:
        progress = bool(getattr(sys.stderr, "isatty", lambda: False)())
    if progress is False:
        return None
    from tqdm.auto import tqdm

    desc = progress if isinstance(progress, str) else "sampling"
    return tqdm(total=total, desc=desc, unit="prompt", leave=True)


async def sample_groups_async(
    sampler,
    prompts: Sequence,
    group_size: int,
    sampling_params_for: Callable[[int], object],
    max_concurrency: int = 8,
    retries: RetryPolicy | None = RetryPolicy(),
    progress: bool | str | None = None,
    on_event: EventCallback | None = None,
) -> list[list]:
    """Sample a group of ``group_size`` completions for every prompt, concurrently; results in prompt order.

    Each prompt is one ``sampler.sample_async(prompt, num_samples=group_size, ...)`` request. All requests are
    started at once, but a semaphore lets at most ``max_concurrency`` be in flight; the others wait for a free slot.
    A request keeps its slot while it backs off between retries, so retries never raise the number in flight.

    Args:
        sampler: a ``SamplingClient`` (real or offline).
        prompts: the batch's prompts (``pytrio.ModelInput``).
        group_size: completions per prompt (>= 1).
        sampling_params_for: ``sampling_params_for(i)`` gives prompt ``i``'s ``SamplingParams``; fixing the seed per
            (step, prompt) there makes the results independent of timing and completion order.
        max_concurrency: most requests in flight at once (>= 1); keeps a large batch under the service's rate
            limits (pytrio itself queues beyond ``sampling_request_max_in_flight``, 16 by default).
        retries: retry policy for transient errors (see :func:`with_retries`); ``None``: no retries, the first error
            of any request is raised as it is.
        progress: ``True`` (or a description string) shows a ``tqdm.auto`` bar that advances as each prompt's group
            arrives; ``False`` hides it; ``None`` shows it only when stderr is a terminal (so notebooks and logs stay
            clean).
        on_event: optional ``on_event(kind, index, t)`` called for every attempt: ``"start"`` when it is sent,
            then ``"end"`` (response received) or ``"error"`` (it failed); ``t`` is ``time.perf_counter()``.

    Returns:
        ``list[list[SampleSequence]]``: entry ``i`` holds prompt ``i``'s ``group_size`` sequences, whatever order
        the responses arrived in.

    Raises:
        ValueError: ``group_size`` or ``max_concurrency`` below 1.
        RetriesExhausted: a request failed on all its attempts (the other requests are cancelled first).
        TypeError: ``retries`` is neither a ``RetryPolicy`` nor ``None``.
        Exception: the first non-retryable error of any request (e.g. ``pytrio.errors.base.ValidationError``),
            after cancelling the others.
        RuntimeError: the service returned a different number of sequences than ``group_size``.

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    if not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ValueError(f"max_concurrency must be an integer >= 1 (requests in flight), got {max_concurrency!r}")
    prompts = list(prompts)
    if retries is not None and not isinstance(retries, RetryPolicy):
        raise TypeError(f"retries must be a RetryPolicy or None (no retries), got {type(retries).__name__}")
    limit = asyncio.Semaphore(max_concurrency)
    bar = _progress_bar(progress, len(prompts))

    def emit(kind: str, index: int) -> None:
        if on_event is not None:
            on_event(kind, index, time.perf_counter())

    async def one(index: int) -> list:
        params = sampling_params_for(index)

        async def attempt():
            emit("start", index)
            try:
                response = await sampler.sample_async(prompts[index], num_samples=group_size, sampling_params=params)
            except BaseException:
                emit("error", index)
                raise
            emit("end", index)
            return response

        async with limit:
            if retries is None:
                response = await attempt()
            else:
                response = await with_retries(attempt, retries, what=f"sample (prompt {index})")
        sequences = list(response.sequences)
        if len(sequences) != group_size:
            raise RuntimeError(
                f"prompt {index}: asked for {group_size} samples, the service returned {len(sequences)}"
            )
        if bar is not None:
            bar.update(1)
        return sequences

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        if bar is not None:
            bar.close()


def run_sync(coroutine):
    """Run a coroutine to completion from synchronous code and return its result.

    Outside an event loop this is ``asyncio.run``. Inside one (a Jupyter cell, where ``asyncio.run`` refuses to
    start a second loop) the coroutine runs on its own loop in a helper thread while this call waits. In a notebook
    you can also simply ``await`` the coroutine in a cell.

    Raises:
        Exception: whatever the coroutine raises.

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="run_sync") as pool:
        return pool.submit(asyncio.run, coroutine).result()


# --------------------------------------------------------------------------------------------------- pipelining
PHASE_KINDS = ("sample_start", "sample_end", "train_start", "train_end")


async def pipeline_steps(
    training_client,
    steps: int,
    sample_batch: Callable[[int, object], Awaitable[object]],
    train_batch: Callable[[int, object], Awaitable[dict]],
    max_staleness: int = 1,
    on_event: EventCallback | None = None,
    after_step: Callable[[dict], Awaitable[None]] | None = None,
) -> list[dict]:
    """Run ``steps`` sample-then-train steps, sampling up to ``max_staleness`` batches ahead of training.

    The weights have a *version*: the number of optimizer steps applied so far. Before training batch ``t`` the
    weights are at version ``t``; every batch ``s <= t + max_staleness`` that is not yet sampling starts sampling
    now, from a sampler of version ``t``. Batch ``s`` is therefore sampled at version ``max(0, s - max_staleness)``
    and trained at version ``s``: its *staleness* (how many updates its sampler is behind) is at most
    ``max_staleness``, and the schedule does not depend on timing, so seeded results are reproducible.
    ``max_staleness=0`` is the plain loop: sample batch ``t``, train on it, refresh the sampler, repeat.

    Args:
        training_client: a ``TrainingClient``; ``save_weights_and_get_sampling_client_async`` gives the samplers.
        steps: number of steps (>= 1).
        sample_batch: ``await sample_batch(step, sampler)`` samples (and grades) batch ``step``.
        train_batch: ``await train_batch(step, sampled)`` trains on it and returns a metrics dict. It must not
            block the event loop (run blocking calls with ``asyncio.to_thread``), or sampling stalls meanwhile.
        max_staleness: how many updates a batch's sampler may lag behind the weights it is trained on (>= 0).
        on_event: optional ``on_event(kind, step, t)`` with kinds ``"sample_start"``, ``"sample_end"``,
            ``"train_start"``, ``"train_end"`` (``t`` from ``time.perf_counter()``), e.g. for a timeline.
        after_step: optional ``await after_step(row)`` after each step (logging, checkpoints); runs before the
            sampler refresh, so a checkpoint saved there holds exactly the step's weights.

    Returns:
        One row per step, in step order: ``step``, ``sampler_version``, ``staleness``, the training metrics, and
        the wall-clock seconds ``time/wait_s`` (training waited for this batch's samples), ``time/refresh_s`` (the
        sampler refresh before this step) and ``time/step_s`` (since the previous step ended).

    Raises:
        ValueError: ``steps < 1`` or ``max_staleness < 0``.
        Exception: whatever sampling or training raises (sampling still in flight is cancelled first).

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an integer >= 0 (0 = no pipelining), got {max_staleness!r}")

    def emit(kind: str, step: int) -> None:
        if on_event is not None:
            on_event(kind, step, time.perf_counter())

    async def sample(step: int, sampler):
        out = await sample_batch(step, sampler)
        emit("sample_end", step)
        return out

    t_prev = time.perf_counter()
    sampler = await training_client.save_weights_and_get_sampling_client_async()
    refresh_s = time.perf_counter() - t_prev
    version = 0
    pending: dict[int, tuple[int, asyncio.Future]] = {}
    next_batch = 0
    history: list[dict] = []
    try:
        for step in range(steps):
            while next_batch < steps and next_batch <= step + max_staleness:
                emit("sample_start", next_batch)
                pending[next_batch] = (version, asyncio.ensure_future(sample(next_batch, sampler)))
                next_batch += 1
            sampled_at, task = pending.pop(step)
            t_wait = time.perf_counter()
            sampled = await task
            wait_s = time.perf_counter() - t_wait
            staleness = version - sampled_at
            if not 0 <= staleness <= max_staleness:  # guaranteed by the schedule above; a cheap invariant check
                raise AssertionError(f"step {step}: staleness {staleness} outside [0, {max_staleness}]")
            emit("train_start", step)
            metrics = await train_batch(step, sampled)
            emit("train_end", step)
            version += 1
            now = time.perf_counter()
            row = {"step": step, "sampler_version": sampled_at, "staleness": staleness, **metrics,
                   "time/wait_s": wait_s, "time/refresh_s": refresh_s, "time/step_s": now - t_prev}
            t_prev = now
            history.append(row)
            if after_step is not None:
                await after_step(row)
            refresh_s = 0.0
            if next_batch < steps:  # a later batch still needs a sampler: take one of the new weights
                t_refresh = time.perf_counter()
                sampler = await training_client.save_weights_and_get_sampling_client_async()
                refresh_s = time.perf_counter() - t_refresh
    finally:
        for _, task in pending.values():
            task.cancel()
        if pending:
            await asyncio.gather(*(task for _, task in pending.values()), return_exceptions=True)
    return history


def run_grpo_pipelined(
    service,
    records: Sequence[dict],
    config,
    max_staleness: int = 1,
    logger=None,
    resume: bool = False,
    progress: bool = True,
    *,
    reward_fn=None,
    on_step: Callable[[dict], None] | None = None,
    on_event: EventCallback | None = None,
    retries: RetryPolicy | None = RetryPolicy(),
):
    """GRPO with concurrent rollouts, sampling the next batch(es) while the current one trains.

    The same run as :func:`trio_helpers.grpo.run_grpo` (same batches, prompts, per-(step, prompt) sampling seeds,
    rewards, advantages, datums, learning rates, logging, checkpoints and final weights), with two changes: every
    batch is sampled with :func:`sample_groups_async` (at most ``config.max_concurrency`` requests in flight per
    batch), and batch ``t + 1`` is sampled while batch ``t`` trains, from weights up to ``max_staleness`` updates
    old (see :func:`pipeline_steps`). The datums carry the logprobs of the sampler that produced them, so the
    ``importance_sampling`` loss's ratio ``exp(logprob_now - logprob_sampler)`` accounts for the lag.
    ``max_staleness=0`` gives ``run_grpo``'s numbers exactly (no overlap).

    Args:
        service: a ``ServiceClient`` (``trio_helpers.connect()``).
        records: GSM8K-style ``{"question", "answer"}`` records.
        config: a :class:`trio_helpers.grpo.GRPOConfig` (validated; ``config.rollout`` is ignored: rollouts are
            always concurrent here).
        max_staleness: how many updates a batch's sampler may lag behind (>= 0; 1 is tinker-cookbook's "off-policy
            by one step"). Up to ``(max_staleness + 1) * config.max_concurrency`` requests can be in flight.
        logger, resume, progress, reward_fn, on_step: as in :func:`trio_helpers.grpo.run_grpo` (``progress``: a bar
            over the steps).
        on_event: optional ``on_event(kind, step, t)`` for a timeline (kinds in :data:`PHASE_KINDS`).
        retries: retry policy of every sampling request (see :func:`sample_groups_async`); on the real service
            prefer patient waits, e.g. ``RetryPolicy(max_attempts=5, initial_delay=2.0, max_delay=60.0)``.

    Returns:
        :class:`trio_helpers.grpo.GRPOResult`; its ``history`` rows hold ``run_grpo``'s metrics plus
        ``sampler_version`` (the weights version the batch was sampled from), ``staleness`` (<= ``max_staleness``)
        and ``time/wait_s`` (how long training waited for the batch's samples). ``time/sample_s`` overlaps the
        previous step's training, so the ``time/*`` parts no longer add up to ``time/step_s``.

    Raises:
        ValueError: invalid config, records or ``max_staleness``; an impossible resume (see
            :func:`trio_helpers.grpo.open_run`).
        TypeError: ``retries`` is neither a ``RetryPolicy`` nor ``None``.
        RetriesExhausted: a sampling request kept failing.

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    import pytrio as trio
    from tqdm.auto import tqdm

    from trio_helpers import grpo
    from trio_helpers.prompts import stop_token_ids
    from trio_helpers.rl import rollout_metrics, train_on_groups

    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an integer >= 0 (0 = no pipelining), got {max_staleness!r}")
    if retries is not None and not isinstance(retries, RetryPolicy):
        raise TypeError(f"retries must be a RetryPolicy or None (no retries), got {type(retries).__name__}")
    records = list(records)
    run = grpo.open_run(service, records, config, logger=logger, resume=resume)
    stop = stop_token_ids(run.tokenizer)
    start = run.start_step
    sample_times: dict[int, float] = {}

    async def sample_batch(local: int, sampler):
        step = start + local
        batch = grpo.batch_for_step(records, step, config.batch_size, config.all_data)
        prompts = grpo.batch_prompts(run.tokenizer, batch)
        t0 = time.perf_counter()
        sequences = await sample_groups_async(
            sampler, prompts, config.group_size, lambda i: grpo.sampling_params_for(config, step, i, stop=stop),
            max_concurrency=config.max_concurrency, retries=retries, progress=False)
        sample_times[local] = time.perf_counter() - t0
        return grpo.grade_groups(batch, prompts, sequences, config.advantage, reward_fn)

    async def train_batch(local: int, groups) -> dict:
        step = start + local
        lr = grpo.learning_rate_at(config, step, run.total_steps)
        adam = trio.AdamParams(learning_rate=lr, beta1=grpo.ADAM_BETAS[0], beta2=grpo.ADAM_BETAS[1])
        t0 = time.perf_counter()
        # the blocking training call runs in a worker thread, so the event loop keeps sampling the next batch
        train = await asyncio.to_thread(train_on_groups, run.training_client, groups, adam, config.skip_degenerate)
        return {**rollout_metrics(groups, config.max_tokens), **train, "lr": lr,
                "time/sample_s": sample_times.pop(local), "time/train_s": time.perf_counter() - t0}

    bar = tqdm(total=run.total_steps, initial=start, desc="GRPO (pipelined)", unit="step", disable=not progress)

    async def after_step(row: dict) -> None:
        step = start + row["step"]
        metrics = {k: v for k, v in row.items() if k != "step"}
        logged = await asyncio.to_thread(grpo.record_step, run, step, metrics)  # may save_state: off the loop
        bar.update(1)
        bar.set_postfix(reward=f"{logged['reward']:.3f}", staleness=logged["staleness"])
        if on_step is not None:
            on_step(logged)

    def event(kind: str, local: int, t: float) -> None:
        if on_event is not None:
            on_event(kind, start + local, t)

    try:
        if run.total_steps > start:
            run_sync(pipeline_steps(run.training_client, run.total_steps - start, sample_batch, train_batch,
                                    max_staleness=max_staleness, on_event=event, after_step=after_step))
    except BaseException:
        if run.owns_logger:
            run.logger.close()
        raise
    finally:
        bar.close()
    return grpo.finish_run(run)

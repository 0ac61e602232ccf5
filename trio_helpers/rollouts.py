"""Concurrent rollouts: sampling a batch's groups at once, bounding the requests in flight, retrying sampling.

On the service a GRPO step spends most of its time *waiting*: for each sampling request to come back and for the
training call. Sending one request after another adds those waits up; sending them all at once (bounded by a
concurrency limit) overlaps them, so a step takes about as long as its slowest request plus the training call.
Pipelining (``rollout="pipeline"`` of the training loop, :mod:`trio_helpers.loop`) goes one step further and
samples batch ``t + 1`` while batch ``t`` trains.

- :func:`sample_groups_async`: every prompt's group requested concurrently, at most ``max_concurrency`` in flight,
  results in prompt order, an optional progress bar and per-request events for timelines;
- :class:`RetryPolicy`, :func:`with_retries`: exponential backoff with a cap for pytrio errors marked
  ``retryable``; everything else is raised at once;
- :class:`RequestLimiter`, :func:`gather_or_cancel`: the concurrency bound and error handling that
  :func:`sample_groups_async` and the training loop (:mod:`trio_helpers.loop`) share;
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
        self.what = what
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
class RequestLimiter:
    """At most ``max_concurrency`` requests in flight, each retried per ``retries``: the one place that sends
    sampling and scoring requests concurrently (used by :func:`sample_groups_async` and the training loop).

    A request keeps its slot while it backs off between retries, so retries never raise the number in flight.

    Args:
        max_concurrency: most requests in flight at once (>= 1; 1 sends one request after another).
        retries: retry policy for transient errors (see :func:`with_retries`); ``None``: no retries.
        on_event: optional ``on_event(kind, index, t)`` for every attempt: ``"start"`` when it is sent, then
            ``"end"`` or ``"error"``; ``t`` is ``time.perf_counter()``.

    Raises:
        ValueError: ``max_concurrency`` below 1; TypeError: ``retries`` neither a ``RetryPolicy`` nor ``None``.

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """

    def __init__(self, max_concurrency: int = 8, retries: RetryPolicy | None = RetryPolicy(),
                 on_event: EventCallback | None = None) -> None:
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an integer >= 1 (requests in flight), got {max_concurrency!r}")
        if retries is not None and not isinstance(retries, RetryPolicy):
            raise TypeError(f"retries must be a RetryPolicy or None (no retries), got {type(retries).__name__}")
        self.max_concurrency = max_concurrency
        self.retries = retries
        self.on_event = on_event
        self._slots: asyncio.Semaphore | None = None

    async def call(self, make_call: Callable[[], Awaitable], what: str = "request", index: int = 0):
        """Send ``make_call()`` when a slot is free, retrying it per the policy; returns its result."""
        if self._slots is None:  # created lazily, inside the event loop that uses it
            self._slots = asyncio.Semaphore(self.max_concurrency)

        async def attempt():
            if self.on_event is not None:
                self.on_event("start", index, time.perf_counter())
            try:
                result = await make_call()
            except BaseException:
                if self.on_event is not None:
                    self.on_event("error", index, time.perf_counter())
                raise
            if self.on_event is not None:
                self.on_event("end", index, time.perf_counter())
            return result

        async with self._slots:
            if self.retries is None:
                return await attempt()
            return await with_retries(attempt, self.retries, what=what)


async def gather_or_cancel(coroutines) -> list:
    """``asyncio.gather`` that, when one coroutine fails, cancels the others before raising its error.

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


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

    Each prompt is one ``sampler.sample_async(prompt, num_samples=group_size, ...)`` request, sent through a
    :class:`RequestLimiter`: all are started at once, at most ``max_concurrency`` are in flight, the others wait
    for a free slot.

    Args:
        sampler: a ``SamplingClient`` (real or offline).
        prompts: the batch's prompts (``pytrio.ModelInput``).
        group_size: completions per prompt (>= 1).
        sampling_params_for: ``sampling_params_for(i)`` gives prompt ``i``'s ``SamplingParams``; fixing the seed per
            (step, prompt) there makes the results independent of timing and completion order.
        max_concurrency: most requests in flight at once (>= 1); keeps a large batch under the service's rate
            limits (pytrio itself queues beyond ``sampling_request_max_in_flight``, 16 by default).
        retries: retry policy for errors that reach this code (see :func:`with_retries`); ``None``: the first
            error of any request is raised as it is.
        progress: ``True`` (or a description string) shows a ``tqdm.auto`` bar that advances as each prompt's group
            arrives; ``False`` hides it; ``None`` shows it only when stderr is a terminal.
        on_event: optional ``on_event(kind, index, t)`` for every attempt (see :class:`RequestLimiter`).

    Returns:
        ``list[list[SampleSequence]]``: entry ``i`` holds prompt ``i``'s ``group_size`` sequences, whatever order
        the responses arrived in.

    Raises:
        ValueError: ``group_size`` or ``max_concurrency`` below 1.
        RetriesExhausted: a request failed on all its attempts (the other requests are cancelled first).
        TypeError: ``retries`` is neither a ``RetryPolicy`` nor ``None``.
        Exception: the first non-retryable error of any request, after cancelling the others.
        RuntimeError: the service returned a different number of sequences than ``group_size``.

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    limiter = RequestLimiter(max_concurrency, retries, on_event)
    prompts = list(prompts)
    bar = _progress_bar(progress, len(prompts))

    async def one(index: int) -> list:
        params = sampling_params_for(index)
        response = await limiter.call(
            lambda: sampler.sample_async(prompts[index], num_samples=group_size, sampling_params=params),
            what=f"sample (prompt {index})", index=index)
        sequences = list(response.sequences)
        if len(sequences) != group_size:
            raise RuntimeError(f"prompt {index}: asked for {group_size} samples, the service returned {len(sequences)}")
        if bar is not None:
            bar.update(1)
        return sequences

    try:
        return await gather_or_cancel(one(i) for i in range(len(prompts)))
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

"""How the offline backend's requests fail and are retried, modelled on pytrio 0.2.9.

Introduced in {ref}`offline-backend-faults` (book/offline_backend.md). pytrio retries
transient failures (HTTP 408, 429, 5xx, connection errors) *inside its transport*, so they
rarely reach user code:

- training events (``POST /v1/events``) and control calls (creating training and sampling
  runs) go through ``pytrio.transport.retry.request_with_retry_timeout``. After the first
  failure a window of ``training_retry_timeout_seconds`` (or
  ``control_retry_timeout_seconds``) opens; the client waits
  ``delay * (1 + U(0, retry_jitter_ratio))``, the last wait cut at the end of the window,
  multiplies ``delay`` by ``retry_multiplier`` up to ``retry_max_delay_seconds``, and tries
  again while the window is open.
- Sampling requests (``sample``, ``compute_logprobs``) go through the streaming path of
  ``BaseActorHTTPClient._stream_with_actor_jwt``: the same exponential waits without jitter,
  the last one cut at the end of the window, then one last attempt.
- When the window is exhausted, the last response's error surfaces. For an HTTP 503 without
  a JSON body that is ``ActorEventSubmitError`` (training), ``ActorAPIError`` (sampling) or
  ``ControlAPIError`` (control), with the message ``"Actor request failed with HTTP 503"``
  (or ``"Control ..."``) and the code ``actor.request_failed`` (or
  ``control.request_failed``). ``tests/test_offline_contract.py`` produces the reference
  errors by running pytrio's own transport against an in-process HTTP mock.
- A training event that could not be submitted leaves the run's state uncertain, so pytrio's
  training-run coordinator becomes *broken*: the events queued behind it fail with
  ``PyTrioError`` code ``training.run_broken``, and so does every later call on that client.

This module plans each request when it is submitted, so which attempts fail and every jitter
draw depend only on ``seed`` and the order of submission, never on thread timing; and it
builds pytrio's own exceptions. Nothing here sleeps: the service sleeps
``latency + retry_time_scale * (simulated seconds - latency)`` of real time per request.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from pytrio.config.config import Configuration, configuration
from pytrio.errors.actor import ActorAPIError, ActorEventSubmitError
from pytrio.errors.base import PyTrioError
from pytrio.errors.control import ControlAPIError

TRAINING, SAMPLING, CONTROL = "training", "sampling", "control"

# Operation name (as the offline service reports it) -> which pytrio retry window applies.
OPERATION_KINDS = {
    "forward": TRAINING,
    "forward_backward": TRAINING,
    "optim_step": TRAINING,
    "save_weights_for_sampler": TRAINING,
    "save_state": TRAINING,
    "load_state": TRAINING,
    "load_state_with_optimizer": TRAINING,
    "save_weights_and_get_sampling_client": TRAINING,
    "sample": SAMPLING,
    "compute_logprobs": SAMPLING,
    "create_training_run": CONTROL,
    "create_sampling_run": CONTROL,
}

# A failed attempt still costs a round trip: at least this many simulated seconds, so that a
# service that stays down exhausts the window even with latency 0 and a zero first delay.
MIN_FAILED_ATTEMPT_SECONDS = 0.001

# What the offline service answers while it is down or flaky: HTTP 503 without a JSON body.
OUTAGE_STATUS = 503
BROKEN_RUN_MESSAGE = (
    "ActorTrainingRunCoordinator is broken after an uncertain submit failure"
)
# pytrio 0.2.9 passes this operation name as a plain string (the braces are not filled in).
SAMPLE_OPERATION = "POST /v1/sampling-runs/{sampling_run_cuid}/sample"
CONTROL_OPERATIONS = {
    "create_training_run": "POST /openapi/v1/service-sessions/{session}/training-runs",
    "create_sampling_run": "POST /openapi/v1/service-sessions/{session}/sampling-runs",
}
SERVER = "trio-offline"


@dataclass(frozen=True)
class RetrySettings:
    """pytrio's retry knobs in seconds (names shortened from pytrio's ``Configuration``)."""

    initial_delay: float = 1.0
    multiplier: float = 2.0
    max_delay: float = 30.0
    jitter: float = 0.1
    training_window: float = 900.0
    sampling_window: float = 900.0
    control_window: float = 900.0

    @classmethod
    def from_pytrio(cls, config: Configuration | None = None) -> "RetrySettings":
        """Read a pytrio configuration; by default the one ``trio.configure`` sets."""
        c = configuration if config is None else config
        return cls(
            initial_delay=float(c.retry_initial_delay_seconds),
            multiplier=float(c.retry_multiplier),
            max_delay=float(c.retry_max_delay_seconds),
            jitter=float(c.retry_jitter_ratio),
            training_window=float(c.training_retry_timeout_seconds),
            sampling_window=float(c.sampling_retry_timeout_seconds),
            control_window=float(c.control_retry_timeout_seconds),
        )

    def window(self, kind: str) -> float:
        windows = {TRAINING: self.training_window, SAMPLING: self.sampling_window,
                   CONTROL: self.control_window}
        return windows[kind]


@dataclass(frozen=True)
class RequestPlan:
    """What the transport will go through for one request, decided when it is submitted.

    Attributes:
        index: 0-based position among all requests submitted to this offline service.
        kind: ``"training"``, ``"sampling"`` or ``"control"``: which retry window applies.
        attempts: HTTP attempts made, the first one included.
        waits: the backoff waits between attempts, in simulated seconds.
        simulated_seconds: time spent in the transport: every attempt's latency plus the
        waits.
        exhausted: the retry window ran out; the request fails without doing any work.
        outage: the request falls into the ``outage_after`` outage.
    """

    index: int
    kind: str
    attempts: int
    waits: tuple[float, ...]
    simulated_seconds: float
    exhausted: bool
    outage: bool

    @property
    def retries(self) -> int:
        return self.attempts - 1

    def retry_seconds(self, latency: float) -> float:
        """Simulated seconds beyond what a first-time success costs (``latency``)."""
        if self.attempts == 1 and not self.exhausted:
            return 0.0
        return max(0.0, self.simulated_seconds - latency)


def plan_attempts(
    kind: str,
    settings: RetrySettings,
    latency: float,
    attempt_fails: Callable[[int], bool],
    jitter_draw: Callable[[], float],
) -> tuple[int, tuple[float, ...], float, bool]:
    """Run pytrio's retry loop for one request on a simulated clock.

    Args:
        kind: ``"sampling"`` (streaming path: no jitter, one last attempt at the end of the
            window) or ``"training"`` / ``"control"`` (``request_with_retry_timeout``:
            jittered waits, gives up at the end of the window).
        settings: pytrio's retry knobs.
        latency: simulated seconds of one attempt (a failed one costs at least
            ``MIN_FAILED_ATTEMPT_SECONDS``).
        attempt_fails: ``attempt_fails(i)`` says whether attempt ``i`` (0-based) fails.
        jitter_draw: returns a uniform draw in [0, 1); called once per jittered wait.

    Returns:
        ``(attempts, waits, simulated_seconds, exhausted)``.
    """
    failed_cost = max(latency, MIN_FAILED_ATTEMPT_SECONDS)
    if not attempt_fails(0):
        return 1, (), latency, False
    t = failed_cost
    deadline = t + max(0.0, settings.window(kind))  # the window opens at the first failure
    delay = settings.initial_delay
    waits: list[float] = []
    attempt = 0
    while True:
        remaining = deadline - t
        if remaining <= 0.0:
            return attempt + 1, tuple(waits), t, True
        if kind == SAMPLING:
            wait = min(max(0.0, delay), remaining)
        else:
            factor = 1.0 + jitter_draw() * max(0.0, settings.jitter)
            wait = min(max(0.0, delay * factor), remaining)
        t += wait
        waits.append(wait)
        if kind != SAMPLING and not t < deadline:  # no attempt after the deadline
            return attempt + 1, tuple(waits), t, True
        delay = min(delay * settings.multiplier, settings.max_delay)
        attempt += 1
        if not attempt_fails(attempt):
            return attempt + 1, tuple(waits), t + latency, False
        t += failed_cost


class FaultModel:
    """Decides, at submission and in submission order, how each request of a service fares.

    ``fault_rate`` makes each attempt fail independently with that probability (one draw per
    attempt, from a generator seeded by ``seed``). From the ``outage_after``-th request on
    (0-based, counting every request submitted to the service, see ``OPERATION_KINDS``)
    every attempt fails. Jitter comes from a second generator seeded by ``seed``, so it
    never shifts which attempts fail.
    """

    def __init__(self, *, seed: int, fault_rate: float, outage_after: int | None,
                 latency: float, settings: RetrySettings) -> None:
        self.fault_rate = fault_rate
        self.outage_after = outage_after
        self.latency = latency
        self.settings = settings
        self._fault_rng = np.random.default_rng([seed, 7])
        self._jitter_rng = np.random.default_rng([seed, 11])
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def plan(self, operation: str) -> RequestPlan:
        kind = OPERATION_KINDS[operation]
        with self._lock:
            index = next(self._counter)
            outage = self.outage_after is not None and index >= self.outage_after
            if outage:
                fails = _always
            elif self.fault_rate > 0:
                fails = self._draw_fault
            else:
                fails = _never
            attempts, waits, seconds, exhausted = plan_attempts(
                kind, self.settings, self.latency, fails, self._draw_jitter
            )
        return RequestPlan(index, kind, attempts, waits, seconds, exhausted, outage)

    def _draw_fault(self, _attempt: int) -> bool:
        return bool(self._fault_rng.random() < self.fault_rate)

    def _draw_jitter(self) -> float:
        return float(self._jitter_rng.random())


def _always(_attempt: int) -> bool:
    return True


def _never(_attempt: int) -> bool:
    return False


# ------------------------------------------------------------------------------------
# errors
def _details(plan: RequestPlan, why: str) -> dict[str, object]:
    return {"offline_backend": (
        f"{why}; {plan.attempts} attempts in {plan.simulated_seconds:.1f} simulated s, "
        f"then the {plan.kind} retry window ran out (request {plan.index})"
    )}


def exhausted_error(
    plan: RequestPlan, operation: str, *, why: str, task_cuid: str = ""
) -> PyTrioError:
    """The error pytrio raises when the ``plan.kind`` window runs out on HTTP 503 responses.

    Same class, message, ``code``, ``status_code`` and ``operation`` as pytrio 0.2.9;
    ``retryable`` and the hint follow from the code through pytrio's own diagnostics;
    ``details`` says what the offline backend simulated.
    """
    details = _details(plan, why)
    if plan.kind == TRAINING:
        error: PyTrioError = ActorEventSubmitError(
            f"Actor request failed with HTTP {OUTAGE_STATUS}",
            status_code=OUTAGE_STATUS,
            code="",  # no JSON body: pytrio falls back to "actor.request_failed"
            details=details,
            operation="POST /v1/events",
            server=SERVER,
            actor_cuid="offline-actor",
            event_cuid=f"offline-event-{uuid.uuid4().hex[:12]}",
        )
    elif plan.kind == SAMPLING:
        error = ActorAPIError(
            f"Actor request failed with HTTP {OUTAGE_STATUS}",
            status_code=OUTAGE_STATUS,
            code="",
            details=details,
            operation=SAMPLE_OPERATION,
            server=SERVER,
            actor_cuid="offline-actor",
        )
    else:
        error = ControlAPIError(
            f"Control request failed with HTTP {OUTAGE_STATUS}",
            status_code=OUTAGE_STATUS,
            code="",  # pytrio falls back to "control.request_failed"
            details=details,
            operation=CONTROL_OPERATIONS[operation].format(session="offline-session"),
            server=SERVER,
        )
    if task_cuid:
        error.task_cuid = task_cuid
    return error


def broken_run_error(task_cuid: str = "") -> PyTrioError:
    """pytrio's error for a training client once one of its events could not be sent."""
    error = PyTrioError(BROKEN_RUN_MESSAGE, code="training.run_broken")
    if task_cuid:
        error.task_cuid = task_cuid
    return error

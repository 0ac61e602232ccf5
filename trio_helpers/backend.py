"""``connect()``: one call that returns a PyTRIO ``ServiceClient``, the real one or the offline backend.

The module also remembers which backend is in use, so that the data loaders (``trio_helpers.data``) read the
offline corpus exactly when the offline backend answers, and real data exactly when the real service does:

- :func:`resolve_backend` says which backend ``connect()`` *would* choose (``TRIO_BACKEND``, else a pytrio
  credential), without printing or creating anything;
- :func:`active_backend` says which backend the last ``connect()`` returned (``None`` before the first one);
- :func:`backend_in_use` is the first of the two that is known: what the data loaders follow.

On the real service ``connect()`` first checks that a credential exists (else :class:`MissingCredentialsError`,
one line saying to run ``trio login``), then probes the service with one cheap call under short timeouts
(:data:`REMOTE_TIMEOUTS`), so that an unreachable service fails at start-up in well under 30 s
(:class:`ServiceUnreachableError`). The client it returns keeps pytrio's own retry windows (15 minutes of
retries for transient errors), unless the caller passes others: a running job survives a network hiccup.

Introduced in: chapter 01 (notebooks/01_gsm8k_data); documented in book/setup.md and book/offline_backend.md.
"""

from __future__ import annotations

import os
import time
import weakref

from pytrio.errors.auth import AuthError

BACKENDS = ("offline", "remote", "auto")

# Bounds of the start-up probe only (one Control call that verifies the API key). pytrio makes the first request
# with the full request timeout, then retries a failing one until the retry window closes, and lets a retry that
# started before the deadline finish: at most about 5 + 10 + 5 = 20 s before an unreachable service is reported.
# The client connect() returns does NOT use these: it keeps pytrio's defaults, or what the caller passes.
REMOTE_TIMEOUTS = {
    "request_timeout_seconds": 5,
    "control_retry_timeout_seconds": 10.0,
}

_ACTIVE: str | None = None  # the backend the last connect() returned: "offline", "remote" or None
_OFFLINE_LEDGERS: list = []  # the usage ledgers of the offline services connect() created (small; no threads)
_SESSIONS: weakref.WeakSet = weakref.WeakSet()  # the pytrio ServiceClients connect() returned (end_sessions)

# pytrio's retries against connect("offline"): its first delay, growth, longest delay and retry
# windows (the service's defaults: 1 s doubling to 30 s, 900-s windows), so a fault costs milliseconds and an
# outage surfaces within seconds; jitter off, so runs take the same path every time.
OFFLINE_SERVER_RETRIES = dict(retry_initial_delay_seconds=0.01, retry_multiplier=2.0, retry_max_delay_seconds=0.2,
                              retry_jitter_ratio=0.0, training_retry_timeout_seconds=2.0,
                              sampling_retry_timeout_seconds=2.0, control_retry_timeout_seconds=2.0)


class MissingCredentialsError(AuthError):
    """The real service was asked for, but pytrio finds no API key. ``str(error)`` is one line with the fix.

    A subclass of pytrio's ``AuthError`` (code ``auth.missing_api_key``), so code that catches pytrio's type
    catches this too.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or MISSING_CREDENTIALS, code="auth.missing_api_key", operation="connect")

    def __str__(self) -> str:
        return self.message


class ServiceUnreachableError(ConnectionError):
    """The start-up probe of the real service failed: ``str(error)`` is one line naming the address and the fix.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """


MISSING_CREDENTIALS = ("no PyTRIO API key found: run `trio login` (or set PYTRIO_API_KEY) to use the real "
                       "service, or set TRIO_BACKEND=offline")


def has_pytrio_credentials() -> bool:
    """True when pytrio would find an API key: ``PYTRIO_API_KEY`` or a profile saved by ``trio login``.

    Reads pytrio's own resolved state (``pytrio.config.config.auth_state``, loaded from ``~/.pytrio`` of the
    current ``HOME`` when pytrio is imported) rather than guessing file locations.
    """
    if os.environ.get("PYTRIO_API_KEY", "").strip():
        return True
    try:
        from pytrio.config.config import auth_state
    except Exception:  # noqa: BLE001 - a broken pytrio install means: no usable credentials
        return False
    return bool((auth_state.api_key or "").strip())


def _requested(backend: str | None) -> str:
    chosen = (backend or os.environ.get("TRIO_BACKEND") or "auto").strip().lower()
    if chosen not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (argument or TRIO_BACKEND), got {chosen!r}")
    return chosen


def resolve_backend(backend: str | None = None) -> str:
    """The backend ``connect(backend)`` would use, ``"offline"`` or ``"remote"``, without printing or connecting.

    Args:
        backend: ``"offline"``, ``"remote"``, ``"auto"`` or None (then ``TRIO_BACKEND``, else ``"auto"``);
            ``auto`` means remote when pytrio finds a credential, otherwise offline.

    Raises:
        ValueError: an unknown backend name (in the argument or in ``TRIO_BACKEND``).

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    chosen = _requested(backend)
    if chosen == "auto":
        return "remote" if has_pytrio_credentials() else "offline"
    return chosen


def offline_usages() -> list:
    """What each offline service :func:`connect` created in this process has served (``Usage`` snapshots,
    oldest service first), whether or not the service is still referenced: together, what the process sent
    (``trio_helpers.costs.session_usage``).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    return [ledger.snapshot() for ledger in _OFFLINE_LEDGERS]


def usage_of(service):
    """The offline ledger (``Usage``) of ``service``: an in-process offline client's ``usage()``, or the ledger
    of the offline server behind a pytrio client that ``connect("offline")`` returned; None for a
    client of the real service (which reports no usage: see your account's usage page).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    usage = getattr(service, "usage", None)
    if callable(usage):  # the in-process offline client
        return usage()
    from trio_helpers.offline.server import server_of

    served = server_of(service)
    return None if served is None else served.usage()


def active_backend() -> str | None:
    """The backend of the service the last ``connect()`` returned: ``"offline"``, ``"remote"``, or None before any.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    return _ACTIVE


def backend_in_use() -> str:
    """``active_backend()`` if ``connect()`` has been called, else :func:`resolve_backend` (what it would choose).

    The data loaders' ``source="auto"`` follows this, so data and model always come from the same world.

    Raises:
        ValueError: no ``connect()`` yet and ``TRIO_BACKEND`` holds an unknown name.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    return _ACTIVE or resolve_backend()


def _verify_with_pytrio(runtime_configuration) -> None:
    """One Control call: pytrio's ``authenticate_api_key`` with the current credential and the given configuration."""
    from pytrio.auth.flow import authenticate_api_key
    from pytrio.config.config import auth_state

    key = os.environ.get("PYTRIO_API_KEY", "").strip() or (auth_state.api_key or "").strip()
    authenticate_api_key(key, runtime_configuration=runtime_configuration)


def probe_remote(verify=None, timeouts: dict | None = None) -> float:
    """Check, under short timeouts, that the real service answers and accepts the credential; return the seconds taken.

    The probe is one Control call (pytrio's ``authenticate_api_key``, which verifies the API key) made with a
    *private copy* of pytrio's configuration with ``timeouts`` applied: pytrio's process-wide settings are not
    touched, so clients created afterwards keep their own retry windows.

    Args:
        verify: ``f(runtime_configuration)`` that makes the call; default pytrio's key verification (tests pass a
            fake here, so no test ever talks to a network address or needs a key).
        timeouts: ``pytrio.configure`` settings for the probe; default :data:`REMOTE_TIMEOUTS`.

    Raises:
        MissingCredentialsError: no API key.
        pytrio.errors.auth.AuthError: the service rejected the key (pytrio's error, unchanged).
        ServiceUnreachableError: the service did not answer within the probe's bounds.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    from pytrio.config.config import configuration
    from pytrio.errors.base import PyTrioError

    if not has_pytrio_credentials():
        raise MissingCredentialsError()
    verify = verify or _verify_with_pytrio
    short = configuration.model_copy(update=dict(REMOTE_TIMEOUTS if timeouts is None else timeouts), deep=True)
    started = time.monotonic()
    try:
        verify(short)
    except AuthError as err:
        if err.code == "auth.missing_api_key":
            raise MissingCredentialsError() from None
        raise
    except (PyTrioError, OSError) as err:
        if isinstance(err, PyTrioError) and not err.retryable:
            raise
        elapsed = time.monotonic() - started
        reason = (getattr(err, "message", None) or str(err) or type(err).__name__).splitlines()[0][:120]
        raise ServiceUnreachableError(
            f"cannot reach the PyTRIO service at {configuration.base_url} (gave up after {elapsed:.0f} s: "
            f"{reason}); check the network and `trio env show`, or set TRIO_BACKEND=offline"
        ) from None
    return time.monotonic() - started


def connect(backend: str | None = None, *, in_process: bool = False, **options):
    """Return a service client: ``pytrio.ServiceClient``, for the real service or for the offline backend.

    Args:
        backend: ``"offline"``, ``"remote"`` or ``"auto"``; default: the ``TRIO_BACKEND`` environment variable,
            else ``"auto"``. ``auto`` picks remote when pytrio finds a credential (``trio login`` or
            ``PYTRIO_API_KEY``), otherwise offline, and prints one line saying which and how to switch.
        in_process: offline only. By default the offline backend is served on 127.0.0.1
            (``trio_helpers.offline.server``: a fresh server, answered by the process's one loopback listener)
            and the client is pytrio's own ``ServiceClient`` for it, so every call goes through pytrio's
            transport, retries and validation, with pytrio's retry delays and windows shortened to
            :data:`OFFLINE_SERVER_RETRIES`. ``in_process=True``
            returns the offline engine's in-process client instead: the same numbers without pytrio's transport
            (about 2 ms of client CPU per request less), for the toy sweeps of chapters 8-11, which make thousands
            of requests. It has no transport, so it takes no ``fault_rate`` or ``outage_after`` (a one-line
            ``ValueError``). :func:`usage_of` reads either one's ledger.
        **options: offline: ``latency``, ``fault_rate``, ``outage_after``, ``seed``, ``home``,
            ``sampler_logit_precision`` (see ``OfflineOptions``).
            remote: any ``pytrio.configure`` keyword (e.g. ``training_retry_timeout_seconds``), applied before
            the client is created; without any, the client keeps pytrio's default retry windows.

    Returns:
        An object with pytrio's ``ServiceClient`` API. :func:`active_backend` then names its backend.

    Raises:
        ValueError: unknown backend (one line listing the allowed values), or options that the chosen backend does
            not take.
        MissingCredentialsError: ``remote`` without a credential (one line: run ``trio login``); a subclass of
            pytrio's ``AuthError``.
        ServiceUnreachableError: ``remote``, but the service did not answer the start-up probe (under 30 s).

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    global _ACTIVE
    requested = _requested(backend)
    chosen = resolve_backend(requested)
    if requested == "auto":
        how = "set TRIO_BACKEND=offline to stay offline" if chosen == "remote" else "run `trio login` for the real service"
        print(f"trio_helpers.connect: using the {chosen} backend ({how}).")  # at most 88 characters
    if chosen == "offline":
        from trio_helpers.offline.service import OfflineOptions, OfflineServiceClient

        allowed = set(OfflineOptions.__dataclass_fields__)
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise ValueError(f"offline backend options are {sorted(allowed)}; got unknown {unknown}")
        offline_options = OfflineOptions(**options)  # checked before anything starts
        if in_process:
            o = offline_options
            wire = ("fault_rate", o.fault_rate) if o.fault_rate else ("outage_after", o.outage_after)
            if wire[1] is not None:
                raise ValueError(f"{wire[0]}={wire[1]!r} needs the offline server: faults happen on the wire, where "
                                 "pytrio's client retries them; drop in_process=True")
            client = OfflineServiceClient(offline_options)
            ledger = client._runtime.ledger
        else:
            from trio_helpers.offline.server import OfflineServer, service_client

            served = OfflineServer(options=offline_options).start()
            client = service_client(served, **OFFLINE_SERVER_RETRIES)
            ledger = served._runtime.ledger
            _SESSIONS.add(client)
        _ACTIVE = "offline"
        _OFFLINE_LEDGERS.append(ledger)
        return client
    if in_process:
        raise ValueError("in_process=True is an option of the offline backend; the remote backend has no in-process "
                         "client (drop in_process, or use connect('offline', in_process=True))")
    import pytrio as trio

    if not has_pytrio_credentials():
        raise MissingCredentialsError()
    if options:
        trio.configure(**options)  # process-wide, read when the ServiceClient below is created
    probe_remote()
    try:
        client = trio.ServiceClient()
    except AuthError as err:
        if err.code == "auth.missing_api_key":
            raise MissingCredentialsError() from None
        raise
    _ACTIVE = "remote"
    _SESSIONS.add(client)
    return client


def end_sessions() -> None:
    """End the service session of every pytrio client :func:`connect` returned that is still open, and with it
    every training and sampling run made through that client.

    pytrio 0.2.9 has no public ``close()``. A training run's heartbeat stops when its ``TrainingClient`` is
    garbage-collected, and the service session (with its runs) ends when the ``ServiceClient`` and every client
    made from it are collected, or when the process exits. In a notebook, whose variables stay referenced, that
    means when the kernel stops. This calls what pytrio's own finalizer calls, ``shutdown()`` of the client's
    runtime (its private ``_runtime``), so a notebook can end its runs without finding every variable that holds
    a client. The clients cannot be used afterwards. In-process offline clients (``in_process=True``) have no
    session and are left alone.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data); see book/troubleshooting.md.
    """
    for client in list(_SESSIONS):
        client._runtime.shutdown()  # idempotent in pytrio: a session already closed is not closed again
        _SESSIONS.discard(client)

"""``connect()``: one call that returns a PyTRIO ``ServiceClient`` — the real one or the offline backend.

Introduced in: chapter 01 (notebooks/01_gsm8k_data); documented in book/setup.md and book/offline_backend.md.
"""

from __future__ import annotations

import os

BACKENDS = ("offline", "remote", "auto")

# Bounds for the real client so an unreachable service fails in well under 30 s instead of retrying for ~15 min.
# Override any of them by passing the same keyword to connect(..., <name>=value).
REMOTE_TIMEOUTS = {
    "request_timeout_seconds": 10,
    "retry_max_attempts": 2,
    "control_retry_timeout_seconds": 20.0,
    "training_retry_timeout_seconds": 20.0,
    "sampling_retry_timeout_seconds": 20.0,
}


def has_pytrio_credentials() -> bool:
    """True when pytrio would find an API key: ``PYTRIO_API_KEY`` or a profile saved by ``trio login``.

    Reads pytrio's own resolved state (``pytrio.config.config.auth_state``) rather than guessing file locations.
    """
    if os.environ.get("PYTRIO_API_KEY", "").strip():
        return True
    try:
        from pytrio.config.config import auth_state
    except Exception:  # noqa: BLE001 - a broken pytrio install means: no usable credentials
        return False
    return bool((auth_state.api_key or "").strip())


def connect(backend: str | None = None, **options):
    """Return a service client: ``pytrio.ServiceClient`` (remote) or the offline backend's twin.

    Args:
        backend: ``"offline"``, ``"remote"`` or ``"auto"``; default: the ``TRIO_BACKEND`` environment variable,
            else ``"auto"``. ``auto`` picks remote when pytrio finds a credential (``trio login`` or
            ``PYTRIO_API_KEY``), otherwise offline, and prints one line saying which and how to switch.
        **options: offline: ``latency``, ``fault_rate``, ``seed``, ``home`` (see ``OfflineOptions``).
            remote: any ``pytrio.configure`` keyword (e.g. ``request_timeout_seconds``), overriding the bounded
            defaults in ``REMOTE_TIMEOUTS``.

    Returns:
        An object with pytrio's ``ServiceClient`` API.

    Raises:
        ValueError: unknown backend, or options that the chosen backend does not take.
        pytrio.errors.auth.AuthError: ``remote`` without credentials (run ``trio login``).

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    chosen = (backend or os.environ.get("TRIO_BACKEND") or "auto").strip().lower()
    if chosen not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (argument or TRIO_BACKEND), got {chosen!r}")
    if chosen == "auto":
        chosen = "remote" if has_pytrio_credentials() else "offline"
        how = "set TRIO_BACKEND=offline to stay offline" if chosen == "remote" else "run `trio login` (or set TRIO_BACKEND=remote) to use the real service"
        print(f"trio_helpers.connect: using the {chosen} backend ({how}).")
    if chosen == "offline":
        from trio_helpers.offline.service import OfflineOptions, OfflineServiceClient

        allowed = set(OfflineOptions.__dataclass_fields__)
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise ValueError(f"offline backend options are {sorted(allowed)}; got unknown {unknown}")
        return OfflineServiceClient(OfflineOptions(**options))
    import pytrio as trio

    settings = {**REMOTE_TIMEOUTS, **options}
    trio.configure(**settings)
    return trio.ServiceClient()

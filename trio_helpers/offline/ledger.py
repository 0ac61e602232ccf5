"""What the offline service has served: requests, retries and simulated time.

Introduced in {ref}`offline-backend-faults` (book/offline_backend.md).
``OfflineServiceClient.usage()`` returns a frozen ``Usage``; updates are taken under a lock,
so concurrent requests never lose or double one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Usage:
    """Totals of one offline service (all counts >= 0).

    Attributes:
        requests: requests that reached the (simulated) service, each counted once however
            often the client retried it. Calls rejected by validation or by a broken
            training client are never sent and not counted.
        retries: attempts beyond the first, made inside the client (pytrio's transport).
        failed_requests: requests whose retry window ran out, so pytrio's error surfaced.
        simulated_seconds: seconds spent in the transport on the simulated clock: every
            attempt's latency plus every backoff wait, summed over requests. Concurrent
            requests overlap in real time, so this is request-seconds, not elapsed time.
        retry_seconds: the part of ``simulated_seconds`` caused by failures (waits and
            failed attempts).
    """

    requests: int = 0
    retries: int = 0
    failed_requests: int = 0
    simulated_seconds: float = 0.0
    retry_seconds: float = 0.0


class Ledger:
    """A thread-safe accumulator of ``Usage``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = {f.name: f.default for f in fields(Usage)}

    def add(self, **counts: float) -> None:
        for name, value in counts.items():
            if value < 0:
                raise ValueError(f"usage count {name} must be >= 0, got {value}")
        with self._lock:
            for name, value in counts.items():
                self._totals[name] += value

    def snapshot(self) -> Usage:
        with self._lock:
            return Usage(**self._totals)

"""Benchmark only (issue 23's question: what would the chapters cost through pytrio's own client?).

``python benchmarks/bench_exact_cost.py --variant real-client`` puts this directory first on the path of one of its
two runs: there ``trio_helpers.connect("offline", ...)`` starts a loopback server (``trio_helpers.offline.server``)
with the same options and returns pytrio's unmodified ``ServiceClient`` for it, so every request of a chapter goes
through pytrio's transport, msgpack/JSON and HTTP on 127.0.0.1. pytrio's retry delays are shortened (as the
server's tests do). Chapters that call the in-process backend's extras (``service.usage()``) fail those cells;
the time of every cell still counts. Never used by the book, the tests or the package.
"""

import trio_helpers.backend as _backend

_FAST = dict(retry_initial_delay_seconds=0.01, retry_multiplier=1.5, retry_max_delay_seconds=0.05,
             retry_jitter_ratio=0.0, training_retry_timeout_seconds=5.0, sampling_retry_timeout_seconds=5.0,
             control_retry_timeout_seconds=5.0)
_original = _backend.connect


def _connect(backend=None, **options):
    if _backend.resolve_backend(_backend._requested(backend)) != "offline":
        return _original(backend, **options)
    from trio_helpers.offline.server import OfflineServer, service_client
    from trio_helpers.offline.service import OfflineOptions

    server = OfflineServer(options=OfflineOptions(**options)).start()
    _backend._ACTIVE = "offline"
    _backend._OFFLINE_LEDGERS.append(server._runtime.ledger)
    return service_client(server, **_FAST)


_backend.connect = _connect

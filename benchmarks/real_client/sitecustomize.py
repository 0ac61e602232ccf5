"""Benchmark only (issue 23's question: what would the chapters cost through pytrio's own client?).

``python benchmarks/bench_exact_cost.py --variant real-client`` puts this directory first on the path of one of its
two runs: there ``trio_helpers.connect("offline", ...)`` is ``connect("offline", server=True, ...)``, which starts
a loopback server (``trio_helpers.offline.server``) with the same options and returns pytrio's unmodified
``ServiceClient`` for it, so every request of a chapter goes through pytrio's transport, msgpack/JSON and HTTP on
127.0.0.1. Chapters that call the in-process backend's extras (``service.usage()``, the exact reverse KL) fail
those cells; the time of every cell still counts. Never used by the book, the tests or the package.
"""

import trio_helpers.backend as _backend

_original = _backend.connect


def _connect(backend=None, **options):
    if _backend.resolve_backend(_backend._requested(backend)) != "offline":
        return _original(backend, **options)
    return _original(backend, server=True, **options)


_backend.connect = _connect

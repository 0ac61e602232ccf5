"""Benchmark and check only: run a chapter's in-process services through pytrio's own client.

Chapters 8-11 ask for the offline engine in-process (``connect("offline", ..., in_process=True)``) because their
toy sweeps make thousands of requests. With this directory first on the path, ``trio_helpers.connect`` ignores
``in_process``, so every service is pytrio's unmodified ``ServiceClient`` for a loopback offline server
(``trio_helpers.offline.server``) with the same options. Two uses:

- ``python benchmarks/bench_exact_cost.py --variant real-client``: what those chapters would cost through pytrio;
- strict nbval of a chapter with ``PYTHONPATH=benchmarks/real_client``: the same outputs through pytrio's client.

Never used by the book, the tests or the package.
"""

import trio_helpers.backend as _backend

_original = _backend.connect


def _connect(backend=None, *, in_process=False, **options):
    return _original(backend, **options)


_backend.connect = _connect

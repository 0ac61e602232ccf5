"""Benchmark only: ``python benchmarks/bench_book.py --float-arithmetic`` puts this directory first on the path of
one of its two runs, so every process of that run (pytest, its workers, each notebook's kernel) computes the offline
backend's products, ``exp`` and ``log`` with numpy's float64 functions instead of
:mod:`trio_helpers.offline.exact`'s. Same chapters, same code paths, other (platform-dependent) bits: the run's
cells fail nbval where a number changed, and its time is what the book would cost without exact arithmetic.
Never used by the book, the tests or the package.
"""

import numpy as np

from trio_helpers.offline import exact


class Rounded:
    """Holds the operand as it is (no rounding): ``matmul`` below multiplies the float64 arrays."""

    def __init__(self, x, side="right"):
        self.value = np.asarray(x, dtype=np.float64)
        self.shape, self.side = self.value.shape, side


def matmul(a, b):
    return np.matmul(getattr(a, "value", a), getattr(b, "value", b))


exact.Rounded, exact.matmul, exact.exp, exact.log = Rounded, matmul, np.exp, np.log

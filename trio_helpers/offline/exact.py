"""Arithmetic that gives the same bits on every computer: the offline backend's matrix products, exp and log.

Introduced in {ref}`offline-backend-exact` (book/offline_backend.md). numpy's ``+ - * /`` and ``sqrt`` are IEEE-754
operations, correctly rounded, so they give the same bits on any machine. Two things do not:

- **Matrix products.** BLAS picks a kernel for the CPU and splits the work over threads; each choice adds the
  products in another order, and floating-point addition is not associative, so the last bits change with the CPU,
  the BLAS build and the thread count.
- **exp, log and the other transcendental functions.** numpy dispatches them to SIMD code chosen for the CPU
  (AVX-512, AVX2, NEON, ...), the C library has its own, and none of them is correctly rounded, so each gives
  slightly different bits.

This module replaces both:

- :func:`matmul` rounds each row of the left operand and each column of the right one to a shared exponent and a
  mantissa short enough that every product and every partial sum is an integer multiple of one unit below
  ``2**53``: a float64 holds each of them exactly, so the result is the exact product of the rounded operands
  whatever order, kernel or thread count BLAS uses (BLAS stays fast). With an inner dimension ``K`` the two
  operands share ``53 - ceil(log2 K)`` bits: 24 bits each for the model's 32-wide products (the precision of
  float32), fewer for long sums such as a gradient over 8,192 tokens (20 bits each). A row's result depends on that
  row only, so a forward pass is batch-invariant by construction.
- :func:`exp` and :func:`log` are built from ``+ - * /``, ``rint``, ``frexp`` and ``ldexp`` only (table-driven
  range reduction and short polynomials, the textbook construction), accurate to a few units in the last place
  and the same bits everywhere. :func:`cos` and :func:`ipow` do the same for the scalars of learning-rate
  schedules and Adam's bias corrections (Python's ``**`` and ``math.cos`` call the C library).

Reductions (``np.sum``, ``np.cumsum``) add in an order fixed by the array's shape, not by the CPU, so they need
nothing. ``tests/test_portability.py`` checks all of it under other BLAS kernels, SIMD levels and thread counts.
"""

from __future__ import annotations

import decimal
import math

import numpy as np

__all__ = ["matmul", "Rounded", "exp", "log", "cos", "ipow", "GRID_BITS", "on_grid"]

# ---- matrix products ---------------------------------------------------------------------------------------------


def _block_round(x: np.ndarray, bits: int, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """``(q, scale)`` with ``q`` integer-valued, ``|q| <= 2**bits`` and ``x ~= q * scale``; ``scale`` is a power of
    two shared along ``axis`` (one per row for ``axis=1``, per column for ``axis=0``), set by the largest magnitude
    there."""
    q = np.abs(x)
    _, top = np.frexp(np.maximum.reduce(q, axis=axis, keepdims=True))  # every |x| < 2**top along the axis
    shift = np.minimum(bits - top, 1000)  # (a row of zeros or of subnormals: 2**shift stays finite)
    np.multiply(x, np.ldexp(1.0, shift), out=q)  # exact: a power of two
    np.rint(q, out=q)
    return q, np.ldexp(1.0, -shift)


def _widths(k: int) -> tuple[int, int]:
    """Significant bits of the left and the right operand's entries for an inner dimension ``k``: they add up to
    ``53 - ceil(log2 k)``, leaving ``ceil(log2 k)`` bits for the sum of ``k`` products."""
    budget = 53 - (k - 1).bit_length()
    return budget // 2, budget - budget // 2


def _round_side(x: np.ndarray, side: str) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_block_round` of ``x`` as the ``side`` operand of a product: per column on the right, per row on the
    left, to that side's share of the bits of its inner dimension."""
    right = side == "right"
    k = x.shape[0] if right else x.shape[1]
    return _block_round(x, _widths(k)[1 if right else 0], axis=0 if right else 1)


class Rounded:
    """An operand of :func:`matmul` rounded once, for an operand used in several products: a model's frozen output
    matrix, a sampler's adapter (``side="right"``: rounded per column) or a hidden state multiplied by two matrices
    (``side="left"``: per row). ``matmul`` with it is the same bits as with the array; it only skips rounding it
    again. The rounded copy is made at once, so later changes to the array do not reach it; ``value`` is the array
    it was made from (for tests that compute the float64 product instead)."""

    def __init__(self, x: np.ndarray, side: str = "right") -> None:
        if side not in ("left", "right"):
            raise ValueError(f"side must be 'left' or 'right', got {side!r}")
        x = np.asarray(x, dtype=np.float64)
        self.value, self.shape, self.side = x, x.shape, side
        if x.size:
            self.q, self.scale = _round_side(x, side)


def _operand(x, side: str) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(x, Rounded):
        return _round_side(x, side)
    if x.side != side:
        raise ValueError(f"matmul: a Rounded(side={x.side!r}) operand used on the {side}")
    return x.q, x.scale


def matmul(a: np.ndarray | Rounded, b: np.ndarray | Rounded) -> np.ndarray:
    """``a @ b`` for 2-D float arrays, computed exactly from a rounded copy of each operand (see the module text).

    Every row of ``a`` and every column of ``b`` is rounded to ``bits`` significant bits below its largest entry,
    where the two widths add up to ``53 - ceil(log2 K)`` for an inner dimension ``K``; the products of the
    resulting integers then sum below ``2**53`` exactly in any order, and scaling the sums back by powers of two
    is an IEEE operation on each entry. Either operand may be given pre-rounded (:class:`Rounded`).
    """
    if not isinstance(a, Rounded):
        a = np.asarray(a, dtype=np.float64)
    if not isinstance(b, Rounded):
        b = np.asarray(b, dtype=np.float64)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align")
    if a.shape[1] == 0 or a.shape[0] == 0 or b.shape[1] == 0:
        return np.zeros((a.shape[0], b.shape[1]))
    qa, sa = _operand(a, "left")
    qb, sb = _operand(b, "right")
    out = qa @ qb
    out *= sa
    out *= sb
    return out


# ---- fixed-point grid for the embedding table ---------------------------------------------------------------------

# The embedding table's entries are multiples of 2**-GRID_BITS below 2**19 in magnitude, so a sum of up to 16 of
# them (a hidden vector sums 13) is exact: 16 * 2**19 * 2**GRID_BITS = 2**53.
GRID_BITS = 30
GRID_LIMIT = 2.0**19


def on_grid(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to the nearest multiple of ``2**-GRID_BITS`` (a new array).

    Raises:
        ValueError: an entry's magnitude is not below ``GRID_LIMIT`` (sums of such entries would not be exact).
    """
    x = np.asarray(x, dtype=np.float64)
    if x.size and not float(np.abs(x).max()) < GRID_LIMIT:
        raise ValueError(f"values must stay below {GRID_LIMIT:g} in magnitude to sum exactly on the grid; "
                         f"got {float(np.abs(x).max()):g}")
    return np.ldexp(np.rint(np.ldexp(x, GRID_BITS)), -GRID_BITS)


# ---- exp and log ---------------------------------------------------------------------------------------------------

# exp(x) = 2**m * 2**(j/256) * exp(r) with x = (256 m + j) ln2/256 + r, |r| <= ln2/512.
_N = 256
_LN2 = 0.6931471805599453  # the double nearest ln 2
_INV_LN2_N = _N / _LN2
# ln2/256 split so that k * hi is exact for |k| < 2**20 (fdlibm's split of ln 2, scaled by a power of two)
_LN2_N_HI = 6.93147180369123816490e-01 / _N
_LN2_N_LO = 1.90821492927058770002e-10 / _N


def _table() -> np.ndarray:
    """2**(j/256) for j = 0..255, correctly rounded, from Python's decimal module (software, so the same bits
    everywhere; never the C library's exp2 or pow)."""
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        return np.array([float(decimal.Decimal(2) ** (decimal.Decimal(j) / _N)) for j in range(_N)])


_T = _table()
_T.flags.writeable = False


_BLOCK = 16384  # elements per pass: a pass's temporaries stay in the CPU's cache


def exp(x) -> np.ndarray:
    """``e**x`` elementwise (float64), the same bits on every machine; error at most one unit in the last place
    (checked against 120-bit arithmetic in tests/test_exact.py)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty(x.shape)
    flat_x, flat_out = x.reshape(-1), out.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, flat_x.size, _BLOCK):
            _exp_block(flat_x[i:i + _BLOCK], flat_out[i:i + _BLOCK])
    return out if out.ndim else out[()]


def _exp_block(x: np.ndarray, out: np.ndarray) -> None:
    t = np.clip(x, -746.0, 710.0)  # beyond these exp is 0 or inf; also maps -inf/inf there (nan stays nan)
    k = np.multiply(t, _INV_LN2_N)
    np.rint(k, out=k)
    r = np.multiply(k, _LN2_N_HI)
    np.subtract(t, r, out=r)
    np.multiply(k, _LN2_N_LO, out=t)
    r -= t
    ki = k.astype(np.int64)
    # exp(r) - 1 for |r| <= 0.00136: Taylor to r**4 (the next term is below 4e-17)
    p = np.multiply(r, 1.0 / 24.0, out=k)
    p += 1.0 / 6.0
    p *= r
    p += 0.5
    p *= r
    p += 1.0
    p *= r
    scale = np.take(_T, np.bitwise_and(ki, _N - 1), out=t)
    p *= scale
    p += scale
    np.ldexp(p, np.right_shift(ki, 8, out=ki), out=out)  # nan in x: p is nan, so out is nan


_SQRT_HALF = 0.7071067811865476
# ln2 split so that e * hi is exact for any float64 exponent e
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
# 2 atanh(s) = 2s (1 + s**2/3 + s**4/5 + ...), |s| <= 0.1716: eleven terms reach below 1e-17
_ATANH = tuple(1.0 / (2 * i + 1) for i in range(1, 12))


_SMALL = 8  # up to this many positive finite entries, Python floats are faster than numpy's per-call overhead


def log(x) -> np.ndarray:
    """Natural logarithm elementwise (float64), the same bits on every machine; error below about 2 units in the
    last place. ``log(0) = -inf``, negative arguments give ``nan``."""
    x = np.asarray(x, dtype=np.float64)
    if x.size <= _SMALL and x.ndim and bool((x > 0.0).all() and (x < np.inf).all()):
        return np.array([_log_one(v) for v in x.reshape(-1).tolist()]).reshape(x.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        return _log(x)


def _log_one(x: float) -> float:
    """:func:`_log` of one positive finite Python float: the same operations in the same order on IEEE doubles
    (each rounded once, as numpy's elementwise ones are), so the same bits (tests/test_exact.py compares)."""
    m, e = math.frexp(x)
    if m < _SQRT_HALF:
        m, e = m + m, e - 1
    f = m - 1.0
    s = f / (f + 2.0)
    z = s * s
    poly = _ATANH[-1]
    for c in _ATANH[-2::-1]:
        poly = poly * z
        poly = poly + c
    poly = poly * z
    ef = float(e)
    poly = poly + poly
    return ef * _LN2_HI + (ef * _LN2_LO + (f - s * (f - poly)))


def _log(x: np.ndarray) -> np.ndarray:
    m, e = np.frexp(x)  # x = m * 2**e, 0.5 <= m < 1
    low = m < _SQRT_HALF
    m = np.where(low, m + m, m)  # now sqrt(1/2) <= m < sqrt(2)
    e = e - low
    f = m - 1.0
    s = f / (f + 2.0)
    z = s * s
    poly = np.full_like(z, _ATANH[-1])
    for c in _ATANH[-2::-1]:
        poly *= z
        poly += c
    poly *= z
    ef = e.astype(np.float64)
    poly += poly  # 2R, with log(1 + f) = 2s (1 + R) = f - s (f - 2R), as 2s = f - s f
    out = ef * _LN2_HI + (ef * _LN2_LO + (f - s * (f - poly)))
    special = ~(x > 0.0) | ~np.isfinite(x)
    if special.any():
        out = np.where(x == 0.0, -np.inf, np.where(x == np.inf, np.inf, np.where(x > 0.0, out, np.nan)))
        out = np.where(np.isnan(x), np.nan, out)
    return out if out.ndim else out[()]


# ---- scalars -------------------------------------------------------------------------------------------------------

_PIO2_HI = 1.57079632673412561417e00  # pi/2 split (fdlibm): k * hi exact for small k
_PIO2_LO = 6.07710050650619224932e-11


def cos(x: float) -> float:
    """``cos(x)`` for a Python float with ``|x| < 1e6``, the same bits everywhere (``math.cos`` is the C
    library's); error about one unit in the last place."""
    x = float(x)
    if not abs(x) < 1e6:
        raise ValueError(f"cos expects |x| < 1e6, got {x!r}")
    k = round(x / _PIO2_HI)
    y = (x - k * _PIO2_HI) - k * _PIO2_LO  # |y| <= pi/4 (a little more)
    y2 = y * y
    # Taylor series to y**16 (|y| <= 0.79: the next terms are below 1e-17)
    c = s = 0.0
    for n in range(8, 0, -1):
        c = (c - 1.0 / math.factorial(2 * n)) * y2 if n % 2 else (c + 1.0 / math.factorial(2 * n)) * y2
        s = (s - 1.0 / math.factorial(2 * n + 1)) * y2 if n % 2 else (s + 1.0 / math.factorial(2 * n + 1)) * y2
    c, s = 1.0 + c, y + y * s
    return (c, -s, -c, s)[k % 4]


def ipow(base: float, n: int) -> float:
    """``base ** n`` for an integer ``n >= 0`` by repeated squaring (Python's float ``**`` calls the C library's
    ``pow``, whose last bits vary between systems)."""
    if n < 0:
        raise ValueError(f"ipow expects n >= 0, got {n}")
    result, b = 1.0, float(base)
    while n:
        if n & 1:
            result *= b
        b *= b
        n >>= 1
    return result

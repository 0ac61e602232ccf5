"""trio_helpers.offline.exact: the same bits on every computer (book/offline_backend.md, "Exact arithmetic").

The products are exact by construction (checked here against integer arithmetic and against every summation order
a kernel could pick); exp, log and cos are checked against 120-bit arithmetic; a scan of the backend's source keeps
numpy's and the C library's transcendental functions and plain matrix products out of every module whose numbers
reach the sampler or the trainer. tests/test_portability.py runs the backend under other SIMD levels and thread counts.
"""

from __future__ import annotations

import ast
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from mpmath import mp

from trio_helpers.offline import exact

REPO = Path(__file__).resolve().parents[1]


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(got - want) / np.spacing(np.abs(want))


def test_exp_is_within_one_unit_in_the_last_place():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-745, 709, 3000), rng.uniform(-1, 1, 3000), rng.uniform(-40, 0, 3000),
                        [0.0, 1e-300, -1e-300, 0.5 * 0.6931471805599453, 709.7, -708.3]])
    with mp.workprec(120):
        want = np.array([float(mp.exp(mp.mpf(float(v)))) for v in x])
    assert _ulps(exact.exp(x), want).max() <= 1.0


def test_exp_special_values_and_shapes():
    got = exact.exp(np.array([-np.inf, np.inf, np.nan, -800.0, 800.0, 0.0]))
    assert got[0] == 0.0 and got[1] == np.inf and np.isnan(got[2]) and got[3] == 0.0 and got[4] == np.inf
    assert got[5] == 1.0
    assert isinstance(exact.exp(0.5), float) and exact.exp(np.zeros((3, 40000))).shape == (3, 40000)


def test_log_is_within_one_unit_in_the_last_place():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(1e-300, 1, 2000), rng.uniform(0.5, 2, 2000), rng.uniform(1, 1e300, 2000),
                        rng.uniform(0.999, 1.001, 2000), [5e-324, 1.0, 2.0, 0.5, 261.0]])
    with mp.workprec(120):
        want = np.array([float(mp.log(mp.mpf(float(v)))) for v in x])
    got = exact.log(x)
    nonzero = want != 0
    assert _ulps(got[nonzero], want[nonzero]).max() <= 1.0 and np.all(got[~nonzero] == 0.0)


def test_log_special_values():
    got = exact.log(np.array([0.0, -1.0, np.inf, np.nan, -np.inf]))
    assert got[0] == -np.inf and np.isnan(got[1]) and got[2] == np.inf and np.isnan(got[3]) and np.isnan(got[4])


def test_cos_and_ipow():
    with mp.workprec(120):
        for x in np.linspace(0.0, math.pi, 513):
            assert abs(exact.cos(x) - float(mp.cos(mp.mpf(float(x))))) <= 2.3e-16
    assert exact.cos(0.0) == 1.0 and exact.cos(math.pi) == -1.0
    for base, n in ((0.9, 1), (0.95, 37), (0.99, 500), (0.5, 1074)):
        assert exact.ipow(base, n) == pytest.approx(float(Fraction(base) ** n), rel=1e-13)
    assert exact.ipow(0.9, 0) == 1.0
    with pytest.raises(ValueError, match="n >= 0"):
        exact.ipow(0.9, -1)


def _rounded_operands(a, b):
    """The integer operands and scales exact.matmul multiplies (recomputed here from its definition)."""
    k = a.shape[1]
    budget = 53 - math.ceil(math.log2(k)) if k > 1 else 53
    qa, sa = exact._block_round(a, budget // 2, axis=1)
    qb, sb = exact._block_round(b, budget - budget // 2, axis=0)
    return qa, sa, qb, sb, budget


@pytest.mark.parametrize("shape", [(7, 32, 261), (5, 261, 32), (3, 8192, 4), (4, 1, 3), (6, 33, 5)])
def test_matmul_is_the_exact_product_of_its_rounded_operands(shape):
    m, k, n = shape
    rng = np.random.default_rng(k)
    a = rng.normal(size=(m, k)) * np.exp2(rng.integers(-30, 30, size=(m, 1)))
    b = rng.normal(size=(k, n)) * np.exp2(rng.integers(-30, 30, size=(1, n)))
    qa, sa, qb, sb, budget = _rounded_operands(a, b)
    assert np.all(np.abs(qa) * np.abs(qb).max() * k <= 2.0**53)  # every partial sum is representable
    ia, ib = qa.astype(np.int64).astype(object), qb.astype(np.int64).astype(object)
    exact_sums = ia.dot(ib)  # Python integers: no rounding at all
    want = np.array([[float(Fraction(int(exact_sums[i, j])) * Fraction(float(sa[i, 0])) * Fraction(float(sb[0, j])))
                      for j in range(n)] for i in range(m)])
    got = exact.matmul(a, b)
    assert np.array_equal(got, want)
    # and the rounding stays within the operands' precision of the float64 product
    bound = k * np.abs(a).max(axis=1, keepdims=True) * np.abs(b).max(axis=0, keepdims=True) * 2.0 ** (2 - budget // 2)
    assert np.all(np.abs(got - a @ b) <= bound)


def test_matmul_does_not_depend_on_the_summation_order_or_the_other_rows():
    rng = np.random.default_rng(5)
    a, b = rng.normal(size=(64, 32)), rng.normal(size=(32, 261))
    whole = exact.matmul(a, b)
    for seed in range(5):
        order = np.random.default_rng(seed).permutation(32)  # another order of the inner sum, as another kernel
        assert np.array_equal(exact.matmul(a[:, order], b[order]), whole)
    for lo, hi in ((0, 1), (3, 4), (5, 38), (63, 64)):
        assert np.array_equal(exact.matmul(a[lo:hi], b), whole[lo:hi])
    assert np.array_equal(exact.matmul(np.asfortranarray(a), b), whole)  # memory layout: another BLAS path


def test_pre_rounded_operands_give_the_same_bits():
    """``Rounded`` (a frozen weight rounded once, a hidden state shared by two products) changes no bit, and keeps
    its own copy: a later change to the array does not reach it."""
    rng = np.random.default_rng(8)
    a, b, c = rng.normal(size=(5, 32)), rng.normal(size=(32, 261)), rng.normal(size=(32, 8))
    left, right = exact.Rounded(a, "left"), exact.Rounded(b)
    for x, y, want in ((left, b, exact.matmul(a, b)), (a, right, exact.matmul(a, b)),
                       (left, right, exact.matmul(a, b)), (left, c, exact.matmul(a, c))):
        assert np.array_equal(exact.matmul(x, y), want)
    before = b.copy()
    b[0, 0] += 1.0
    assert np.array_equal(exact.matmul(a, right), exact.matmul(a, before))
    with pytest.raises(ValueError, match="side='left'"):  # a row-rounded operand on the right
        exact.matmul(a, exact.Rounded(c, "left"))
    with pytest.raises(ValueError, match="do not align"):
        exact.matmul(left, rng.normal(size=(31, 2)))


def test_log_of_a_few_values_takes_the_scalar_path_with_the_same_bits():
    """``log`` of up to ``_SMALL`` values runs on Python floats (faster than numpy's per-call overhead): the same
    operations, so the same bits as the array path, over the whole range including subnormals."""
    rng = np.random.default_rng(9)
    xs = np.concatenate([rng.random(20000) * 10, exact.exp(rng.uniform(-700, 700, 20000)),
                         rng.random(200) * 1e-310, [5e-324, np.finfo(float).max, 1.0, 0.5, np.sqrt(0.5)]])
    with np.errstate(all="ignore"):
        vector = exact._log(xs)
    scalar = np.array([exact._log_one(v) for v in xs.tolist()])
    assert np.array_equal(vector.view(np.int64), scalar.view(np.int64))
    few = xs[:exact._SMALL]
    assert np.array_equal(exact.log(few), vector[:exact._SMALL])
    assert np.array_equal(exact.log(few.reshape(2, -1)), vector[:exact._SMALL].reshape(2, -1))
    assert np.isnan(exact.log(np.array([-1.0, 2.0]))[0]) and exact.log(np.array([0.0]))[0] == -np.inf


def test_matmul_edge_cases():
    assert exact.matmul(np.zeros((3, 0)), np.zeros((0, 4))).shape == (3, 4)
    z = exact.matmul(np.zeros((2, 5)), np.ones((5, 3)))
    assert np.array_equal(z, np.zeros((2, 3)))
    tiny = exact.matmul(np.full((1, 4), 1e-310), np.ones((4, 1)))
    assert np.isfinite(tiny).all() and tiny[0, 0] == pytest.approx(4e-310, rel=1e-6)


def test_grid_sums_are_exact_and_bounded():
    rng = np.random.default_rng(2)
    rows = exact.on_grid(rng.uniform(-2.0**18, 2.0**18, size=(16, 8)))
    assert np.array_equal(rows, exact.on_grid(rows))
    total = sum(Fraction(float(v)) for v in rows[:, 0])
    for seed in range(5):
        assert float(total) == rows[np.random.default_rng(seed).permutation(16), 0].sum() == rows[:, 0].sum()
    with pytest.raises(ValueError, match="below 524288"):
        exact.on_grid(np.array([2.0**19]))


# Modules whose numbers reach the sampler or the trainer, offline: they compute with exact's functions only.
SCANNED = sorted(p for p in (REPO / "trio_helpers" / "offline").glob("*.py") if p.name != "exact.py") + [
    REPO / "trio_helpers" / name for name in ("rl.py", "loop.py", "grpo.py", "distillation.py", "sft.py", "datums.py")
]
NOT_PORTABLE = {"exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "logaddexp", "logaddexp2", "tanh", "sinh",
                "cosh", "sin", "cos", "tan", "arctan", "power", "float_power", "pow", "erf", "erfc", "lgamma", "gamma",
                "dot", "vdot", "inner", "matmul", "einsum", "tensordot", "convolve", "correlate"}


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: p.name)
def test_no_platform_dependent_arithmetic_in_the_backend(path):
    """No ``@``, BLAS call or transcendental function of numpy or math (only ``exact``'s), and no ``**`` whose
    base is not an integer literal (a float power calls the C library's pow)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in ("np", "numpy", "math") and node.attr in NOT_PORTABLE):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            found.append(f"{node.lineno}: @")
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow)
              and not (isinstance(node.left, ast.Constant) and type(node.left.value) is int)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    assert not found, f"{path.name}: {found}"

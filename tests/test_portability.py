"""The offline backend gives the same bits on every computer (issue: exact arithmetic; book/offline_backend.md).

A fixed workload (tests/portability_workload.py: a small model fitted from scratch, a short GRPO run, a
``compute_logprobs``, a ``forward_backward``'s loss and gradients) runs in subprocesses under every combination of
numpy SIMD level (``NPY_DISABLE_CPU_FEATURES``: none, AVX-512 off, AVX2 and AVX-512 off) and BLAS thread count
(``OPENBLAS_NUM_THREADS`` 1 and 2), and must give one digest per quantity. The BLAS kernel is varied too
(``OPENBLAS_CORETYPE``: as found, Haswell, Sandybridge) unless the environment pins it: some machines pin it because
older OpenBLAS builds miscompute with the kernel they would pick, and tests leave such a pin alone.
Then the book's three fitted models (student, teacher, tool) are fitted from scratch under two other settings and
compared with the digests the committed outputs were made with (``trio_helpers.offline.catalog.BOOK_WEIGHTS``).
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from trio_helpers.offline import catalog, fit

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO / "tests" / "portability_workload.py"
X86 = platform.machine().lower() in ("x86_64", "amd64")

SIMD = ["", "X86_V4", "X86_V3 X86_V4"] if X86 else [""]
THREADS = ["1", "2"]
KERNELS = [None] if os.environ.get("OPENBLAS_CORETYPE") or not X86 else [None, "Haswell", "Sandybridge"]


def _env(simd: str, threads: str, kernel: str | None, **extra: str) -> dict[str, str]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads, **extra}
    env.pop("NPY_DISABLE_CPU_FEATURES", None)
    if simd:
        env["NPY_DISABLE_CPU_FEATURES"] = simd
    if kernel:
        env["OPENBLAS_CORETYPE"] = kernel
    return env


def _run(mode: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKLOAD), mode], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _results(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, dict]:
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{name}: {stderr[-2000:]}"
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


def test_workload_gives_the_same_bits_under_every_simd_level_thread_count_and_kernel():
    settings = list(itertools.product(SIMD, THREADS, KERNELS))
    results = {}
    for batch in range(0, len(settings), 2):  # two at a time on a 2-core machine
        procs = {f"simd={s!r} threads={t} kernel={k or 'as found'}": _run("small", _env(s, t, k))
                 for s, t, k in settings[batch:batch + 2]}
        results.update(_results(procs, timeout=300))
    first = next(iter(results.values()))
    assert set(first) == {"fit_small", "grpo_metrics", "grpo_weights", "compute_logprobs", "forward_backward"}
    for quantity in first:
        digests = {name: r[quantity] for name, r in results.items()}
        assert len(set(digests.values())) == 1, f"{quantity} differs: {json.dumps(digests, indent=1)}"


def test_book_models_fitted_under_other_settings_are_the_books(tmp_path):
    """From an empty cache, with AVX2 and AVX-512 off on one BLAS thread, and with two BLAS threads (and another
    kernel where none is pinned): the weights behind the book's outputs, bit for bit (all three fitted models:
    the student, the teacher and chapter 12's tool model)."""
    other_kernel = None if KERNELS == [None] else "Sandybridge"
    procs = {
        "no AVX2/AVX-512, 1 thread": _run("book", _env(SIMD[-1], "1", None, TRIO_OFFLINE_CACHE=str(tmp_path / "a"))),
        "2 threads": _run("book", _env("", "2", other_kernel, TRIO_OFFLINE_CACHE=str(tmp_path / "b"))),
    }
    for name, digests in _results(procs, timeout=900).items():
        assert digests == {role: catalog.BOOK_WEIGHTS[role] for role in ("student", "teacher", "tool")}, name

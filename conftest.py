"""Session-wide settings for `make test` (unit tests in tests/ and strict nbval over notebooks/).

Everything runs on the offline backend: `TRIO_BACKEND=offline` is forced here, before any test runs or
any notebook kernel starts; the kernels nbval launches inherit this process's environment. No API key
is ever set (with a key but no reachable service, pytrio would retry for about fifteen minutes).

Matplotlib: the `MPLBACKEND` variable is removed rather than set to Agg, because kernels inherit it: with
`MPLBACKEND=Agg` a kernel's `plt.show()` displays nothing, so a notebook whose committed outputs contain
figures would fail strict nbval. Without the variable, ipykernel picks its inline backend, exactly as when
`make notebook` executed the chapter. This process does not import matplotlib (that would cost every
pytest-xdist worker about 0.4 s of CPU); the unit tests that draw select Agg themselves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ["TRIO_BACKEND"] = "offline"
# One BLAS thread in every notebook kernel (they inherit this environment), for speed only: the offline arithmetic
# gives the same bits on any thread count (trio_helpers/offline/exact.py), but the models' matrices are small and
# OpenBLAS's threads spin while they wait, so with three pytest workers on two cores a threaded BLAS cost the book
# 112 s of CPU instead of 71 s (python benchmarks/bench_book.py, with and without OPENBLAS_NUM_THREADS=1).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests never download models or data sets: make the Hugging Face libraries fail fast instead of retrying.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.pop("MPLBACKEND", None)


def pytest_configure(config: pytest.Config) -> None:
    """Resolve a relative `--nbval-sanitize-with` path against the repository root.

    This lets `pytest` run from any working directory with the options in pyproject.toml.
    """
    sanitize = getattr(config.option, "nbval_sanitize_with", None)
    if sanitize and not Path(sanitize).is_absolute():
        config.option.nbval_sanitize_with = str(config.rootpath / sanitize)
    if getattr(config.option, "nbval", False) or getattr(config.option, "nbval_lax", False):
        _retry_kernel_starts()


def _retry_kernel_starts(attempts: int = 3) -> None:
    """Start a notebook's kernel again when it does not come up (at most ``attempts`` starts).

    jupyter_client picks a kernel's five ports by binding port 0 and releasing it; until the new kernel binds them,
    another process can take one: another kernel starting on another pytest-xdist worker, or an outgoing loopback
    connection (the chapters' pytrio clients talk to their offline servers over 127.0.0.1). The kernel then never
    answers, and nbval fails every cell after its 60-s start-up timeout (jupyter_client issue 487; it happened once
    in six runs of the notebooks on 2026-12-03, to chapter 5). nbval's ``start_new_kernel`` shuts a kernel that did
    not answer down before it raises, so starting another one, with fresh ports, is safe.
    """
    import warnings

    from nbval import kernel as nbval_kernel

    start = nbval_kernel.RunningKernel.__init__
    if getattr(start, "retries_kernel_starts", False):
        return

    def start_with_retries(self, *args, **kwargs):
        for attempt in range(1, attempts + 1):
            try:
                return start(self, *args, **kwargs)
            except RuntimeError as err:  # "Kernel didn't respond in 60 seconds", "Kernel died before replying ..."
                if attempt == attempts:
                    raise
                warnings.warn(f"a notebook kernel did not start ({err}); starting another", stacklevel=1)

    start_with_retries.retries_kernel_starts = True
    nbval_kernel.RunningKernel.__init__ = start_with_retries


# Longest first (times from `python benchmarks/bench_book.py`), so that pytest-xdist, which hands files to its
# workers in collection order (`make test` passes --no-loadscope-reorder), never starts a long chapter last.
SLOWEST_FIRST = ("07_evaluation", "05_grpo_async", "06_opd", "04_grpo_sync", "08_losses", "11_tuning_and_monitoring",
                 "12_tool_use", "10_grpo_variants", "09_sft_and_kl", "02_reward_parsing", "01_gsm8k_data",
                 "03_datum_alignment")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Notebooks first, slowest first; everything else after them in its own order (a stable sort)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}

    def key(item) -> int:
        path = Path(str(item.fspath))
        if path.suffix == ".ipynb":
            return rank.get(path.stem, len(rank))
        return len(rank) + 1

    items.sort(key=key)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Fit (or load from the cache) the offline base models before any test or notebook kernel needs them.

    The first use of a fitted model prints a one-time "fitting ..." message; doing it here keeps that message out
    of notebook outputs, which strict nbval compares. With pytest-xdist this runs in the controller before it
    starts the workers (xdist's own session start runs last), so the workers, which only read the cache, skip it.
    """
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from trio_helpers.offline.fit import ensure_fitted  # fits or loads the fitted models into the disk cache

    ensure_fitted()


# After a notebook's last cell, its kernel is asked which runs of its offline servers are still open: a chapter
# ends what it opened (trio_helpers.backend.end_sessions), as a reader should on the service, where pytrio keeps a
# run alive while its client exists. The probe runs in the kernel after the cells (store_history off, so the
# notebook's outputs are not touched); a run left open fails the notebook's last cell at teardown.
OPEN_RUNS_PROBE = """
import gc as _gc, json as _json, sys as _sys
_gc.collect()
_server = _sys.modules.get("trio_helpers.offline.server")
print("OPEN_RUNS=" + _json.dumps(_server.open_runs() if _server else []))
"""


def _open_runs(kernel, timeout: float = 60.0) -> list[str]:
    msg_id = kernel.execute_cell_input(OPEN_RUNS_PROBE, allow_stdin=False)
    text = ""
    while True:
        msg = kernel.get_message(stream="iopub", timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text += msg["content"]["text"]
        elif msg["msg_type"] == "error":
            raise RuntimeError(f"the open-runs probe failed in the kernel: {msg['content']['evalue']}")
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    kernel.await_reply(msg_id, timeout)
    return json.loads(text.split("OPEN_RUNS=", 1)[1])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Fail a notebook whose kernel still holds open runs after its last cell."""
    last_cell = type(item).__name__ == "IPyNbCell" and (nextitem is None or nextitem.parent is not item.parent)
    kernel = getattr(item.parent, "kernel", None) if last_cell else None
    left_open = _open_runs(kernel) if kernel is not None and kernel.is_alive() else []
    result = yield  # nbval stops the kernel here
    if left_open:
        pytest.fail(f"{Path(str(item.fspath)).name} leaves {len(left_open)} run(s) open after its last cell "
                    f"({', '.join(left_open[:6])}{', ...' if len(left_open) > 6 else ''}): end them with "
                    "trio_helpers.backend.end_sessions() (book/troubleshooting.md)", pytrace=False)
    return result

"""How long the book's notebooks take under strict nbval, run exactly as ``make test`` runs them (one run, a table).

Usage::

    python benchmarks/bench_book.py               # the notebooks, the way make test runs them; bars below
    python benchmarks/bench_book.py --repeats 2   # run twice, keep the faster run (other processes only add time)
    python benchmarks/bench_book.py --serial      # the same with TEST_ARGS= (no parallel workers: the "before")
    python benchmarks/bench_book.py --all         # the whole of make test (unit tests too), not just notebooks/
    python benchmarks/bench_book.py notebooks/05_grpo_async.ipynb   # some notebooks only
    python benchmarks/bench_book.py --workers 2,3 --repeats 2   # worker counts compared, runs interleaved
    python benchmarks/bench_book.py --against --repeats 3       # against the book issue 10 timed, interleaved

What runs: the pytest command of ``make test``, taken from ``make -n test`` (so its environment and its
``TEST_ARGS`` are exactly the Makefile's; strict nbval and the sanitize file come from pyproject.toml's
``addopts``), with ``notebooks`` appended (and ``-q -p bench_book``, this file as a plugin that records
durations). ``--serial`` runs ``make -n test TEST_ARGS=``. Run ``make venv`` first if requirements changed.

What is printed: per notebook, the seconds its cells took (setup + call + teardown of every cell item, so the
kernel start and shutdown are included), the CPU seconds of its kernel process (independent of how busy the
machine is, unlike the wall times), the worker it ran on and how many cells passed/failed; with parallel
workers each notebook runs whole on one worker, so these are the notebook's own wall times and they add up to
more than the total; a kernel over the project's 20 s of CPU is marked, and the heaviest kernel gets PASS/FAIL.
Then the total wall time of the whole pytest process (start-up, the session-start fit or cache load of the offline
models, worker start-up, every notebook) with PASS/FAIL against ``--budget`` (the project's 90 s for the whole book;
issue 10 set 60 s for the seven chapters of round 1, which ``--against`` still applies to the reference it scales),
the CPU time of every process of the run (a floor for the wall time on an idle machine, useful when
other processes share it) and the slowest cells. A notebook that fails nbval still counts with its time. Exit
status 1 if the total or a kernel is over budget, 2 if both are within budget but a notebook failed.

Before and after every run a *machine check* times a fixed single-threaded workload (a Python loop and small
numpy operations, the mix the offline backend computes) in CPU seconds. The machines these benchmarks run on
share their host: the same code's CPU time varies by 20 % and more from hour to hour (and the check itself
within minutes), so the two checks are a rough reading of how fast the machine was around each run.

``--against`` measures the book relative to another commit's book (``--rev``, default ``REFERENCE_REV``, the end of
round 1: the seven-chapter book that issue 10 timed at "about 64 s", ``REFERENCE_S``, when it set the 60-s bar).
The other commit's tree is exported with ``git archive`` into a temporary directory, its offline models are fitted
or loaded from the shared cache first (not timed), and then the two books run in turn (every other round the other
one first), ``--repeats`` rounds, with the same pytest command (this Makefile's ``make test`` line, so the same
xdist workers) and the same environment (one BLAS thread), each tree with its own conftest, pyproject options and
committed outputs. A round's two runs are back to back, so a slow stretch of the host tends to slow both (it also
drifts within minutes: hence several rounds and medians): each round prints the ratios of wall and of CPU times,
and the summary scales the issue's 64 s by the larger of the two medians (PASS if that is within its 60 s). Round
1 ran its notebooks serially (its ``make test`` had no workers); running the reference on the same workers makes it
faster than it was, so the ratio errs against this book. Cells of the older book may fail on their last digits (it
was executed before the book fixed one BLAS thread); they still run, so their time counts. A round in which either
run reports errors (items that could not run, such as a kernel that did not start) is left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 90.0  # the whole book, wall, on a quiet 2-core machine (the project's standing bar)
KERNEL_CPU_S = 20.0  # each chapter's kernel, CPU seconds (the project's standing bar)
ISSUE10_BUDGET_S = 60.0  # issue 10's bar for the book of round 1 (REFERENCE_REV), which --against scales
# The book issue 10 timed when it set the budget (the last commit of round 1: chapters 01-07), and that time.
REFERENCE_REV = "06f894a"
REFERENCE_S = 64.0
_ERRORS = re.compile(r"\b\d+ errors?\b")  # in pytest's summary line: items that could not run


# ------------------------------------------------------------------------------ pytest plugin (``-p bench_book``)
# Loaded into the pytest process under test (and, with pytest-xdist, into each worker, where it does nothing): the
# controller sees every report, including the workers', and writes per-file durations to $BENCH_BOOK_OUT.
def pytest_runtest_logreport(report) -> None:
    out = os.environ.get("BENCH_BOOK_OUT")
    if not out or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    path = report.nodeid.split("::")[0]
    _CELLS[report.nodeid] = _CELLS.get(report.nodeid, 0.0) + float(report.duration or 0.0)
    row = _ROWS[path]
    row["seconds"] += float(report.duration or 0.0)
    if report.when == "call" or report.failed:  # a failed setup/teardown counts as a failed cell too
        row["failed" if report.failed else ("skipped" if report.skipped else "passed")] += 1
    if report.failed:
        _FAILED.append(report.nodeid)
    node = getattr(report, "node", None)
    gateway = getattr(node, "gateway", None)
    if gateway is not None:
        row["worker"] = gateway.id


def pytest_sessionfinish(session) -> None:
    out = os.environ.get("BENCH_BOOK_OUT")
    if out and not os.environ.get("PYTEST_XDIST_WORKER"):
        Path(out).write_text(json.dumps({"files": dict(_ROWS), "cells": _CELLS, "failed": _FAILED}), encoding="utf-8")


def _process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process, from /proc (None where that is unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Before a notebook's kernel is shut down (its last cell's teardown), read the kernel's CPU time."""
    out = os.environ.get("BENCH_BOOK_OUT")
    kernel = getattr(item.parent, "kernel", None)
    if out and kernel is not None and (nextitem is None or nextitem.parent is not item.parent):
        process = getattr(getattr(getattr(kernel, "km", None), "provisioner", None), "process", None)
        cpu = _process_cpu_seconds(process.pid) if process is not None else None
        if cpu is not None:
            path = item.nodeid.split("::")[0]
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            kernels = Path(f"{out}.kernels.{worker}.json")
            known = json.loads(kernels.read_text(encoding="utf-8")) if kernels.exists() else {}
            known[path] = cpu
            kernels.write_text(json.dumps(known), encoding="utf-8")
    yield


_ROWS: dict = defaultdict(lambda: {"seconds": 0.0, "passed": 0, "failed": 0, "skipped": 0, "worker": "-"})
_CELLS: dict[str, float] = {}
_FAILED: list[str] = []


# -------------------------------------------------------------------------------------------------- the runner
def make_test_command(serial: bool = False, workers: int | None = None) -> str:
    """The shell command ``make test`` runs (``make -n test``), with ``TEST_ARGS`` emptied for ``serial``, or
    with its ``-n`` (pytest-xdist workers) replaced by ``workers``.

    Raises:
        RuntimeError: make prints no pytest command, or wants to rebuild the venv first (run ``make venv``).
    """
    command = ["make", "-n", "-s", "--no-print-directory", "test"] + (["TEST_ARGS="] if serial else [])
    if workers is not None:
        echo = ["make", "-s", "--no-print-directory", "--eval=print-test-args:; @printf '%s\\n' $(TEST_ARGS)",
                "print-test-args"]  # (echo would take TEST_ARGS's -n for its own option)
        args = shlex.split(subprocess.run(echo, cwd=REPO, capture_output=True, text=True, check=True).stdout)
        if "-n" not in args:
            raise RuntimeError(f"the Makefile's TEST_ARGS ({' '.join(args)}) set no -n to replace")
        args[args.index("-n") + 1] = str(workers)
        command.append("TEST_ARGS=" + " ".join(args))
    lines = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    lines = [line.strip() for line in lines if line.strip()]
    if not lines or " -m pytest" not in lines[-1]:
        raise RuntimeError(f"`{' '.join(command)}` printed no pytest command: {lines}")
    if len(lines) > 1:
        raise RuntimeError("make test would rebuild the venv first (requirements changed): run `make venv`, "
                           "then this benchmark")
    return lines[-1]


def machine_check() -> float:
    """CPU seconds of a fixed single-threaded workload: how fast the machine is right now (lower is faster)."""
    import numpy as np

    t0 = time.process_time()
    total = 0
    for i in range(1_000_000):
        total += i * i
    rows = np.random.default_rng(0).random((32, 261))
    for _ in range(2000):
        np.exp(rows - rows.max(axis=-1, keepdims=True)).cumsum(axis=-1)
    return time.process_time() - t0


def run_checked(paths: list[str], command: str, tree: Path = REPO) -> tuple[tuple[float, float, int, dict, str],
                                                                          str]:
    """:func:`run_once` between two machine checks: its result and ``"before/after s"``."""
    before = machine_check()
    result = run_once(paths, command, tree)
    return result, f"{before:.2f}/{machine_check():.2f} s"


def run_once(paths: list[str], command: str, tree: Path = REPO) -> tuple[float, float, int, dict, str]:
    """Run ``command`` (make test's pytest line) on ``paths`` once, in ``tree`` (a checkout of the book: its
    ``trio_helpers`` first on the path of pytest and of every kernel).

    Returns:
        (wall seconds, CPU seconds of every process of the run (pytest, its workers and kernels), exit status,
        ``{"files": per-file rows, "cells": per-item seconds}``, pytest's last output lines).
    """
    with tempfile.TemporaryDirectory(prefix="bench_book_") as tmp:
        out = Path(tmp) / "rows.json"
        path = [str(REPO / "benchmarks")] + ([str(tree)] if tree != REPO else []) + [os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "BENCH_BOOK_OUT": str(out), "PYTHONPATH": os.pathsep.join(path)}
        full = f"{command} -p bench_book -q {' '.join(shlex.quote(p) for p in paths)}"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(["bash", "-c", full], cwd=tree, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        rows = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {"files": {}, "cells": {}, "failed": []}
        for kernels in Path(tmp).glob("rows.json.kernels.*.json"):
            for path, seconds in json.loads(kernels.read_text(encoding="utf-8")).items():
                rows["files"].setdefault(path, {"seconds": 0.0, "passed": 0, "failed": 0, "skipped": 0,
                                                "worker": "-"})["kernel_cpu"] = seconds
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    return wall, cpu, proc.returncode, rows, tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=["notebooks"], help="what to run (default: notebooks)")
    ap.add_argument("--repeats", type=int, default=1, help="run this many times and keep the fastest (default 1)")
    ap.add_argument("--serial", action="store_true", help="leave out the Makefile's TEST_ARGS (no parallel workers)")
    ap.add_argument("--all", action="store_true", help="time the whole of make test, not only notebooks/")
    ap.add_argument("--cells", type=int, default=5, help="also list the N slowest cells (default 5; 0: none)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds allowed (default {BUDGET_S:g})")
    ap.add_argument("--workers", help="compare pytest-xdist worker counts, e.g. 2,3: each count's runs "
                                      "interleaved with the others' (--repeats rounds), a line per run, ratios")
    ap.add_argument("--against", action="store_true",
                    help="time another commit's book (--rev) and this one in turn, --repeats rounds, with ratios")
    ap.add_argument("--rev", default=REFERENCE_REV,
                    help=f"the commit --against compares with (default {REFERENCE_REV}: the book issue 10 timed at "
                         f"about {REFERENCE_S:g} s)")
    args = ap.parse_args(argv)
    if args.against:
        return compare_against(args.rev, [] if args.all else args.paths, max(1, args.repeats), ISSUE10_BUDGET_S)
    if args.workers:
        return compare_workers([int(n) for n in args.workers.split(",")], [] if args.all else args.paths,
                               max(1, args.repeats))

    command = make_test_command(serial=args.serial)
    paths = [] if args.all else args.paths
    best = None
    load = os.getloadavg()[0]
    for r in range(max(1, args.repeats)):
        result, check = run_checked(paths, command)
        if args.repeats > 1:
            print(f"run {r + 1}: wall {result[0]:.1f} s, CPU {result[1]:.1f} s, machine check before/after {check}")
        if best is None or result[0] < best[0]:
            best, best_check = result, check
    wall, cpu, status, result, tail = best
    rows, cells = result["files"], result["cells"]

    what = "make test (unit tests + notebooks)" if args.all else f"{' '.join(paths)} under strict nbval"
    print(f"{what}: {command} {' '.join(paths)}")
    print(f"{os.cpu_count()} cpus, 1-minute load average {load:.1f} before the run; fastest of "
          f"{max(1, args.repeats)} runs; machine check before/after it {best_check} CPU (a fixed workload: "
          f"lower is a faster machine)")
    shown = {k: v for k, v in rows.items() if args.all is False or k.endswith(".ipynb")}
    if args.all:
        units = [v for k, v in rows.items() if not k.endswith(".ipynb")]
        if units:
            shown["(unit tests, all files)"] = {
                "seconds": sum(u["seconds"] for u in units), "passed": sum(u["passed"] for u in units),
                "failed": sum(u["failed"] for u in units), "skipped": sum(u["skipped"] for u in units),
                "worker": ",".join(sorted({u["worker"] for u in units})),
            }
    print(f"{'file':<34}{'seconds':>9}{'kernel cpu':>11}  {'worker':<7}{'passed':>7}{'failed':>7}  result")
    failed_files = []
    for name in sorted(shown):
        row = shown[name]
        ok = row["failed"] == 0
        if not ok:
            failed_files.append(name)
        kcpu = f"{row['kernel_cpu']:.1f}" if "kernel_cpu" in row else "-"
        over = row.get("kernel_cpu", 0.0) > KERNEL_CPU_S
        print(f"{name:<34}{row['seconds']:>9.1f}{kcpu:>11}  {row['worker']:<7}{row['passed']:>7}{row['failed']:>7}"
              f"  {'ok' if ok else 'FAILED'}{f' (kernel over {KERNEL_CPU_S:g} s CPU)' if over else ''}")
    kernel_cpu = sum(r.get("kernel_cpu", 0.0) for r in shown.values())
    print(f"{'sum of the files above':<34}{sum(r['seconds'] for r in shown.values()):>9.1f}{kernel_cpu:>11.1f}")
    heaviest = max((r.get("kernel_cpu", 0.0) for r in shown.values()), default=0.0)
    kernels_ok = heaviest <= KERNEL_CPU_S
    print(f"{'heaviest kernel (CPU)':<34}{'':>9}{heaviest:>11.1f}  budget {KERNEL_CPU_S:g} s: "
          f"{'PASS' if kernels_ok else 'FAIL'}")
    print(f"{'CPU time, every process of the run':<34}{cpu:>9.1f}  (so >= {cpu / os.cpu_count():.1f} s wall on "
          f"{os.cpu_count()} idle cpus)")
    within = wall <= args.budget
    print(f"{'total wall (whole pytest run)':<34}{wall:>9.1f}  budget {args.budget:g} s: "
          f"{'PASS' if within else 'FAIL'}")
    if args.cells:
        slow = sorted(((s, k) for k, s in cells.items() if k.split("::")[0].endswith(".ipynb")), reverse=True)
        print(f"slowest cells: " + "; ".join(f"{k.removeprefix('notebooks/')} {s:.1f}s"
                                             for s, k in slow[:args.cells]))
    print(f"pytest exit status {status}: {tail.splitlines()[-1] if tail else ''}")
    if failed_files:
        print("failed (their time still counts): " + ", ".join(failed_files))
        print("failing items: " + ", ".join(result["failed"][:10]) + (" ..." if len(result["failed"]) > 10 else ""))
    if not (within and kernels_ok):
        return 1
    return 2 if failed_files or status not in (0,) else 0


def interleaved(paths: list[str], variants: dict[str, tuple[str, Path]], rounds: int) -> list[dict]:
    """Run every variant (label -> (command, tree)) once per round, in turn, so that a machine that gets busier or
    quieter affects them alike (every other round in the reverse order, so that a steady drift does not always
    favour the variant that runs first); print a line per run. Returns each round's ``{label: (wall, cpu, exit
    status, pytest's last line)}``."""
    results = []
    for r in range(rounds):
        row = {}
        for label, (command, tree) in list(variants.items())[::-1 if r % 2 else 1]:
            (wall, cpu, status, _, tail), check = run_checked(paths, command, tree)
            last = tail.splitlines()[-1] if tail else ""
            row[label] = (wall, cpu, status, last)
            print(f"round {r + 1}  {label:<9}  wall {wall:6.1f} s  cpu {cpu:6.1f} s  check {check}  exit {status}  "
                  f"{last}")
        results.append(row)
    return results


def compare_workers(counts: list[int], paths: list[str], rounds: int) -> int:
    """Run the notebooks with each worker count in turn, ``rounds`` times; print each run and each count's best
    wall time relative to the first count's."""
    print(f"{os.cpu_count()} cpus; {' '.join(paths) or 'make test'} with -n " + ", ".join(map(str, counts))
          + f", {rounds} interleaved rounds")
    results = interleaved(paths, {f"-n {n}": (make_test_command(workers=n), REPO) for n in counts}, rounds)
    best = {label: min(row[label][0] for row in results) for label in results[0]}
    first = f"-n {counts[0]}"
    print("best wall: " + "; ".join(f"{label} {wall:.1f} s ({wall / best[first]:.2f} x {first})"
                                    for label, wall in best.items()))
    return 2 if any(status != 0 for row in results for _, _, status, _ in row.values()) else 0


def export_tree(rev: str, into: Path) -> Path:
    """The tracked files of commit ``rev`` in ``into`` (``git archive``: no worktree is registered)."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def compare_against(rev: str, paths: list[str], rounds: int, budget: float) -> int:
    """This book against commit ``rev``'s, in turn, ``rounds`` times: a line per run and per round's ratio, then
    the median ratio and, for the default reference, the issue's 64 s scaled by it."""
    known = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=REPO,
                           capture_output=True, text=True)
    if known.returncode != 0:
        print(f"error: --rev {rev}: no such commit in {REPO} (a shallow clone lacks the old ones: "
              f"git fetch --unshallow)", file=sys.stderr)
        return 2
    python = REPO / ".venv" / "bin" / "python"
    # make test's line names the venv relatively; both trees run the same interpreter
    command = shlex.join(str(python) if word == ".venv/bin/python" else word
                         for word in shlex.split(make_test_command()))
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"  # both books alike
    with tempfile.TemporaryDirectory(prefix="bench_book_ref_") as tmp:
        ref = export_tree(rev, Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(ref), "TRIO_BACKEND": "offline"}
        subprocess.run([str(python), "-c", "from trio_helpers.offline.fit import ensure_fitted; ensure_fitted()"],
                       cwd=ref, env=env, check=True, capture_output=True)  # fit or load: not timed
        print(f"{os.cpu_count()} cpus; {' '.join(paths) or 'make test'} of {rev} (reference) and of this tree, "
              f"in turn, {rounds} rounds; each: {command} {' '.join(paths)}")
        results = interleaved(paths, {"reference": (command, ref), "this book": (command, REPO)}, rounds)
    # A run with errors (a kernel that did not start, say) did not run every cell: its round says nothing.
    ratios, cpu_ratios = [], []
    for r, row in enumerate(results):
        (wall, cpu, *_), (ref_wall, ref_cpu, *_) = row["this book"], row["reference"]
        if any(_ERRORS.search(last) for *_, last in row.values()):
            print(f"round {r + 1}  this book / reference: left out (errors)")
            continue
        ratios.append(wall / ref_wall)
        cpu_ratios.append(cpu / ref_cpu)
        print(f"round {r + 1}  this book / reference: wall {ratios[-1]:.2f}, cpu {cpu_ratios[-1]:.2f}")
    failed = any(row["this book"][2] != 0 for row in results)
    if not ratios:
        print("no round without errors: no ratio")
        return 2
    wall_ratio, cpu_ratio = statistics.median(ratios), statistics.median(cpu_ratios)
    print(f"this book / reference: wall median {wall_ratio:.2f} (range {min(ratios):.2f}-{max(ratios):.2f}), "
          f"cpu median {cpu_ratio:.2f} (range {min(cpu_ratios):.2f}-{max(cpu_ratios):.2f})")
    if rev != REFERENCE_REV or paths != ["notebooks"]:
        return 2 if failed else 0
    # The larger of the two ratios decides: the CPU ratio does not depend on how the files fell on the workers.
    scaled = max(wall_ratio, cpu_ratio) * REFERENCE_S
    print(f"issue 10 timed the reference at about {REFERENCE_S:g} s; at the larger median ratio this book would take "
          f"{scaled:.1f} s there; budget {budget:g} s: {'PASS' if scaled <= budget else 'FAIL'}")
    if failed:
        return 2
    return 0 if scaled <= budget else 1


if __name__ == "__main__":
    sys.exit(main())

"""What exact arithmetic costs, chapter by chapter: each notebook run twice *at the same time*, once as the book
computes (``trio_helpers.offline.exact``) and once with numpy's float64 products, ``exp`` and ``log`` instead
(``benchmarks/float_arithmetic/sitecustomize.py``), each pinned to its own core, the cores swapped every round.

Usage (from the repository root, on a quiet 2-core machine; about 5 minutes for 2 rounds)::

    python benchmarks/bench_exact_cost.py            # every chapter, 2 rounds
    python benchmarks/bench_exact_cost.py 3 04 06    # 3 rounds, chapters 04 and 06 only
    python benchmarks/bench_exact_cost.py --variant real-client 1 04 08   # through pytrio's own client instead
    python benchmarks/bench_exact_cost.py --against 490c258 2            # against another commit's book

``--variant real-client`` compares the book with itself with every service it asks for in-process
(``connect("offline", ..., in_process=True)``: chapters 8-11) made pytrio's unmodified client for the loopback
server instead (``benchmarks/real_client/sitecustomize.py``): what those chapters would cost through pytrio's
client (chapters 1-7 and 12 already run through it, so both arms compute alike there). The ratio column is the
first column over the second: exact over float (what exactness costs), or the real client over the book as it
runs (column ``exact``). ``--against REV`` compares the book with commit
``REV``'s (exported with ``git archive``; its offline models are fitted or loaded by one untimed warm-up notebook
first), chapter by chapter for the notebooks both have: issue 22 set its bar against the book of the day it was
filed, 490c258 (the last commit before exact arithmetic). Each tree's notebooks run with their own
``trio_helpers`` and their own committed cells, so a chapter whose work changed since ``REV`` compares different
work (the table says which chapters changed; the ratio then also carries that change).

Why simultaneous pairs: the machines these benchmarks run on share their host, and the same book's CPU time moves
by 20 % and more within minutes (running the two whole books one after the other, 3 rounds each time, gave median
ratios of 1.04, 1.52 and 1.23 within an hour on 2026-12-03). Two runs side by side meet the same
host load, so their ratio is steadier. Each run is ``jupyter-execute`` of a copy of the notebook (in a temporary
directory, so run directories do not collide) under ``/usr/bin/time``: its CPU time (user + system) includes the
kernel's and the Jupyter client's, alike for both arms. The float run's cells compute other numbers (its outputs
are not compared): the time is what the book would cost without exact arithmetic. Issue 22's bar: at most 1.10.
"""

from __future__ import annotations

import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


VARIANTS = {"float": "float_arithmetic", "real-client": "real_client"}


def main(argv: list[str]) -> int:
    variant = "float"
    if argv[:1] == ["--against"] and len(argv) > 1:
        return compare_commits(argv[1], int(argv[2]) if argv[2:] else 2, argv[3:])
    if argv[:1] == ["--variant"]:
        variant, argv = argv[1], argv[2:]
        if variant not in VARIANTS:
            print(f"error: --variant must be one of {sorted(VARIANTS)}, got {variant!r}", file=sys.stderr)
            return 2
    # the ratio column is the first arm over the second: exactness's cost, or the real client's over in-process
    arms = ("exact", variant) if variant == "float" else (variant, "exact")
    rounds = int(argv[0]) if argv else 2
    names = _names(REPO, argv[1:])
    if not _can_pin():
        return 2
    paths = {"exact": str(REPO), variant: f"{REPO / 'benchmarks' / VARIANTS[variant]}{os.pathsep}{REPO}"}
    with tempfile.TemporaryDirectory(prefix="bench_exact_cost_") as tmp:
        dirs = {}
        for arm in arms:
            dirs[arm] = Path(tmp) / arm
            shutil.copytree(REPO / "notebooks", dirs[arm], ignore=shutil.ignore_patterns("runs", "*.md"))
        _pairs(arms, dirs, paths, names, rounds)
    return 0


def _names(tree: Path, prefixes: list[str]) -> list[str]:
    names = sorted(Path(p).name for p in glob.glob(str(tree / "notebooks" / "*.ipynb")))
    return [n for n in names if any(n.startswith(k) for k in prefixes)] if prefixes else names


def _can_pin() -> bool:
    if shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        print("error: needs taskset (util-linux) and 2 cores", file=sys.stderr)
        return False
    return True


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    env.update(TRIO_BACKEND="offline", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", JUPYTER_PREFER_ENV_PATH="1",
               OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return env


def compare_commits(rev: str, rounds: int, prefixes: list[str]) -> int:
    """This book against commit ``rev``'s, chapter by chapter, in simultaneous pairs."""
    if not _can_pin():
        return 2
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True)
    if sha.returncode != 0:
        print(f"error: --against {rev!r} is not a commit of this repository; give a commit such as 490c258",
              file=sys.stderr)
        return 2
    arms = ("this book", sha.stdout.strip())
    with tempfile.TemporaryDirectory(prefix="bench_exact_cost_") as tmp:
        old = Path(tmp) / "tree"
        old.mkdir()
        archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        both = [n for n in _names(REPO, prefixes) if (old / "notebooks" / n).exists()]
        changed = [n for n in both if subprocess.run(["git", "diff", "--quiet", rev, "HEAD", "--",
                                                      f"notebooks/{Path(n).stem}.md"], cwd=REPO).returncode]
        dirs = {arms[0]: Path(tmp) / "new", arms[1]: Path(tmp) / "old"}
        shutil.copytree(REPO / "notebooks", dirs[arms[0]], ignore=shutil.ignore_patterns("runs", "*.md"))
        shutil.copytree(old / "notebooks", dirs[arms[1]], ignore=shutil.ignore_patterns("runs", "*.md"))
        paths = {arms[0]: str(REPO), arms[1]: str(old)}
        for arm in arms:  # fit or load each tree's offline models before anything is timed
            subprocess.run([str(REPO / ".venv" / "bin" / "jupyter-execute"), "--timeout=1200", both[0]],
                           cwd=dirs[arm], env={**_environment(), "PYTHONPATH": paths[arm]},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _pairs(arms, dirs, paths, both, rounds)
        print("notebooks whose source changed since", arms[1] + ":", ", ".join(n[:2] for n in changed) or "none")
    return 0


def _pairs(arms, dirs, paths, names, rounds) -> None:
    """Run each notebook of both arms at the same time, one core each (swapped every round); print the table."""
    env = _environment()
    cpu = {n: {arm: [] for arm in arms} for n in names}
    for r in range(rounds):
        for name in names:
            procs = {}
            for i, arm in enumerate(arms):
                times = dirs[arm] / "time.txt"
                command = ["taskset", "-c", str((i + r) % 2), "/usr/bin/time", "-f", "%U %S", "-o", str(times),
                           str(REPO / ".venv" / "bin" / "jupyter-execute"), "--timeout=600", name]
                procs[arm] = (subprocess.Popen(command, cwd=dirs[arm], env={**env, "PYTHONPATH": paths[arm]},
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), times)
            failed = []
            for arm, (proc, times) in procs.items():
                if proc.wait() != 0:
                    failed.append(arm)  # a cell raised: the rest of that notebook did not run
                user, system = map(float, times.read_text().split()[-2:])
                cpu[name][arm].append(user + system)
            print(f"round {r + 1}  {name:<34} {arms[0]} {cpu[name][arms[0]][-1]:6.1f} s  "
                  f"{arms[1]} {cpu[name][arms[1]][-1]:6.1f} s"
                  + (f"  STOPPED EARLY: {', '.join(failed)}" if failed else ""), flush=True)
    total = dict.fromkeys(arms, 0.0)
    print(f"{'CPU seconds, median over rounds':<36}{arms[0]:>12}{arms[1]:>12}{'ratio':>7}")
    for name in names:
        median = {arm: statistics.median(cpu[name][arm]) for arm in arms}
        for arm in arms:
            total[arm] += median[arm]
        print(f"{name:<36}{median[arms[0]]:>12.1f}{median[arms[1]]:>12.1f}{median[arms[0]] / median[arms[1]]:>7.2f}")
    print(f"{'all chapters':<36}{total[arms[0]]:>12.1f}{total[arms[1]]:>12.1f}"
          f"{total[arms[0]] / total[arms[1]]:>7.2f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

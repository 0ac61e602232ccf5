"""``make test-service``: run every chapter on the real PyTRIO service and check the invariants it states.

With a PyTRIO credential (``trio login`` or ``PYTRIO_API_KEY``), each chapter listed in ``_toc.yml`` is executed
from a fresh kernel with ``TRIO_BACKEND=remote`` (every cell must run; outputs are not compared, since a real
model's differ from the committed offline ones), then :func:`tools.invariants.check_namespace` checks what the
chapter computed. It prints one line per chapter (time, objects checked, violations, tokens its runs logged) and
exits 1 if a cell failed or an invariant was violated. The cells that are offline experiments by design (fault
injection, exact KL) check ``TRIO_BACKEND`` and skip themselves, as each chapter's "Run it on the real service"
callout says. This costs real tokens: the introduction's cost table says how many.

Without a credential it prints one line saying what it would do and exits 0, touching no network.

Usage: ``make test-service`` (or ``python tools/check_service.py [notebooks/NN_x.ipynb ...]``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECK = """
import json as _json
import sys as _sys
_sys.path.insert(0, {tools!r})
from invariants import check_namespace as _check
_n, _problems = _check(globals())
print("INVARIANTS " + _json.dumps({{"checked": _n, "problems": _problems}}))
"""


def has_credential() -> bool:
    """Whether pytrio would find an API key (reads pytrio's own state; no network)."""
    sys.path.insert(0, str(REPO))
    from trio_helpers.backend import has_pytrio_credentials

    return has_pytrio_credentials()


def chapters() -> list[Path]:
    """The chapters of ``_toc.yml``, in order."""
    import yaml

    toc = yaml.safe_load((REPO / "_toc.yml").read_text(encoding="utf-8"))
    files = [c["file"] for part in toc.get("parts", []) for c in part.get("chapters", [])]
    return [REPO / f"{f}.ipynb" for f in files if f.startswith("notebooks/")]


def run_chapter(path: Path) -> tuple[float, dict, str | None]:
    """Execute one chapter on the real service; returns (seconds, invariant report, error or None)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(CHECK.format(tools=str(REPO / "tools"))))
    client = NotebookClient(nb, timeout=3600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    error = None
    try:
        client.execute()
    except CellExecutionError as err:
        error = str(err).splitlines()[0] if str(err) else type(err).__name__
    seconds = time.perf_counter() - t0
    report = {"checked": 0, "problems": []}
    for output in nb.cells[-1].get("outputs", []):
        for line in output.get("text", "").splitlines():
            if line.startswith("INVARIANTS "):
                report = json.loads(line[len("INVARIANTS "):])
    return seconds, report, error


def main(argv: list[str]) -> int:
    if not has_credential():
        print("make test-service: no PyTRIO credential (run `trio login` or set PYTRIO_API_KEY); with one it "
              "would run every chapter on the real service and check its invariants. Nothing was sent.")
        return 0
    os.environ["TRIO_BACKEND"] = "remote"
    paths = [Path(a).resolve() for a in argv] or chapters()
    failed = 0
    for path in paths:
        seconds, report, error = run_chapter(path)
        status = "ok" if not error and not report["problems"] else "FAILED"
        failed += status != "ok"
        print(f"{path.stem:<24} {seconds:7.1f} s  {report['checked']:>3} objects checked  {status}")
        if error:
            print(f"  cell error: {error}")
        for problem in report["problems"]:
            print(f"  invariant: {problem}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Print the introduction's cost table from the chapters' own ledgers (the last cell of every chapter).

Each chapter ends with ``print(chapter_bill(...))``; its last two lines, the real-service estimate in Qwen tokens,
are that chapter's row. ``tests/test_costs.py`` checks that ``book/intro.md`` says exactly this, so after
re-executing a chapter, run ``python tools/cost_table.py`` and paste its output into the introduction.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def chapter_bills() -> dict[str, tuple[str, str]]:
    """``{"04": (title, bill)}`` for every chapter whose notebook ends with a ``chapter_bill`` cell."""
    out = {}
    for path in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        title = next((re.sub(r"^#\s*", "", line) for c in nb["cells"] if c["cell_type"] == "markdown"
                      for line in "".join(c["source"]).splitlines() if line.startswith("# ")), path.stem)
        for cell in nb["cells"]:
            if cell["cell_type"] == "code" and "print(chapter_bill(" in "".join(cell["source"]):
                text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
                lines = [line.strip() for line in text.strip().splitlines()]
                out[path.name[:2]] = (title, "; ".join(lines[-2:]))
    return out


def main() -> None:
    print("| Chapter | | On the service, in Qwen tokens (measured offline, converted) |")
    print("|---|---|---|")
    for number, (title, bill) in chapter_bills().items():
        print(f"| {number} | {title} | {bill} |")


if __name__ == "__main__":
    main()

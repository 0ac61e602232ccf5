"""What the rendered book shows a reader: nbval's marker comments are left out of the code blocks
(_ext/hide_nbval_markers.py), while the notebooks keep them for strict nbval."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import yaml
from docutils import nodes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "_ext"))

from hide_nbval_markers import strip_markers  # noqa: E402


def test_marker_lines_are_removed_and_the_rest_of_the_cell_kept():
    code = "# NBVAL_IGNORE_OUTPUT\n# Wall-clock times differ from run to run.\nprint(elapsed)"
    block = nodes.literal_block(code, code)
    other = nodes.literal_block("x = 1  # NBVAL_IGNORE_OUTPUT is not alone here", "x = 1  # NBVAL_IGNORE_OUTPUT is"
                                " not alone here")
    doc = nodes.document(None, None)
    doc += [block, other]
    assert strip_markers(doc) == 1
    assert block.astext() == block.rawsource == "# Wall-clock times differ from run to run.\nprint(elapsed)"
    assert "NBVAL_IGNORE_OUTPUT" in other.astext()  # only a marker alone on its line is one


def test_the_book_loads_the_extension():
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    assert config["sphinx"]["local_extensions"] == {"hide_nbval_markers": "_ext"}
    assert any("NBVAL_IGNORE_OUTPUT" in p.read_text(encoding="utf-8") for p in (ROOT / "notebooks").glob("*.md"))


# ------------------------------------------------------------------------------------- code blocks in the prose
# Measured in headless Chromium at a 1280-px window with _static/book.css (12-px monospace, 7.2 px a character):
# a top-level code block of a chapter shows 92 characters, one inside an admonition 86 and inside a dropdown 90
# (their borders and padding);
# an exercise solution's block is as wide as the page's. Code cells are checked in tests/test_notebooks.py.
TOP_LEVEL, NESTED, DROPDOWN = 92, 86, 90
FENCE = re.compile(r"^\s*(`{3,}|~{3,}|:{3,})\s*(.*)$")
PAGES = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.md")) + sorted((ROOT / "book").glob("*.md"))


def wide_fenced_lines(text: str) -> list[str]:
    """Lines of fenced code blocks (not code cells, not directives) wider than the page shows without scrolling."""
    problems, stack = [], []  # stack of open fences: (character, length, kind, width limit or None)
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if match:
            marks, info = match.group(1), match.group(2).strip()
            top = stack[-1] if stack else None
            if top and top[0] == marks[0] and len(marks) >= top[1] and not info:
                stack.pop()
                continue
            if top is None or top[2] == "directive":
                if info.startswith("{code-cell}"):
                    kind = "cell"
                elif info.startswith("{"):
                    kind = "directive"
                else:
                    kind = "code"
                limit = (NESTED if info.startswith(("{admonition}", "{note}", "{tip}", "{important}", "{warning}"))
                         else DROPDOWN if info.startswith("{dropdown}") else None)
                stack.append((marks[0], len(marks), kind, limit))
                continue
        if stack and stack[-1][2] == "code":
            limit = min([entry[3] for entry in stack if entry[3]] or [TOP_LEVEL])
            if len(line) > limit:
                problems.append(f"line {number} ({len(line)} > {limit} chars): {line[:60]!r}")
    return problems


def test_the_width_rule_sees_nesting():
    text = "```python\n" + "x" * 93 + "\n```\n:::{admonition} A\n```text\n" + "y" * 87 + "\n```\n:::\n"
    assert [p.split(" ")[1] for p in wide_fenced_lines(text)] == ["2", "6"]
    assert wide_fenced_lines("```{code-cell} ipython3\n" + "z" * 120 + "\n```\n") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_code_blocks_in_the_prose_fit_the_page(page):
    problems = wide_fenced_lines(page.read_text(encoding="utf-8"))
    assert not problems, f"{page.relative_to(ROOT)}: code lines that would scroll at 1280 px:\n" + "\n".join(problems)


# ------------------------------------------------------------------------------------------------ glued numbers
def test_rounded_keeps_six_significant_digits_and_whole_counts():
    import numpy as np

    from trio_helpers.plotting import rounded

    assert rounded(66.84210526315789) == 66.8421 and rounded(np.float64(3.431628661787478e-10)) == 3.43163e-10
    assert rounded(1234567.8) == 1234568.0 and rounded(123689.95000000001) == 123690.0
    assert rounded(7) == 7 and rounded(True) is True and rounded("x") == "x" and math.isnan(rounded(float("nan")))


FLOAT = re.compile(r"^-?(\d+\.\d*|\.\d+|\d+)(e[+-]?\d+)?$")


@pytest.mark.parametrize("notebook", sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem)
def test_glued_numbers_are_stored_at_the_digits_a_page_reads(notebook):
    """Every glued float is stored at 6 significant digits at most (trio_helpers.plotting.glue), never the 17 of a
    float's repr: the prose formats it further, and last-digit noise has no place in a committed output."""
    long = []
    for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
        for output in cell.get("outputs", []):
            text = output.get("data", {}).get("application/papermill.record/text/plain")
            if text is None:
                continue
            text = "".join(text) if isinstance(text, list) else text
            if FLOAT.match(text.strip()) and "." in text:
                mantissa = text.strip().lstrip("-").split("e")[0].replace(".", "").lstrip("0")
                if len(mantissa.rstrip("0")) > 6 and float(text) < 1e6:
                    long.append(f"{output['metadata']['scrapbook']['name']} = {text.strip()}")
    assert not long, f"{notebook.name}: glued with more than 6 significant digits: {long}"

"""What the rendered book shows a reader: nbval's marker comments are left out of the code blocks
(_ext/hide_nbval_markers.py), while the notebooks keep them for strict nbval."""

from __future__ import annotations

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


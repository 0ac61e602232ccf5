"""Sphinx extension: the rendered book does not show nbval's marker comments.

A code cell whose output changes from run to run (wall-clock times) starts with the line ``# NBVAL_IGNORE_OUTPUT``,
which tells strict nbval (``make test``) not to compare its output; nbval reads it only alone on its line, so it
stays in the notebooks. It says nothing to a reader of the page, so this extension removes such lines from the
code blocks of the rendered pages (both editions); the comment that follows it, saying why the output varies, stays.
"""

from __future__ import annotations

import re

from docutils import nodes

MARKER = re.compile(r"#\s*NBVAL_[A-Z_]+")


def strip_markers(doctree: nodes.Node) -> int:
    """Remove nbval marker lines from every literal block of ``doctree``; return how many blocks changed."""
    changed = 0
    for block in doctree.findall(nodes.literal_block):
        text = block.astext()
        if "NBVAL_" not in text:
            continue
        kept = "\n".join(line for line in text.split("\n") if not MARKER.fullmatch(line.strip()))
        if kept != text:
            block.rawsource = kept
            block[:] = [nodes.Text(kept)]
            changed += 1
    return changed


def _on_doctree_read(app, doctree) -> None:
    strip_markers(doctree)


def setup(app):
    app.connect("doctree-read", _on_doctree_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}

"""File-level checks of the book's notebooks and table of contents (fast: no kernel is started).

What strict nbval (`make test`) cannot see on its own:
- a code cell without an `execution_count` is skipped by nbval, so it would go untested;
- `notebooks/NN_topic.md` must be exactly what `jupytext --to md:myst NN_topic.ipynb` writes (the pair);
- every chapter must be in `_toc.yml` and every `_toc.yml` entry must exist, or the book silently drops it;
- committed outputs must not leak absolute local paths or credentials.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

import jupytext
import pytest
import yaml
from jupytext.config import load_jupytext_config

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
TOC_PATH = ROOT / "_toc.yml"
PAIR_FORMAT = "md:myst"

NAME_PATTERN = re.compile(r"[0-9]{2}_[a-z0-9]+(?:_[a-z0-9]+)*")
LOCAL_PATH_PATTERN = re.compile(r"(?<![\w.~])/(?:root|home|work|tmp|Users)/")
SECRET_PATTERNS = {
    "OpenAI-style key": re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"),
    "Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{30,}"),
    "assigned API key or token": re.compile(
        r"(?i)\b(?:api[_-]?key|access[_-]?token|auth[_-]?token|secret)\b['\"]?\s*[:=]\s*['\"]?[A-Za-z0-9_\-]{16,}"
    ),
    "bearer token": re.compile(r"(?i)\bbearer\s+[A-Za-z0-9_\-.=]{20,}"),
}
NBVAL_RAISES_MARKERS = ("raises-exception", "nbval-raises-exception")

IPYNB_PATHS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
MD_PATHS = sorted(NOTEBOOK_DIR.glob("*.md"))
STEMS = sorted({path.stem for path in IPYNB_PATHS + MD_PATHS})


def _ids(paths: list[Path]) -> list[str]:
    return [path.name for path in paths]


def _load_ipynb(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _code_cells(notebook: dict) -> list[tuple[int, dict]]:
    """(cell index, cell) for every code cell with non-blank source."""
    return [
        (index, cell)
        for index, cell in enumerate(notebook["cells"])
        if cell["cell_type"] == "code" and _source(cell).strip()
    ]


def _output_texts(output: dict) -> list[str]:
    """The human-readable text of one output (streams, text/* and JSON data, errors); images are skipped."""
    texts: list[str] = []
    if output.get("output_type") == "stream":
        texts.append(_joined(output.get("text", "")))
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text/"):
            texts.append(_joined(value))
        elif mime.endswith("json"):
            texts.append(json.dumps(value))
    if output.get("output_type") == "error":
        texts.extend([output.get("ename", ""), output.get("evalue", ""), *output.get("traceback", [])])
    return texts


def _joined(value: str | list[str]) -> str:
    return "".join(value) if isinstance(value, list) else value


def _toc_files(node: object) -> list[str]:
    """Every `file:` entry (and the `root:`) in a jb-book table of contents, in order."""
    found: list[str] = []
    if isinstance(node, dict):
        for key in ("root", "file"):
            if isinstance(node.get(key), str):
                found.append(node[key])
        for value in node.values():
            if isinstance(value, (dict, list)):
                found.extend(_toc_files(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(_toc_files(item))
    return found


def _toc() -> dict:
    return yaml.safe_load(TOC_PATH.read_text(encoding="utf-8"))


# --- table of contents -------------------------------------------------------------------------------


def test_toc_is_a_jb_book_rooted_at_the_introduction() -> None:
    toc = _toc()
    assert toc.get("format") == "jb-book", f"_toc.yml: format must be 'jb-book', got {toc.get('format')!r}"
    assert toc.get("root") == "book/intro", f"_toc.yml: root must be 'book/intro', got {toc.get('root')!r}"
    entries = _toc_files(toc)
    duplicates = sorted({entry for entry in entries if entries.count(entry) > 1})
    assert not duplicates, f"_toc.yml lists these pages more than once: {duplicates}"


@pytest.mark.parametrize("entry", _toc_files(yaml.safe_load(TOC_PATH.read_text(encoding="utf-8"))))
def test_toc_entry_exists(entry: str) -> None:
    """Each page in _toc.yml exists; a chapter in notebooks/ must exist as .ipynb (the .md is not built)."""
    base = ROOT / entry
    if entry.startswith("notebooks/"):
        assert base.with_suffix(".ipynb").is_file(), (
            f"_toc.yml lists {entry!r} but {entry}.ipynb does not exist; the book builds chapters from the "
            f"notebook (write {entry}.md, then run `make notebook NB={entry}.md`)"
        )
    else:
        candidates = [base.with_suffix(suffix) for suffix in (".md", ".ipynb")]
        assert any(path.is_file() for path in candidates), f"_toc.yml lists {entry!r} but neither .md nor .ipynb exists"


@pytest.mark.parametrize("stem", [path.stem for path in IPYNB_PATHS])
def test_notebook_is_in_toc(stem: str) -> None:
    entries = _toc_files(_toc())
    assert f"notebooks/{stem}" in entries, (
        f"notebooks/{stem}.ipynb is not in _toc.yml, so the book does not show it (only_build_toc_files); "
        f"add `- file: notebooks/{stem}` to its part"
    )


# --- names and pairs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", IPYNB_PATHS + MD_PATHS, ids=_ids(IPYNB_PATHS + MD_PATHS))
def test_notebook_file_name(path: Path) -> None:
    assert NAME_PATTERN.fullmatch(path.stem), (
        f"notebooks/{path.name}: names must look like NN_snake_case (two digits, underscore, lowercase words), "
        f"e.g. 04_grpo_sync.ipynb"
    )


@pytest.mark.parametrize("stem", STEMS)
def test_both_files_of_the_pair_exist(stem: str) -> None:
    missing = [f"notebooks/{stem}{suffix}" for suffix in (".ipynb", ".md") if not (NOTEBOOK_DIR / f"{stem}{suffix}").is_file()]
    assert not missing, (
        f"chapter {stem}: missing {missing}; create the notebook with `make notebook NB=notebooks/{stem}.md`, "
        f"or the markdown with `jupytext --to {PAIR_FORMAT} notebooks/{stem}.ipynb`"
    )


@pytest.mark.parametrize("path", IPYNB_PATHS, ids=_ids(IPYNB_PATHS))
def test_markdown_pair_matches_notebook(path: Path) -> None:
    """Converting the .ipynb to MyST in-process, with the repository's jupytext.toml, gives the .md exactly."""
    md_path = path.with_suffix(".md")
    if not md_path.is_file():
        pytest.skip(f"{md_path.name} is missing (reported by test_both_files_of_the_pair_exist)")
    config = load_jupytext_config(str(path))
    notebook = jupytext.read(path, config=config)
    expected = jupytext.writes(notebook, fmt=PAIR_FORMAT, config=config)
    if not expected.endswith("\n"):
        expected += "\n"  # the jupytext CLI adds the final newline too
    actual = md_path.read_text(encoding="utf-8")
    if actual != expected:
        diff = "".join(
            difflib.unified_diff(
                actual.splitlines(keepends=True),
                expected.splitlines(keepends=True),
                fromfile=f"notebooks/{md_path.name} (committed)",
                tofile=f"jupytext --to {PAIR_FORMAT} notebooks/{path.name}",
            )
        )
        pytest.fail(
            f"notebooks/{md_path.name} does not match notebooks/{path.name}. If you edited the .md, run "
            f"`make notebook NB=notebooks/{md_path.name}`; if you edited the .ipynb, run "
            f"`jupytext --to {PAIR_FORMAT} notebooks/{path.name}`. Never `jupytext --sync`.\n{diff}",
            pytrace=False,
        )


# --- executed outputs --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", IPYNB_PATHS, ids=_ids(IPYNB_PATHS))
def test_every_code_cell_was_executed_in_order(path: Path) -> None:
    """Strict nbval skips code cells without an execution_count, so every one must have been executed,
    top to bottom in one fresh kernel (counts 1, 2, 3, ...), and the notebook must have outputs."""
    notebook = _load_ipynb(path)
    cells = _code_cells(notebook)
    assert cells, f"notebooks/{path.name} has no code cells"
    unexecuted = [index for index, cell in cells if cell.get("execution_count") is None]
    assert not unexecuted, (
        f"notebooks/{path.name}: code cells {unexecuted} (0-based) have no execution_count, so nbval would not "
        f"test them; run `make notebook NB=notebooks/{path.stem}.md`"
    )
    counts = [cell["execution_count"] for _, cell in cells]
    assert counts == list(range(1, len(counts) + 1)), (
        f"notebooks/{path.name}: execution counts {counts} are not 1..{len(counts)}, so the notebook was not "
        f"run top to bottom in a fresh kernel; run `make notebook NB=notebooks/{path.stem}.md`"
    )
    assert any(cell.get("outputs") for _, cell in cells), f"notebooks/{path.name} has no outputs at all"


@pytest.mark.parametrize("path", IPYNB_PATHS, ids=_ids(IPYNB_PATHS))
def test_errors_only_where_expected(path: Path) -> None:
    """An error output is allowed only in a cell that nbval expects to raise."""
    unexpected = []
    for index, cell in _code_cells(_load_ipynb(path)):
        raised = any(output.get("output_type") == "error" for output in cell.get("outputs", []))
        tags = cell.get("metadata", {}).get("tags", [])
        expected = any(tag in NBVAL_RAISES_MARKERS for tag in tags) or "# NBVAL_RAISES_EXCEPTION" in _source(cell)
        if raised and not expected:
            unexpected.append(index)
    assert not unexpected, (
        f"notebooks/{path.name}: cells {unexpected} (0-based) stored an error; fix them, or tag a cell that "
        f"demonstrates an error with `raises-exception`"
    )


@pytest.mark.parametrize("path", IPYNB_PATHS, ids=_ids(IPYNB_PATHS))
def test_outputs_have_no_local_paths_or_secrets(path: Path) -> None:
    problems = []
    for index, cell in _code_cells(_load_ipynb(path)):
        for output in cell.get("outputs", []):
            for text in _output_texts(output):
                if match := LOCAL_PATH_PATTERN.search(text):
                    problems.append(f"cell {index}: absolute local path near {text[max(0, match.start() - 30):match.end() + 30]!r}")
                for kind, pattern in SECRET_PATTERNS.items():
                    if pattern.search(text):
                        problems.append(f"cell {index}: something that looks like a {kind}")
    assert not problems, f"notebooks/{path.name}: outputs must not show machine paths or credentials:\n" + "\n".join(problems)


# --- width -------------------------------------------------------------------------------------------

MAX_LINE = 92  # characters: what the book's text column shows at a 1400-px window without clipping
# Every chapter's code and text outputs must fit (a chapter added later is checked automatically).
WIDTH_CHECKED = sorted(p.stem for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


def _wide_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > MAX_LINE]


@pytest.mark.parametrize("stem", WIDTH_CHECKED)
def test_code_and_outputs_fit_the_page(stem: str) -> None:
    """No code line and no line of a text output (streams, text/plain, errors) is wider than MAX_LINE: the page
    would cut it off. Reshape wide tables (fewer columns, shorter headers); never clip."""
    path = NOTEBOOK_DIR / f"{stem}.ipynb"
    problems = []
    for index, cell in _code_cells(_load_ipynb(path)):
        for line in _wide_lines(_source(cell)):
            problems.append(f"cell {index} code ({len(line)} chars): {line[:60]!r}...")
        for output in cell.get("outputs", []):
            texts = []
            if output.get("output_type") == "stream":
                texts.append(_joined(output.get("text", "")))
            if "text/plain" in output.get("data", {}) and "image/png" not in output.get("data", {}):
                texts.append(_joined(output["data"]["text/plain"]))
            if output.get("output_type") == "error":
                texts.append(f"{output.get('ename', '')}: {output.get('evalue', '')}")
            for text in texts:
                for line in _wide_lines(text):
                    problems.append(f"cell {index} output ({len(line)} chars): {line[:60]!r}...")
    assert not problems, (f"notebooks/{stem}: lines wider than {MAX_LINE} characters (reshape them in "
                          f"notebooks/{stem}.md, then `make notebook NB=notebooks/{stem}.md`):\n" + "\n".join(problems))


def test_a_notebook_kernel_that_does_not_start_is_started_again(monkeypatch) -> None:
    """conftest.py wraps nbval's kernel start: a kernel that never answers (a port taken between jupyter_client's
    choice and the kernel's bind) is replaced by a fresh one instead of failing every cell of the chapter."""
    import conftest
    from nbval import kernel as nbval_kernel

    conftest._retry_kernel_starts()  # what pytest_configure did under --nbval (a second call changes nothing)
    starts = []

    def start_new_kernel(**kwargs):
        starts.append(kwargs)
        if len(starts) == 1:
            raise RuntimeError("Kernel didn't respond in 60 seconds")
        return "kernel manager", "kernel client"

    monkeypatch.setattr(nbval_kernel, "start_new_kernel", start_new_kernel)
    monkeypatch.setattr(nbval_kernel.RunningKernel, "_ensure_iopub_up", lambda self: None)
    with pytest.warns(UserWarning, match="did not start"):
        kernel = nbval_kernel.RunningKernel("python3")
    assert len(starts) == 2 and kernel.km == "kernel manager"
    starts.clear()
    monkeypatch.setattr(nbval_kernel, "start_new_kernel", lambda **kwargs: starts.append(1) or 1 / 0)
    with pytest.raises(ZeroDivisionError):  # anything but a start-up failure is not retried
        nbval_kernel.RunningKernel("python3")
    assert len(starts) == 1

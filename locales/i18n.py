"""The Simplified Chinese edition: its message catalogs and its build (issue 15).

    python locales/i18n.py catalogs   `make catalogs`: .pot files from the English sources into _build/gettext,
                                      then `sphinx-intl update` of locales/zh_CN/LC_MESSAGES/{book,notebooks}/*.po
    python locales/i18n.py html       `make book-zh`: the Chinese edition into _build/zh_CN/html, with
                                      -W -n --keep-going and a fresh environment, like `make book`
    python locales/i18n.py pot DIR    only the .pot files, into DIR (the staleness check in tests/test_i18n.py)
    python locales/i18n.py stat       messages, translated, fuzzy and untranslated entries per catalog

Every build goes through Jupyter Book's own Sphinx entry point (`jupyter_book.sphinx.build_sphinx`, what
`jupyter-book build` calls) with the book's _config.yml and _toc.yml, so the editions cannot drift apart in
configuration: the Chinese build only overrides `language`, `html_title` (the title's translation) and two
labels of MyST-NB (UI_STRINGS). (`jupyter-book build` has no option to override a Sphinx setting, hence this
script.) The catalogs are per page (`gettext_compact: false`) and carry no source line numbers
(`gettext_location: false`), so editing a page changes only the entries it touches.

After `sphinx-intl update`, entries with nothing to translate (only code, math, numbers and punctuation, see
`is_invariant`) get their msgid as msgstr, so translators see only prose.
"""

from __future__ import annotations

import argparse
import functools
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
LANGUAGE = "zh_CN"
LOCALE_DIR = ROOT / "locales"
CATALOG_DIR = LOCALE_DIR / LANGUAGE / "LC_MESSAGES"
BUILD_DIR = ROOT / "_build"
HTML_DIR = BUILD_DIR / LANGUAGE / "html"
POT_DIR = BUILD_DIR / "gettext"
LINE_WIDTH = 0  # no wrapping in the .po files: a one-word edit changes one line of the diff
BOOK_TITLE = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))["title"]

# Interface text that comes from configuration, not from the pages, so not from the catalogs (the theme and
# sphinx-exercise translate their own): MyST-NB's toggle on a `hide-input`/`hide-output` cell. MyST-NB puts an
# English word for "{type}", so the Chinese says expand/collapse the cell for every type.
UI_STRINGS = {"nb_code_prompt_show": "展开单元格", "nb_code_prompt_hide": "收起单元格"}

# Pieces of a MyST message that are never translated. Roles and code spans are found in one left-to-right
# scan, so that a code span showing a role (`{term}`) or braces (`\boxed{N}`) stays a code span.
MARKUP = re.compile(r"\{(?P<name>[\w:.-]+)\}`(?P<role>[^`]*)`|(?P<tick>`+)(?P<code>.+?)(?P=tick)(?!`)", re.DOTALL)
MATH = re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$", re.DOTALL)
LINK_TARGET = re.compile(r"\]\((?P<target>[^)\s]+)\)")
LATEX_COMMAND = re.compile(r"\\[A-Za-z]+(\{[^{}]*\})?")
WORD = re.compile(r"[A-Za-z]{2,}")
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
# Roles whose output the reader sees as text (a term, a page title), as opposed to a citation or a glued value.
TEXT_ROLES = {"term", "doc", "ref", "numref", "eq", "prf:ref", "download"}


def markup(text: str, show_roles: bool = False) -> tuple[list[tuple[str, str]], list[str], str]:
    """Split a MyST message into its roles [(name, body)], its code spans [body] and the rest, in which each
    role and code span is a space (or, with show_roles, a text role is the text it shows)."""
    roles, code, rest, pos = [], [], [], 0
    for m in MARKUP.finditer(text):
        rest.append(text[pos:m.start()])
        pos = m.end()
        if m.group("name"):
            roles.append((m.group("name"), m.group("role")))
            shown = re.sub(r"\s*<[^<>]*>\s*$", "", m.group("role"))
            rest.append(shown if show_roles and m.group("name") in TEXT_ROLES else " ")
        else:
            code.append(m.group("code").strip())
            rest.append(" ")
    rest.append(text[pos:])
    return roles, code, "".join(rest)


def without_latex(text: str) -> str:
    for _ in range(3):  # nested \frac{\text{a}}{b}: innermost groups first
        text = LATEX_COMMAND.sub("", text)
    return text


def is_invariant(msgid: str) -> bool:
    """True if a message has nothing to translate: without its code spans, math, LaTeX, citations and glued
    values, no word of two or more letters is left (a table cell `0 / 0`, a `flag` name, a display formula)."""
    roles, _, rest = markup(msgid)
    if any(name in TEXT_ROLES for name, _ in roles):
        return False
    return not WORD.search(without_latex(MATH.sub(" ", rest)))


def role_targets(roles: list[tuple[str, str]]) -> list[str]:
    """Sorted "role:target" of a message's roles: {term}`优势 <advantage>` -> "term:advantage"."""
    out = []
    for name, body in roles:
        target = re.search(r"<([^<>]+)>\s*$", body)
        key = (target.group(1) if target else body).strip()
        out.append(f"{name}:{key.lower() if name == 'term' else key}")
    return sorted(out)


def protected(text: str) -> dict[str, list[str]]:
    """What a translation must keep exactly (names of APIs, flags and files, math, citations, cross-reference
    and link targets, and the numbers of the prose), each as a sorted list, to compare msgid with msgstr."""
    roles, code, rest = markup(text)
    math = sorted(m.group(0) for m in MATH.finditer(rest))
    prose = MATH.sub(" ", rest)
    return {
        "roles": role_targets(roles),
        "code": sorted(code),
        "math": math,
        "links": sorted(m.group("target") for m in LINK_TARGET.finditer(prose)),
        "numbers": sorted(NUMBER.findall(LINK_TARGET.sub(" ", prose))),
    }


def prose(text: str) -> str:
    """The words a reader sees, without code, math and LaTeX; text roles as the text they show."""
    return without_latex(MATH.sub(" ", markup(text, show_roles=True)[2]))


def has_prose(msgid: str) -> bool:
    """True if a message holds English prose (three or more words outside code and math), which a translation
    must render in Chinese rather than copy."""
    return len(WORD.findall(without_latex(MATH.sub(" ", markup(msgid)[2])))) >= 3


def is_copy(m) -> bool:
    """An entry with nothing to translate whose msgstr is its msgid (filled in by `fill_invariant`)."""
    return m.string == m.id and is_invariant(m.id)


def sphinx_build(builder: str, outdir: Path, doctreedir: Path, overrides: dict, strict: bool) -> int:
    """Run Sphinx on the book as `jupyter-book build . [-W -n --keep-going] --all` does; return its status."""
    from jupyter_book.sphinx import build_sphinx

    confoverrides = {
        "external_toc_path": (ROOT / "_toc.yml").as_posix(),
        "latex_individualpages": False,
        **({"nitpicky": True} if strict else {}),
        **overrides,
    }
    result = build_sphinx(
        ROOT,
        outdir,
        noconfig=True,
        path_config=str(ROOT / "_config.yml"),
        confoverrides=confoverrides,
        builder=builder,
        doctreedir=doctreedir,
        warningiserror=strict,
        keep_going=strict,
        freshenv=True,
        quiet=True,
    )
    return result if isinstance(result, int) else 1


def write_pot(outdir: Path) -> None:
    """The English sources' message templates: one .pot per page under outdir (book/…, notebooks/…)."""
    shutil.rmtree(outdir, ignore_errors=True)
    with tempfile.TemporaryDirectory() as doctrees:
        status = sphinx_build("gettext", outdir, Path(doctrees), {"project": BOOK_TITLE}, strict=False)
    if status:
        sys.exit(f"error: the gettext build failed (status {status})")


def catalogs() -> list[Path]:
    """All committed catalogs, sorted."""
    return sorted(CATALOG_DIR.rglob("*.po"))


def load(path: Path):
    from sphinx_intl import catalog as c

    return c.load_po(str(path))


def msgids(path: Path) -> set[str]:
    """The msgids of a .pot or .po file, without the header and without obsolete entries."""
    return {m.id for m in load(path) if m.id}


def stale_catalogs(pot_dir: Path, catalog_dir: Path = CATALOG_DIR) -> list[str]:
    """How the catalogs under catalog_dir differ from freshly generated .pot files under pot_dir: pages with no
    catalog, catalogs of pages that are gone, and per page the msgids added to or removed from the English.
    Empty when the catalogs are current."""
    pots = {p.relative_to(pot_dir).with_suffix("").as_posix(): p for p in pot_dir.rglob("*.pot")}
    pos = {p.relative_to(catalog_dir).with_suffix("").as_posix(): p for p in catalog_dir.rglob("*.po")}
    problems = [f"{page}: no catalog" for page in sorted(pots.keys() - pos.keys())]
    problems += [f"{page}: catalog of a page no longer in the book" for page in sorted(pos.keys() - pots.keys())]
    for page in sorted(pots.keys() & pos.keys()):
        new, old = msgids(pots[page]), msgids(pos[page])
        problems += [f"{page}: new English text: {m[:100]!r}" for m in sorted(new - old)]
        problems += [f"{page}: English text gone: {m[:100]!r}" for m in sorted(old - new)]
    return problems


FLAG_LINE = re.compile(r"^#, (.*no-python-format.*)$", re.MULTILINE)


def fill_invariant(path: Path) -> int:
    """Give every untranslated or fuzzy entry with nothing to translate its msgid as msgstr; return how many."""
    from sphinx_intl import catalog as c

    cat = load(path)
    changed = rewrite = 0
    for m in cat:
        if m.id and is_invariant(m.id) and (not m.string or m.fuzzy):
            m.string = m.id
            m.flags.discard("fuzzy")
            changed += 1
        # Babel marks any text with a "%" followed by a letter ("95% interval") as a Python format string,
        # and `msgfmt -c` then demands the same directive in the translation; MyST text is never one.
        if "python-format" in m.flags and "no-python-format" not in m.flags:
            m.flags.add("no-python-format")
            rewrite += 1
    if changed or rewrite:
        c.dump_po(str(path), cat, width=LINE_WIDTH, ignore_obsolete=True)
    # Babel adds the guess back whenever it reads a catalog, so drop it from the file's flag lines
    text = path.read_text(encoding="utf-8")
    tidy = FLAG_LINE.sub(lambda m: "#, " + ", ".join(f for f in m.group(1).split(", ") if f != "python-format"),
                         text)
    if tidy != text:
        path.write_text(tidy, encoding="utf-8")
    return changed


def update_catalogs() -> None:
    t0 = time.monotonic()
    write_pot(POT_DIR)
    subprocess.run(
        [sys.executable, "-m", "sphinx_intl", "update", "-p", str(POT_DIR), "-l", LANGUAGE,
         "-d", str(LOCALE_DIR), "-w", str(LINE_WIDTH), "--no-obsolete"],
        check=True,
    )
    pots = {p.relative_to(POT_DIR).with_suffix("") for p in POT_DIR.rglob("*.pot")}
    for po in catalogs():
        if po.relative_to(CATALOG_DIR).with_suffix("") not in pots:
            print(f"removed {po.relative_to(ROOT)}: its page is no longer in the book")
            po.unlink()
    filled = sum(fill_invariant(po) for po in catalogs())
    print(f"{filled} entries with nothing to translate filled in; {time.monotonic() - t0:.1f} s")
    stat()


def stat() -> None:
    """Per catalog: messages, translated, fuzzy, untranslated (the header entry not counted)."""
    total = [0, 0, 0, 0]
    print(f"{'catalog':38} {'msgids':>6} {'done':>6} {'fuzzy':>6} {'todo':>6}")
    for po in catalogs():
        msgs = [m for m in load(po) if m.id]
        row = [len(msgs), sum(bool(m.string) and not m.fuzzy for m in msgs),
               sum(m.fuzzy for m in msgs), sum(not m.string for m in msgs)]
        total = [a + b for a, b in zip(total, row)]
        print(f"{po.relative_to(CATALOG_DIR)!s:38} " + " ".join(f"{n:>6}" for n in row))
    print(f"{'total':38} " + " ".join(f"{n:>6}" for n in total))


def speed_up_chinese_search_index() -> None:
    """Sphinx before 8.1 keeps the Latin words of a Chinese search index in a list and scans it for every word
    it stems, which is quadratic (about 40 s of this book's build); 8.1 made it a set (sphinx-doc/sphinx#12995).
    The same fix, applied to the pinned Sphinx: the index written is unchanged."""
    from sphinx.search import zh

    if not isinstance(zh.SearchChinese.latin_terms, list):
        return  # already a set

    def split(self, input: str) -> list[str]:
        chinese = list(zh.jieba.cut_for_search(input)) if zh.JIEBA else []
        latin1 = [term.strip() for term in self.latin1_letters.findall(input)]
        self.latin_terms.update(latin1)
        return chinese + latin1

    zh.SearchChinese.latin_terms = set()
    zh.SearchChinese.split = split


@functools.lru_cache(maxsize=1)
def root_translations() -> dict[str, str]:
    """The translated (not fuzzy) strings of the landing page's catalog, the root of _toc.yml: the book's
    title is that page's heading, and the toc's part captions are extracted with that page."""
    root = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))["root"]
    return {m.id: m.string for m in load(CATALOG_DIR / f"{root}.po") if m.id and m.string and not m.fuzzy}


def translated_title() -> str:
    """The book's title (_config.yml's `title`, Sphinx's html_title) as translated in the landing page's
    catalog; the English title while it is untranslated."""
    return root_translations().get(BOOK_TITLE, BOOK_TITLE)


def glue_in_translated_text() -> None:
    """Let `{glue:text}` roles work inside translated paragraphs.

    Sphinx's i18n transform parses each msgstr after the notebook itself was parsed, when myst-nb no longer
    holds the notebook's glued values where a same-page `{glue:text}` role looks them up: every glue role of
    a translated paragraph would fail with "No key ... found in glue data". So, in translated text, such a
    role is read as myst-nb's cross-page form `this-notebook.ipynb::key`, a reference that myst-nb resolves
    after reading, from the glued values it saved while parsing the page: the same values, the same format."""
    from pathlib import PurePath

    from myst_nb.ext.glue.roles import PasteTextRole

    original_run = PasteTextRole.run

    def run(self):
        if "nb_renderer" not in self.document and "::" not in self.text:
            env = self.document.settings.env
            spec = "" if ":" in self.text else ":s"  # the role's own default format, stated (the colon of
            # "page::key" would otherwise be read as the key's format separator)
            self.text = f"{PurePath(env.doc2path(env.docname)).name}::{self.text}{spec}"
        return original_run(self)

    PasteTextRole.run = run


def translated_toc() -> Path:
    """A copy of _toc.yml with the part captions translated from the catalogs.

    sphinx-external-toc inserts the toctrees after Sphinx's i18n transform has run, so their captions (which
    the sidebar shows) would stay English; their msgids are in the root page's catalog."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    strings = root_translations()
    missing = [part["caption"] for part in toc.get("parts", []) if part.get("caption") not in strings]
    if missing:
        raise SystemExit(f"error: no translation of the part caption(s) {missing}: run `make catalogs` and "
                         "translate them")
    for part in toc.get("parts", []):
        part["caption"] = strings[part["caption"]]
    path = BUILD_DIR / LANGUAGE / "_toc.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(toc, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


def build_html() -> int:
    t0 = time.monotonic()
    speed_up_chinese_search_index()
    glue_in_translated_text()
    overrides = {"language": LANGUAGE, "html_title": translated_title(),
                 "external_toc_path": translated_toc().as_posix(), **UI_STRINGS}
    status = sphinx_build("html", HTML_DIR, HTML_DIR.parent / ".doctrees", overrides, strict=True)
    took = time.monotonic() - t0
    if status:
        print(f"error: the {LANGUAGE} build had warnings or errors (status {status}, {took:.0f} s)", file=sys.stderr)
    else:
        print(f"{LANGUAGE} edition built with 0 warnings in {took:.0f} s: open "
              f"{(HTML_DIR / 'index.html').relative_to(ROOT)}")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("catalogs", help="regenerate the .pot files and update the .po catalogs")
    sub.add_parser("html", help="build the Chinese edition into _build/zh_CN/html")
    pot = sub.add_parser("pot", help="write the .pot files into DIR")
    pot.add_argument("dir", type=Path)
    sub.add_parser("stat", help="translation counts per catalog")
    args = parser.parse_args(argv)
    if args.command == "catalogs":
        update_catalogs()
    elif args.command == "html":
        return build_html()
    elif args.command == "pot":
        write_pot(args.dir.resolve())
    else:
        stat()
    return 0


if __name__ == "__main__":
    sys.exit(main())

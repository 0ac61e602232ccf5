"""The Simplified Chinese edition (issue 15): its catalogs are complete, current and faithful to the English.

Catalogs: locales/zh_CN/LC_MESSAGES/{book,notebooks}/*.po, one per page; `make catalogs` regenerates them,
`make book-zh` builds the edition (with -W, so that build is itself the 0-warnings check). The tools are in
locales/i18n.py; the terms in locales/zh_CN/TERMINOLOGY.md.

Checked on every translated entry: code spans, math, citations, link and cross-reference targets and
numbers are kept exactly; prose is rendered in Chinese, not copied; terms follow the table. And on the
catalogs as a whole: no entry untranslated or fuzzy, and the catalogs current with the English sources (a
fresh .pot build, about 10 s of CPU, compared msgid by msgid), so a one-word English edit fails here until
`make catalogs` has run and the new entry is translated.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

# On since every page is translated (issue 15); `make book-zh` runs in .ci/run.
TRANSLATION_COMPLETE = True
NOT_YET = pytest.mark.skipif(
    not TRANSLATION_COMPLETE,
    reason="the Chinese translation is not complete yet (issue 15): only the glossary, the references "
    "and the landing page's title and part captions are translated; set TRANSLATION_COMPLETE when it is",
)


def _load_i18n():
    spec = importlib.util.spec_from_file_location("book_i18n", ROOT / "locales" / "i18n.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


i18n = _load_i18n()
CATALOGS = i18n.catalogs()
TERMINOLOGY = ROOT / "locales" / "zh_CN" / "TERMINOLOGY.md"


def entries(translated_only: bool = True):
    """(catalog name, message) for every entry of every catalog, or only the translated ones (not fuzzy, and
    not the entries with nothing to translate, whose msgstr is a copy of the msgid)."""
    for po in CATALOGS:
        for m in i18n.load(po):
            if m.id and (not translated_only or (m.string and not m.fuzzy and not i18n.is_copy(m))):
                yield po.relative_to(i18n.CATALOG_DIR).with_suffix("").as_posix(), m


def terminology() -> dict[str, list[str]]:
    """English term (lower case) -> accepted Chinese renderings, from the table in TERMINOLOGY.md."""
    table = {}
    for line in TERMINOLOGY.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) != 3 or cells[0] in ("English", "---"):
            continue
        english = re.sub(r"\s*\([^)]*\)", "", cells[0]).lower().split(" / ")
        chinese = re.sub(r"（[^）]*）", "", cells[1]).split(" / ")
        for i, term in enumerate(english):
            table[term.strip()] = [chinese[i].strip()] if len(chinese) == len(english) else [
                c.strip() for c in chinese]
    return table


# Single-word terms checked wherever they occur in prose (the standard terms, each unambiguous);
# multi-word terms from the table are always checked.
CHECKED_WORDS = {"advantage", "reward", "policy", "checkpoint", "datum", "staleness", "pipelining"}


def test_catalogs_exist_one_per_page():
    pages = {p.relative_to(i18n.CATALOG_DIR).parts[0] for p in CATALOGS}
    assert pages == {"book", "notebooks"}, pages
    assert (i18n.CATALOG_DIR / "book" / "glossary.po").exists()


def test_i18n_configuration_keeps_english_default():
    sphinx = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))["sphinx"]["config"]
    assert sphinx["language"] == "en"  # make book-zh overrides it; make book stays English
    assert sphinx["locale_dirs"] == ["locales"]
    assert sphinx["gettext_compact"] is False  # one catalog per page
    templates = ROOT / sphinx["templates_path"][0]
    assert (templates / "layout.html").exists() and (templates / "i18n-switch.html").exists()


def test_invariant_and_protected_pieces():
    assert i18n.is_invariant("`train/lr`, `optim/...`")
    assert i18n.is_invariant("9 / 4.5") and i18n.is_invariant("$2^{17}$")
    assert i18n.is_invariant("\nP_{\\text{degenerate}}(p, G) = p^G + (1 - p)^G,\n")
    assert not i18n.is_invariant("{term}`greedy decoding` (temperature 0)")
    assert not i18n.is_invariant("(batch 1 still sampling)")
    english = "See {term}`active tokens <active token>` and `cross_entropy`, $x$ in 3 steps {cite}`a2024`."
    chinese = "见 `cross_entropy` 和{term}`有效 token <Active token>`，$x$ 在 3 步内 {cite}`a2024`。"
    assert i18n.protected(english) == i18n.protected(chinese)
    assert i18n.protected(english) != i18n.protected(chinese.replace("3 步", "4 步"))
    assert i18n.protected(english) != i18n.protected(chinese.replace("`cross_entropy`", "交叉熵"))


def test_staleness_check_sees_a_one_word_edit(tmp_path):
    """The comparison behind test_catalogs_are_current, on a two-entry page: a one-word edit of the English
    is reported (as a new and a gone msgid) until the catalog is regenerated."""
    header = 'msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n\n'
    (tmp_path / "pot" / "book").mkdir(parents=True)
    (tmp_path / "po" / "book").mkdir(parents=True)
    pot, po = tmp_path / "pot" / "book" / "glossary.pot", tmp_path / "po" / "book" / "glossary.po"
    po.write_text(header + 'msgid "Glossary"\nmsgstr "术语表"\n\nmsgid "One pass."\nmsgstr "一次遍历。"\n')
    pot.write_text(header + 'msgid "Glossary"\nmsgstr ""\n\nmsgid "One pass."\nmsgstr ""\n')
    assert i18n.stale_catalogs(tmp_path / "pot", tmp_path / "po") == []
    pot.write_text(header + 'msgid "Glossary"\nmsgstr ""\n\nmsgid "One full pass."\nmsgstr ""\n')
    assert i18n.stale_catalogs(tmp_path / "pot", tmp_path / "po") == [
        "book/glossary: new English text: 'One full pass.'",
        "book/glossary: English text gone: 'One pass.'",
    ]


def test_translations_keep_code_math_numbers_and_targets():
    """Names of APIs, flags and files, formulas, citations, link and cross-reference targets, and the numbers
    of the prose are the same in the translation as in the English."""
    bad = [
        f"{page}: {m.id[:80]!r}: {key} {want} -> {got}"
        for page, m in entries()
        for (key, want), got in zip(i18n.protected(m.id).items(), i18n.protected(m.string).values())
        if want != got
    ]
    assert not bad, "\n".join(bad)


def test_prose_is_translated_not_copied():
    bad = [f"{page}: {m.id[:100]!r}" for page, m in entries()
           if i18n.has_prose(m.id) and not i18n.CJK.search(m.string)]
    assert not bad, "English prose left in a msgstr:\n" + "\n".join(bad)


def test_terminology_table():
    table = terminology()
    assert len(table) >= 60
    for english, chinese in {
        "policy": "策略", "advantage": "优势", "reward": "奖励", "sampling": "采样",
        "importance sampling": "重要性采样", "degenerate group": "退化组", "training client": "训练客户端",
        "sampling client": "采样客户端", "checkpoint": "检查点", "on-policy distillation": "同策略蒸馏",
        "teacher": "教师", "student": "学生", "reverse kl": "反向 KL", "datum": "数据项",
        "learning rate": "学习率", "staleness": "陈旧度", "pipelining": "流水线",
    }.items():
        assert chinese in table[english], (english, table.get(english))


def test_translations_use_the_terminology():
    """A term of the table in an English message (outside code and math) appears in its translation in the
    table's Chinese: every multi-word term, and the single words in CHECKED_WORDS."""
    table = {t: zh for t, zh in terminology().items() if " " in t or t in CHECKED_WORDS}
    # not inside a hyphenated word: a {ref} label such as offline-backend-faults shows as itself here
    patterns = {t: re.compile(r"(?<![\w-])" + r"[\s-]+".join(map(re.escape, t.split())) + r"s?(?![\w-])", re.IGNORECASE)
                for t in table}
    bad = []
    for page, m in entries():
        prose = i18n.prose(m.id)
        for term, pattern in patterns.items():
            if pattern.search(prose) and not any(zh in m.string for zh in table[term]):
                bad.append(f"{page}: {term!r} -> one of {table[term]}: {m.string[:80]!r}")
    assert not bad, "\n".join(bad)


@NOT_YET
def test_every_entry_translated_and_none_fuzzy():
    untranslated = [f"{page}: {m.id[:100]!r}" for page, m in entries(False) if not m.string]
    fuzzy = [f"{page}: {m.id[:100]!r}" for page, m in entries(False) if m.fuzzy]
    assert not untranslated and not fuzzy, (
        f"{len(untranslated)} untranslated, {len(fuzzy)} fuzzy:\n" + "\n".join(untranslated + fuzzy))


@NOT_YET
def test_catalogs_are_current(tmp_path):
    """Regenerate the .pot files from the English sources and compare their msgids with the catalogs'."""
    run = subprocess.run([sys.executable, str(ROOT / "locales" / "i18n.py"), "pot", str(tmp_path)],
                         check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    problems = i18n.stale_catalogs(tmp_path)
    assert not problems, "catalogs are stale; run `make catalogs` and translate:\n" + "\n".join(problems)

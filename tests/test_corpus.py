"""Tests of the offline corpus generator and of the shipped data files (no network)."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from trio_helpers.offline import corpus

DATA = Path(corpus.__file__).parent / "data"
NUMERAL = re.compile(r"\d+(?:\.\d+)?")
ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>([^\s$]*)")
BINARY = re.compile(r"^(\d+(?:\.\d+)?)([-+*/])(\d+(?:\.\d+)?)$")


def read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").splitlines()]


TRAIN, TEST, DEEPMATH = read_jsonl("gsm8k_train.jsonl"), read_jsonl("gsm8k_test.jsonl"), read_jsonl("deepmath.jsonl")
GSM8K = TRAIN + TEST


def evaluate(expr: str) -> Fraction:
    """Evaluate ``a op b`` exactly, without eval()."""
    match = BINARY.match(expr)
    assert match, f"not a binary expression: {expr!r}"
    a, op, b = Fraction(match[1]), match[2], Fraction(match[3])
    if op == "/":
        assert b != 0, expr
        return a / b
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def context(question: str) -> str:
    return question.rsplit(". ", 1)[0]


def check_record(rec: dict) -> None:
    """Every invariant the generator promises, checked independently of its own code."""
    assert set(rec) == {"question", "answer"}
    question, answer = rec["question"], rec["answer"]
    lines = answer.split("\n")
    final_line = lines[-1]
    assert re.fullmatch(r"#### \d+(\.\d+)?", final_line), final_line
    final = Fraction(final_line[5:])
    assert final >= 0
    steps = lines[:-1]
    assert 2 <= len(steps) <= 6, answer
    results: list[Fraction] = []
    operands: list[Fraction] = []
    for line in steps:
        found = ANNOTATION.findall(line)
        assert len(found) == 1, f"each step line carries one annotation: {line!r}"
        expr, result, shown = found[0]
        value = evaluate(expr)
        assert value == Fraction(result), f"false annotation {expr}={result}"
        assert Fraction(shown.rstrip(".,")) == value, f"number after >> differs: {line!r}"
        assert value >= 0
        a, _, b = BINARY.match(expr).groups()
        operands += [Fraction(a), Fraction(b)]
        results.append(value)
    assert results[-1] == final, "#### N must equal the last annotation's result"
    numerals = [Fraction(x) for x in NUMERAL.findall(question)]
    assert len(numerals) == len(steps) + 1, question
    assert len(set(numerals)) == len(numerals), f"a number is mentioned twice: {question!r}"
    # Each question numeral and each intermediate result is used exactly once: the steps form a tree.
    assert Counter(operands) == Counter(numerals + results[:-1]), question


def test_shipped_counts_and_format():
    assert (len(TRAIN), len(TEST), len(DEEPMATH)) == (600, 300, 300)
    for rec in GSM8K:
        check_record(rec)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fresh_draws_keep_every_invariant(seed):
    for rec in corpus.generate_gsm8k(1500, seed):
        check_record(rec)


def test_text_is_clean():
    for text in [r["question"] for r in GSM8K + DEEPMATH] + [r["answer"] for r in GSM8K]:
        assert not re.search(r"[@{}]|None|  | \.|\b1 \w+s\b", text), text
        assert text.isascii()
    for rec in GSM8K:
        assert rec["question"][0].isupper() or rec["question"][0].isdigit()
        assert rec["question"].endswith("?")


def test_generator_is_deterministic():
    assert corpus.generate_gsm8k(40, 7) == corpus.generate_gsm8k(40, 7)
    assert corpus.generate_gsm8k(40, 7) != corpus.generate_gsm8k(40, 8)
    assert corpus.generate_deepmath(20, 7) == corpus.generate_deepmath(20, 7)
    assert corpus.generate_gsm8k(0, 1) == []


def test_generator_validates_arguments():
    with pytest.raises(ValueError, match="n must be"):
        corpus.generate_gsm8k(-1, 0)
    with pytest.raises(TypeError, match="seed must be"):
        corpus.generate_gsm8k(3, "0")


def test_variety():
    steps = Counter(r["answer"].count("<<") for r in GSM8K)
    assert set(steps) == {2, 3, 4, 5, 6}
    decimals = sum("." in r["answer"].rsplit("#### ", 1)[1] for r in GSM8K)
    assert 0.02 * len(GSM8K) <= decimals <= 0.10 * len(GSM8K)
    names = Counter(r["question"].split()[0] for r in GSM8K)
    assert len(names) >= 30
    assert len({context(r["question"]).split(". ")[0] for r in GSM8K}) > 850


def test_shipped_files_match_a_fresh_regeneration(tmp_path):
    files = corpus.build_files()
    assert sorted(files) == sorted(p.name for p in DATA.iterdir() if p.is_file())
    for name, data in files.items():
        assert (DATA / name).read_bytes() == data, f"{name} is stale: run python -m trio_helpers.offline.corpus"
    corpus.write_files(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


def test_manifest_describes_the_files():
    manifest = json.loads((DATA / "manifest.json").read_text())
    for name, meta in manifest["files"].items():
        data = (DATA / name).read_bytes()
        assert meta["records"] == len(data.splitlines())
        assert meta["sha256"] == hashlib.sha256(data).hexdigest()
    joined = b"".join((DATA / name).read_bytes() for name in sorted(manifest["files"]))
    assert manifest["content_sha256"] == hashlib.sha256(joined).hexdigest()


def test_splits_are_disjoint():
    train_q, test_q = {r["question"] for r in TRAIN}, {r["question"] for r in TEST}
    assert len(train_q) == 600 and len(test_q) == 300 and not train_q & test_q
    train_c, test_c = {context(q) for q in train_q}, {context(q) for q in test_q}
    assert len(train_c) == 600 and not train_c & test_c
    deep_c = {context(r["question"]) for r in DEEPMATH}
    assert len(deep_c) == 300 and not deep_c & (train_c | test_c)


def test_deepmath_records():
    for rec in DEEPMATH:
        assert set(rec) == {"question", "final_answer", "difficulty", "r1_solution_1"}
        steps = rec["r1_solution_1"].split("\n")
        assert steps[-1] == f"\\boxed{{{rec['final_answer']}}}"
        assert len(steps) - 1 == len(NUMERAL.findall(rec["question"])) - 1  # one annotated step per line
        assert isinstance(rec["final_answer"], str) and Fraction(rec["final_answer"]) >= 0
        assert isinstance(rec["difficulty"], float) and 1.0 <= rec["difficulty"] <= 10.0
        numerals = NUMERAL.findall(rec["question"])
        assert 3 <= len(numerals) <= 7 and len(set(map(Fraction, numerals))) == len(numerals)
        # difficulty = 1.5 * steps - 0.5 (+0.5 for decimals) and steps = numerals - 1
        expected = 1.5 * (len(numerals) - 1) - 0.5 + (0.5 if "." in rec["final_answer"] else 0.0)
        assert rec["difficulty"] == expected
    gsm_q = {r["question"] for r in GSM8K}
    assert not gsm_q & {r["question"] for r in DEEPMATH}
    assert len({r["question"].rsplit(". ", 1)[-1].split()[0] for r in DEEPMATH}) >= 5  # several phrasings


def test_render_solution_styles():
    rec = {"question": "q", "answer": "A is 2+3 = <<2+3=5>>5.\nB is 5*4 = <<5*4=20>>20.\n#### 20"}
    body = "A is 2+3 = <<2+3=5>>5.\nB is 5*4 = <<5*4=20>>20."
    assert corpus.render_solution(rec, "hash") == body + "\n#### 20"
    assert corpus.render_solution(rec, "sentence") == body + "\nThe answer is 20."
    assert corpus.render_solution(rec, "boxed") == body + "\n\\boxed{20}"
    assert corpus.render_solution(TRAIN[0], "hash") == TRAIN[0]["answer"]
    with pytest.raises(ValueError, match="style must be one of"):
        corpus.render_solution(rec, "latex")
    with pytest.raises(ValueError, match="no final"):
        corpus.render_solution({"question": "q", "answer": "no final line"}, "hash")


def test_fmt_writes_gsm8k_numbers():
    assert corpus.fmt(Fraction(12)) == "12"
    assert corpus.fmt(Fraction(9, 2)) == "4.5"
    assert corpus.fmt(Fraction(1, 4)) == "0.25"
    assert corpus.fmt(Fraction(10101, 100)) == "101.01"

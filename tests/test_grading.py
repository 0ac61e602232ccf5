"""Tests for trio_helpers.grading: one example per rule, a table of tricky cases, and properties."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_helpers.grading import (
    answers_match,
    extract_answer_flexible,
    extract_boxed,
    extract_gsm8k_answer,
    grade_answer,
    grade_answer_flexible,
    grade_with_math_verify,
    normalize_answer,
    parse_number,
    reward_plus_minus,
)

# Deterministic and modest, so CI sees the same examples every run. Applied per test
# rather than as a global profile so other test files keep their own settings.
PROPERTY = settings(
    derandomize=True,
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# ---------------------------------------------------------------------------
# extract_gsm8k_answer
# ---------------------------------------------------------------------------


def test_gsm8k_answer_takes_text_after_last_marker_and_drops_commas() -> None:
    solution = "She sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 1,234 \n"
    assert extract_gsm8k_answer(solution) == "1234"
    assert extract_gsm8k_answer("#### 5\nfix: #### 6") == "6"


def test_gsm8k_answer_missing_marker_names_problem_and_shows_start() -> None:
    with pytest.raises(ValueError, match=r"no '####' marker.*'The answer is 7'"):
        extract_gsm8k_answer("The answer is 7")


def test_gsm8k_answer_empty_after_marker_is_an_error() -> None:
    with pytest.raises(ValueError, match="nothing after its last '####'"):
        extract_gsm8k_answer("work\n####   ")


def test_gsm8k_answer_rejects_non_string() -> None:
    with pytest.raises(TypeError, match="answer_text must be a str"):
        extract_gsm8k_answer(42)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# extract_boxed
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{18}.", "18"),
        (r"\boxed{\frac{3}{4}}", r"\frac{3}{4}"),
        (r"first \boxed{5}, no wait: \boxed{7}", "7"),
        (r"\boxed {12}", "12"),
        (r"\fbox{12}", "12"),
        (r"$\boxed{\{1, 2\}}$", r"\{1, 2\}"),
        (r"\boxed{\text{\boxed{3}}}", r"\text{\boxed{3}}"),  # inner box belongs to the outer one
        (r"\boxed{}", ""),
        ("no box here", None),
        (r"\boxed{12", None),  # truncated
        (r"\boxed{5} then \boxed{\frac{1}{2}", None),  # last box unbalanced: no fallback
        (r"\fboxsep{3pt} and \boxedfoo{2}", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


# ---------------------------------------------------------------------------
# normalize_answer, parse_number, answers_match
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1,234", "1234"),
        ("1{,}234", "1234"),
        ("1,234,567", "1234567"),
        ("1,2", "1,2"),  # not thousands grouping: kept
        (r"\$18", "18"),
        ("$18", "18"),
        ("$18$", "18"),
        (r"\(18\)", "18"),
        ("25%", "25"),
        (r"25\%", "25"),
        ("18.", "18"),
        ("\u22125", "-5"),
        ("- 5", "-5"),
        (r"1\,000", "1000"),
        (r"1\!000", "1000"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\tfrac{1}{2}", r"\frac{1}{2}"),
        (r"18\text{ dollars}", "18"),
        (r"\mathrm{18~cm}", "18"),
        (r"\text{18}", "18"),
        ("18 dollars.", "18"),
        ("x = 5", "5"),
        (r"90^\circ", "90"),
        ("  a   b ", "a b"),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18", Fraction(18)),
        ("18.00", Fraction(18)),
        (".5", Fraction(1, 2)),
        ("-3", Fraction(-3)),
        ("3/4", Fraction(3, 4)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"-\frac{3}{4}", Fraction(-3, 4)),
        (r"\frac{-3}{4}", Fraction(-3, 4)),
        (r"\frac12", Fraction(1, 2)),
        (r"\frac{1.5}{3}", Fraction(1, 2)),
        ("1/0", None),
        ("1e3", None),
        ("10^3", None),
        ("x", None),
        ("", None),
    ],
)
def test_parse_number(text: str, expected: Fraction | None) -> None:
    assert parse_number(text) == expected


def test_numeric_comparison_is_exact() -> None:
    assert answers_match("0.5", "1/2")
    assert answers_match("0.1", r"\frac{1}{10}")
    assert not answers_match("0.33", "1/3")
    assert not answers_match("0.333333", "1/3")  # no float tolerance
    assert not answers_match("18.0001", "18")


def test_non_numeric_answers_compare_as_strings() -> None:
    assert answers_match(r"\text{(B)}", "(B)")
    assert not answers_match("x+1", "x+2")
    assert not answers_match("five", "5")  # one side numeric, the other not


def test_empty_gold_is_an_error() -> None:
    with pytest.raises(ValueError, match="gold is empty"):
        answers_match("5", "  $ $ ")
    with pytest.raises(ValueError, match="gold is empty"):
        grade_answer("no box", "")


def test_type_errors_name_the_argument() -> None:
    with pytest.raises(TypeError, match="pred and gold"):
        answers_match(5, "5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="text must be a str"):
        extract_boxed(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="s must be a str"):
        normalize_answer(1.0)  # type: ignore[arg-type]


# Tricky cases: (response, gold, grade_answer, grade_answer_flexible, reward_plus_minus)
TRICKY = [
    (r"The total is \boxed{18}.", "18", 1.0, 1.0, 1.0),
    (r"\boxed{1,234}", "1234", 1.0, 1.0, 1.0),
    (r"\boxed{1{,}234}", "1234", 1.0, 1.0, 1.0),
    (r"\boxed{\$18.00}", "18", 1.0, 1.0, 1.0),
    (r"\boxed{25\%}", "25", 1.0, 1.0, 1.0),
    (r"\boxed{\frac{3}{4}}", "0.75", 1.0, 1.0, 1.0),
    (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0, 1.0, 1.0),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0, 1.0, 1.0),
    ("\\boxed{\u22127}", "-7", 1.0, 1.0, 1.0),
    (r"\boxed{18 \text{ dollars}}", "18", 1.0, 1.0, 1.0),
    (r"\boxed{1\,000}", "1000", 1.0, 1.0, 1.0),
    (r"$\boxed{12}$", "12", 1.0, 1.0, 1.0),
    (r"\boxed {12}", "12", 1.0, 1.0, 1.0),
    (r"\fbox{12}", "12", 1.0, 1.0, 1.0),
    (r"I guess \boxed{5}. Wait, recount: \boxed{7}", "7", 1.0, 1.0, 1.0),
    (r"I guess \boxed{5}. Wait, recount: \boxed{7}", "5", 0.0, 0.0, -0.5),
    (r"\boxed{0.33}", "1/3", 0.0, 0.0, -0.5),
    (r"\boxed{12", "12", 0.0, 1.0, 1.0),  # truncated box: flexible falls back to the last number
    ("#### 42", "42", 0.0, 1.0, 1.0),
    ("The answer is $1,234.", "1234", 0.0, 1.0, 1.0),
    ("3 apples and 5 pears make 8 fruits", "8", 0.0, 1.0, 1.0),
    ("I am not sure.", "8", 0.0, 0.0, -1.0),
    (r"\boxed{}", "8", 0.0, 0.0, -0.5),
    (r"\boxed{x = 5}", "5", 1.0, 1.0, 1.0),
    (r"\boxed{10^3}", "1000", 0.0, 0.0, -0.5),  # powers are outside the numeric rule
]


@pytest.mark.parametrize(("response", "gold", "strict", "flexible", "plus_minus"), TRICKY)
def test_tricky_cases(response: str, gold: str, strict: float, flexible: float, plus_minus: float) -> None:
    assert grade_answer(response, gold) == strict
    assert grade_answer_flexible(response, gold) == flexible
    assert reward_plus_minus(response, gold) == plus_minus


def test_tricky_table_has_at_least_25_cases() -> None:
    assert len(TRICKY) >= 25


# ---------------------------------------------------------------------------
# Flexible extraction and the +1/-0.5/-1 reward
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (r"The answer is \boxed{9}. #### 10", "9"),  # the box wins
        ("Total 7.\n#### 8\n", "8"),
        ("#### none\nso 4 it is", "4"),  # no number after ####: later rules
        ("The answer is: 12 cookies, from 3 boxes", "12"),
        ("Final answer: -3", "-3"),
        ("The range 3-5 holds", "5"),  # no sign after a digit
        (r"The answer is \frac{3}{4}", r"\frac{3}{4}"),
        ("It costs $1,234.50 in total", "1,234.50"),
        ("nothing numeric", None),
    ],
)
def test_extract_answer_flexible(response: str, expected: str | None) -> None:
    assert extract_answer_flexible(response) == expected


def test_reward_plus_minus_with_required_box_and_custom_levels() -> None:
    assert reward_plus_minus("#### 4", "4", require_box=True) == -1.0
    assert reward_plus_minus(r"\boxed{4}", "4", require_box=True) == 1.0
    assert reward_plus_minus("no idea", "4", correct=2.0, wrong=0.0, unparseable=-3.0) == -3.0
    assert reward_plus_minus("5", "4", correct=2.0, wrong=0.0, unparseable=-3.0) == 0.0


# ---------------------------------------------------------------------------
# math-verify cross-check (optional dependency)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        (r"so \boxed{\frac{3}{4}}", "0.75", 1.0),
        (r"\boxed{19}", "18", 0.0),
        ("no answer", "18", 0.0),
    ],
)
def test_grade_with_math_verify(response: str, gold: str, expected: float) -> None:
    pytest.importorskip("math_verify")
    assert grade_with_math_verify(response, gold) == expected


# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------

integers = st.integers(min_value=-(10**9), max_value=10**9)


def _integer_formats(n: int) -> list[str]:
    """Equivalent ways a model might write the integer n."""
    grouped = f"{abs(n):,}"
    sign = "-" if n < 0 else ""
    return [
        str(n),
        f"{sign}{grouped}",
        f"{sign}{grouped.replace(',', '{,}')}",
        f"{sign}{grouped.replace(',', chr(92) + ',')}",  # 1\,000
        f"{n}.00",
        f"{sign}\\${grouped}",
        f"{n}\\%",
        f"{n} \\text{{ units}}",
        f"\\frac{{{n}}}{{1}}",
        f"\\dfrac{{{2 * n}}}{{2}}",
        f"{n}/1",
        f"${n}$",
        f"{n}.",
        ("\u2212" + str(-n)) if n < 0 else f"x = {n}",
    ]


@PROPERTY
@given(n=integers, prefix=st.sampled_from(["", "So the total is ", "Therefore $", "Answer: "]))
def test_any_integer_format_grades_one(n: int, prefix: str) -> None:
    for written in _integer_formats(n):
        response = f"{prefix}\\boxed{{{written}}}"
        assert grade_answer(response, str(n)) == 1.0, response
        assert grade_answer(response, str(n + 1)) == 0.0, response


@PROPERTY
@given(
    value=st.decimals(
        min_value=Decimal("-100000"), max_value=Decimal("100000"), places=3, allow_nan=False
    )
)
def test_any_decimal_format_grades_one(value: Decimal) -> None:
    gold = format(value.normalize(), "f")  # canonical: 2.5, 100, -0.125
    formats = [f"{value}", f"{value:,}", f"{value}000", f"{value:,}".replace(",", "{,}")]
    fraction = Fraction(value)
    formats.append(f"\\frac{{{fraction.numerator}}}{{{fraction.denominator}}}")
    for written in formats:
        assert grade_answer(f"\\boxed{{{written}}}", gold) == 1.0, written


@PROPERTY
@given(
    numerator=st.integers(min_value=-500, max_value=500),
    denominator=st.integers(min_value=1, max_value=500),
    scale=st.integers(min_value=1, max_value=9),
)
def test_any_fraction_format_grades_one(numerator: int, denominator: int, scale: int) -> None:
    value = Fraction(numerator, denominator)
    gold = f"{value.numerator}/{value.denominator}"
    a, b = numerator * scale, denominator * scale
    sign = "-" if value < 0 else ""
    formats = [
        f"\\frac{{{a}}}{{{b}}}",
        f"\\tfrac{{{a}}}{{{b}}}",
        f"{a}/{b}",
        f"{sign}\\dfrac{{{abs(a)}}}{{{b}}}",
        f"$\\frac{{{a}}}{{{b}}}$",
    ]
    for written in formats:
        assert grade_answer(f"\\boxed{{{written}}}", gold) == 1.0, written


@PROPERTY
@given(first=integers, second=integers, filler=st.sampled_from(["", " wait, ", "\nActually:\n"]))
def test_a_later_box_replaces_the_answer(first: int, second: int, filler: str) -> None:
    response = f"\\boxed{{{first}}}{filler}\\boxed{{{second}}}"
    assert grade_answer(response, str(second)) == 1.0
    if first != second:
        assert grade_answer(response, str(first)) == 0.0


@PROPERTY
@given(text=st.text(max_size=200), n=integers)
def test_text_without_a_box_grades_zero(text: str, n: int) -> None:
    text = text.replace("\\", "/").replace("#", "")  # no LaTeX commands, no "####" marker
    # Even a response that states the right number earns nothing without a box.
    response = f"{text} the answer is {n}"
    assert extract_boxed(response) is None
    assert grade_answer(response, str(n)) == 0.0
    assert grade_answer_flexible(response, str(n)) == 1.0


_plain = st.text(alphabet=st.characters(blacklist_characters="{}\\", codec="utf-8"), max_size=8)
_balanced = st.recursive(
    _plain,
    lambda inner: st.builds(lambda a, b, c: f"{a}{{{b}}}{c}", inner, inner, inner),
    max_leaves=12,
)


@PROPERTY
@given(content=_balanced, before=_plain, after=_plain)
def test_extract_boxed_round_trips_nested_content(content: str, before: str, after: str) -> None:
    assert extract_boxed(f"{before}\\boxed{{{content}}}{after}") == content
    # Drop the closing brace and the box never closes: no answer, not a wrong one.
    assert extract_boxed(f"{before}\\boxed{{{content}") is None


@PROPERTY
@given(n=st.integers(min_value=0, max_value=10**12), work=_plain)
def test_extract_gsm8k_answer_inverts_formatting(n: int, work: str) -> None:
    assert extract_gsm8k_answer(f"{work}\n#### {n:,}") == str(n)


@PROPERTY
@given(n=integers)
def test_normalisation_is_idempotent_and_matching_symmetric(n: int) -> None:
    for written in _integer_formats(n):
        once = normalize_answer(written)
        assert normalize_answer(once) == once
        assert answers_match(written, str(n)) and answers_match(str(n), written)


@PROPERTY
@given(response=st.text(max_size=120), n=integers)
def test_plus_minus_reward_levels(response: str, n: int) -> None:
    reward = reward_plus_minus(response, str(n))
    assert reward in (1.0, -0.5, -1.0)
    assert (reward == -1.0) == (extract_answer_flexible(response) is None)


# ---------------------------------------------------------------------------
# Hostile model output: the graders return a reward, never raise, never stall
# ---------------------------------------------------------------------------

HOSTILE = [
    "1" * 100_000,
    "\\boxed{" + "1" * 100_000 + "}",
    "\\boxed{0." + "1" * 100_000 + "}",
    "\\boxed{" + "1" * 5000 + "/" + "3" * 5000 + "}",
    "1e999999",
    "\\boxed{1e999999}",
    "{" * 50_000 + "}" * 50_000,
    "\\boxed{" * 20_000,
    "\\boxed{" + "{" * 50_000 + "18" + "}" * 50_000 + "}",
    "NaN", "\\boxed{NaN}", "\\boxed{nan}", "\\boxed{inf}", "\\boxed{-inf}",
    "\\boxed{9^{9^{9^{9}}}}", "\\boxed{10^{10^{10}}}", "\\boxed{2^{1000000}}",
    "\\boxed{1/0}", "\\boxed{\\frac{1}{0}}", "\\boxed{0/0}",
    "1," * 50_000, "The answer is " + "9" * 50_000, "#### " + "9" * 50_000,
    "\\boxed{1" + " dollars" * 20_000 + "}", "\\boxed{\\text{" * 10_000, "\x00\ufffd\u202e", "",
]
GRADERS = {
    "grade_answer": (grade_answer, {0.0, 1.0}),
    "grade_answer_flexible": (grade_answer_flexible, {0.0, 1.0}),
    "reward_plus_minus": (reward_plus_minus, {1.0, -0.5, -1.0}),
}


@pytest.mark.parametrize("response", HOSTILE, ids=[repr(h[:24]) + f"...{len(h)}" for h in HOSTILE])
def test_graders_never_raise_on_hostile_output(response: str) -> None:
    import time

    started = time.monotonic()
    for name, (grade, levels) in GRADERS.items():
        assert grade(response, "18") in levels, name
    assert answers_match(response, "18") in (True, False)
    assert parse_number(normalize_answer(response)) is None or len(response) < 1000
    assert time.monotonic() - started < 5, "a grader stalled"


def test_a_huge_number_is_wrong_not_an_error() -> None:
    assert grade_answer("\\boxed{" + "1" * 100_000 + "}", "18") == 0.0
    assert reward_plus_minus("The answer is " + "9" * 50_000, "18") == -0.5  # an answer, just not 18
    assert answers_match("1" * 5000, "1" * 5000)  # too long to be a number, equal as text


@pytest.mark.parametrize("response", ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{10^{10^{10}}}", "10^10^10", "2**2**30",
                                      "\\boxed{" + "1" * 100_000 + "}", "{" * 5000, "\\boxed{NaN}"])
def test_math_verify_cross_check_never_raises_or_hangs(response: str) -> None:
    pytest.importorskip("math_verify")
    assert grade_with_math_verify(response, "18") == 0.0


def test_markdown_bold_is_not_a_power_tower() -> None:
    pytest.importorskip("math_verify")
    assert grade_with_math_verify("**Step 1** adds, **Step 2** doubles: $\\boxed{18}$", "18") == 1.0


_hostile_pieces = st.sampled_from(["\\boxed{", "}", "{", "\\frac", "^", "**", "e", "E", "9" * 3000, "0.", ".",
                                   ",", "/", "-", "\u2212", "#### ", "The answer is ", "NaN", "inf", "$", "\\,",
                                   "\\text{", "%", " dollars", "\n", "x = "])


@PROPERTY
@given(st.lists(_hostile_pieces | st.text(max_size=20), max_size=30), st.integers(min_value=1, max_value=40))
def test_graders_return_a_level_for_any_mix_of_hostile_pieces(pieces: list[str], repeat: int) -> None:
    response = "".join(pieces) * repeat
    for name, (grade, levels) in GRADERS.items():
        assert grade(response, "18") in levels, name


@PROPERTY
@given(st.text())
def test_graders_return_a_level_for_any_text(response: str) -> None:
    for name, (grade, levels) in GRADERS.items():
        assert grade(response, "18") in levels, name
        assert grade(response, "3/4") in levels, name


# ------------------------------------------------------------------------------------------- issue 25
ADVERSARIAL_100KB = {
    "grouped digits then a long group": "1234," + "123," * 24_998 + "1234",
    "grouped digits": "123," * 25_000,
    "commas": "1," * 50_000,
    "nested boxes": "\\boxed{" * 14_285,
    "dollar signs": "$" * 100_000,
    "text wrappers": "\\text{" * 16_666,
    "unit words": "12 " + "ab." * 33_332 + "!",
    "digits": "1" * 100_000,
    "a sign and spaces": "- " + " " * 99_998,
}


@pytest.mark.parametrize("name", ADVERSARIAL_100KB)
def test_graders_take_linear_time_on_adversarial_100kb_inputs(name) -> None:
    import time

    text = ADVERSARIAL_100KB[name]
    assert len(text) >= 99_990
    calls = (lambda: normalize_answer(text), lambda: grade_answer(text, "42"),
             lambda: grade_answer_flexible(text, "42"), lambda: grade_answer("\\boxed{" + text + "}", "42"),
             lambda: reward_plus_minus(text, "42"))
    for call in calls:
        best = float("inf")
        for _ in range(5):  # the best of a few tries: a busy shared machine slows one, not all
            # this thread's CPU time, not the wall clock: under make test's three workers on two cores a thread waits
            # for a core about half the time (a wall-clock bound failed at 51 ms there; these take 25 ms or less)
            started = time.thread_time()
            call()
            best = min(best, time.thread_time() - started)
            if best < 0.05:
                break
        assert best < 0.05, f"{name}: {best:.3f} s"


def test_a_gsm8k_gold_with_a_final_period_is_the_number() -> None:
    assert extract_gsm8k_answer("So 1,234 in all.\n#### 1,234.") == "1234"
    assert grade_answer(r"\boxed{1234}", extract_gsm8k_answer("#### 1,234.")) == 1.0


def test_a_non_numeric_gsm8k_gold_is_refused_at_load_time() -> None:
    with pytest.raises(ValueError, match=r"final answer 'N/A' \(after its last '####'\) is not a number"):
        extract_gsm8k_answer("Nothing to compute.\n#### N/A")


def test_thousands_commas_are_dropped_only_in_a_whole_grouped_number() -> None:
    assert normalize_answer("1,234,567") == "1234567" and normalize_answer("1,234.5") == "1234.5"
    assert normalize_answer("1,2,345") == "1,2,345"  # not a grouped number: stays (was "1,2345")
    assert normalize_answer("12,34,567") == "12,34,567" and normalize_answer("0.123,456") == "0.123,456"

"""Reading answers out of text and turning them into rewards.

Chapter 02 (notebooks/02_reward_parsing) explains every rule here; chapter 01 introduces
:func:`extract_gsm8k_answer`. The module needs only the standard library; the optional
cross-check :func:`grade_with_math_verify` imports ``math_verify`` when it is called.

The numeric rule, in one place: an answer and a gold answer *match* when both normalise
(:func:`normalize_answer`) to strings that parse (:func:`parse_number`) to the same exact
rational number (:class:`fractions.Fraction`). ``18.00 == 18`` and ``0.5 == 1/2`` hold;
``0.33 != 1/3`` and ``0.333333 != 1/3`` because there is no float tolerance. If either side
is not a number, the normalised strings must be equal (ignoring whitespace).
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = [
    "extract_gsm8k_answer",
    "extract_boxed",
    "normalize_answer",
    "parse_number",
    "answers_match",
    "extract_answer_flexible",
    "grade_answer",
    "gsm8k_reward",
    "grade_answer_flexible",
    "reward_plus_minus",
    "grade_with_math_verify",
    "MAX_NUMBER_CHARS",
]

# ---------------------------------------------------------------------------
# Gold answers (GSM8K)
# ---------------------------------------------------------------------------


def extract_gsm8k_answer(answer_text: str) -> str:
    """Return the final answer of a GSM8K solution: the text after the last ``####``.

    GSM8K's ``answer`` field is a worked solution that ends with ``#### <number>``.
    The number is returned stripped, with commas and a sentence's final period removed
    (``"#### 1,234"`` and ``"#### 1,234."`` give ``"1234"``). Every GSM8K gold answer is a
    number, so a final answer that :func:`parse_number` cannot read (``"#### N/A"``) is an
    error here, at load time, rather than a gold that ``\\boxed{N/A}`` would match. (The
    graders themselves still accept a non-numeric gold and compare it as text: DeepMath-style
    answers such as ``\\frac{\\pi}{2}`` need that.)

    Args:
        answer_text: the dataset's ``answer`` field.

    Returns:
        The final answer as a string, e.g. ``"72"``.

    Raises:
        TypeError: if ``answer_text`` is not a string.
        ValueError: if there is no ``####`` marker, nothing follows the last one, or what
            follows is not a number.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    if not isinstance(answer_text, str):
        raise TypeError(
            f"answer_text must be a str (the GSM8K 'answer' field), got {type(answer_text).__name__}"
        )
    if "####" not in answer_text:
        raise ValueError(
            "answer_text has no '####' marker, so it is not a GSM8K solution "
            f"(it starts {answer_text[:60]!r}); pass the dataset's 'answer' field, "
            "which ends with '#### <number>'"
        )
    answer = answer_text.rsplit("####", 1)[1].strip().replace(",", "").rstrip(".").strip()
    if not answer:
        raise ValueError(
            "answer_text has nothing after its last '####' "
            f"(it starts {answer_text[:60]!r}); a GSM8K solution ends with '#### <number>'"
        )
    if parse_number(answer) is None:
        raise ValueError(
            f"answer_text's final answer {answer[:60]!r} (after its last '####') is not a number; every GSM8K "
            "gold answer is one, so the row is not GSM8K's: fix or drop it"
        )
    return answer


# ---------------------------------------------------------------------------
# Boxed answers
# ---------------------------------------------------------------------------

# ``\boxed{``, ``\boxed {`` and ``\fbox{``; not ``\fboxsep`` or ``\boxedfoo``.
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _closing_brace(text: str, open_index: int) -> int | None:
    """Index of the ``}`` that closes the ``{`` at ``open_index``, or None if unbalanced.

    A backslash escapes the next character, so ``\\{`` and ``\\}`` are not counted,
    while ``\\\\{`` (a LaTeX line break, then a brace) is.
    """
    depth = 0
    i = open_index
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Return the content of the last top-level ``\\boxed{...}`` in ``text``.

    Braces are matched by counting, so nested content such as ``\\frac{3}{4}`` survives.
    ``\\boxed {...}`` (with a space) and ``\\fbox{...}`` count as boxes too. A box inside
    another box belongs to the outer one. If the last box never closes (a truncated
    response), the result is None rather than an earlier box the model moved past.

    Args:
        text: a model response.

    Returns:
        The box content, unstripped (``"\\frac{3}{4}"``), or None when there is no box
        or the last box is unbalanced.

    Raises:
        TypeError: if ``text`` is not a string.

    Introduced in: chapter 02 (notebooks/02_reward_parsing).
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str (a model response), got {type(text).__name__}")
    content: str | None = None
    position = 0
    while (match := _BOX_OPEN.search(text, position)) is not None:
        open_index = match.end() - 1
        close_index = _closing_brace(text, open_index)
        if close_index is None:
            return None
        content = text[open_index + 1 : close_index]
        position = close_index + 1
    return content


# ---------------------------------------------------------------------------
# Normalisation and numeric equivalence
# ---------------------------------------------------------------------------

_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
# Runs of digits and commas that start and end with a digit; each is then checked whole (linear time: no
# backtracking over a 100 kB ``123,123,...``, which a lookahead pattern needs quadratic time for).
_DIGIT_RUN = re.compile(r"\d(?:[\d,]*\d)?")
_GROUPED = re.compile(r"\d{1,3}(?:,\d{3})+")
_SIGN_SPACE = re.compile(r"^([-+])\s+")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\s*=\s*")
# A number followed by unit words of two or more letters: "18 dollars", "5 cm".
_TRAILING_UNITS = re.compile(r"^([-+]?[\d.,/]+)\s*[A-Za-z]{2,}(?:[\s.]+[A-Za-z]+)*\.?$")


def normalize_answer(s: str) -> str:
    """Strip the formatting that does not change an answer's value.

    Rules, applied in order: unicode minus (U+2212) becomes ``-``; surrounding ``$...$``,
    ``$$...$$``, ``\\(...\\)`` and ``\\[...\\]`` go; ``\\left``/``\\right`` go; ``\\dfrac`` and
    ``\\tfrac`` become ``\\frac``; ``\\text{...}``, ``\\mathrm{...}`` (and ``\\textbf``,
    ``\\mbox``, ...) are unwrapped; LaTeX spacing ``\\,`` ``\\!`` ``\\;`` ``\\:`` is deleted and
    ``~`` / ``\\ `` become spaces; ``{,}`` becomes ``,``; ``\\$``, ``$``, ``\\%``, ``%`` and
    degree marks go (a percentage is compared as the number written, as GSM8K writes
    it); a leading single-letter assignment ``x =`` goes; a trailing ``.`` goes; unit words
    after a number (``18 dollars``) go; commas in correctly grouped thousands
    (``1,234,567``) go, other commas (``1,2``) stay; whitespace is collapsed.

    Args:
        s: an extracted answer or a gold answer.

    Returns:
        The normalised string, e.g. ``normalize_answer("\\\\$1{,}234.50") == "1234.50"``.

    Raises:
        TypeError: if ``s`` is not a string.

    Introduced in: chapter 02 (notebooks/02_reward_parsing).
    """
    if not isinstance(s, str):
        raise TypeError(f"s must be a str (an answer), got {type(s).__name__}")
    t = s.strip().replace("\u2212", "-")
    t = _strip_delimiters(t)
    t = t.replace("\\left", "").replace("\\right", "")
    t = t.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    t = _TEXT_WRAPPER.sub(lambda m: f" {m.group(1)} ", t)
    for spacing in ("\\,", "\\!", "\\;", "\\:"):
        t = t.replace(spacing, "")
    t = t.replace("\\ ", " ").replace("~", " ")
    t = t.replace("{,}", ",")
    for mark in ("\\$", "$", "\\%", "%", "^{\\circ}", "^\\circ", "\u00b0"):
        t = t.replace(mark, "")
    t = " ".join(t.split())
    t = _ASSIGNMENT.sub("", t)
    t = t.rstrip(".").strip()
    t = _TRAILING_UNITS.sub(r"\1", t)
    t = _drop_thousands_commas(t)
    t = _SIGN_SPACE.sub(r"\1", t)
    return t.rstrip(".").strip()


def _drop_thousands_commas(t: str) -> str:
    """Remove the commas of each maximal run of digits and commas that is exactly ``d{1,3}(,ddd)+`` and does not
    follow a ``.`` (``1,234,567`` -> ``1234567``; ``1,2``, ``12,34,567`` and the decimals ``.123,456`` stay)."""

    def one(match: re.Match) -> str:
        run = match.group(0)
        start = match.start()
        if "," not in run or (start and t[start - 1] == ".") or not _GROUPED.fullmatch(run):
            return run
        return run.replace(",", "")

    return _DIGIT_RUN.sub(one, t)


def _strip_delimiters(t: str) -> str:
    """Remove one or more layers of surrounding math delimiters (by index: linear in ``len(t)``)."""
    start, end = 0, len(t)
    changed = True
    while changed:
        changed = False
        for left, right in _DELIMITERS:
            if end - start >= len(left) + len(right) and t.startswith(left, start, end) \
                    and t.endswith(right, start, end):
                start, end = start + len(left), end - len(right)
                while start < end and t[start].isspace():
                    start += 1
                while end > start and t[end - 1].isspace():
                    end -= 1
                changed = True
                break
    return t[start:end]


MAX_NUMBER_CHARS = 1000
"""Longest normalised answer :func:`parse_number` reads as a number; longer strings are compared as text."""

_DECIMAL = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_PLAIN_NUMBER = re.compile(rf"^{_DECIMAL}$")
_SLASH_FRACTION = re.compile(rf"^({_DECIMAL})\s*/\s*({_DECIMAL})$")
_LATEX_FRACTION = re.compile(rf"^([-+]?)\\frac\s*(?:\{{\s*({_DECIMAL})\s*\}}|(\d))\s*(?:\{{\s*({_DECIMAL})\s*\}}|(\d))$")


def parse_number(s: str) -> Fraction | None:
    """Parse a normalised answer as an exact rational number.

    Accepts integers and decimals (``-3``, ``18.00``, ``.5``), ``a/b`` and ``\\frac{a}{b}``
    (also ``\\frac12``) with an optional sign in front or in the numerator. Scientific
    notation, powers, roots and mixed numbers are not numbers under this rule, and neither
    is anything longer than :data:`MAX_NUMBER_CHARS` characters (``"1" * 100000`` or a
    5,000-digit decimal is no answer to a word problem, and exact arithmetic on it could be
    slow), so hostile model output never raises or stalls a grader.

    Args:
        s: a string, usually the output of :func:`normalize_answer`.

    Returns:
        The value as a :class:`fractions.Fraction`, or None if ``s`` is not such a number
        (or has a zero denominator).

    Raises:
        TypeError: if ``s`` is not a string.

    Introduced in: chapter 02 (notebooks/02_reward_parsing).
    """
    if not isinstance(s, str):
        raise TypeError(f"s must be a str (a normalised answer), got {type(s).__name__}")
    t = s.strip()
    if len(t) > MAX_NUMBER_CHARS:  # no answer is that long; Python refuses int("1" * 5000) anyway
        return None
    try:
        if _PLAIN_NUMBER.match(t):
            return Fraction(t)
        if match := _SLASH_FRACTION.match(t):
            return _ratio("", match.group(1), match.group(2))
        if match := _LATEX_FRACTION.match(t):
            numerator = match.group(2) or match.group(3)
            denominator = match.group(4) or match.group(5)
            return _ratio(match.group(1), numerator, denominator)
    except (ValueError, ZeroDivisionError, OverflowError):  # a grader never raises on what a model wrote
        return None
    return None


def _ratio(sign: str, numerator: str, denominator: str) -> Fraction | None:
    """``sign * numerator / denominator`` as a Fraction, None for a zero denominator."""
    bottom = Fraction(denominator)
    if bottom == 0:
        return None
    value = Fraction(numerator) / bottom
    return -value if sign == "-" else value


def _normalized_gold(gold: str) -> str:
    """Normalise ``gold``, refusing a gold answer that is not a string or normalises to nothing.

    The graders call this even when the response has no answer, so a bad gold answer is
    reported on every response rather than only on those that happen to contain one.
    """
    if not isinstance(gold, str):
        raise TypeError(f"gold must be a str (the reference answer), got {type(gold).__name__}")
    gold_norm = normalize_answer(gold)
    if not gold_norm:
        raise ValueError(
            f"gold is empty after normalisation (gold={gold!r}); pass the reference answer, "
            "e.g. extract_gsm8k_answer(row['answer'])"
        )
    return gold_norm


def answers_match(pred: str, gold: str) -> bool:
    """Decide whether a predicted answer equals the gold answer.

    Both sides go through :func:`normalize_answer`. If both then parse as numbers
    (:func:`parse_number`) they match when they are exactly equal as fractions, so
    ``"18.00"`` matches ``"18"`` and ``"\\frac{1}{2}"`` matches ``"0.5"``, but ``"0.33"``
    does not match ``"1/3"``: no float tolerance, no rounding surprises. If exactly one
    side is a number, they do not match. Otherwise the normalised strings are compared
    with whitespace removed.

    Args:
        pred: the model's extracted answer (e.g. the content of its last box).
        gold: the reference answer.

    Returns:
        True if they match.

    Raises:
        TypeError: if either argument is not a string.
        ValueError: if ``gold`` is empty after normalisation.

    Introduced in: chapter 02 (notebooks/02_reward_parsing).
    """
    if not isinstance(pred, str) or not isinstance(gold, str):
        raise TypeError(
            f"pred and gold must be str, got {type(pred).__name__} and {type(gold).__name__}"
        )
    gold_norm = _normalized_gold(gold)
    pred_norm = normalize_answer(pred)
    pred_value, gold_value = parse_number(pred_norm), parse_number(gold_norm)
    if pred_value is not None and gold_value is not None:
        return pred_value == gold_value
    if pred_value is not None or gold_value is not None:
        return False
    return "".join(pred_norm.split()) == "".join(gold_norm.split())


# ---------------------------------------------------------------------------
# Extracting an answer from free text
# ---------------------------------------------------------------------------

# A number as it appears in prose: optional sign (not after a word character, so the
# "5" in "3-5" stays positive), grouped or plain digits, decimals, a/b or \frac{a}{b}.
_PROSE_NUMBER = re.compile(
    r"(?:(?<![\w)])[-\u2212])?"
    r"(?:\\[dt]?frac\{\d+\}\{\d+\}"
    r"|(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
    r"|\.\d+)"
)
_HASHES = re.compile(r"####([^\n]*)")
_ANSWER_IS = re.compile(r"\banswer\b\s*(?:is\b|:|=)", re.IGNORECASE)


def extract_answer_flexible(response: str) -> str | None:
    """Find the final answer in a response that may ignore the requested format.

    Tries, in order: the last ``\\boxed{}`` (:func:`extract_boxed`); the first number after
    the last ``####``; the first number on the line after the last "answer is" /
    "answer:"; the last number anywhere in the text.

    Args:
        response: a model response.

    Returns:
        The answer text (not yet normalised), or None when the response holds no number.

    Raises:
        TypeError: if ``response`` is not a string.

    Introduced in: chapter 02 (notebooks/02_reward_parsing).
    """
    boxed = extract_boxed(response)
    if boxed is not None:
        return boxed
    hashes = _HASHES.findall(response)
    if hashes and (number := _PROSE_NUMBER.search(hashes[-1])):
        return number.group(0)
    answer_is = list(_ANSWER_IS.finditer(response))
    if answer_is:
        line = response[answer_is[-1].end() :].split("\n", 1)[0]
        if number := _PROSE_NUMBER.search(line):
            return number.group(0)
    numbers = _PROSE_NUMBER.findall(response)
    return numbers[-1] if numbers else None


# ---------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------


def grade_answer(response: str, gold: str) -> float:
    """Binary reward that requires the requested format: the last ``\\boxed{}`` must match.

    The prompt asks for the answer inside ``\\boxed{}``, so following that format is part
    of the task: a right number outside a box earns nothing. This is the reward the
    GRPO chapters train with (instruction-tuned models follow the format).

    Args:
        response: a model response.
        gold: the reference answer (e.g. from :func:`extract_gsm8k_answer`).

    Returns:
        1.0 if the last box exists and :func:`answers_match` the gold, else 0.0.

    Raises:
        TypeError: if an argument is not a string.
        ValueError: if ``gold`` is empty after normalisation.

    Introduced in: chapter 02 (notebooks/02_reward_parsing).
    """
    boxed = extract_boxed(response)
    if boxed is None:
        _normalized_gold(gold)
        return 0.0
    return 1.0 if answers_match(boxed, gold) else 0.0


def gsm8k_reward(text: str, record: dict) -> float:
    """1.0 when the last ``\\boxed{}`` of ``text`` equals the record's gold answer, else 0.0: :func:`grade_answer`
    against :func:`extract_gsm8k_answer` of ``record["answer"]`` (also importable from ``trio_helpers.grpo``).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    return float(grade_answer(text, extract_gsm8k_answer(record["answer"])))


def grade_answer_flexible(response: str, gold: str) -> float:
    """Binary reward that accepts the answer in whatever form the model gave it.

    Uses :func:`extract_answer_flexible` (box, then ``####``, then "the answer is", then
    the last number). Use it to *measure* a base model that was never taught the box
    format, or to compare against graders such as math-verify; train with
    :func:`grade_answer` when the prompt asks for a box, otherwise the policy is never
    pushed towards the format.

    Args:
        response: a model response.
        gold: the reference answer.

    Returns:
        1.0 if an answer was found and matches the gold, else 0.0.

    Raises:
        TypeError: if an argument is not a string.
        ValueError: if ``gold`` is empty after normalisation.

    Introduced in: chapter 02 (notebooks/02_reward_parsing).
    """
    answer = extract_answer_flexible(response)
    if answer is None:
        _normalized_gold(gold)
        return 0.0
    return 1.0 if answers_match(answer, gold) else 0.0


def reward_plus_minus(
    response: str,
    gold: str,
    *,
    require_box: bool = False,
    correct: float = 1.0,
    wrong: float = -0.5,
    unparseable: float = -1.0,
) -> float:
    """Three-level reward: right answer, wrong answer, or no answer at all.

    "Unparseable" means no answer could be extracted (no box when ``require_box``, else
    no number anywhere); an extracted answer that does not match is "wrong", even when
    it is not a number.

    Args:
        response: a model response.
        gold: the reference answer.
        require_box: extract with :func:`extract_boxed` instead of
            :func:`extract_answer_flexible`.
        correct: reward for a matching answer.
        wrong: reward for an answer that does not match.
        unparseable: reward when no answer was found.

    Returns:
        One of ``correct``, ``wrong``, ``unparseable`` (by default +1, -0.5, -1).

    Raises:
        TypeError: if ``response`` or ``gold`` is not a string.
        ValueError: if ``gold`` is empty after normalisation.

    Introduced in: chapter 02 (notebooks/02_reward_parsing).
    """
    answer = extract_boxed(response) if require_box else extract_answer_flexible(response)
    if answer is None:
        _normalized_gold(gold)
        return unparseable
    return correct if answers_match(answer, gold) else wrong


# ---------------------------------------------------------------------------
# Cross-check with math-verify
# ---------------------------------------------------------------------------


_POWER_OPEN = re.compile(r"\^\s*\{")
_BARE_TOWER = re.compile(r"\^\s*[\w.]+\s*\^|\w\*\*[\w.(]+\*\*[\w(]")  # not markdown **bold**


def _has_power_tower(text: str) -> bool:
    """True when an exponent contains another power (``9^{9^{9^{9}}}``, ``10^10^10``, ``2**2**30``)."""
    if _BARE_TOWER.search(text):
        return True
    for match in _POWER_OPEN.finditer(text):
        close = _closing_brace(text, match.end() - 1)
        exponent = text[match.end() : close if close is not None else len(text)]
        if "^" in exponent or "**" in exponent:
            return True
    return False


def grade_with_math_verify(response: str, gold: str) -> float:
    """Grade with Hugging Face math-verify, for cross-checking our rules.

    Parses the gold (wrapped in ``$...$``) and the whole response with
    ``math_verify.parse`` and compares them with ``math_verify.verify``. Both timeouts
    are disabled (``parsing_timeout=None``, ``timeout_seconds=None``) because math-verify
    implements them with ``signal.alarm``, which fails outside the main thread. Without a
    timeout, two kinds of model output are handled here instead: a response with a power
    tower (an exponent that contains another power, such as ``9^{9^{9^{9}}}``, which SymPy
    would try to evaluate and never finish) earns 0.0 without being parsed, and any
    exception math-verify raises on a response earns 0.0. math-verify logs one warning
    about the disabled timeout through the ``math_verify`` logger.

    Args:
        response: a model response.
        gold: the reference answer.

    Returns:
        1.0 if math-verify judges them equal, else 0.0 (also for refused or unparseable
        responses).

    Raises:
        TypeError: if an argument is not a string.
        ImportError: if ``math_verify`` is not installed (``pip install math-verify``).

    Introduced in: chapter 02 (notebooks/02_reward_parsing).
    """
    if not isinstance(response, str) or not isinstance(gold, str):
        raise TypeError(
            f"response and gold must be str, got {type(response).__name__} and {type(gold).__name__}"
        )
    from math_verify import parse, verify

    if _has_power_tower(response):
        return 0.0
    gold_text = gold if "$" in gold or "\\boxed" in gold else f"${gold}$"
    try:
        parsed_gold = parse(gold_text, parsing_timeout=None)
        parsed_response = parse(response, parsing_timeout=None)
        return 1.0 if verify(parsed_gold, parsed_response, timeout_seconds=None) else 0.0
    except Exception:  # noqa: BLE001 - a grader never raises on what a model wrote
        return 0.0

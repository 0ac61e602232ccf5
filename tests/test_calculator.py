"""The calculator tool (trio_helpers.calculator, chapter 12): the safe parser, the tool-call format, the environment.

Hostile inputs are each bounded in time: the best of a few tries must stay under a generous 50 ms (they take
microseconds), so a slow shared machine does not make the test flaky while a quadratic or exponential blow-up
still fails it.
"""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from trio_helpers.calculator import (
    MAX_CHARS,
    MAX_DEPTH,
    STOP,
    CalculatorEnv,
    CalculatorError,
    calculate,
    evaluate,
    find_tool_call,
    format_number,
    parse_tool_call,
    tool_call_text,
    tool_reply_text,
)
from trio_helpers.episodes import Environment, StepResult

BOUND_S = 0.05


def best_time(fn, tries: int = 3) -> float:
    """The best of a few tries, in this thread's CPU time (a loaded machine's waits for a core do not count)."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


# --- ordinary arithmetic -------------------------------------------------------------------------------------
@pytest.mark.parametrize("expression, value", [
    ("48/2", Fraction(24)),
    ("1 + 2 * 3", Fraction(7)),
    ("(1 + 2) * 3", Fraction(9)),
    ("10 - 4 - 3", Fraction(3)),          # left-associative
    ("24 / 4 / 2", Fraction(3)),
    ("-3 - -2", Fraction(-1)),
    ("2 * -3", Fraction(-6)),
    ("+5", Fraction(5)),
    ("-(-(2))", Fraction(2)),
    ("0.1 + 0.2", Fraction(3, 10)),       # exact, unlike floats
    ("10 / 4", Fraction(5, 2)),
    ("2 / 3 * 3", Fraction(2)),
    (".5 + 1.", Fraction(3, 2)),
    ("  7\t", Fraction(7)),
    ("999999999999999", Fraction(999999999999999)),  # 15 digits: the largest literal
])
def test_evaluate_ordinary(expression, value) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize("value, text", [
    (Fraction(24), "24"), (Fraction(-7), "-7"), (Fraction(5, 2), "2.5"), (Fraction(10, 3), "3.333333"),
    (Fraction(2, 3), "0.666667"), (Fraction(1, 8), "0.125"), (Fraction(-1, 10**9), "0"), (Fraction(0), "0"),
])
def test_format_number(value, text) -> None:
    assert format_number(value) == text


def test_calculate_returns_text() -> None:
    assert calculate("48/2") == "24"
    assert calculate("7 * 1.5") == "10.5"


# --- bad and hostile inputs: a one-line error, bounded in time ---------------------------------------------------
HOSTILE = {
    "division by zero": ("1/0", "division by zero"),
    "division by a zero expression": ("5 / (2 - 2)", "division by zero"),
    "huge literal": ("9" * 16, "number too long"),
    "huge product": ("999999999999999 * 999999999999999", "result too large"),
    "huge by repeated product": ("*".join(["99999"] * 30), "result too large"),
    "tiny by repeated division": ("1" + "/97" * 40, "result too precise"),
    "10,000-deep nesting": ("(" * 10_000 + "1" + ")" * 10_000, "expression too long"),
    "deep nesting under the length limit": ("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1), "too deep"),
    "deep unary minus": ("-" * 150 + "1", "too deep"),
    "100 kB expression": ("1+" * 50_000 + "1", "expression too long"),
    "exponent notation": ("1e999", "unexpected 'e'"),
    "power operator": ("2**10", "unexpected '*'"),
    "unicode digits": ("\u0663 + 1", "unexpected"),       # ARABIC-INDIC DIGIT THREE
    "fullwidth digits": ("\uff11\uff12", "unexpected"),
    "superscript": ("2\u00b2", "unexpected"),
    "thousands comma": ("1,000 + 1", "unexpected ','"),
    "python code": ("__import__('os')", "unexpected '_'"),
    "two points": ("1.5.2", "bad number"),
    "dangling operator": ("1 +", "ends too early"),
    "unclosed parenthesis": ("(1 + 2", "missing ')'"),
    "stray parenthesis": ("1 + 2)", "unexpected ')'"),
    "empty": ("", "empty expression"),
    "blank": ("   ", "empty expression"),
    "newline inside": ("1\n+\n", "ends too early"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_input_is_a_one_line_error_fast(name) -> None:
    expression, fragment = HOSTILE[name]
    with pytest.raises(CalculatorError) as caught:
        evaluate(expression)
    message = str(caught.value)
    assert fragment in message, message
    assert "\n" not in message and len(message) < 120
    reply = calculate(expression)
    assert reply == f"error: {message}"
    assert best_time(lambda: calculate(expression)) < BOUND_S, name


def test_length_limit_is_exact() -> None:
    at_limit = "1+" * ((MAX_CHARS - 1) // 2) + "1"
    assert len(at_limit) <= MAX_CHARS and evaluate(at_limit) == (MAX_CHARS - 1) // 2 + 1
    with pytest.raises(CalculatorError, match="too long"):
        evaluate(at_limit + "+1")


def test_depth_limit_is_exact() -> None:
    assert evaluate("(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH) == 1
    with pytest.raises(CalculatorError, match="too deep"):
        evaluate("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1))


def test_calculate_never_raises_on_non_strings() -> None:
    assert calculate(None).startswith("error: ")
    assert calculate(12).startswith("error: ")


# --- the tool-call format ------------------------------------------------------------------------------------
def test_tool_call_round_trip() -> None:
    text = "First the half. " + tool_call_text("48/2")
    body, closed = find_tool_call(text)
    assert closed and parse_tool_call(body) == "48/2"
    assert text.endswith(STOP[0])


def test_find_tool_call_cases() -> None:
    assert find_tool_call("The answer is \\boxed{24}.") is None
    body, closed = find_tool_call('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}')
    assert not closed and parse_tool_call(body) == "1+1"  # a service that drops the matched stop string
    two = tool_call_text("1+1") + " then " + tool_call_text("2+2")
    assert parse_tool_call(find_tool_call(two)[0]) == "2+2"  # the last call counts


@pytest.mark.parametrize("body, fragment", [
    ("not json", "not JSON"),
    ('{"name": "search", "arguments": {"query": "x"}}', "unknown tool 'search'"),
    ('{"name": "calculator", "arguments": {}}', 'string "expression"'),
    ('{"name": "calculator", "arguments": {"expression": 5}}', 'string "expression"'),
    ('[1, 2]', "unknown tool"),
    ("[" * 100_000, "too long"),
    ("[" * 499 + "]" * 499, "unknown tool"),  # deep JSON within MAX_CALL_CHARS: parsed, then refused
    ('{"a": ' * 400 + "1" + "}" * 400, "tool call too long"),
])
def test_bad_tool_calls(body, fragment) -> None:
    with pytest.raises(CalculatorError) as caught:
        parse_tool_call(body)
    assert fragment in str(caught.value)
    assert best_time(lambda: find_tool_call("<tool_call>" + body)) < BOUND_S


def test_arguments_as_json_string_are_accepted() -> None:
    assert parse_tool_call('{"name": "calculator", "arguments": "{\\"expression\\": \\"3*4\\"}"}') == "3*4"


def test_tool_reply_text() -> None:
    reply = tool_reply_text("24")
    assert reply == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n24\n</tool_response><|im_end|>\n"
                     "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tool_reply_text("24", closed=False).startswith("</tool_call><|im_end|>")
    assert tool_reply_text("24", enable_thinking=True).endswith("<|im_start|>assistant\n")


# --- the environment -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from trio_helpers.offline.tokenizer import get_offline_tokenizer

    return get_offline_tokenizer()


RECORD = {"question": "Natalia sold 48 clips in April and half as many in May. How many in May?",
          "answer": "In May she sold 48/2=<<48/2=24>>24 clips.\n#### 24"}


def test_env_is_an_environment(tokenizer) -> None:
    assert isinstance(CalculatorEnv(tokenizer), Environment)


def test_env_reset_gives_chapter_01_prompt(tokenizer) -> None:
    from trio_helpers.prompts import build_prompt, gsm8k_messages

    env = CalculatorEnv(tokenizer)
    assert env.reset(RECORD) == build_prompt(tokenizer, gsm8k_messages(RECORD["question"])).to_ints()


def test_env_answers_a_call_then_grades_the_final_answer(tokenizer) -> None:
    env = CalculatorEnv(tokenizer)
    env.reset(RECORD)
    call = "Half of 48: " + tool_call_text("48/2")
    result = env.step(call, tokenizer.encode(call, add_special_tokens=False))
    assert isinstance(result, StepResult) and not result.done and result.reward == 0.0
    assert tokenizer.decode(result.tokens) == tool_reply_text("24")
    assert result.info == {"tool_calls": 1, "tool_errors": 0}
    final = "She sold \\boxed{24} clips in May."
    result = env.step(final, tokenizer.encode(final, add_special_tokens=False))
    assert result.done and result.reward == 1.0 and result.tokens == []
    env.reset(RECORD)
    wrong = "\\boxed{25}"
    assert env.step(wrong, []).reward == 0.0


@pytest.mark.parametrize("call, error", [
    (tool_call_text("1/0"), "error: division by zero"),
    (tool_call_text("1e999"), "error: syntax error: unexpected 'e' at position 1"),
    (tool_call_text("(" * 10_000 + "1" + ")" * 10_000), "error: tool call too long"),
    ("<tool_call>{oops}</tool_call>", "error: bad tool call: not JSON"),
    ('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>', "error: unknown tool 'python'"),
])
def test_env_bad_calls_get_an_error_reply(tokenizer, call, error) -> None:
    env = CalculatorEnv(tokenizer)
    env.reset(RECORD)
    result = env.step(call, [])
    reply = tokenizer.decode(result.tokens)
    assert not result.done and result.info == {"tool_calls": 1, "tool_errors": 1}
    line = reply.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
    assert line.startswith(error) and "\n" not in line


def test_env_unclosed_call_is_closed_by_the_reply(tokenizer) -> None:
    env = CalculatorEnv(tokenizer)
    env.reset(RECORD)
    result = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}', [])
    assert tokenizer.decode(result.tokens) == tool_reply_text("4", closed=False)


def test_env_call_limit(tokenizer) -> None:
    env = CalculatorEnv(tokenizer, max_calls=1)
    env.reset(RECORD)
    assert env.step(tool_call_text("1+1"), []).info["tool_errors"] == 0
    second = env.step(tool_call_text("1+1"), [])
    assert second.info["tool_errors"] == 1 and "give the final answer" in tokenizer.decode(second.tokens)


def test_env_custom_reward_and_errors(tokenizer) -> None:
    env = CalculatorEnv(tokenizer, reward_fn=lambda text, record: 0.25)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("x", [])
    env.reset(RECORD)
    assert env.step("no answer", []).reward == 0.25
    with pytest.raises(ValueError, match="max_calls"):
        CalculatorEnv(tokenizer, max_calls=-1)

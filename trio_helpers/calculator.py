"""A calculator tool for GSM8K: a safe arithmetic parser, the tool-call format, and the episode environment.

**The parser** (:func:`evaluate`, :func:`calculate`) is a recursive-descent parser for the grammar::

    expression := term (("+" | "-") term)*
    term       := factor (("*" | "/") factor)*
    factor     := "-" factor | "+" factor | "(" expression ")" | number
    number     := digits ["." digits] | "." digits          (ASCII digits 0-9 only)

evaluated exactly with :class:`fractions.Fraction` (``0.1 + 0.2`` is ``0.3``, ``10/4`` is ``5/2``). It never calls
``eval``: model output is untrusted text. Every input is bounded before any work is done: at most
:data:`MAX_CHARS` characters, :data:`MAX_DEPTH` nested parentheses or signs, :data:`MAX_DIGITS` digits per number,
and every intermediate result's magnitude at most :data:`MAX_MAGNITUDE` (its denominator too), so a hostile
expression costs microseconds, never a ``RecursionError`` or a million-digit integer. No exponent notation
(``1e999`` is a syntax error), no ``**``, no thousands commas, no unicode digits.

**The tool-call format** is the one Qwen's chat models (Qwen2.5, Qwen3) are trained with, Hermes-style JSON inside
tags::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "48/2"}}
    </tool_call>

Why this rather than a shorter ``<calc>48/2</calc>``: a real chat model on the service already writes tool calls in
this shape (its chat template renders tools this way), so the same environment runs there without teaching a new
format; the closing tag is a plain stop string (``SamplingParams.stop``); JSON names the tool, so a second tool
would need no new syntax. Its cost is length (about 60 characters of wrapping per call), which matters for the
byte-level offline models. The reply follows the same family: the tool's result in a ``<tool_response>`` block of a
user turn, as Qwen3's template renders a ``tool`` message (:func:`tool_reply_text`).

Introduced in: chapter 12 (notebooks/12_tool_use).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from decimal import ROUND_HALF_EVEN, Decimal
from fractions import Fraction

from trio_helpers.episodes import StepResult
from trio_helpers.grading import gsm8k_reward

MAX_CHARS = 200
"""Longest expression accepted, in characters (GSM8K's calculator notes are under 40)."""
MAX_DEPTH = 32
"""Deepest nesting of parentheses and unary signs."""
MAX_DIGITS = 15
"""Most digits in one number literal (before and after the decimal point together)."""
MAX_MAGNITUDE = 10**15
"""Largest absolute value (and largest denominator) of any intermediate result."""
RESULT_DECIMALS = 6
"""A result that is not a short exact decimal is rounded to this many decimal places (``10/3`` -> ``3.333333``)."""
MAX_CALL_CHARS = 1000
"""Longest tool-call block (between the tags) that is parsed as JSON at all."""

TOOL_NAME = "calculator"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
STOP = [CALL_CLOSE]
"""Stop strings that end a model turn at its tool call: put them in ``SamplingParams.stop``."""
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 48/2"}},
            "required": ["expression"],
        },
    },
}
"""The calculator as a chat template's ``tools`` entry (OpenAI/Hermes function schema): a real Qwen chat
template turns it into the system block that tells the model the tool exists and how to call it; the offline
template ignores ``tools`` (its tool model was fitted on episodes and always knows the calculator)."""


class CalculatorError(ValueError):
    """A bad expression; ``str(error)`` is the one-line message the tool replies with.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """


# --------------------------------------------------------------------------------------------------- parser
class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.depth = 0

    def _skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t\n":
            self.pos += 1

    def _peek(self) -> str:
        self._skip()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _unexpected(self) -> CalculatorError:
        ch = self._peek()
        if not ch:
            return CalculatorError("syntax error: the expression ends too early")
        return CalculatorError(f"syntax error: unexpected {ch!r} at position {self.pos}")

    def parse(self) -> Fraction:
        value = self.expression()
        if self._peek():
            raise self._unexpected()
        return value

    def expression(self) -> Fraction:
        value = self.term()
        while self._peek() in ("+", "-"):
            op = self.text[self.pos]
            self.pos += 1
            value = _check(value + self.term() if op == "+" else value - self.term())
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self._peek() in ("*", "/"):
            op = self.text[self.pos]
            self.pos += 1
            right = self.factor()
            if op == "/" and right == 0:
                raise CalculatorError("division by zero")
            value = _check(value * right if op == "*" else value / right)
        return value

    def factor(self) -> Fraction:
        ch = self._peek()
        if ch in ("-", "+", "("):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise CalculatorError(f"too deep: more than {MAX_DEPTH} nested parentheses or signs")
            self.pos += 1
            if ch == "(":
                value = self.expression()
                if self._peek() != ")":
                    raise self._unexpected() if self._peek() else CalculatorError("syntax error: missing ')'")
                self.pos += 1
            else:
                value = self.factor()
                value = -value if ch == "-" else value
            self.depth -= 1
            return value
        return self.number()

    def number(self) -> Fraction:
        self._skip()
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in "0123456789.":
            self.pos += 1
        literal = self.text[start : self.pos]
        if not literal:
            raise self._unexpected()
        if literal.count(".") > 1 or literal == ".":
            raise CalculatorError(f"syntax error: bad number {literal!r} at position {start}")
        if sum(c.isdigit() for c in literal) > MAX_DIGITS:
            raise CalculatorError(f"number too long: more than {MAX_DIGITS} digits at position {start}")
        return _check(Fraction(literal))


def _check(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"result too large: magnitude above 10^{len(str(MAX_MAGNITUDE)) - 1}")
    if value.denominator > MAX_MAGNITUDE:
        raise CalculatorError("result too precise: denominator above 10^15")
    return value


def evaluate(expression: str) -> Fraction:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: ``+ - * /``, unary ``-``/``+``, parentheses, decimal numbers (ASCII digits), spaces and tabs.

    Returns:
        The exact value as a ``fractions.Fraction``.

    Raises:
        CalculatorError: (a ``ValueError``) a syntax error, division by zero, an expression longer than
            :data:`MAX_CHARS`, nesting deeper than :data:`MAX_DEPTH`, a number with more than :data:`MAX_DIGITS`
            digits, or an intermediate result beyond :data:`MAX_MAGNITUDE`; its message is one line.
        TypeError: ``expression`` is not a string.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a str, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression too long: {len(expression)} characters, at most {MAX_CHARS}")
    if not expression.strip():
        raise CalculatorError("syntax error: empty expression")
    return _Parser(expression).parse()


def format_number(value: Fraction) -> str:
    """A result as the tool shows it: an integer (``24``), an exact short decimal (``2.5``) or a decimal rounded to
    :data:`RESULT_DECIMALS` places (``3.333333``), never exponent notation.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    if value.denominator == 1:
        return str(value.numerator)
    exact = Decimal(value.numerator) / Decimal(value.denominator)  # 28 significant digits: enough below 10^15
    text = format(exact.quantize(Decimal(1).scaleb(-RESULT_DECIMALS), rounding=ROUND_HALF_EVEN), "f")
    text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def calculate(expression) -> str:
    """The calculator tool: the result of ``expression`` as text, or a one-line ``"error: ..."``; never raises.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    try:
        return format_number(evaluate(expression))
    except (CalculatorError, TypeError) as error:
        return f"error: {error}"


# --------------------------------------------------------------------------------------------------- tool calls
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.S)


def find_tool_call(text: str) -> tuple[str, bool] | None:
    """The last tool-call block of a model turn.

    Args:
        text: the model's turn.

    Returns:
        ``None`` when the turn has no ``<tool_call>``; else ``(body, closed)``: the text between the last
        ``<tool_call>`` and its ``</tool_call>`` (or the end of the turn), and whether the closing tag was there
        (a service may drop a matched stop string from the output; the environment then writes it).

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    start = text.rfind(CALL_OPEN)
    if start < 0:
        return None
    match = _CALL.match(text, start)
    return match.group(1), text.find(CALL_CLOSE, start) >= 0


def parse_tool_call(body: str) -> str:
    """The expression of a calculator call's JSON body ``{"name": "calculator", "arguments": {"expression": ...}}``.

    Returns:
        The expression string.

    Raises:
        CalculatorError: the body is too long, not JSON, names another tool or has no string ``expression``.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    if len(body) > MAX_CALL_CHARS:
        raise CalculatorError(f"tool call too long: {len(body)} characters, at most {MAX_CALL_CHARS}")
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        raise CalculatorError('bad tool call: not JSON like {"name": "calculator", "arguments": '
                              '{"expression": "48/2"}}') from None
    if not isinstance(call, dict) or call.get("name") != TOOL_NAME:
        name = call.get("name") if isinstance(call, dict) else None
        raise CalculatorError(f"unknown tool {name!r}: the only tool is {TOOL_NAME!r}")
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    if not isinstance(expression, str):
        raise CalculatorError('bad tool call: arguments need a string "expression"')
    return expression


def tool_call_text(expression: str) -> str:
    """A calculator call in the format the environment reads (for prompts, tests and corpora).

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    body = json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}})
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def tool_reply_text(result: str, closed: bool = True, enable_thinking: bool = False) -> str:
    """The environment's reply after a tool call, as text: close the assistant turn, the tool's result in a user
    turn's ``<tool_response>`` block (Qwen3's rendering of a ``tool`` message), then the next assistant header.

    The block is written out here rather than re-rendered with ``apply_chat_template``: a template renders whole
    conversations (and drops earlier think blocks), so the difference of two renderings is not always a suffix.

    Args:
        result: the tool's output (a number or an ``error: ...`` line).
        closed: the turn already ends with ``</tool_call>``; False prepends it.
        enable_thinking: False (as :func:`trio_helpers.prompts.build_prompt`) pre-fills an empty think block, as
            the chat template does for a new assistant turn.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    head = "" if closed else CALL_CLOSE
    think = "" if enable_thinking else "<think>\n\n</think>\n\n"
    return (f"{head}<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
            f"<|im_start|>assistant\n{think}")


# --------------------------------------------------------------------------------------------------- environment
class CalculatorEnv:
    """A GSM8K episode with a calculator tool (implements :class:`trio_helpers.episodes.Environment`).

    ``reset(record)`` renders the record's question as chapter 01's prompt (or ``messages_fn(record)``);
    ``step(text, tokens)``: when the turn holds a tool call, evaluate it (:func:`calculate`; a bad call gets its
    ``error: ...`` line as the reply, never an exception) and reply with :func:`tool_reply_text`; otherwise the turn
    is the final answer: the episode ends with ``reward_fn(text, record)``, by default chapter 02's final-answer
    reward (:func:`trio_helpers.grading.gsm8k_reward`: 1.0 when the last ``\\boxed{}`` equals the gold answer).
    After ``max_calls`` calls a further call is answered with an error asking for the final answer.

    Args:
        tokenizer: the sampler's tokenizer (``encode``/``apply_chat_template``).
        messages_fn: ``messages_fn(record) -> list[dict]``; default
            :func:`trio_helpers.prompts.gsm8k_messages` of ``record["question"]``.
        reward_fn: ``reward_fn(final_turn_text, record) -> float``; default chapter 02's grader.
        max_calls: tool calls answered with a result (>= 0).
        enable_thinking: passed to the prompt and to :func:`tool_reply_text`.
        declare_tool: render the prompt with ``tools=[TOOL_SCHEMA]`` (:data:`TOOL_SCHEMA`), as a real chat
            model needs to know the tool; the offline template ignores it, so offline prompts are chapter 01's
            either way.

    ``info`` counters per step: ``tool_calls``, ``tool_errors``.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """

    stop = STOP

    def __init__(self, tokenizer, messages_fn: Callable[[dict], list] | None = None,
                 reward_fn: Callable[[str, dict], float] | None = None, max_calls: int = 4,
                 enable_thinking: bool = False, declare_tool: bool = True) -> None:
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 0:
            raise ValueError(f"max_calls must be an integer >= 0, got {max_calls!r}")
        self.tokenizer = tokenizer
        self.messages_fn = messages_fn
        self.reward_fn = reward_fn
        self.max_calls = max_calls
        self.enable_thinking = enable_thinking
        self.declare_tool = declare_tool
        self.record: dict | None = None
        self.calls = 0

    def reset(self, record: dict) -> list[int]:
        """The prompt's token ids for ``record``; starts a new episode."""
        from trio_helpers.prompts import build_prompt, gsm8k_messages

        self.record, self.calls = record, 0
        messages = self.messages_fn(record) if self.messages_fn else gsm8k_messages(record["question"])
        if not self.declare_tool:
            return build_prompt(self.tokenizer, messages, enable_thinking=self.enable_thinking).to_ints()
        text = self.tokenizer.apply_chat_template(messages, tools=[TOOL_SCHEMA], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=self.enable_thinking)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def step(self, text: str, tokens: list[int]) -> StepResult:
        """Answer one model turn (see the class docstring); never raises for anything the model wrote."""
        if self.record is None:
            raise RuntimeError("CalculatorEnv.step before reset(record): start each episode with reset")
        call = find_tool_call(text)
        if call is None:
            reward_fn = self.reward_fn or gsm8k_reward
            return StepResult([], done=True, reward=float(reward_fn(text, self.record)))
        body, closed = call
        self.calls += 1
        if self.calls > self.max_calls:
            result = f"error: no more than {self.max_calls} calculator calls; give the final answer"
        else:
            try:
                result = calculate(parse_tool_call(body))
            except CalculatorError as error:
                result = f"error: {error}"
        reply = tool_reply_text(result, closed, self.enable_thinking)
        tokens = self.tokenizer.encode(reply, add_special_tokens=False)
        return StepResult(tokens, done=False, reward=0.0,
                          info={"tool_calls": 1, "tool_errors": int(result.startswith("error:"))})

"""Tests of trio_helpers.prompts (chapter 01): messages, rendered chat text, prompt tokens and stop tokens.

They use the offline tokenizer (byte-level, Qwen-style special tokens and chat template), so no download happens.
"""

from __future__ import annotations

import pytest
from pytrio import ModelInput

from trio_helpers.offline.tokenizer import END_THINK_ID, IM_END_ID, IM_START_ID, THINK_ID, get_offline_tokenizer
from trio_helpers.prompts import (
    DEEPMATH_INSTRUCTION,
    GSM8K_INSTRUCTION,
    ONE_SHOT_ANSWER,
    ONE_SHOT_QUESTION,
    build_prompt,
    deepmath_messages,
    gsm8k_messages,
    render_prompt,
    stop_token_ids,
)

QUESTION = "Ann has 3 apples and buys 4 more. How many apples does she have?"
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def tokenizer():
    return get_offline_tokenizer()


# --- messages ----------------------------------------------------------------------------------------


def test_gsm8k_messages_one_shot_layout() -> None:
    messages = gsm8k_messages(QUESTION)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[0]["content"] == f"{ONE_SHOT_QUESTION} {GSM8K_INSTRUCTION}"
    assert messages[1]["content"] == ONE_SHOT_ANSWER
    assert messages[2]["content"] == f"{QUESTION} {GSM8K_INSTRUCTION}"


def test_gsm8k_messages_without_one_shot_and_question_is_stripped() -> None:
    messages = gsm8k_messages(f"  {QUESTION}\n", one_shot=False)
    assert messages == [{"role": "user", "content": f"{QUESTION} {GSM8K_INSTRUCTION}"}]


def test_one_shot_example_demonstrates_the_boxed_format() -> None:
    # The example must end in the format the grader reads, and carry the empty think block of enable_thinking=False.
    assert ONE_SHOT_ANSWER.startswith(EMPTY_THINK)
    assert ONE_SHOT_ANSWER.rstrip().endswith("\\boxed{4}")
    assert ONE_SHOT_QUESTION.count("mississippi") == 1 and "mississippi".count("s") == 4
    assert "\\boxed{}" in GSM8K_INSTRUCTION


@pytest.mark.parametrize("bad", ["", "   \n", None, 42])
def test_gsm8k_messages_rejects_empty_or_non_string_questions(bad) -> None:
    with pytest.raises(ValueError, match="question must be a non-empty string"):
        gsm8k_messages(bad)


def test_deepmath_messages_single_user_turn() -> None:
    assert deepmath_messages(" x + 1 = 2? ") == [{"role": "user", "content": f"x + 1 = 2? {DEEPMATH_INSTRUCTION}"}]
    with pytest.raises(ValueError):
        deepmath_messages("")


# --- rendering and tokens ----------------------------------------------------------------------------


def test_render_prompt_thinking_off_ends_with_empty_think_block(tokenizer) -> None:
    text = render_prompt(tokenizer, gsm8k_messages(QUESTION, one_shot=False), enable_thinking=False)
    assert text == (
        f"<|im_start|>user\n{QUESTION} {GSM8K_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n{EMPTY_THINK}"
    )


def test_render_prompt_thinking_on_ends_at_assistant_header(tokenizer) -> None:
    text = render_prompt(tokenizer, gsm8k_messages(QUESTION, one_shot=False), enable_thinking=True)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "<think>" not in text


def test_render_prompt_default_is_thinking_off(tokenizer) -> None:
    messages = gsm8k_messages(QUESTION)
    assert render_prompt(tokenizer, messages) == render_prompt(tokenizer, messages, enable_thinking=False)


def test_build_prompt_encodes_the_rendered_text_once(tokenizer) -> None:
    messages = gsm8k_messages(QUESTION)
    prompt = build_prompt(tokenizer, messages)
    assert isinstance(prompt, ModelInput)
    ids = prompt.to_ints()
    text = render_prompt(tokenizer, messages)
    assert tokenizer.decode(ids) == text
    # Three turns plus the generation prompt: exactly four <|im_start|> markers, the first at position 0.
    assert ids[0] == IM_START_ID
    assert ids.count(IM_START_ID) == 4
    assert ids.count(IM_END_ID) == 3
    # The last tokens are the empty think block, as special tokens rather than their bytes.
    assert ids[-6:] == [THINK_ID, 10, 10, END_THINK_ID, 10, 10]
    assert max(ids) < len(tokenizer)


def test_build_prompt_one_token_per_byte_of_ordinary_text(tokenizer) -> None:
    messages = gsm8k_messages(QUESTION, one_shot=False)
    ids = build_prompt(tokenizer, messages).to_ints()
    text = render_prompt(tokenizer, messages)
    specials = {"<|im_start|>": 2, "<|im_end|>": 1, "<think>": 1, "</think>": 1}
    special_chars = sum(len(tok) * n for tok, n in specials.items())
    assert len(ids) == len(text.encode("utf-8")) - special_chars + sum(specials.values())


# --- stop tokens -------------------------------------------------------------------------------------


def test_stop_token_ids_offline_is_im_end_only(tokenizer) -> None:
    assert tokenizer.eos_token_id == IM_END_ID
    assert stop_token_ids(tokenizer) == [IM_END_ID]


class _FakeTokenizer:
    def __init__(self, eos_token_id, im_end_id) -> None:
        self.eos_token_id = eos_token_id
        self._im_end_id = im_end_id

    def convert_tokens_to_ids(self, token: str):
        assert token == "<|im_end|>"
        return self._im_end_id


@pytest.mark.parametrize(
    ("eos", "im_end", "expected"),
    [
        (151643, 151645, [151643, 151645]),  # base-model style: <|endoftext|> and <|im_end|> differ
        (151645, 151643, [151643, 151645]),  # sorted whatever the order
        (151645, 151645, [151645]),  # chat-model style: eos is <|im_end|>
        (None, 7, [7]),  # no eos token
        (5, None, [5]),  # no <|im_end|> in the vocabulary
        (-1, 9, [9]),  # negative ids are not tokens
    ],
)
def test_stop_token_ids_deduplicates_and_drops_missing(eos, im_end, expected) -> None:
    assert stop_token_ids(_FakeTokenizer(eos, im_end)) == expected

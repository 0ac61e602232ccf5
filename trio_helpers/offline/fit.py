"""Fitting the offline base models ("pretraining" in miniature), once, then caching them on disk.

The student (``Qwen/Qwen3.5-4B``) and the teacher (``Qwen/Qwen3.6-27B``) are :class:`~trio_helpers.offline.model.TinyLM`
base weights fitted by next-token cross-entropy on text built from the package's own corpus
(:mod:`trio_helpers.offline.corpus`): each problem's prompt exactly as the book renders it, followed by its worked
solution. Like real pretraining text, the solutions end in several final-answer styles (``#### N``,
``The answer is N.``, ``\\boxed{N}``), drawn independently for each of several copies of every problem:

============  ==========  ===========  =========  ================================================
model         ``#### N``  sentence     boxed      fitting
============  ==========  ===========  =========  ================================================
student       35%         25%          40%        d = 32, 8 epochs from scratch (lr 0.05, cosine)
teacher       0%          0%           100%       the student's weights + 2 epochs (lr 0.01, cosine)
tool          35%         25%          40%        the student's weights + 6 epochs (lr 0.05, cosine)
============  ==========  ===========  =========  ================================================

The tool model (``Qwen/Qwen3.5-9B``, chapter 12) is fitted on the same GSM8K solutions written as calculator
episodes (:func:`tool_pieces`: every ``<<expr=result>>`` note becomes a ``<tool_call>``, the tool's
``<tool_response>`` reply and a new assistant turn; the replies are inputs, not fitted), and not on the
distillation prompts.

Each problem appears 4 times; since the worked steps are the same in every copy, the first copy is fitted on the
whole solution and the others on their final-answer line only. So the student writes the format the grader demands
only some of the time (its groups are mixed); the teacher knows everything the student knows, was fitted further on
boxed answers only and is sharper (lower loss per token), which gives on-policy distillation a positive reverse KL
to shrink, concentrated on a habit the student can learn: how to write the final answer.
The models see the solutions of both splits while fitting, as pretrained LLMs have seen benchmark-like text; the
book says so where it reports accuracies.

Fitting is deterministic to the bit on any computer (fixed seeds, fixed data order, and the portable arithmetic of
:mod:`trio_helpers.offline.exact`: whatever the CPU, BLAS kernel or thread count, the same weights come out) and
uses sparse-row Adam on the embedding table. Weights
are cached under ``$TRIO_OFFLINE_CACHE`` (default ``~/.cache/trio_helpers/models``) in a file named by a hash of
everything that determines them (this file, the model code, the model spec and the corpus), so a change to any of
them refits instead of loading stale weights.

``python -m trio_helpers.offline.fit`` fits (or loads) the three models and prints how long each took.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trio_helpers.offline import exact
from trio_helpers.offline.model import NUM_FEATURES, BaseWeights, sequence_features, shifted_exp, table_rows, uniform
from trio_helpers.offline.tokenizer import IM_END_ID, VOCAB_SIZE, get_offline_tokenizer

FIT_VERSION = "fit-v2-exact"
STYLE_MIX = {
    "student": {"hash": 0.35, "sentence": 0.25, "boxed": 0.40},
    "teacher": {"hash": 0.0, "sentence": 0.0, "boxed": 1.0},
    "tool": {"hash": 0.35, "sentence": 0.25, "boxed": 0.40},  # the student's mix: GRPO has a format to learn
}
EPOCHS = {"student": 8, "teacher": 2, "tool": 6}
COPIES = 4  # copies of each problem (the later ones train the final line only)
BATCH_TOKENS = 8192
LEARNING_RATE = {"student": 0.05, "teacher": 0.01, "tool": 0.05}  # teacher and tool continue from the student
EMBED_LR_MULT = (2.0, 20.0)  # step multipliers for shared / per-question embedding rows (the latter are rare)


@dataclass(frozen=True)
class ModelSpec:
    """An offline model: its name, role (``"student"``, ``"teacher"`` or ``"tiny"``), feature sizes and the
    scales of its LoRA adapter (the low-rank update is scaled by ``lora_alpha / rank``; ``final_row_scale``
    scales the two final-line adapter rows)."""

    name: str
    role: str
    dim: int
    table_size: int
    lora_alpha: float
    final_row_scale: float


STUDENT = ModelSpec("Qwen/Qwen3.5-4B", "student", dim=32, table_size=1 << 17, lora_alpha=32.0 * 20,
                    final_row_scale=2400.0)
TEACHER = ModelSpec("Qwen/Qwen3.6-27B", "teacher", dim=32, table_size=1 << 17, lora_alpha=32.0 * 20,
                    final_row_scale=2400.0)
TOOL = ModelSpec("Qwen/Qwen3.5-9B", "tool", dim=32, table_size=1 << 17, lora_alpha=32.0 * 20,
                 final_row_scale=2400.0)
"""Chapter 12's tool-calling model: the student's weights fitted further on the same solutions written as
calculator episodes (:func:`tool_transcript`); a separate model, so the student and the teacher stay the bits
of ``BOOK_WEIGHTS``."""


def cache_dir() -> Path:
    """Where fitted base weights are cached: ``$TRIO_OFFLINE_CACHE`` or ``~/.cache/trio_helpers/models``."""
    return Path(os.environ.get("TRIO_OFFLINE_CACHE") or Path.home() / ".cache" / "trio_helpers" / "models")


def _corpus_records() -> tuple[list[dict], list[dict]]:
    """The shipped corpus, read directly (not through ``trio_helpers.data``, which follows the backend): both
    GSM8K-format splits in file order, and the DeepMath-style records shuffled with seed 42."""
    import random

    from trio_helpers.offline.corpus import DATA_DIR

    def read(name: str) -> list[dict]:
        with open(DATA_DIR / f"{name}.jsonl", encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]

    gsm = [{"question": str(r["question"]), "answer": str(r["answer"])}
           for split in ("train", "test") for r in read(f"gsm8k_{split}")]
    deep = read("deepmath")
    random.Random(42).shuffle(deep)
    return gsm, deep


def _fingerprint(spec) -> str:
    from trio_helpers import prompts
    from trio_helpers.offline import corpus, model, tokenizer

    h = hashlib.sha256()
    h.update(FIT_VERSION.encode())
    h.update(json.dumps([spec.name, spec.role, spec.dim, spec.table_size, STYLE_MIX[spec.role], EPOCHS[spec.role],
                         COPIES, BATCH_TOKENS, LEARNING_RATE, EMBED_LR_MULT]).encode())
    # the feature, arithmetic, corpus, fitting, tokenizer and prompt code all shape the fitted weights
    for source in (model.__file__, exact.__file__, corpus.__file__, __file__, tokenizer.__file__, prompts.__file__):
        h.update(Path(source).read_bytes())
    if spec.role == "tool":  # the tool-call and reply format (trio_helpers.calculator) shapes its corpus
        h.update(tool_transcript({"question": "", "answer": "a <<1+2=3>>3 b\n#### 3"}, "boxed").encode())
    data_dir = Path(corpus.__file__).parent / "data"
    for f in sorted(data_dir.glob("*.jsonl")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def fitting_examples(role: str, seed: int = 0) -> list[tuple]:
    """The fitting sequences of a model: ``(tokens, answer_start, loss_start)``; the loss covers
    ``tokens[loss_start:]``. The tool model's have a fourth item, one bool per token of ``tokens[loss_start:]``:
    False on the environment's replies, which are not fitted.

    Each GSM8K-style problem appears ``COPIES`` times, each copy ending in an independently drawn final-answer
    style. The worked steps are identical in every copy, so only the first copy is fitted on the whole solution;
    the other copies contribute their final-answer line (the part that differs). Each distillation prompt with a
    worked solution appears once.
    """
    from trio_helpers.offline.corpus import render_solution
    from trio_helpers.prompts import deepmath_messages, gsm8k_messages, render_prompt

    tok = get_offline_tokenizer()
    gsm, deep = _corpus_records()
    styles = list(STYLE_MIX[role])
    probs = np.array([STYLE_MIX[role][s] for s in styles])
    rng = np.random.default_rng([seed, 1 if role == "student" else 2])
    out: list[tuple[list[int], int, int]] = []
    for rec in gsm:
        prompt = tok.encode(render_prompt(tok, gsm8k_messages(rec["question"])), add_special_tokens=False)
        for copy in range(COPIES):
            style = styles[int(rng.choice(len(styles), p=probs))]
            fitted = None
            if role == "tool":  # the environment's replies are inputs, not fitted (a 4th item: the mask)
                pieces = [(tok.encode(t, add_special_tokens=False), f) for t, f in tool_pieces(rec, style)]
                answer = [i for ids, _ in pieces for i in ids] + [IM_END_ID]
                fitted = [f for ids, f in pieces for _ in ids] + [True]
            else:
                answer = tok.encode(render_solution(rec, style), add_special_tokens=False) + [IM_END_ID]
            tokens = prompt + answer
            last_line = len(tokens) - 2
            while tokens[last_line] != 10:  # back to the newline before the final-answer line
                last_line -= 1
            start = len(prompt) if copy == 0 else last_line + 1
            if fitted is None:
                out.append((tokens, len(prompt), start))
            else:
                out.append((tokens, len(prompt), start, fitted[start - len(prompt):]))
    for rec in deep if role != "tool" else ():  # the tool model continues the student, who saw them
        if not rec.get("r1_solution_1"):
            continue
        prompt = tok.encode(render_prompt(tok, deepmath_messages(rec["question"])), add_special_tokens=False)
        answer = tok.encode(rec["r1_solution_1"], add_special_tokens=False) + [IM_END_ID]
        out.append((prompt + answer, len(prompt), len(prompt)))
    return out


_NOTE = re.compile(r"<<([^=<>]*)=([^<>]*)>>")


def tool_transcript(record: dict, style: str) -> str:
    """:func:`tool_pieces` joined: the text of one calculator episode after the prompt.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    return "".join(text for text, _ in tool_pieces(record, style))


def tool_pieces(record: dict, style: str) -> list[tuple[str, bool]]:
    """A GSM8K solution as a calculator episode, the tool model's fitting text (chapter 12).

    Each ``<<expr=result>>`` note becomes what an episode with :class:`trio_helpers.calculator.CalculatorEnv`
    holds there: the text so far, a newline and the tool call (:func:`trio_helpers.calculator.tool_call_text`,
    Qwen3's ``<tool_call>`` JSON), then the environment's reply (:func:`trio_helpers.calculator.tool_reply_text`:
    the turn ends, the result comes back in a ``<tool_response>`` block, a new assistant turn starts), after which
    the solution goes on (it repeats the result: ``<<48/2=24>>24`` reads ``... = <call> <reply> 24``). The final
    line is drawn as for the student (:func:`trio_helpers.offline.corpus.render_solution`).

    Returns:
        ``(text, fitted)`` pieces in order: the model's text (fitted) and the environment's replies (not fitted,
        like the masked tool outputs of supervised fine-tuning on tool traces: a rollout never samples them).

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    from trio_helpers.calculator import tool_call_text, tool_reply_text
    from trio_helpers.offline.corpus import render_solution

    text = render_solution(record, style)
    out, last = [], 0
    for note in _NOTE.finditer(text):
        before = text[last : note.start()]
        out += [(before + ("\n" if before else "") + tool_call_text(note.group(1)), True),
                (tool_reply_text(note.group(2)), False)]
        last = note.end()
    return out + [(text[last:], True)]


_ROWS_MEMO: dict[tuple[int, ...], np.ndarray] = {}


def _token_matrix(examples) -> tuple[np.ndarray, np.ndarray]:
    """Feature keys and targets of every loss token. Identical sequences (the same problem in the same style, for
    either model) are featurised once per process."""
    keys, targets = [], []
    for tokens, answer_start, loss_start, *mask in examples:
        key = tuple(tokens)
        k = _ROWS_MEMO.get(key)
        if k is None:
            k = sequence_features(tokens)[0][answer_start - 1 : len(tokens) - 1]
            _ROWS_MEMO[key] = k
        k, y = k[loss_start - answer_start :], np.asarray(tokens[loss_start:], dtype=np.int64)
        if mask:  # the tool model's examples: only the fitted positions
            fitted = np.asarray(mask[0], dtype=bool)
            k, y = k[fitted], y[fitted]
        keys.append(k)
        targets.append(y)
    return np.concatenate(keys), np.concatenate(targets)


def fit_base(spec, seed: int = 0, verbose: bool = True, init: BaseWeights | None = None) -> BaseWeights:
    """Fit ``spec``'s base weights by cross-entropy with sparse-row Adam (deterministic, the same bits on any
    computer: see :mod:`trio_helpers.offline.exact`).

    The embedding table stays on the fixed-point grid (each updated row is rounded back to it), so the hidden
    vector of a token is an exact sum; the products go through ``exact.matmul``; ``exp`` and ``log`` are the
    module's own; the cosine schedule and Adam's bias corrections use ``exact.cos`` and ``exact.ipow``.
    """
    t0 = time.perf_counter()
    keys, targets = _token_matrix(fitting_examples(spec.role, seed))
    rows = table_rows(keys, spec.table_size)  # (the final-line slot column is not an embedding feature)
    n, d = len(targets), spec.dim
    rng = np.random.default_rng([seed, spec.dim])
    if init is None:
        E = exact.on_grid(uniform(rng, (spec.table_size, d), 0.01))
        W = uniform(rng, (d, VOCAB_SIZE), 1.0 / math.sqrt(d))
        b = np.zeros(VOCAB_SIZE)
    else:  # continue fitting from another model's weights (the teacher starts from the student)
        E, W, b = init.E.copy(), init.W.copy(), init.b.copy()
    row_mult = np.where(np.arange(spec.table_size) >= spec.table_size // 2, EMBED_LR_MULT[1], EMBED_LR_MULT[0])
    row_mult = row_mult[:, None]
    dense = {"W": W, "b": b}
    m = {k: np.zeros_like(v) for k, v in dense.items()}
    v = {k: np.zeros_like(v) for k, v in dense.items()}
    mE, vE = np.zeros_like(E), np.zeros_like(E)
    beta1, beta2, eps = 0.9, 0.99, 1e-8
    step = 0
    epochs = EPOCHS[spec.role]
    total_steps = epochs * ((n + BATCH_TOKENS - 1) // BATCH_TOKENS)
    lanes = np.arange(d)
    for epoch in range(epochs):
        order = rng.permutation(n)
        loss_sum = 0.0
        for s in range(0, n, BATCH_TOKENS):
            idx = order[s : s + BATCH_TOKENS]
            r, y = rows[idx], targets[idx]
            h = E[r].sum(axis=1)  # exact: the rows are on the grid
            z = exact.matmul(h, W)
            z += b
            shifted, G = shifted_exp(z)  # log_softmax(z) = shifted - log(sum of G), row by row
            total = G.sum(axis=1, keepdims=True)
            picked = np.arange(len(y))
            loss_sum += float((exact.log(total[:, 0]) - shifted[picked, y]).sum())
            G /= total  # softmax(z)
            G[picked, y] -= 1.0
            G /= len(y)
            grads = {"W": exact.matmul(h.T, G), "b": G.sum(axis=0)}
            dh = exact.matmul(G, W.T)
            # scatter-add dh into the touched embedding rows (bincount over row*d + lane is the fast way)
            uniq, inv = np.unique(r.ravel(), return_inverse=True)
            flat = (inv[:, None] * d + lanes).ravel()
            gE = np.bincount(flat, weights=np.repeat(dh, NUM_FEATURES, axis=0).ravel(),
                             minlength=len(uniq) * d).reshape(len(uniq), d)
            step += 1
            lr = LEARNING_RATE[spec.role] * 0.5 * (1 + exact.cos(math.pi * step / total_steps))  # cosine decay
            c1, c2 = 1 - exact.ipow(beta1, step), 1 - exact.ipow(beta2, step)
            for name, p in dense.items():
                g = grads[name]
                m[name] = beta1 * m[name] + (1 - beta1) * g
                v[name] = beta2 * v[name] + (1 - beta2) * g * g
                p -= lr * (m[name] / c1) / (np.sqrt(v[name] / c2) + eps)
            mu = beta1 * mE[uniq] + (1 - beta1) * gE
            vu = beta2 * vE[uniq] + (1 - beta2) * gE * gE
            mE[uniq], vE[uniq] = mu, vu
            E[uniq] = exact.on_grid(E[uniq] - (lr * row_mult[uniq]) * (mu / c1) / (np.sqrt(vu / c2) + eps))
        if verbose:
            print(f"  epoch {epoch + 1}/{epochs}: loss/token {loss_sum / n:.3f} ({time.perf_counter() - t0:.1f}s)",
                  file=sys.stderr)
    return BaseWeights(E=E, W=W, b=b, name=spec.name)


def load_or_fit(spec, home: Path | None = None) -> BaseWeights:
    """Load ``spec``'s fitted weights from the cache, fitting and caching them first if needed.

    The teacher continues from the student's fitted weights (so it knows everything the student knows, then is
    fitted further on mostly-boxed answers); its cache key therefore includes the student's.
    """
    path = cache_path(spec)
    if not path.exists():
        _fit_and_cache(spec, load_or_fit(STUDENT) if spec.role in ("teacher", "tool") else None, path)
    with np.load(path) as z:
        return BaseWeights(E=z["E"], W=z["W"], b=z["b"], name=spec.name)


def cache_path(spec) -> Path:
    """Where ``spec``'s fitted weights are cached: a file named by the fingerprint of what determines them."""
    fingerprint = _fingerprint(spec)
    if spec.role in ("teacher", "tool"):
        fingerprint = hashlib.sha256((fingerprint + _fingerprint(STUDENT)).encode()).hexdigest()[:16]
    return cache_dir() / f"{spec.role}-{fingerprint}.npz"




def weights_digest(weights: BaseWeights) -> str:
    h = hashlib.sha256()
    for a in (weights.E, weights.W, weights.b):
        h.update(np.ascontiguousarray(a, dtype=np.float64).tobytes())
    return h.hexdigest()


def _fit_and_cache(spec, init, path: Path) -> None:
    print(f"trio_helpers offline backend: fitting base model {spec.name!r} on the offline corpus "
          "(first use only; cached afterwards)...", file=sys.stderr)
    weights = fit_base(spec, init=init)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp.npz")
    np.savez(tmp, E=weights.E, W=weights.W, b=weights.b)
    os.replace(tmp, path)


def ensure_fitted() -> None:
    """Fit (or load) every fitted model, so that later first uses only read the cache."""
    for spec in (STUDENT, TEACHER, TOOL):
        load_or_fit(spec)


if __name__ == "__main__":
    for spec in (STUDENT, TEACHER, TOOL):
        t = time.perf_counter()
        load_or_fit(spec)
        print(f"{spec.name}: ready in {time.perf_counter() - t:.1f}s")

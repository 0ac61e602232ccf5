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
============  ==========  ===========  =========  ================================================

Each problem appears 4 times; since the worked steps are the same in every copy, the first copy is fitted on the
whole solution and the others on their final-answer line only. So the student writes the format the grader demands
only some of the time (its groups are mixed); the teacher knows everything the student knows, was fitted further on
boxed answers only and is sharper (lower loss per token), which gives on-policy distillation a positive reverse KL
to shrink, concentrated on a habit the student can learn: how to write the final answer.
The models see the solutions of both splits while fitting, as pretrained LLMs have seen benchmark-like text; the
book says so where it reports accuracies.

Fitting is deterministic (fixed seeds, fixed data order, and always ``FIT_THREADS`` BLAS threads: it runs in a
subprocess that sets them, because the last bits of a threaded matrix product depend on the thread count) and
uses sparse-row Adam on the embedding table. Weights
are cached under ``$TRIO_OFFLINE_CACHE`` (default ``~/.cache/trio_helpers/models``) in a file named by a hash of
everything that determines them (this file, the model code, the model spec and the corpus), so a change to any of
them refits instead of loading stale weights.

``python -m trio_helpers.offline.fit`` fits (or loads) both models and prints how long each took.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trio_helpers.offline.model import NUM_FEATURES, BaseWeights, log_softmax, sequence_features, table_rows
from trio_helpers.offline.tokenizer import IM_END_ID, VOCAB_SIZE, get_offline_tokenizer

FIT_VERSION = "fit-v1"
STYLE_MIX = {
    "student": {"hash": 0.35, "sentence": 0.25, "boxed": 0.40},
    "teacher": {"hash": 0.0, "sentence": 0.0, "boxed": 1.0},
}
EPOCHS = {"student": 8, "teacher": 2}
COPIES = 4  # copies of each problem (the later ones train the final line only)
BATCH_TOKENS = 8192
LEARNING_RATE = {"student": 0.05, "teacher": 0.01}  # the teacher only continues from the student
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
    # the feature, corpus, fitting, tokenizer and prompt code all shape the fitted weights
    for source in (model.__file__, corpus.__file__, __file__, tokenizer.__file__, prompts.__file__):
        h.update(Path(source).read_bytes())
    data_dir = Path(corpus.__file__).parent / "data"
    for f in sorted(data_dir.glob("*.jsonl")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def fitting_examples(role: str, seed: int = 0) -> list[tuple[list[int], int, int]]:
    """The fitting sequences of a model: ``(tokens, answer_start, loss_start)``; the loss covers
    ``tokens[loss_start:]``.

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
            answer = tok.encode(render_solution(rec, style), add_special_tokens=False) + [IM_END_ID]
            tokens = prompt + answer
            last_line = len(tokens) - 2
            while tokens[last_line] != 10:  # back to the newline before the final-answer line
                last_line -= 1
            out.append((tokens, len(prompt), len(prompt) if copy == 0 else last_line + 1))
    for rec in deep:
        if not rec.get("r1_solution_1"):
            continue
        prompt = tok.encode(render_prompt(tok, deepmath_messages(rec["question"])), add_special_tokens=False)
        answer = tok.encode(rec["r1_solution_1"], add_special_tokens=False) + [IM_END_ID]
        out.append((prompt + answer, len(prompt), len(prompt)))
    return out


_ROWS_MEMO: dict[tuple[int, ...], np.ndarray] = {}


def _token_matrix(examples) -> tuple[np.ndarray, np.ndarray]:
    """Feature keys and targets of every loss token. Identical sequences (the same problem in the same style, for
    either model) are featurised once per process."""
    keys, targets = [], []
    for tokens, answer_start, loss_start in examples:
        key = tuple(tokens)
        k = _ROWS_MEMO.get(key)
        if k is None:
            k = sequence_features(tokens)[0][answer_start - 1 : len(tokens) - 1]
            _ROWS_MEMO[key] = k
        keys.append(k[loss_start - answer_start :])
        targets.append(np.asarray(tokens[loss_start:], dtype=np.int64))
    return np.concatenate(keys), np.concatenate(targets)


def fit_base(spec, seed: int = 0, verbose: bool = True, init: BaseWeights | None = None) -> BaseWeights:
    """Fit ``spec``'s base weights by cross-entropy with sparse-row Adam (deterministic).

    Computed in float32 for speed (the fitted weights are then used in float64, an exact conversion).
    """
    t0 = time.perf_counter()
    keys, targets = _token_matrix(fitting_examples(spec.role, seed))
    rows = table_rows(keys, spec.table_size)  # (the final-line slot column is not an embedding feature)
    n, d, f32 = len(targets), spec.dim, np.float32
    rng = np.random.default_rng([seed, spec.dim])
    if init is None:
        E = rng.normal(0.0, 0.01, size=(spec.table_size, d)).astype(f32)
        W = rng.normal(0.0, 1.0 / np.sqrt(d), size=(d, VOCAB_SIZE)).astype(f32)
        b = np.zeros(VOCAB_SIZE, dtype=f32)
    else:  # continue fitting from another model's weights (the teacher starts from the student)
        E, W, b = init.E.astype(f32), init.W.astype(f32), init.b.astype(f32)
    row_mult = np.where(np.arange(spec.table_size) >= spec.table_size // 2, EMBED_LR_MULT[1], EMBED_LR_MULT[0])
    row_mult = row_mult.astype(f32)[:, None]
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
            h = E[r].sum(axis=1)
            logp = log_softmax(h @ W + b)
            picked = np.arange(len(y))
            loss_sum += float(-logp[picked, y].sum())
            G = np.exp(logp)
            G[picked, y] -= 1.0
            G /= len(y)
            grads = {"W": h.T @ G, "b": G.sum(axis=0)}
            dh = G @ W.T
            # scatter-add dh into the touched embedding rows (bincount over row*d + lane is the fast way)
            uniq, inv = np.unique(r.ravel(), return_inverse=True)
            flat = (inv[:, None] * d + lanes).ravel()
            gE = np.bincount(flat, weights=np.repeat(dh, NUM_FEATURES, axis=0).ravel(),
                             minlength=len(uniq) * d).reshape(len(uniq), d).astype(f32)
            step += 1
            lr = LEARNING_RATE[spec.role] * 0.5 * (1 + np.cos(np.pi * step / total_steps))  # cosine decay
            c1, c2 = 1 - beta1**step, 1 - beta2**step
            for name, p in dense.items():
                g = grads[name]
                m[name] = beta1 * m[name] + (1 - beta1) * g
                v[name] = beta2 * v[name] + (1 - beta2) * g * g
                p -= lr * (m[name] / c1) / (np.sqrt(v[name] / c2) + eps)
            mu = beta1 * mE[uniq] + (1 - beta1) * gE
            vu = beta2 * vE[uniq] + (1 - beta2) * gE * gE
            mE[uniq], vE[uniq] = mu, vu
            E[uniq] -= (lr * row_mult[uniq]) * (mu / c1) / (np.sqrt(vu / c2) + eps)
        if verbose:
            print(f"  epoch {epoch + 1}/{epochs}: loss/token {loss_sum / n:.3f} ({time.perf_counter() - t0:.1f}s)",
                  file=sys.stderr)
    return BaseWeights(E=E.astype(np.float64), W=W.astype(np.float64), b=b.astype(np.float64), name=spec.name)


def load_or_fit(spec, home: Path | None = None) -> BaseWeights:
    """Load ``spec``'s fitted weights from the cache, fitting and caching them first if needed.

    The teacher continues from the student's fitted weights (so it knows everything the student knows, then is
    fitted further on mostly-boxed answers); its cache key therefore includes the student's.
    """
    path = cache_path(spec)
    if not path.exists():
        if spec in (STUDENT, TEACHER) and os.environ.get(_WORKER_ENV) != str(FIT_THREADS):
            _fit_in_subprocess(check=True)  # where BLAS has FIT_THREADS threads, whatever this process has
        else:
            _fit_and_cache(spec, load_or_fit(STUDENT) if spec.role == "teacher" else None, path)
    with np.load(path) as z:
        return BaseWeights(E=z["E"], W=z["W"], b=z["b"], name=spec.name)


def cache_path(spec) -> Path:
    """Where ``spec``'s fitted weights are cached: a file named by the fingerprint of what determines them."""
    fingerprint = _fingerprint(spec)
    if spec.role == "teacher":
        fingerprint = hashlib.sha256((fingerprint + _fingerprint(STUDENT)).encode()).hexdigest()[:16]
    return cache_dir() / f"{spec.role}-{fingerprint}.npz"


def _fit_in_subprocess(check: bool) -> int:
    """Run this module's ``__main__`` (fit or load both book models) with BLAS on ``FIT_THREADS`` threads."""
    return subprocess.run([sys.executable, "-m", "trio_helpers.offline.fit"], check=check,
                          env={**os.environ, **_fit_env()}).returncode


# The last bits of fitted weights depend on how many threads BLAS splits the fitting's matrix products over;
# the book's outputs were produced with weights fitted on this many (a notebook kernel computes on one thread,
# see conftest.py). OpenBLAS uses at most one thread per core, so a 1-core machine fits other weights.
FIT_THREADS = 2
_WORKER_ENV = "TRIO_OFFLINE_FIT_THREADS"
# sha256 of the fitted E, W and b (float64 bytes) behind the book's committed outputs; tests/test_offline_fit.py
# compares. Change them only together with re-executing every chapter (make notebooks).
BOOK_WEIGHTS = {
    "student": "e0fa3dcca4bdaeccb541dd93f419f997e100590b59fd038515f7bcabc447c813",
    "teacher": "2916b542a9ea94877f12bbf25702fe86105765f0e0a6c861da75ceef3f45e901",
}


def _fit_env() -> dict[str, str]:
    n = str(FIT_THREADS)
    return {_WORKER_ENV: n, "OPENBLAS_NUM_THREADS": n, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def weights_digest(weights: BaseWeights) -> str:
    h = hashlib.sha256()
    for a in (weights.E, weights.W, weights.b):
        h.update(np.ascontiguousarray(a, dtype=np.float64).tobytes())
    return h.hexdigest()


def _check_digest(spec, weights: BaseWeights) -> None:
    expected = BOOK_WEIGHTS.get(spec.role)
    if expected and spec in (STUDENT, TEACHER) and weights_digest(weights) != expected:
        print(f"trio_helpers offline backend: the fitted {spec.role} model differs in its last bits from the "
              "one the book's outputs were made with (another BLAS kernel, or fewer than "
              f"{FIT_THREADS} cores); runs work, but printed numbers may differ from the book's.",
              file=sys.stderr)


def _fit_and_cache(spec, init, path: Path) -> None:
    print(f"trio_helpers offline backend: fitting base model {spec.name!r} on the offline corpus "
          "(first use only; cached afterwards)...", file=sys.stderr)
    weights = fit_base(spec, init=init)
    _check_digest(spec, weights)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp.npz")
    np.savez(tmp, E=weights.E, W=weights.W, b=weights.b)
    os.replace(tmp, path)


def ensure_fitted() -> None:
    """Fit (or load) every fitted model, so that later first uses only read the cache."""
    for spec in (STUDENT, TEACHER):
        load_or_fit(spec)


if __name__ == "__main__":
    if os.environ.get(_WORKER_ENV) != str(FIT_THREADS):  # numpy is imported: re-run with the threads set
        sys.exit(_fit_in_subprocess(check=False))
    for spec in (STUDENT, TEACHER):
        t = time.perf_counter()
        load_or_fit(spec)
        print(f"{spec.name}: ready in {time.perf_counter() - t:.1f}s")

"""A tiny autoregressive language model in numpy: the compute behind the offline backend.

The model is a *hashed-feature log-bilinear* model over the byte-level vocabulary of
:mod:`trio_helpers.offline.tokenizer`. To predict the token after a context it

1. reads a handful of **context features** (the last 1, 2, 3, 4 and 6 tokens, the position in the line, the line
   number, the word being written, the chat role, a hash of the user's question, a "copy the last calculator
   result" feature (the result of a ``<<expr=result>>`` note, or the number of a tool's ``<tool_response>`` reply,
   chapter 12) and a "the final-answer line is due" flag — see :class:`Context`), each hashed to a row of an
   embedding table ``E``;
2. sums those rows into a hidden vector ``h`` (dimension ``d``);
3. maps ``h`` to logits with a frozen output matrix plus a trainable **low-rank adapter**:
   ``z = h @ W + b + (alpha / rank) * (h @ A) @ B``.

``A`` and ``B`` are the LoRA adapter (rank = the ``rank`` a training client is created with). ``B`` starts at zero,
so a fresh training client samples exactly like its base model. Training (``forward_backward`` + ``optim_step``)
changes only ``A`` and ``B``; base weights are fitted once (see :mod:`trio_helpers.offline.fit`) and frozen.

Every gradient here is exact (a finite-difference test checks each loss), and every number is the same bits on any
computer: matrix products, ``exp`` and ``log`` come from :mod:`trio_helpers.offline.exact`, the embedding table lives
on a fixed-point grid (so a hidden vector's sum is exact) and random initial weights are uniform draws (numpy's normal
sampler calls the C library's ``exp`` in its rejection step).
Nothing in this module sees rewards, answers or the caller's intent: a loss only receives per-token advantages,
weights and old logprobs, like the real trainer.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from trio_helpers.offline import exact
from trio_helpers.offline.tokenizer import IM_END_ID, IM_START_ID, NUM_BYTES, VOCAB_SIZE

NL = 10
_DIGITS = frozenset(range(48, 58))
_ROLES = {b"system": 1, b"user": 2, b"assistant": 3}
NUM_FEATURES = 13
KEY_WIDTH = NUM_FEATURES + 1  # the hashed features plus the final-line slot
# Features 9 and 12 are keyed by the question (they let a model memorise solutions it saw while fitting); they live
# in the upper half of the embedding table, the shared features in the lower half, so fitting can give the rarely
# seen per-question rows larger steps.
PER_QUESTION_SLOTS = (9, 12)
_END = 1000  # "the copied number is complete"
_NONE = 1001  # "nothing to copy"
TOOL_REPLY_OPEN = b"<tool_response>\n"  # how a tool's reply message starts (chapter 12's calculator)


def _is_digit(tok: int) -> bool:
    return 48 <= tok <= 57


class Context:
    """Incremental feature extractor: push tokens one at a time, read the features for the next prediction.

    The same object serves sampling (one token at a time) and training (a whole sequence), so the logprobs the
    sampler returns and the logprobs the trainer computes come from identical features.
    """

    __slots__ = (
        "last", "role", "role_buf", "reading_role", "line_pos", "line_no", "word", "msg_buf",
        "prompt_key", "n_numbers", "n_results", "in_calc", "calc_buf", "last_result", "run",
    )

    def __init__(self) -> None:
        self.last: tuple[int, ...] = (0, 0, 0, 0, 0, 0)  # the last six tokens, oldest first
        self.role = 0
        self.role_buf = b""
        self.reading_role = False
        self.line_pos = 0
        self.line_no = 0
        self.word = 0
        self.msg_buf = bytearray()  # the current user message (to key per-question features)
        self.prompt_key = 0
        self.n_numbers = 0
        self.n_results = 0
        self.in_calc = False
        self.calc_buf = bytearray()
        self.last_result = b""
        self.run = b""  # the number being written (digits and '.')

    def copy(self) -> "Context":
        c = Context.__new__(Context)
        for name in Context.__slots__:
            value = getattr(self, name)
            setattr(c, name, bytearray(value) if isinstance(value, bytearray) else value)
        return c

    def push(self, tok: int) -> None:
        """Consume one token."""
        self.last = self.last[1:] + (tok,)
        if tok == IM_START_ID:
            self.reading_role, self.role_buf = True, b""
            self.role = 0
            self.line_pos = self.line_no = self.word = 0
            return
        if tok == IM_END_ID:
            if self.role == 2 and self.msg_buf.startswith(TOOL_REPLY_OPEN):
                # a tool's reply (Qwen3 renders a ``tool`` message as a user turn in <tool_response> tags; no
                # text of the book's other corpora starts so): the question stays; a number in it is the last
                # calculator result, as a <<expr=result>> note's would be
                result = bytes(self.msg_buf[len(TOOL_REPLY_OPEN):]).split(b"\n", 1)[0]
                if result and all(_is_digit(b) or b in (45, 46) for b in result):
                    self.last_result = result
                    self.n_results += 1
                # the question's key moves on with each reply, so that the per-question features tell the
                # episode's turns apart (each starts at line 0 again)
                self.prompt_key = (self.prompt_key * 1099511628211 + 0x7E1) & 0xFFFFFFFFFFFFFFFF
            elif self.role == 2:  # a user message just ended: it is the question the answer will be about
                text = bytes(self.msg_buf)
                self.prompt_key = _stable_hash(text)
                self.n_numbers = _count_numbers(text)
                self.n_results = 0
                self.last_result = b""
            self.role = 0
            return
        if tok >= NUM_BYTES:  # <think>, </think>, <|endoftext|>
            self.word = hash((self.word, tok))
            return
        if self.reading_role:
            if tok == NL:
                self.reading_role = False
                self.role = _ROLES.get(self.role_buf, 4)
                if self.role == 2:
                    self.msg_buf = bytearray()
            else:
                self.role_buf += bytes((tok,))
            return
        if self.role == 2:
            self.msg_buf.append(tok)
        # calculator annotations <<expr=result>>: remember the result
        if self.role == 3:
            if tok == 60 and self.last[-2] == 60:  # "<<"
                self.in_calc, self.calc_buf = True, bytearray()
            elif self.in_calc:
                if tok == 62:  # ">"
                    self.in_calc = False
                    expr = bytes(self.calc_buf)
                    if b"=" in expr:
                        self.last_result = expr.rsplit(b"=", 1)[1]
                        self.n_results += 1
                else:
                    self.calc_buf.append(tok)
        if _is_digit(tok) or (tok == 46 and self.run):
            self.run += bytes((tok,))
        else:
            self.run = b""
        if tok == NL:
            self.line_pos = 0
            self.line_no += 1
            self.word = 0
        else:
            self.line_pos += 1
            self.word = 0 if tok == 32 else hash((self.word, tok))

    def features(self) -> list[int]:
        """The hashed feature keys (before reduction modulo the table size) for the next prediction."""
        l6 = self.last
        x1, x2, x3 = l6[5], l6[4], l6[3]
        role = self.role
        pos = self.line_pos if self.line_pos < 31 else 31
        line = self.line_no if self.line_no < 15 else 15
        in_answer = role == 3
        # the copy feature: which character of the last calculator result comes next?
        run, res = self.run, self.last_result
        if res and res.startswith(run):
            nxt = res[len(run)] if len(run) < len(res) else _END
        else:
            nxt = _NONE
        final = int(in_answer and self.n_numbers > 0 and self.n_results >= self.n_numbers - 1)
        pk = self.prompt_key if in_answer else 0
        return [
            0,
            hash((1, role, x1)),
            hash((2, role, x2, x1)),
            hash((3, role, x3, x2, x1)),
            hash((4, l6[2], x3, x2, x1)),
            hash((5, l6[0], l6[1], l6[2], x3, x2, x1)),
            hash((6, role, pos, x1 if pos < 2 else _is_digit(x1))),
            hash((7, role, line, min(pos, 7))),
            hash((8, role, self.word)),
            hash((9, pk, line, x3, x2, x1)),
            hash((10, nxt, x2, x1)),
            hash((11, final, x2, x1, min(pos, 15))),
            hash((12, pk, final, x3, x2, x1)),
            # not a hashed feature: 1 where the final-answer line starts (its adapter row applies), else 0
            1 if final and self.line_pos == 0 else 0,
        ]


def _stable_hash(data: bytes) -> int:
    """A process-independent hash of bytes (Python's str/bytes hash is salted per process)."""
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def _count_numbers(text: bytes) -> int:
    """How many numeric literals (digit runs, with inner ',' or '.') the text contains."""
    count, inside = 0, False
    for i, b in enumerate(text):
        if 48 <= b <= 57:
            if not inside:
                count += 1
                inside = True
        elif b in (44, 46) and inside and i + 1 < len(text) and 48 <= text[i + 1] <= 57:
            continue
        else:
            inside = False
    return count


def uniform(rng: np.random.Generator, size, std: float) -> np.ndarray:
    """Uniform draws on ``[-std * sqrt(3), std * sqrt(3)]`` (standard deviation ``std``): random initial weights
    that are the same bits everywhere (``rng.random`` is integer arithmetic and one exact scaling)."""
    return (rng.random(size) * 2.0 - 1.0) * (std * math.sqrt(3.0))


@dataclass
class BaseWeights:
    """The frozen part of a model: embedding table ``E`` (H x d), output matrix ``W`` (d x V), bias ``b`` (V).

    ``E`` is kept on the fixed-point grid of :func:`trio_helpers.offline.exact.on_grid`, so the sum of a context's
    rows is exact in any order."""

    E: np.ndarray
    W: np.ndarray
    b: np.ndarray
    name: str = "random"

    def __post_init__(self) -> None:
        self.E = exact.on_grid(self.E)
        self.W_rounded = exact.Rounded(self.W)  # W is frozen: round it for matmul once

    @property
    def dim(self) -> int:
        return int(self.E.shape[1])

    @property
    def table_size(self) -> int:
        return int(self.E.shape[0])

    @staticmethod
    def random(dim: int, table_size: int, seed: int, name: str = "random") -> "BaseWeights":
        rng = np.random.default_rng(seed)
        return BaseWeights(
            E=uniform(rng, (table_size, dim), 0.3),
            W=uniform(rng, (dim, VOCAB_SIZE), 1.0 / math.sqrt(dim)),
            b=np.zeros(VOCAB_SIZE),
            name=name,
        )


@dataclass
class Adapter:
    """The trainable part: a low-rank adapter on the output layer plus one output row for the final-answer line.

    ``delta_logits = scale * (h @ A) @ B + c_scale * C[slot]`` where ``scale = alpha / rank`` (LoRA's convention)
    and ``slot`` is 1 where the final-answer line starts, 0 elsewhere (``C[0]`` is fixed at zero, so ``C`` holds one
    trainable row). ``B`` and ``C`` start at zero, so a fresh adapter changes nothing.
    """

    A: np.ndarray
    B: np.ndarray
    C: np.ndarray
    scale: float
    c_scale: float

    @property
    def rank(self) -> int:
        return int(self.A.shape[1])

    @staticmethod
    def fresh(dim: int, rank: int, seed: int, alpha: float, final_row_scale: float) -> "Adapter":
        rng = np.random.default_rng(seed)
        return Adapter(
            A=uniform(rng, (dim, rank), 1.0 / math.sqrt(dim)),
            B=np.zeros((rank, VOCAB_SIZE)),
            C=np.zeros((2, VOCAB_SIZE)),
            scale=alpha / rank,
            c_scale=final_row_scale,
        )

    def copy(self) -> "Adapter":
        return Adapter(A=self.A.copy(), B=self.B.copy(), C=self.C.copy(), scale=self.scale, c_scale=self.c_scale)

    def params(self) -> dict[str, np.ndarray]:
        return {"A": self.A, "B": self.B, "C": self.C}


@dataclass
class FeatureCache:
    """A bounded, thread-safe LRU map from token sequences to what was computed for them."""

    max_items: int = 256
    items: OrderedDict = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, key: tuple[int, ...]):
        with self.lock:
            hit = self.items.get(key)
            if hit is not None:
                self.items.move_to_end(key)
            return hit

    def put(self, key: tuple[int, ...], value) -> None:
        with self.lock:
            self.items[key] = value
            if len(self.items) > self.max_items:
                self.items.popitem(last=False)


# The feature rows and the context after every chat prefix that ends with a message's header line: prompts share
# their leading messages (the one-shot example, a system prompt), and a sampling request's completions, a step's
# datums and later requests for the same prompt share the whole prompt, so each is computed once.
_CACHE = FeatureCache(max_items=512)


def _header_ends(tokens: list[int]) -> list[int]:
    """The positions just past each chat message's header line (``<|im_start|>role\n``), in order."""
    ends, i = [], 0
    while True:
        try:
            i = tokens.index(IM_START_ID, i)
            i = tokens.index(NL, i + 1) + 1
        except ValueError:
            return ends
        ends.append(i)


def sequence_features(tokens: list[int]) -> tuple[np.ndarray, Context]:
    """Feature keys for every prediction position of ``tokens``.

    Row ``i`` holds the features of the context ``tokens[: i + 1]`` (i.e. for predicting ``tokens[i + 1]``).
    Features depend on the tokens only, so the rows of a cached prefix (see ``_CACHE``) are the rows recomputing
    it gives.

    Returns:
        ``(keys, context)``: an int64 array ``[len(tokens), KEY_WIDTH]`` (hashed keys + final-line slot; read-only
        when it is a cached prefix's) and the context after the last token (ready to continue sampling).
    """
    tokens = list(tokens)
    ends = _header_ends(tokens)
    done, ctx, prefix = 0, None, None
    for end in reversed(ends):  # the longest cached prefix
        hit = _CACHE.get(tuple(tokens[:end]))
        if hit is not None:
            prefix, ctx, done = hit[0], hit[1].copy(), end
            break
    if ctx is None:
        ctx = Context()
    # the rows up to each later header end (cached there), then the rest
    for stop, cache in [(end, True) for end in ends if end > done] + [(len(tokens), False)]:
        rows = []
        for tok in tokens[done:stop]:
            ctx.push(tok)
            rows.append(ctx.features())
        if rows or prefix is None:
            new = np.array(rows, dtype=np.int64).reshape(len(rows), KEY_WIDTH)
            prefix = new if prefix is None else np.concatenate([prefix, new])
        if cache:
            prefix.flags.writeable = False
            _CACHE.put(tuple(tokens[:stop]), (prefix, ctx.copy()))
        done = stop
    return prefix, ctx


# The feature rows the sampler computed for each completion it returned, keyed by the token sequence they
# describe (prompt + completion[:-1]): training on that completion, or scoring it, needs exactly these rows,
# and features depend on the tokens only, so reading them here gives the same bits as recomputing them.
_SAMPLED = FeatureCache(max_items=512)


def sequence_rows(tokens: list[int]) -> np.ndarray:
    """The feature keys of :func:`sequence_features` (rows only): what the trainer and the logprob scorer
    need, for a sampled completion read from the sampler's own computation."""
    blocks = sequence_row_blocks(tokens)
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)


def sequence_row_blocks(tokens: list[int]) -> tuple[np.ndarray, ...]:
    """The rows of :func:`sequence_rows` in consecutive blocks: ``(the prompt's rows, the completion's)`` for a
    sampled completion, whose prompt block is the same array for every completion of one request (so a caller
    can compute it once: a row's numbers do not depend on the other rows of a forward pass); one block
    otherwise."""
    hit = _SAMPLED.get(tuple(tokens))
    return (sequence_features(tokens)[0],) if hit is None else hit


def table_rows(keys: np.ndarray, table_size: int) -> np.ndarray:
    """Map hashed feature keys ``[..., NUM_FEATURES]`` to embedding-table rows (per-question slots: upper half)."""
    half = table_size // 2
    return keys[..., :NUM_FEATURES] % half + _row_offsets(half)


@functools.lru_cache(maxsize=8)
def _row_offsets(half: int) -> np.ndarray:
    offsets = np.zeros(NUM_FEATURES, dtype=np.int64)
    offsets[list(PER_QUESTION_SLOTS)] = half
    offsets.flags.writeable = False
    return offsets


def shifted_exp(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(s, exp(s))`` with ``s = z - max z`` row by row: ``log_softmax(z) == s - log(sum exp(s))``."""
    s = z - np.maximum.reduce(z, axis=-1, keepdims=True)
    return s, exact.exp(s)


def log_softmax(z: np.ndarray) -> np.ndarray:
    s, e = shifted_exp(z)
    return s - exact.log(np.add.reduce(e, axis=-1, keepdims=True))


class TinyLM:
    """Base weights plus (optionally) an adapter; computes logits, logprobs and gradients."""

    def __init__(self, base: BaseWeights, adapter: Adapter | None = None, frozen: bool = False) -> None:
        """``frozen``: the adapter never changes (a sampler's snapshot), so its matrices are rounded for the
        products once (:class:`trio_helpers.offline.exact.Rounded`; the same bits, less work per decoding step)."""
        self.base = base
        self.adapter = adapter
        self._AB = (exact.Rounded(adapter.A), exact.Rounded(adapter.B)) if frozen and adapter is not None else None

    def rows(self, keys: np.ndarray) -> np.ndarray:
        return table_rows(keys, self.base.table_size)

    def hidden(self, keys: np.ndarray) -> np.ndarray:
        return self.base.E[self.rows(keys)].sum(axis=-2)

    def forward(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(h, logits)`` for every row of ``keys`` (``[N, KEY_WIDTH]``).

        Batch-invariant by construction: a row's logits are the same bits whichever rows share the call (the
        products of :func:`trio_helpers.offline.exact.matmul` depend on the row alone), so the trainer's logprobs
        equal the sampler's.
        """
        h = self.hidden(keys)
        hr = exact.Rounded(h, "left")  # rounded once for both products with h
        z = exact.matmul(hr, self.base.W_rounded)
        z += self.base.b
        if self.adapter is not None:
            a = self.adapter
            A, B = self._AB or (a.A, a.B)
            delta = exact.matmul(exact.matmul(hr, A), B)
            delta *= a.scale
            z += delta
            slots = keys[:, NUM_FEATURES]
            if slots.any():  # C[0] is zero: adding it would change no logit
                z += a.c_scale * a.C[slots]
        return h, z

    def logprobs_all(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(h, log_softmax(logits))`` for every row of ``keys``."""
        h, z = self.forward(keys)
        return h, log_softmax(z)

    def log_softmax_parts(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(h, s, n)`` with ``log_softmax(logits) == s - n`` elementwise, the same bits as
        :meth:`logprobs_all`, for callers that need only some of its entries."""
        h, z = self.forward(keys)
        s, e = shifted_exp(z)
        return h, s, exact.log(np.add.reduce(e, axis=-1, keepdims=True))

    def adapter_grads(self, h, slots, logp, targets, coef):
        """Gradients of ``L`` with respect to the adapter, given ``coef_i = dL/dlp_i`` for target logprobs ``lp_i``.

        ``dlp_i / dz_i = onehot(target_i) - softmax(z_i)``, so ``dL/dz_i = coef_i * (onehot - p_i)``; then the chain
        rule through ``z = ... + scale * (h A) B + c_scale * C[slot]``.
        """
        G = -exact.exp(logp) * coef[:, None]
        G[np.arange(len(targets)), targets] += coef
        a = self.adapter
        hA = exact.matmul(h, a.A)
        grad_C = np.zeros_like(a.C)
        np.add.at(grad_C, slots, a.c_scale * G)
        grad_C[0] = 0.0  # slot 0 means "no final-line row": it is not a parameter
        return {"A": a.scale * exact.matmul(h.T, exact.matmul(G, a.B.T)), "B": a.scale * exact.matmul(hA.T, G),
                "C": grad_C}, G


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


def _sampling_distribution(z: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Row-wise probabilities the sampler draws from: softmax(z / T), then top-k, then top-p, renormalised."""
    logq = log_softmax(z / temperature)
    q = exact.exp(logq)
    if 0 < top_k < q.shape[-1]:
        kth = -np.partition(-q, top_k - 1, axis=-1)[:, top_k - 1 : top_k]
        q = np.where(q >= kth, q, 0.0)
    if top_p < 1.0:
        order = np.argsort(-q, axis=-1, kind="stable")
        sorted_q = np.take_along_axis(q, order, axis=-1)
        before = np.cumsum(sorted_q, axis=-1) - sorted_q  # mass strictly above each token
        keep_sorted = before < top_p * sorted_q.sum(axis=-1, keepdims=True)
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        q = np.where(keep, q, 0.0)
    return q / q.sum(axis=-1, keepdims=True)


def _inverse_cdf(q: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Per row, the token whose cumulative probability first exceeds ``u`` (in [0, 1)) of the row's mass."""
    cdf = np.cumsum(q, axis=-1)
    x = u * cdf[:, -1]
    # cdf is non-decreasing and x <= cdf[:, -1] (u < 1), so the first entry >= x is the first one that exceeds
    # the fraction u of the mass; it has probability 0 only where x == 0 (a row whose first tokens have none)
    choice = (cdf >= x[:, None]).argmax(axis=-1)
    if not x.all():  # never pick a zero-probability token
        for j in np.flatnonzero(q[np.arange(len(q)), choice] == 0.0):
            choice[j] = np.flatnonzero(q[j])[0]
    return choice


def _draw(z: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sample from the model's own distribution ``softmax(z)``: the tokens and their logprobs.

    The same numbers as ``log_softmax`` gives for the chosen tokens, computed only for them; the cumulative sum
    runs over the unnormalised ``exp(z - max z)``, as sampling does not need the normalised probabilities.
    """
    s, e = shifted_exp(z)
    choice = _inverse_cdf(e, u)
    return choice, s[np.arange(len(z)), choice] - exact.log(np.add.reduce(e, axis=-1))


def choose_rows(z: np.ndarray, u: np.ndarray | None, temperature: float, top_k: int,
                top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The sampler's draw for every row of logits ``z``: the tokens and their reported logprobs (see
    :class:`SampleJob`), row by row, so rows of different requests with the same settings can be drawn in one
    call. ``u``: one uniform number per row (``None`` for greedy decoding, ``temperature == 0``)."""
    if temperature == 0:
        choice = z.argmax(axis=-1)
        return choice, log_softmax(z)[np.arange(len(z)), choice]
    if temperature == 1.0 and top_k <= 0 and top_p >= 1.0:  # the model's own distribution
        return _draw(z, u)
    q = _sampling_distribution(z, temperature, top_k, top_p)
    choice = _inverse_cdf(q, u)
    return choice, exact.log(q[np.arange(len(z)), choice])


class SampleJob:
    """One sampling request, advanced one token per step, alone or together with other requests.

    An inference server batches the requests in flight (continuous batching): every step it runs one forward
    pass over the active rows of all of them. :func:`step_sample_jobs` does the same with jobs of one model, and
    a job's tokens and logprobs do not depend on which other jobs share its steps: each job draws its own
    random numbers, and every computation is row by row (the forward pass is batch-invariant, see
    :meth:`TinyLM.forward`), so a request gives the same completions alone or in any batch.

    Returned logprobs are those of the distribution each token was drawn from (temperature, top-k and top-p
    applied); at temperature 1 with no truncation that is exactly the model's logprob, the same number
    ``compute_logprobs`` and the trainer's ``forward`` give. With ``temperature == 0`` decoding is greedy and the
    reported logprob is the model's own (temperature-1) logprob of the chosen token.

    A sequence stops at a stop token (included in ``tokens``), when its bytes end with a stop string (included), or
    after ``max_tokens`` tokens (``stop_reason == "length"``).
    """

    def __init__(self, model: TinyLM, prompt: list[int], num_samples: int, max_tokens: int,
                 rng: np.random.Generator, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                 stop_token_ids: frozenset[int] = frozenset(), stop_strings: tuple[bytes, ...] = ()) -> None:
        self.model, self.rng, self.max_tokens = model, rng, max_tokens
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.stop_token_ids, self.stop_strings = stop_token_ids, stop_strings
        self.max_stop = max((len(s) for s in stop_strings), default=0)
        self.prompt_rows, ctx0 = sequence_features(prompt)
        self.prompt = tuple(prompt)
        self.rows: list[list[list[int]]] = [[] for _ in range(num_samples)]
        self.ctxs = [ctx0.copy() for _ in range(num_samples)]
        self.out = [Completion([], [], "length") for _ in range(num_samples)]
        self.texts = [bytearray() for _ in range(num_samples)]
        self.active = list(range(num_samples)) if max_tokens > 0 else []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.active

    def keys(self) -> list[list[int]]:
        """The feature keys of the next prediction of every active sequence."""
        keys = [self.ctxs[i].features() for i in self.active]
        for i, k in zip(self.active, keys):
            self.rows[i].append(k)
        return keys

    def _retire(self, i: int) -> None:
        """Sequence ``i`` is complete: offer its feature rows to the trainer (see ``sequence_rows``)."""
        tokens = self.out[i].tokens
        # row t of the sampler is the context prompt + tokens[:t]; the sequence prompt + tokens[:-1] needs
        # the prompt's rows (its last one is row 0) and rows 1 .. len(tokens) - 1
        rows = np.array(self.rows[i][1:len(tokens)], dtype=np.int64).reshape(-1, KEY_WIDTH)
        _SAMPLED.put(self.prompt + tuple(tokens[:-1]), (self.prompt_rows, rows))
        self.rows[i] = []

    @property
    def draw_settings(self) -> tuple[float, int, float]:
        """What decides how a row's token is drawn from its logits (jobs that agree are drawn together)."""
        return self.temperature, self.top_k, self.top_p

    def random_numbers(self) -> np.ndarray | None:
        """This step's uniform numbers, one per active row (greedy decoding uses none)."""
        return None if self.temperature == 0 else self.rng.random(len(self.active))

    def choose(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Draw the next token of every active row from logits ``z``."""
        return choose_rows(z, self.random_numbers(), *self.draw_settings)

    def advance(self, choice: np.ndarray, chosen_lp: np.ndarray) -> None:
        """Append the chosen tokens and retire the sequences that stopped."""
        still = []
        for tok, lp, i in zip(choice.tolist(), chosen_lp.tolist(), self.active):
            comp = self.out[i]
            comp.tokens.append(tok)
            comp.logprobs.append(lp)
            self.ctxs[i].push(tok)
            if tok < NUM_BYTES:
                self.texts[i].append(tok)
            if tok in self.stop_token_ids:
                comp.stop_reason = "stop"
                self._retire(i)
                continue
            if self.max_stop and tok < NUM_BYTES and any(self.texts[i].endswith(s) for s in self.stop_strings):
                comp.stop_reason = "stop"
                self._retire(i)
                continue
            still.append(i)
        self.steps += 1
        if self.steps >= self.max_tokens:
            for i in still:
                self._retire(i)
            still = []
        self.active = still


def step_sample_jobs(jobs: list[SampleJob]) -> None:
    """Advance every unfinished job by one token: one forward pass per model over all their active rows."""
    by_model: dict[int, list[SampleJob]] = {}
    for job in jobs:
        if not job.done:
            by_model.setdefault(id(job.model), []).append(job)
    for group in by_model.values():
        if len(group) == 1:  # the sync loop's case, without the bookkeeping of a shared batch
            job = group[0]
            job.advance(*job.choose(sampler_logits(job.model, job.keys())))
            continue
        z = sampler_logits(group[0].model, [k for job in group for k in job.keys()])
        bounds = np.cumsum([0] + [len(job.active) for job in group]).tolist()
        by_settings: dict[tuple, list[int]] = {}
        for j, job in enumerate(group):
            by_settings.setdefault(job.draw_settings, []).append(j)
        choice = np.empty(len(z), dtype=np.int64)
        chosen_lp = np.empty(len(z))
        for settings, members in by_settings.items():  # each job still draws its own random numbers
            rows = slice(None) if len(members) == len(group) else np.concatenate(
                [np.arange(bounds[j], bounds[j + 1]) for j in members])
            us = [group[j].random_numbers() for j in members]
            choice[rows], chosen_lp[rows] = choose_rows(z[rows], None if us[0] is None else np.concatenate(us),
                                                        *settings)
        for j, job in enumerate(group):
            job.advance(choice[bounds[j]:bounds[j + 1]], chosen_lp[bounds[j]:bounds[j + 1]])


def sampler_logits(model: TinyLM, keys) -> np.ndarray:
    """Logits for the rows ``keys`` (lists of feature keys), as the sampler computes them."""
    return model.forward(np.array(keys, dtype=np.int64))[1]

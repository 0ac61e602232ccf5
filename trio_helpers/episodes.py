"""Episodes: multi-turn rollouts with an environment, and one training datum per whole episode.

In chapters 03-11 a sample is one piece: prompt, then completion. With a tool the model writes a turn, stops at its
tool call, the *environment* appends its reply (the tool's result), and the model writes the next turn from there.
One episode is then a single token sequence made of alternating pieces written by different authors::

    prompt | model turn 1 | environment reply 1 | model turn 2 | ... | model turn k

Only the model's tokens are decisions of the policy, so only they are trained: in the episode's datum every
environment token (like every prompt token) is an input with target ``-100``, logprob 0 and advantage 0. The
planner then ignores those positions, exactly as chapter 03's prompt positions, and the loss is normalised over the
model's tokens only.

- :class:`Environment` (the interface), :class:`StepResult` (what a step returns);
- :class:`Segment`, :class:`Episode`: the tokens of a finished episode, who wrote each, and its reward;
- :func:`run_episode_async`, :func:`run_episodes_async`, :func:`run_episodes`: the rollout over pytrio's
  ``SamplingClient.sample_async``, one request per model turn, with bounds on turns and on total tokens;
- :func:`episode_datum`: the ``importance_sampling`` datum of a whole episode (pytrio's ``Datum``,
  ``ModelInput``, ``TensorData``), built with chapter 03's conventions;
- :func:`episode_rows`: chapter 03's token-level view (:func:`trio_helpers.datums.alignment_rows`) plus who wrote
  each target.

Introduced in: chapter 12 (notebooks/12_tool_use).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from trio_helpers.datums import IGNORE, _floats, _tokens
from trio_helpers.rollouts import RequestLimiter, RetryPolicy, gather_or_cancel, run_sync

PROMPT, MODEL, ENV = "prompt", "model", "env"
"""Who wrote a token: the prompt (from ``reset``), the model (sampled) or the environment (a step's reply)."""


# --------------------------------------------------------------------------------------------------- interface
@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one model turn.

    Attributes:
        tokens: the environment's token ids to append after the turn (e.g. the tool's reply and the next assistant
            header); empty when the episode ends.
        done: the episode is over (no further model turn).
        reward: the reward of this step (usually 0.0 until the final step, which carries the final-answer reward).
        info: counters for metrics, e.g. ``{"tool_calls": 1, "tool_errors": 0}``; summed over the episode.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """

    tokens: list[int] = field(default_factory=list)
    done: bool = False
    reward: float = 0.0
    info: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """The interface every environment of chapter 12 implements (one instance per episode: it may keep state).

    ``reset(record)`` returns the prompt's token ids (a list or a ``pytrio.ModelInput``) for one dataset record;
    ``step(text, tokens)`` takes the model's turn (its decoded text and its token ids) and returns a
    :class:`StepResult`. ``stop`` lists the stop strings that end a model turn at a tool call (e.g.
    ``["</tool_call>"]``); the rollout does not read it, the caller puts it into ``SamplingParams.stop``.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """

    stop: list[str]

    def reset(self, record: dict): ...

    def step(self, text: str, tokens: list[int]) -> StepResult: ...


# --------------------------------------------------------------------------------------------------- episodes
@dataclass(frozen=True)
class Segment:
    """A run of tokens with one author: ``source`` is ``"model"`` (with the sampler's ``logprobs``) or ``"env"``.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """

    source: str
    tokens: list[int]
    logprobs: list[float] | None = None


@dataclass
class Episode:
    """A finished episode.

    Attributes:
        prompt: the prompt's token ids (from ``Environment.reset``).
        segments: model turns and environment replies, in order.
        reward: the sum of the steps' rewards.
        done: the environment ended the episode (False: a bound stopped it first, see ``truncated``).
        truncated: ``None``, ``"turns"`` (``max_turns`` model turns without the environment ending it) or
            ``"tokens"`` (the next turn or reply would have exceeded ``max_total_tokens``).
        info: the steps' ``info`` counters, summed.
        stop_reasons: the sampler's ``stop_reason`` of each model turn.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """

    prompt: list[int]
    segments: list[Segment] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    truncated: str | None = None
    info: dict[str, float] = field(default_factory=dict)
    stop_reasons: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        """Every token of the episode: prompt, then each segment."""
        out = list(self.prompt)
        for segment in self.segments:
            out += segment.tokens
        return out

    @property
    def sources(self) -> list[str]:
        """Who wrote each token of :attr:`tokens`: ``"prompt"``, ``"model"`` or ``"env"``."""
        out = [PROMPT] * len(self.prompt)
        for segment in self.segments:
            out += [segment.source] * len(segment.tokens)
        return out

    @property
    def turns(self) -> int:
        """The number of model turns."""
        return sum(1 for s in self.segments if s.source == MODEL)

    @property
    def model_tokens(self) -> int:
        """The number of tokens the model wrote (the tokens a datum trains)."""
        return sum(len(s.tokens) for s in self.segments if s.source == MODEL)


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of model turn ``turn`` (0-based) of an episode sampled with ``seed``.

    Turn 0 keeps ``seed`` (a one-turn episode samples exactly what chapter 04's single request did); later turns
    get ``(seed + 1_000_003 * turn) % 2**31``, far from the seeds ``seed + 1, seed + 2, ...`` that neighbouring
    episodes usually get. ``None`` stays ``None`` (unseeded).

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    if seed is None or turn == 0:
        return seed
    return (seed + 1_000_003 * turn) % 2**31


def _turn_params(params, max_tokens: int, turn: int):
    """``params`` with ``max_tokens`` lowered to the budget and the seed moved on by the turn's index."""
    return params.model_copy(update={"max_tokens": max_tokens, "seed": turn_seed(params.seed, turn)})


async def run_episode_async(
    sampler,
    env: Environment,
    record: dict,
    sampling_params,
    max_turns: int = 4,
    max_total_tokens: int = 4096,
    limiter: RequestLimiter | None = None,
    tokenizer=None,
    index: int = 0,
) -> Episode:
    """Play one episode: sample a turn, hand it to the environment, append its reply, sample the next turn.

    Each model turn is one ``sampler.sample_async(tokens_so_far, num_samples=1, ...)`` request with a copy of
    ``sampling_params`` whose ``max_tokens`` is ``min(sampling_params.max_tokens, max_total_tokens - len(tokens))``
    and whose seed is :func:`turn_seed` ``(seed, turn)`` (turn 0 keeps ``seed``), so an episode is reproducible whatever else runs
    at the same time. Stop strings and stop token ids come from ``sampling_params.stop`` (put the environment's
    ``stop`` there, e.g. ``["</tool_call>"]``). ``SamplingParams.stop`` takes strings *or* token ids, not both; the
    offline backend always stops at ``<|im_end|>`` as well, and whether the service does so with stop strings set
    (and whether it keeps a matched stop string in ``tokens``) is to be checked there: an environment should accept a
    turn whose closing tag is missing (:class:`trio_helpers.calculator.CalculatorEnv` does).

    Args:
        sampler: a ``SamplingClient`` (real or offline).
        env: a fresh :class:`Environment` for this episode.
        record: the dataset record passed to ``env.reset``.
        sampling_params: ``pytrio.SamplingParams`` with ``max_tokens`` (the per-turn bound) set.
        max_turns: at most this many model turns (>= 1); reaching it without ``done`` sets ``truncated="turns"``
            (the environment's reply to the last turn is then not appended: no turn would read it).
        max_total_tokens: bound on the whole sequence, prompt included (the datum's length + 1); a turn is never
            asked for more than what is left, and an environment reply that would cross it is dropped and the
            episode ends with ``truncated="tokens"``.
        limiter: a :class:`trio_helpers.rollouts.RequestLimiter` shared by concurrent episodes (concurrency bound,
            retries); ``None`` sends the requests directly, without retries.
        tokenizer: used only when the sampler returns no text (``return_text=False``), to decode the turn.
        index: the episode's index, for the limiter's events and error messages.

    Returns:
        An :class:`Episode`.

    Raises:
        ValueError: ``max_turns < 1``, ``sampling_params.max_tokens`` unset, a prompt not shorter than
            ``max_total_tokens``, or an environment that returns something other than a :class:`StepResult`.
        Exception: whatever the sampler or the environment raises (a retryable error is retried by ``limiter``).

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    from pytrio import ModelInput

    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
    if not sampling_params.max_tokens or sampling_params.max_tokens < 1:
        raise ValueError(f"sampling_params.max_tokens must be set (the per-turn bound), got {sampling_params.max_tokens!r}")
    episode = Episode(prompt=_tokens("prompt", env.reset(record)))
    if not episode.prompt:
        raise ValueError("env.reset returned an empty prompt; the model needs at least one token to start from")
    if len(episode.prompt) >= max_total_tokens:
        raise ValueError(
            f"the prompt has {len(episode.prompt)} tokens, not fewer than max_total_tokens={max_total_tokens}: "
            "no room for a turn; raise max_total_tokens or shorten the prompt"
        )
    tokens = list(episode.prompt)
    for turn in range(max_turns):
        budget = max_total_tokens - len(tokens)
        if budget < 1:
            episode.truncated = "tokens"
            break
        params = _turn_params(sampling_params, min(sampling_params.max_tokens, budget), turn)
        prompt = ModelInput.from_ints(tokens)

        def call(prompt=prompt, params=params):
            return sampler.sample_async(prompt, num_samples=1, sampling_params=params)

        if limiter is None:
            response = await call()
        else:
            response = await limiter.call(call, what=f"sample (episode {index}, turn {turn})", index=index)
        seq = response.sequences[0]
        turn_tokens = list(seq.tokens)
        episode.segments.append(Segment(MODEL, turn_tokens, list(seq.logprobs)))
        episode.stop_reasons.append(seq.stop_reason)
        tokens += turn_tokens
        text = seq.text if seq.text is not None else tokenizer.decode(turn_tokens)
        result = env.step(text, turn_tokens)
        if not isinstance(result, StepResult):
            raise ValueError(f"env.step must return a StepResult, got {type(result).__name__}")
        episode.reward += float(result.reward)
        for key, value in result.info.items():
            episode.info[key] = episode.info.get(key, 0) + value
        if result.done:
            episode.done = True
            if result.tokens:  # a closing reply (never trained) is kept so the episode reads as a whole
                episode.segments.append(Segment(ENV, _tokens("StepResult.tokens", result.tokens)))
            break
        if turn == max_turns - 1:  # no turn will read a reply: end here
            break
        reply = _tokens("StepResult.tokens", result.tokens)
        if len(tokens) + len(reply) >= max_total_tokens:
            episode.truncated = "tokens"
            break
        episode.segments.append(Segment(ENV, reply))
        tokens += reply
    if not episode.done and episode.truncated is None:
        episode.truncated = "turns"
    return episode


async def run_episodes_async(
    sampler,
    make_env: Callable[[dict], Environment],
    records: Sequence[dict],
    sampling_params_for: Callable[[int], object],
    max_turns: int = 4,
    max_total_tokens: int = 4096,
    max_concurrency: int = 8,
    retries: RetryPolicy | None = RetryPolicy(),
    tokenizer=None,
) -> list[Episode]:
    """Play one episode per record, concurrently (``max_concurrency=1``: one request after another); in order.

    Episodes run as concurrent tasks; their sampling requests share one
    :class:`trio_helpers.rollouts.RequestLimiter`, so at most ``max_concurrency`` turns are in flight at once. For
    GRPO groups repeat each record ``group_size`` times and give each copy its own seed in
    ``sampling_params_for``.

    Args:
        sampler: a ``SamplingClient``.
        make_env: ``make_env(record)`` returns a fresh environment for one episode.
        records: the dataset records, one episode each.
        sampling_params_for: ``sampling_params_for(i)`` gives episode ``i``'s ``SamplingParams`` (its seed is moved
            on by the turn index, see :func:`run_episode_async`).
        max_turns, max_total_tokens, tokenizer: as :func:`run_episode_async`.
        max_concurrency: most sampling requests in flight (>= 1).
        retries: retry policy for transient sampling errors; ``None``: no retries.

    Returns:
        ``list[Episode]``, entry ``i`` for ``records[i]``, whatever order they finished in.

    Raises:
        ValueError: as :func:`run_episode_async`, or ``max_concurrency < 1``.
        Exception: the first error of any episode, after cancelling the others.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    limiter = RequestLimiter(max_concurrency, retries)
    records = list(records)
    return await gather_or_cancel(
        run_episode_async(sampler, make_env(record), record, sampling_params_for(i), max_turns, max_total_tokens,
                          limiter, tokenizer, i)
        for i, record in enumerate(records)
    )


def run_episodes(sampler, make_env, records, sampling_params_for, **options) -> list[Episode]:
    """:func:`run_episodes_async` from synchronous code (also inside Jupyter), via
    :func:`trio_helpers.rollouts.run_sync`; same arguments and result.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    return run_sync(run_episodes_async(sampler, make_env, records, sampling_params_for, **options))


# --------------------------------------------------------------------------------------------------- datums
def episode_datum(episode: Episode, advantage):
    """The ``importance_sampling`` (or ``ppo``/``cispo``/``dro``) datum of a whole episode.

    With ``tokens = episode.tokens`` (length ``N``) the datum has ``model_input = tokens[:-1]`` and, aligned with
    it, ``target_tokens[i] = tokens[i + 1]`` where that token was written by the model and ``-100`` where it belongs
    to the prompt or the environment; ``logprobs`` (the sampler's) and ``advantages`` are non-zero only at the
    model's targets. Trailing environment tokens (a closing reply after the last turn) predict nothing trained and
    are left out. For a one-turn episode this is exactly
    :func:`trio_helpers.datums.importance_sampling_datum` ``(prompt, turn, logprobs, advantage)``.

    Args:
        episode: an :class:`Episode` with at least one non-empty model turn.
        advantage: one number for every model token (GRPO: the episode's reward minus its group's mean), or one
            number per model token, in order (``episode.model_tokens`` of them).

    Returns:
        ``pytrio.Datum`` with ``target_tokens`` (int64), ``logprobs`` and ``advantages`` (float32), each as long as
        ``model_input``.

    Raises:
        ValueError: no model tokens, a model segment whose logprobs do not match its tokens, a non-finite value, or
            per-token advantages of the wrong length.
        TypeError: a non-numeric advantage.

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    from pytrio.types import Datum, ModelInput, TensorData

    n_model = episode.model_tokens
    if n_model == 0:
        raise ValueError("the episode has no model tokens: there is nothing to train on; skip it")
    if isinstance(advantage, numbers.Real) and not isinstance(advantage, bool):
        if not math.isfinite(float(advantage)):
            raise ValueError(f"advantage = {advantage} is not finite; give a finite number (check for 0/0)")
        adv = [float(advantage)] * n_model
    else:
        adv = _floats("advantage", advantage, n_model, "give one number, or one per model token of the episode")
    segments = list(episode.segments)
    while segments and segments[-1].source != MODEL:
        segments.pop()
    tokens, targets, logprobs, advantages = _tokens("episode.prompt", episode.prompt), [], [], []
    if not tokens:
        raise ValueError("the episode's prompt is empty; a datum needs one token to predict the first turn from")
    used = 0
    for segment in segments:
        seg_tokens = _tokens(f"{segment.source} segment", segment.tokens)
        if segment.source == MODEL:
            lp = _floats("logprobs", segment.logprobs, len(seg_tokens), "pass SampleSequence.logprobs of the turn")
            targets += seg_tokens
            logprobs += lp
            advantages += adv[used : used + len(seg_tokens)]
            used += len(seg_tokens)
        elif segment.source == ENV:
            targets += [IGNORE] * len(seg_tokens)
            logprobs += [0.0] * len(seg_tokens)
            advantages += [0.0] * len(seg_tokens)
        else:
            raise ValueError(f"segment source {segment.source!r} is neither {MODEL!r} nor {ENV!r}")
        tokens += seg_tokens
    pad = len(episode.prompt) - 1
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_numpy(np.array([IGNORE] * pad + targets, dtype=np.int64)),
            "logprobs": TensorData.from_numpy(np.array([0.0] * pad + logprobs, dtype=np.float32)),
            "advantages": TensorData.from_numpy(np.array([0.0] * pad + advantages, dtype=np.float32)),
        },
    )


def episode_rows(episode: Episode, datum, tokenizer, start: int = 0, stop: int | None = None) -> list[dict]:
    """Chapter 03's token-level view of an episode's datum, with who wrote each target.

    Args:
        episode: the episode the datum was built from (:func:`episode_datum`).
        datum: its datum.
        tokenizer: anything with ``decode(list[int]) -> str``.
        start, stop: the positions to show (slice semantics).

    Returns:
        :func:`trio_helpers.datums.alignment_rows` rows with one more key, ``by``: who wrote the target token at
        that position (``"prompt"``, ``"model"`` or ``"env"``), inserted after ``target``. Only ``"model"`` rows
        are trained.

    Raises:
        ValueError: the datum is longer than the episode (it was built from another one).

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    from trio_helpers.datums import alignment_rows

    sources = episode.sources
    if len(datum.model_input) > len(sources) - 1:
        raise ValueError(
            f"the datum has {len(datum.model_input)} positions but the episode only {len(sources) - 1}: "
            "pass the episode the datum was built from"
        )
    rows = []
    for row in alignment_rows(datum, tokenizer, start, stop):
        by = sources[row["pos"] + 1]
        keys = list(row)
        at = keys.index("target") + 1
        rows.append({k: row[k] for k in keys[:at]} | {"by": by} | {k: row[k] for k in keys[at:]})
    return rows

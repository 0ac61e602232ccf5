"""GRPO on GSM8K: the reward scorer of the training loop, its config, and one step in the open.

GRPO's signal: grade each completion of a prompt's group (chapter 02's grader), subtract the group's mean reward
(optionally divide by its standard deviation) and give every token of a completion that advantage. Everything
else (batches, sampler refresh, rollouts, datums, training, logging, checkpoints) is the shared loop of
:mod:`trio_helpers.loop`; :func:`run_grpo` is that loop with :class:`GRPOScorer`. ``python -m
trio_helpers.recipes.grpo`` runs the same code from the command line.

Introduced in: chapter 04 (notebooks/04_grpo_sync).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from trio_helpers.grading import gsm8k_reward  # the GRPO chapters' reward (importable from here too)
from trio_helpers.loop import LoopConfig, RunResult, StepOutput, one_step, run_loop
from trio_helpers.rl import make_group, reward_metrics

ADVANTAGES = ("mean", "std", "none")
OVERLONG = ("keep", "drop", "penalty")

RewardFn = Callable[[str, dict], float]
"""``reward_fn(completion_text, record) -> float``."""


@dataclass
class GRPOConfig(LoopConfig):
    """Every setting of a GRPO run: the loop's (:class:`trio_helpers.loop.LoopConfig`) plus the advantage.

    Defaults follow the *GRPO* example's scripts (batch 4 x group 4, lr 4e-5, temperature 1).

    Attributes:
        advantage: ``"mean"`` (reward minus group mean, the *GRPO* example), ``"std"`` (also divided by the
            group's standard deviation, the *GSM8K* example) or ``"none"`` (the raw reward, no baseline; a group
            whose rewards are all equal still counts as degenerate and is skipped with ``skip_degenerate``;
            chapter 10).
        skip_degenerate: send no datums for groups whose rewards are all equal.
        overlong: completions cut off at ``max_tokens`` (``len(tokens) >= max_tokens``, as
            ``completion/frac_max_tokens`` counts them): ``"keep"`` trains on them like any other; ``"drop"``
            sends no datum for them (DAPO's overlong filtering; the group's advantages are computed with their
            rewards included); ``"penalty"`` adds DAPO's soft overlong punishment to every reward before the
            advantages (:func:`trio_helpers.rl.soft_overlong_penalty`: linear from 0 to -1 over the last
            ``overlong_buffer`` tokens before ``max_tokens``). Chapter 10.
        overlong_buffer: with ``"penalty"``, the length of that ramp, in [1, max_tokens].
        env: ``None`` (one completion per sample, chapters 04-11) or the name of an environment in
            :data:`ENVIRONMENTS` (``"calculator"``): each group member is then a multi-turn *episode*
            (:func:`trio_helpers.episodes.run_episode_async`), rewarded by the environment at its end, and trained
            with the environment's tokens masked (:func:`trio_helpers.episodes.episode_datum`); ``max_tokens``
            bounds each model turn. Chapter 12.
        max_turns: with ``env``, the most model turns per episode (the calculator answers ``max_turns - 1``
            calls, so the last turn is left for the answer).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    advantage: str = "mean"
    skip_degenerate: bool = True
    overlong: str = "keep"
    overlong_buffer: int = 0
    env: str | None = None
    max_turns: int = 8

    def validate(self) -> None:
        """The loop's checks, plus the settings under which GRPO can never learn.

        Raises:
            ValueError: naming the field, the value and the fix.

        Introduced in: chapter 04 (notebooks/04_grpo_sync).
        """
        super().validate()
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage must be one of {', '.join(map(repr, ADVANTAGES))}, got {self.advantage!r}")
        if self.overlong not in OVERLONG:
            raise ValueError(f"overlong must be one of {', '.join(map(repr, OVERLONG))}, got {self.overlong!r}")
        if self.overlong == "penalty" and not (isinstance(self.overlong_buffer, int)
                                               and 1 <= self.overlong_buffer <= self.max_tokens):
            raise ValueError(f"overlong_buffer must be an integer in [1, max_tokens={self.max_tokens}] with "
                             f"overlong='penalty', got {self.overlong_buffer!r}; e.g. max_tokens // 4")
        if self.overlong != "penalty" and self.overlong_buffer != 0:
            raise ValueError(f"overlong_buffer={self.overlong_buffer!r} is only used with overlong='penalty', got "
                             f"overlong={self.overlong!r}; set overlong='penalty' or overlong_buffer=0")
        if self.group_size < 2:
            raise ValueError(f"group_size={self.group_size}: GRPO compares completions of the same prompt, and a "
                             "group of one is always degenerate (advantage 0, nothing learned); use >= 2")
        if self.env is not None:
            self._validate_env()
        if self.temperature == 0 and self.skip_degenerate:
            raise ValueError("temperature=0 samples the same completion group_size times, so every group is "
                             "degenerate and skipped: nothing would be learned; use temperature > 0")


    def _validate_env(self) -> None:
        """The episode options (chapter 12): a known environment and the loop options that work on episodes."""
        if self.env not in ENVIRONMENTS:
            raise ValueError(f"env must be None or one of {', '.join(map(repr, ENVIRONMENTS))}, got {self.env!r}")
        if not (isinstance(self.max_turns, int) and not isinstance(self.max_turns, bool) and self.max_turns >= 2):
            raise ValueError(f"max_turns must be an integer >= 2 with env={self.env!r} (a tool call, then the "
                             f"answer), got {self.max_turns!r}")
        for name, off in (("tis_cap", None), ("ref_kl_coef", 0.0), ("overlong", "keep")):
            if getattr(self, name) != off:
                raise ValueError(f"{name}={getattr(self, name)!r} is not implemented for episodes (env="
                                 f"{self.env!r}): it rescores single completions; set {name}={off!r} or env=None")


def calculator_env(tokenizer, config: "GRPOConfig", reward_fn: "RewardFn | None" = None):
    """A fresh :class:`trio_helpers.calculator.CalculatorEnv` for one episode of a run with ``env="calculator"``:
    ``max_turns - 1`` calls answered, chapter 02's reward (or ``reward_fn``).

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    from trio_helpers.calculator import CalculatorEnv

    return CalculatorEnv(tokenizer, reward_fn=reward_fn, max_calls=config.max_turns - 1)


ENVIRONMENTS = {"calculator": calculator_env}
"""Environments a run can name in :attr:`GRPOConfig.env`: ``name -> factory(tokenizer, config, reward_fn)``."""


def batch_prompts(tokenizer, records_batch: Sequence[tuple[int, dict]]) -> list:
    """The chat prompts (``pytrio.ModelInput``) of a batch, chapter 01's one-shot GSM8K format.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    from trio_helpers.prompts import build_prompt, gsm8k_messages

    return [build_prompt(tokenizer, gsm8k_messages(record["question"])) for _, record in records_batch]


def grade_groups(records_batch, prompts, sequences, advantage: str = "mean", reward_fn: RewardFn | None = None) -> list:
    """Grade each prompt's completions and compute their group advantages.

    Args:
        records_batch: the batch's ``(index, record)`` pairs.
        prompts: their prompts.
        sequences: one list of ``SampleSequence`` per prompt.
        advantage: ``"mean"`` or ``"std"``.
        reward_fn: ``reward_fn(text, record)``; default :func:`gsm8k_reward`.

    Returns:
        One :class:`trio_helpers.rl.Group` per prompt, in batch order.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    reward_fn = reward_fn or gsm8k_reward
    return [
        make_group(i, prompt, seqs, lambda text, rec=record: reward_fn(text, rec), normalize=advantage)
        for i, ((_, record), prompt, seqs) in enumerate(zip(records_batch, prompts, sequences))
    ]


class GRPOScorer:
    """The loop's GRPO scorer: rewards -> group-relative advantages (one per completion).

    Args:
        config: the run's :class:`GRPOConfig` (``advantage``, ``skip_degenerate``).
        reward_fn: ``reward_fn(text, record)``; default :func:`gsm8k_reward` (needs ``question`` and ``answer``).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    name = "grpo"
    headline = {"reward/mean": "reward", "reward/frac_degenerate": "degenerate"}
    require_datums = False  # a step whose groups are all degenerate trains on nothing, by design

    def __init__(self, config: GRPOConfig, reward_fn: RewardFn | None = None, make_env=None) -> None:
        self.advantage = config.advantage
        # episodes (chapter 12): make_env(tokenizer) -> a fresh Environment; the loop reads this attribute
        if make_env is None and config.env is not None:
            factory = ENVIRONMENTS[config.env]

            def make_env(tokenizer, factory=factory, config=config, reward_fn=reward_fn):
                return factory(tokenizer, config, reward_fn)
        self.make_env = make_env
        self.max_turns = config.max_turns
        self.skip_degenerate = config.skip_degenerate
        self.overlong, self.overlong_buffer = config.overlong, config.overlong_buffer
        self.max_tokens = config.max_tokens
        self.reward_fn = reward_fn or gsm8k_reward
        self.fields = ("question",) if reward_fn is not None else ("question", "answer")

    def check_records(self, records: Sequence[dict]) -> None:
        """Every record must be a dict with the fields the prompt and the reward read.

        Raises:
            ValueError: naming the first bad record (its index) and the missing field.
        """
        for i, record in enumerate(records):
            if not isinstance(record, dict):
                raise ValueError(f"record {i} is a {type(record).__name__}, not a dict with "
                                 f"{', '.join(self.fields)} (trio_helpers.data.load_gsm8k)")
            for name in self.fields:
                if not isinstance(record.get(name), str) or not record[name].strip():
                    raise ValueError(f"record {i} has no {name!r} text (keys: {sorted(record)}); GSM8K records "
                                     "need 'question' and 'answer' (trio_helpers.data.load_gsm8k)")

    def setup(self, service) -> None:
        """Nothing to create: the reward is computed locally."""

    def prompt(self, tokenizer, record: dict):
        """Chapter 01's one-shot GSM8K chat prompt."""
        return batch_prompts(tokenizer, [(0, record)])[0]

    async def score(self, index: int, prompt, record: dict, sequences: list, limiter):
        """Grade the group and compute its advantages (no requests); apply ``overlong`` (chapter 10)."""
        group = make_group(index, prompt, sequences, lambda text: self.reward_fn(text, record), self.advantage)
        return apply_overlong(group, self.overlong, self.max_tokens, self.overlong_buffer, self.advantage)

    async def score_episodes(self, index: int, prompt, record: dict, episodes: list):
        """A group of episodes (chapter 12): each episode's reward (the environment's), group advantages; the
        group's ``sequences`` are the model's turns of each episode, joined (tokens, logprobs), and
        ``extras["episodes"]`` the episodes, from which :func:`trio_helpers.rl.group_datums` builds the datums."""
        from types import SimpleNamespace

        from trio_helpers.episodes import MODEL
        from trio_helpers.rl import Group, group_advantages

        rewards = np.array([float(e.reward) for e in episodes])
        views = [SimpleNamespace(tokens=[t for s in e.segments if s.source == MODEL for t in s.tokens],
                                 logprobs=[x for s in e.segments if s.source == MODEL for x in s.logprobs],
                                 text=None, stop_reason=(e.stop_reasons or ["stop"])[-1]) for e in episodes]
        return Group(index, prompt, views, rewards, group_advantages(rewards, self.advantage),
                     extras={"episodes": list(episodes)})

    def metrics(self, groups: Sequence) -> dict:
        """``reward/mean`` and ``reward/frac_degenerate``; with ``overlong`` ``"drop"``
        ``train/frac_dropped_overlong`` (share of completions left out), with ``"penalty"`` ``reward/overlong_penalty``
        (mean penalty, included in ``reward/mean``)."""
        out = reward_metrics(groups)
        episodes = [e for g in groups for e in (g.extras.get("episodes") or [])]
        if episodes:
            out.update(episode_metrics(episodes))
        if self.overlong == "drop":
            out["train/frac_dropped_overlong"] = float(np.mean([d for g in groups for d in g.extras["dropped"]]))
        elif self.overlong == "penalty":
            out["reward/overlong_penalty"] = float(np.mean(np.concatenate(
                [g.extras["overlong_penalty"] for g in groups])))
        return out


def episode_metrics(episodes: Sequence) -> dict[str, float]:
    """What a step's episodes did (chapter 12): ``episode/turns_mean`` (model turns), ``episode/tool_calls_mean``
    and ``episode/tool_errors_mean`` (per episode, from the environment's ``info``), ``episode/frac_tool_use``
    (share of episodes with at least one call), ``episode/frac_truncated`` (ended by a bound, not by the
    environment) and ``episode/tokens_mean`` (whole sequence, prompt and replies included: what one datum holds).

    Introduced in: chapter 12 (notebooks/12_tool_use).
    """
    calls = np.array([e.info.get("tool_calls", 0) for e in episodes], dtype=np.float64)
    return {"episode/turns_mean": float(np.mean([e.turns for e in episodes])),
            "episode/tool_calls_mean": float(calls.mean()),
            "episode/tool_errors_mean": float(np.mean([e.info.get("tool_errors", 0) for e in episodes])),
            "episode/frac_tool_use": float(np.mean(calls > 0)),
            "episode/frac_truncated": float(np.mean([e.truncated is not None for e in episodes])),
            "episode/tokens_mean": float(np.mean([len(e.tokens) for e in episodes]))}


def apply_overlong(group, overlong: str, max_tokens: int, buffer: int = 0, advantage: str = "mean"):
    """DAPO's overlong handling of a graded group (see :class:`GRPOConfig`'s ``overlong``), in place.

    ``"drop"`` flags the cut-off completions in ``group.extras["dropped"]`` (no datum is built for them);
    ``"penalty"`` adds :func:`trio_helpers.rl.soft_overlong_penalty` to the rewards and recomputes the advantages
    (``group.extras["overlong_penalty"]`` keeps the penalties); ``"keep"`` changes nothing.

    Introduced in: chapter 10 (notebooks/10_grpo_variants).
    """
    from trio_helpers.rl import group_advantages, soft_overlong_penalty

    lengths = [len(s.tokens) for s in group.sequences]
    if overlong == "drop":
        group.extras["dropped"] = [n >= max_tokens for n in lengths]
    elif overlong == "penalty":
        penalty = soft_overlong_penalty(lengths, max_tokens, buffer)
        group.rewards = group.rewards + penalty
        group.advantages = group_advantages(group.rewards, advantage)
        group.extras["overlong_penalty"] = penalty
    return group


def grpo_step(training_client, records_batch: Sequence[tuple[int, dict]], config: GRPOConfig, step: int,
              tokenizer, *, total_steps: int | None = None, reward_fn: RewardFn | None = None) -> StepOutput:
    """One on-policy GRPO step: refresh the sampler, sample, grade, compute advantages, build datums, train.

    The loop's :func:`trio_helpers.loop.one_step` with :class:`GRPOScorer`.

    Returns:
        :class:`trio_helpers.loop.StepOutput` (the graded ``groups`` and the step's ``metrics`` row).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    return one_step(training_client, GRPOScorer(config, reward_fn), records_batch, config, step, tokenizer,
                    total_steps=total_steps)


def run_grpo(service, records: Sequence[dict], config: GRPOConfig, logger=None, resume: bool = False,
             progress: bool = False, *, reward_fn: RewardFn | None = None, make_env=None,
             **loop_options) -> RunResult:
    """Run GRPO: the training loop (:func:`trio_helpers.loop.run_loop`) with :class:`GRPOScorer`.

    Args:
        service: a ``ServiceClient`` (``trio_helpers.connect()``).
        records: GSM8K-style ``{"question", "answer"}`` records (``trio_helpers.data.load_gsm8k``).
        config: the run's settings (``config.rollout``: ``"sync"``, ``"async"`` or ``"pipeline"``).
        logger, resume, progress: as in :func:`trio_helpers.loop.run_loop`.
        reward_fn: ``reward_fn(text, record)``; default :func:`gsm8k_reward`.
        make_env: ``make_env(tokenizer)`` returns a fresh :class:`trio_helpers.episodes.Environment` per episode
            (chapter 12); default: ``config.env``'s factory, or none (single completions).
        **loop_options: ``on_step``, ``on_event``, ``retries``, ``training_client``, ``print_every``.

    Returns:
        :class:`trio_helpers.loop.RunResult`.

    Raises:
        ValueError: invalid config or records, an impossible resume; RunStopped: a service call failed for good.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    return run_loop(service, records, config, GRPOScorer(config, reward_fn, make_env), logger=logger,
                    resume=resume, progress=progress, **loop_options)

"""GRPO building blocks: group-relative advantages, degenerate groups, rollouts and one training step.

Every function takes and returns PyTRIO's own types (``ModelInput``, ``SamplingParams``, ``SampleSequence``,
``Datum``, ``AdamParams``), so the same code runs on the offline backend and on the real service.

Introduced in: chapter 04 (notebooks/04_grpo_sync); the async variants are in :mod:`trio_helpers.rollouts`
(chapter 05).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from trio_helpers.datums import importance_sampling_datum


def group_advantages(rewards: Sequence[float], normalize: str = "mean", eps: float = 1e-8) -> np.ndarray:
    """Group-relative advantages of one prompt's group of completions.

    Args:
        rewards: one reward per completion of the same prompt.
        normalize: ``"mean"`` subtracts the group mean (tutorial A); ``"std"`` also divides by the group's standard
            deviation plus ``eps`` (tutorial C, DeepSeekMath's GRPO).

    Returns:
        float64 array, same length as ``rewards``; all zeros when every reward is equal (a degenerate group).

    Raises:
        ValueError: empty group, non-finite rewards or an unknown ``normalize``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D sequence, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    centred = r - r.mean()
    if normalize == "mean":
        return centred
    if normalize == "std":
        return centred / (r.std() + eps)
    raise ValueError(f"normalize must be 'mean' or 'std', got {normalize!r}")


def is_degenerate(rewards: Sequence[float]) -> bool:
    """True when every completion of a group got the same reward: all advantages are 0, nothing to learn.

    A group of one completion is always degenerate (its reward equals its own mean); so is an empty group.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    r = np.asarray(rewards, dtype=np.float64)
    return bool(r.size == 0 or np.all(r == r[0]))


def prob_degenerate(p: float, group_size: int) -> float:
    """Probability that a group of ``group_size`` independent binary rewards with success rate ``p`` is all-right or
    all-wrong: ``p**G + (1 - p)**G``.

    Args:
        p: the chance that one completion is right (the policy's accuracy on this prompt), in [0, 1].
        group_size: completions per prompt, >= 1.

    Returns:
        A probability in [0, 1] (1 for ``group_size == 1``, smallest, ``2 ** (1 - G)``, at ``p = 0.5``).

    Raises:
        ValueError: ``p`` outside [0, 1] or ``group_size < 1``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be a probability in [0, 1], got {p}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return p**group_size + (1.0 - p) ** group_size


def cosine_lr(step: int, total_steps: int, base_lr: float, min_ratio: float = 0.0) -> float:
    """Cosine decay from ``base_lr`` at step 0 to ``min_ratio * base_lr`` at ``total_steps`` (tutorial C's schedule).

    Args:
        step: 0-based step index (clipped to [0, total_steps]).
        total_steps: length of the run, >= 1.
        base_lr: the learning rate at step 0.
        min_ratio: the final learning rate as a fraction of ``base_lr``.

    Returns:
        ``base_lr * (min_ratio + (1 - min_ratio) * (1 + cos(pi * step / total_steps)) / 2)``.

    Raises:
        ValueError: ``total_steps < 1``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    frac = min(max(step / total_steps, 0.0), 1.0)
    return base_lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac)))


@dataclass
class Group:
    """One prompt's rollouts: the prompt, its sampled completions, their rewards and advantages.

    Attributes:
        index: the prompt's position in the step's batch.
        prompt: the ``pytrio.ModelInput`` that was sampled from.
        sequences: the ``SampleSequence`` objects (tokens, logprobs, text) of its completions.
        rewards, advantages: one float per completion.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    index: int
    prompt: object  # pytrio.ModelInput
    sequences: list  # list[pytrio.SampleSequence]
    rewards: np.ndarray
    advantages: np.ndarray

    @property
    def degenerate(self) -> bool:
        """All rewards equal (so all advantages are 0): the group has nothing to teach."""
        return is_degenerate(self.rewards)


def make_group(index: int, prompt, sequences, reward_fn: Callable[[str], float], normalize: str = "mean") -> Group:
    """Grade a prompt's completions with ``reward_fn(text)`` and compute their group advantages.

    Args:
        index: the prompt's position in the batch.
        prompt: the ``pytrio.ModelInput`` the completions were sampled from.
        sequences: the ``SampleSequence`` objects of one ``sample`` call.
        reward_fn: maps a completion's text to a float reward (``None`` text counts as ``""``).
        normalize: ``"mean"`` or ``"std"``, as in :func:`group_advantages`.

    Returns:
        A :class:`Group`.

    Raises:
        ValueError: no sequences, a non-finite reward or an unknown ``normalize``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    rewards = np.array([float(reward_fn(s.text or "")) for s in sequences])
    return Group(index, prompt, list(sequences), rewards, group_advantages(rewards, normalize))


def group_datums(group: Group, skip_degenerate: bool = True) -> list:
    """``importance_sampling`` datums for a group (none for a degenerate group when ``skip_degenerate``).

    Args:
        group: a graded group (:func:`make_group`).
        skip_degenerate: return no datums when every advantage is zero (they would add nothing to the gradient
            but still be sent, processed and counted as training tokens).

    Returns:
        One ``pytrio.Datum`` per completion with at least one token (chapter 03's layout: prompt positions masked
        with ``-100``, the completion's tokens carrying the sampler's logprobs and the completion's advantage).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if skip_degenerate and group.degenerate:
        return []
    prompt = group.prompt.to_ints()
    return [
        importance_sampling_datum(prompt, s.tokens, s.logprobs, float(a))
        for s, a in zip(group.sequences, group.advantages)
        if len(s.tokens) > 0
    ]


def datum_tokens(group: Group) -> int:
    """Model-input tokens that *all* of a group's datums hold: ``len(prompt) + len(completion) - 1`` per completion.

    This is what sending the group costs in training tokens, whether or not it is degenerate; the loop uses it to
    count the tokens that skipping degenerate groups saves.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    p = len(group.prompt.to_ints())
    return sum(p + len(s.tokens) - 1 for s in group.sequences if len(s.tokens) > 0)


def step_datums(groups: Sequence[Group], skip_degenerate: bool = True) -> list:
    """All datums of a step, group after group (see :func:`group_datums`).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    return [d for g in groups for d in group_datums(g, skip_degenerate)]


def sample_groups(sampler, prompts: Sequence, group_size: int, sampling_params_for) -> list:
    """Sample a group for each prompt, one request after another (the synchronous baseline).

    Args:
        sampler: a ``SamplingClient`` holding the weights to sample from.
        prompts: ``pytrio.ModelInput`` prompts.
        group_size: completions per prompt (``num_samples`` of each request).
        sampling_params_for: ``sampling_params_for(i)`` returns the ``SamplingParams`` of prompt ``i`` (so each
            prompt can get its own seed).

    Returns:
        One list of ``SampleSequence`` per prompt (``SampleResponse.sequences``), in prompt order.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    return [
        sampler.sample(p, num_samples=group_size, sampling_params=sampling_params_for(i)).result().sequences
        for i, p in enumerate(prompts)
    ]


@dataclass
class StepResult:
    """What one GRPO step did: its ``metrics`` (every key is explained in chapter 04) and its graded ``groups``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    metrics: dict[str, float] = field(default_factory=dict)
    groups: list = field(default_factory=list)


def train_on_groups(
    training_client, groups: Sequence[Group], adam_params, skip_degenerate: bool = True,
    loss_fn: str = "importance_sampling",
) -> dict:
    """Build the step's datums and submit ``forward_backward`` and ``optim_step`` back to back, then wait for both.

    Args:
        training_client: a ``TrainingClient`` (real or offline).
        groups: the step's graded groups.
        adam_params: ``pytrio.AdamParams`` of this step (its ``learning_rate`` may follow a schedule).
        skip_degenerate: leave degenerate groups out (see :func:`group_datums`).
        loss_fn: the policy-gradient loss (``"importance_sampling"``; ``"ppo"`` adds clipping).

    Returns:
        The step's training metrics: ``datums`` sent, ``train_tokens`` (model-input tokens sent),
        ``train_tokens_skipped`` (tokens the skipped degenerate groups would have added), ``loss`` (the trainer's
        ``loss_mean``; NaN when nothing was sent) and the optimizer's metrics prefixed ``optim/``. With no datums
        (every group degenerate) nothing is sent and the weights do not change.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    data = step_datums(groups, skip_degenerate)
    skipped = sum(datum_tokens(g) for g in groups if skip_degenerate and g.degenerate)
    metrics: dict[str, float] = {
        "datums": float(len(data)),
        "train_tokens": float(sum(len(d.model_input) for d in data)),
        "train_tokens_skipped": float(skipped),
    }
    if not data:
        metrics["loss"] = float("nan")
        return metrics
    fb = training_client.forward_backward(data, loss_fn)
    opt = training_client.optim_step(adam_params)  # submitted before waiting: both run back to back
    out = fb.result()
    metrics["loss"] = float(out.metrics.get("loss_mean", float("nan")))
    for k, v in (opt.result().metrics or {}).items():
        metrics[f"optim/{k}"] = float(v)
    return metrics


def rollout_metrics(groups: Sequence[Group], max_tokens: int) -> dict[str, float]:
    """Reward and completion statistics of a step's groups.

    Returns:
        ``reward`` (mean over every completion), ``frac_degenerate`` (share of groups with all-equal rewards),
        ``completion_tokens_mean`` / ``completion_tokens_max`` (sampled tokens per completion) and
        ``frac_max_tokens`` (share of completions that used the whole ``max_tokens`` budget, i.e. were cut off).

    Raises:
        ValueError: no groups, or groups without completions.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if not groups or not any(len(g.sequences) for g in groups):
        raise ValueError("groups must hold at least one completion; got an empty step")
    rewards = np.concatenate([g.rewards for g in groups])
    lengths = np.array([len(s.tokens) for g in groups for s in g.sequences])
    return {
        "reward": float(rewards.mean()),
        "frac_degenerate": float(np.mean([g.degenerate for g in groups])),
        "completion_tokens_mean": float(lengths.mean()),
        "completion_tokens_max": float(lengths.max()),
        "frac_max_tokens": float(np.mean(lengths >= max_tokens)),
    }


def timed(fn, *args, **kwargs):
    """``(result, seconds)`` of one call (wall clock; keep these numbers out of compared notebook outputs).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t

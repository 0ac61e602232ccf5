"""RL building blocks: group-relative advantages, degenerate groups, datums of a step and one training call.

Every function takes and returns PyTRIO's own types (``ModelInput``, ``SamplingParams``, ``SampleSequence``,
``Datum``, ``AdamParams``), so the same code runs on the offline backend and on the real service.

The training loop that strings them together is :mod:`trio_helpers.loop`.

Introduced in: chapter 04 (notebooks/04_grpo_sync).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from trio_helpers.datums import importance_sampling_datum
from trio_helpers.offline import exact


def group_advantages(rewards: Sequence[float], normalize: str = "mean", eps: float = 1e-8) -> np.ndarray:
    """Group-relative advantages of one prompt's group of completions.

    Args:
        rewards: one reward per completion of the same prompt.
        normalize: ``"mean"`` subtracts the group mean (the *GRPO* example); ``"std"`` also divides by the group's
            standard deviation plus ``eps`` (the *GSM8K* example, DeepSeekMath's GRPO).

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
    return exact.ipow(p, group_size) + exact.ipow(1.0 - p, group_size)


def cosine_lr(step: int, total_steps: int, base_lr: float, min_ratio: float = 0.0) -> float:
    """Cosine decay from ``base_lr`` at step 0 to ``min_ratio * base_lr`` at ``total_steps`` (the *GSM8K* example's schedule).

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
    # exact.cos, not math.cos: the C library's last bits differ between systems, and the rate moves the weights
    return base_lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + exact.cos(math.pi * frac)))


@dataclass
class Group:
    """One prompt's rollouts: the prompt, its sampled completions and the signal each completion trains on.

    Attributes:
        index: the prompt's position in the step's batch.
        prompt: the ``pytrio.ModelInput`` that was sampled from.
        sequences: the ``SampleSequence`` objects (tokens, logprobs, text) of its completions.
        rewards: one float per completion (GRPO), or ``None`` when the signal is not a reward (distillation).
        advantages: per completion, one number (GRPO: the same for every token) or one per completion token
            (distillation).
        extras: what a scorer wants to keep with the group (e.g. the teacher's logprobs).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    index: int
    prompt: object  # pytrio.ModelInput
    sequences: list  # list[pytrio.SampleSequence]
    rewards: np.ndarray | None
    advantages: Sequence  # floats, or one array per completion
    extras: dict = field(default_factory=dict)

    @property
    def degenerate(self) -> bool:
        """Nothing to teach: all rewards equal (so all advantages are 0), or, without rewards, all advantages 0."""
        if self.rewards is not None:
            return is_degenerate(self.rewards)
        return all(not np.any(np.asarray(a, dtype=np.float64)) for a in self.advantages)


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
        group: a scored group (:func:`make_group`, or a distillation scorer's).
        skip_degenerate: return no datums when the group has nothing to teach (they would add nothing to the
            gradient but still be sent, processed and counted as training tokens).

    Returns:
        One ``pytrio.Datum`` per completion with at least one token (chapter 03's layout: prompt positions masked
        with ``-100``, the completion's tokens carrying the sampler's logprobs and the completion's advantages).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if skip_degenerate and group.degenerate:
        return []
    prompt = group.prompt.to_ints()
    return [
        importance_sampling_datum(prompt, s.tokens, s.logprobs, a if np.ndim(a) else float(a))
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


def ratio_metrics(data: Sequence, fb_output, loss_fn: str = "importance_sampling",
                  loss_fn_config: dict | None = None) -> dict[str, float]:
    """How far the trainer's logprobs are from the sampler's, over the trained (non-masked) tokens.

    ``forward_backward`` returns the trainer's logprob of every target (``loss_fn_outputs[i]["logprobs"]``,
    computed before the update); the datums carry the sampler's. Their difference is the policy lag (zero for a
    fresh sampler with identical numerics) and ``exp`` of it the importance ratio.

    Returns:
        ``train/ratio_mean``, ``train/ratio_max``, ``train/policy_lag`` (mean ``|logp_train - logp_sampler|``),
        ``train/kl_sampler_trainer`` (mean ``logp_sampler - logp_train``: an estimate of KL(sampler || trainer)
        on the sampled tokens) and ``train/clip_frac`` (share of tokens the loss clips,
        :func:`trio_helpers.losses.clipped_mask`); NaN when the output carries no logprobs.

    Introduced in: chapter 04 (notebooks/04_grpo_sync); the clipping and KL keys in chapter 08.
    """
    from trio_helpers.losses import LOSS_CONFIG, clipped_mask

    gaps, advs = [], []
    for d, out in zip(data, getattr(fb_output, "loss_fn_outputs", None) or []):
        lp = out.get("logprobs") if isinstance(out, dict) else None
        if lp is None:
            break
        new = lp.to_numpy() if hasattr(lp, "to_numpy") else np.asarray(lp)
        old = d.loss_fn_inputs["logprobs"].to_numpy()
        mask = d.loss_fn_inputs["target_tokens"].to_numpy() != -100
        gaps.append(np.asarray(new, dtype=np.float64)[mask] - old[mask])
        advs.append(d.loss_fn_inputs["advantages"].to_numpy()[mask])
    keys = ("train/ratio_mean", "train/ratio_max", "train/policy_lag", "train/kl_sampler_trainer",
            "train/clip_frac")
    if not gaps or len(gaps) != len(data):
        return dict.fromkeys(keys, float("nan"))
    gap, adv = np.concatenate(gaps), np.concatenate(advs)
    ratio = exact.exp(gap)
    clip = float(np.mean(clipped_mask(loss_fn, ratio, adv, loss_fn_config))) if loss_fn in LOSS_CONFIG else 0.0
    return dict(zip(keys, (float(ratio.mean()), float(ratio.max()), float(np.abs(gap).mean()),
                           float(-gap.mean()), clip)))


def train_on_groups(
    training_client, groups: Sequence[Group], adam_params, skip_degenerate: bool = True,
    loss_fn: str = "importance_sampling", loss_fn_config: dict | None = None,
) -> dict:
    """Build the step's datums, run ``forward_backward``, and only once it succeeded, ``optim_step``.

    Waiting for ``forward_backward`` before submitting ``optim_step`` costs one round trip per step, and buys
    this: if ``forward_backward`` fails (after pytrio's own retries), no optimizer step is queued behind it that
    could move the weights without this step's gradients. Chapter 05 measures the cost.

    Args:
        training_client: a ``TrainingClient`` (real or offline).
        groups: the step's scored groups.
        adam_params: ``pytrio.AdamParams`` of this step (its ``learning_rate`` may follow a schedule).
        skip_degenerate: leave degenerate groups out (see :func:`group_datums`).
        loss_fn: the policy-gradient loss (``"importance_sampling"``; chapter 08 compares the others).
        loss_fn_config: the loss's settings (e.g. clip bounds); merged with the book's defaults
            (:data:`trio_helpers.losses.LOSS_CONFIG`) and sent in full, so the service clips with the very bounds
            ``train/clip_frac`` is computed with (``None`` would let the service apply its own defaults).

    Returns:
        The step's training metrics: ``train/datums`` sent, ``train/tokens`` (model-input tokens sent),
        ``train/tokens_skipped`` (tokens the skipped degenerate groups would have added), ``train/loss`` (the
        trainer's ``loss_mean``; NaN when nothing was sent), :func:`ratio_metrics` and the optimizer's metrics
        prefixed ``optim/``. With no datums (every group degenerate) nothing is sent and the weights stay.

    Raises:
        pytrio.errors.base.PyTrioError: a training call failed after pytrio's retries (no optimizer step was sent
            if ``forward_backward`` failed).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    data = step_datums(groups, skip_degenerate)
    skipped = sum(datum_tokens(g) for g in groups if skip_degenerate and g.degenerate)
    metrics: dict[str, float] = {
        "train/datums": float(len(data)),
        "train/tokens": float(sum(len(d.model_input) for d in data)),
        "train/tokens_skipped": float(skipped),
    }
    if not data:
        metrics["train/loss"] = float("nan")
        return metrics
    from trio_helpers.losses import LOSS_CONFIG, check_loss_config

    sent = (check_loss_config(loss_fn, loss_fn_config) or None) if loss_fn in LOSS_CONFIG else loss_fn_config
    out = training_client.forward_backward(data, loss_fn, sent).result()
    metrics["train/loss"] = float(out.metrics.get("loss_mean", float("nan")))
    metrics.update(ratio_metrics(data, out, loss_fn, loss_fn_config))
    optim = training_client.optim_step(adam_params).result()  # only after forward_backward succeeded
    for k, v in (optim.metrics or {}).items():
        metrics[f"optim/{k}"] = float(v)
    return metrics


def completion_metrics(groups: Sequence[Group], max_tokens: int) -> dict[str, float]:
    """Length statistics of a step's completions (every scorer's step reports them).

    Returns:
        ``completion/tokens_mean``, ``completion/tokens_max``, ``completion/tokens_total`` (sampled tokens per
        completion and in all), ``completion/frac_max_tokens`` (share of completions that used the whole
        ``max_tokens`` budget, i.e. were cut off) and ``completion/entropy`` (mean ``-logprob`` of the sampled
        tokens: an estimate of the sampling distribution's per-token entropy, in nats).

    Raises:
        ValueError: no groups, or groups without completions.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    lengths = np.array([len(s.tokens) for g in groups for s in g.sequences])
    if lengths.size == 0:
        raise ValueError("groups must hold at least one completion; got an empty step")
    logprobs = [np.asarray(s.logprobs, dtype=np.float64) for g in groups for s in g.sequences if s.tokens]
    entropy = float(-np.concatenate(logprobs).mean()) if logprobs else float("nan")
    return {
        "completion/tokens_mean": float(lengths.mean()),
        "completion/tokens_max": float(lengths.max()),
        "completion/tokens_total": float(lengths.sum()),
        "completion/frac_max_tokens": float(np.mean(lengths >= max_tokens)),
        "completion/entropy": entropy,
    }


def reward_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """Reward statistics of a step's graded groups.

    Returns:
        ``reward/mean`` (mean over every completion) and ``reward/frac_degenerate`` (share of groups whose
        rewards are all equal).

    Raises:
        ValueError: no groups, or groups without rewards.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if not groups or any(g.rewards is None or len(g.rewards) == 0 for g in groups):
        raise ValueError("reward_metrics needs graded groups with at least one reward each")
    rewards = np.concatenate([g.rewards for g in groups])
    return {"reward/mean": float(rewards.mean()),
            "reward/frac_degenerate": float(np.mean([g.degenerate for g in groups]))}


def timed(fn, *args, **kwargs):
    """``(result, seconds)`` of one call (wall clock; keep these numbers out of compared notebook outputs).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t

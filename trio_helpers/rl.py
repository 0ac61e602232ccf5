"""RL building blocks: group-relative advantages, degenerate groups, datums of a step and one training call.

Every function takes and returns PyTRIO's own types (``ModelInput``, ``SamplingParams``, ``SampleSequence``,
``Datum``, ``AdamParams``), so the same code runs on the offline backend and on the real service.

The training loop that strings them together is :mod:`trio_helpers.loop`.

Introduced in: chapter 04 (notebooks/04_grpo_sync).
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
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
            standard deviation plus ``eps`` (the *GSM8K* example, DeepSeekMath's GRPO); ``"none"`` keeps the raw
            rewards (no baseline: REINFORCE without a baseline; chapter 10).

    Returns:
        float64 array, same length as ``rewards``; all zeros when every reward is equal (a degenerate group), except
        with ``"none"`` (the rewards themselves).

    Raises:
        ValueError: empty group, non-finite rewards or an unknown ``normalize``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D sequence, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    if normalize == "none":
        return r.copy()
    centred = r - r.mean()
    if normalize == "mean":
        return centred
    if normalize == "std":
        return centred / (r.std() + eps)
    raise ValueError(f"normalize must be 'mean', 'std' or 'none', got {normalize!r}")


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
        Completions flagged in ``group.extras["dropped"]`` (overlong filtering) get no datum; per-completion
        logprobs in ``group.extras["train_logprobs"]`` (truncated importance sampling) replace the sampler's.
        A group of episodes (``group.extras["episodes"]``, chapter 12) gets one
        :func:`trio_helpers.episodes.episode_datum` per episode: environment tokens are inputs with target -100.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if skip_degenerate and group.degenerate:
        return []
    if group.extras.get("episodes") is not None:  # multi-turn episodes (chapter 12): environment tokens masked
        from trio_helpers.episodes import episode_datum

        return [episode_datum(e, a if np.ndim(a) else float(a))
                for e, a in zip(group.extras["episodes"], group.advantages) if e.model_tokens > 0]
    prompt = group.prompt.to_ints()
    dropped = group.extras.get("dropped") or [False] * len(group.sequences)
    logprobs = group.extras.get("train_logprobs") or [s.logprobs for s in group.sequences]
    return [
        importance_sampling_datum(prompt, s.tokens, lp, a if np.ndim(a) else float(a))
        for s, a, lp, drop in zip(group.sequences, group.advantages, logprobs, dropped)
        if len(s.tokens) > 0 and not drop
    ]


def datum_tokens(group: Group) -> int:
    """Model-input tokens that *all* of a group's datums hold: ``len(prompt) + len(completion) - 1`` per completion.

    This is what sending the group costs in training tokens, whether or not it is degenerate; the loop uses it to
    count the tokens that skipping degenerate groups saves.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if group.extras.get("episodes") is not None:  # an episode's datum: every token but the last
        return sum(len(e.tokens) - 1 for e in group.extras["episodes"] if e.model_tokens > 0)
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


LOSS_AGGREGATIONS = ("token", "sequence", "constant")
"""How a batch's per-token losses are averaged (chapter 10), all through the advantages a datum carries:

- ``"token"``: what the service does by itself. pytrio's planner (``plan_training_batch``) counts, over all datums
  of one ``forward_backward`` call, ``total_active_tokens`` (targets that are not ``-100``: every completion token,
  *including* those with advantage 0) and ``total_advantage_tokens`` (those with a non-zero advantage); the
  service divides the summed per-token loss by ``total_active_tokens`` (``dro``: by ``total_advantage_tokens``), as
  the offline backend does. Long completions weigh more (DAPO's token-level loss, TRL's ``bnpo``/``dapo``).
- ``"sequence"``: mean over each completion's tokens, then over completions (the GRPO paper, TRL's ``grpo``): each
  token's advantage times ``N / (n * L_i)`` (``N`` active tokens, ``n`` datums of the call, ``L_i`` the completion's
  length) undoes the service's ``1 / N`` and applies ``1 / (n * L_i)``.
- ``"constant"``: a fixed denominator, ``n * max_tokens`` (Dr. GRPO, TRL's ``dr_grpo``): advantages times
  ``N / (n * max_tokens)``.
"""


def aggregation_scales(data: Sequence, mode: str, max_tokens: int | None = None) -> list[float]:
    """The factor each datum's advantages are multiplied by so that the service's ``1 / total_active_tokens``
    becomes the normaliser of ``mode`` (:data:`LOSS_AGGREGATIONS`), for the datums of *one* ``forward_backward``.

    Exact for losses linear in the advantage (``importance_sampling``, ``ppo`` and ``cispo``: a positive factor
    scales their per-token loss and gradient); ``dro``'s penalty does not scale with it (the loop refuses it).

    Raises:
        ValueError: unknown ``mode``; ``"constant"`` without ``max_tokens >= 1``.

    Introduced in: chapter 10 (notebooks/10_grpo_variants).
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_aggregation must be one of {', '.join(map(repr, LOSS_AGGREGATIONS))}, got {mode!r}")
    if mode == "token":
        return [1.0] * len(data)
    lengths = [int(np.sum(d.loss_fn_inputs["target_tokens"].to_numpy() != -100)) for d in data]
    total, n = sum(lengths), len(data)
    if mode == "sequence":
        return [total / (n * length) for length in lengths]
    if not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise ValueError(f"loss_aggregation='constant' needs max_tokens >= 1, got {max_tokens!r}")
    return [total / (n * max_tokens)] * n


def scale_advantages(datum, factor: float):
    """A copy of an ``importance_sampling`` datum with its advantages multiplied by ``factor`` (1: the datum).

    Introduced in: chapter 10 (notebooks/10_grpo_variants).
    """
    if factor == 1.0:
        return datum
    from pytrio import Datum

    inputs = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
    inputs["advantages"] = (inputs["advantages"].astype(np.float64) * factor).astype(np.float32)
    return Datum(model_input=datum.model_input, loss_fn_inputs=inputs)


def minibatches(data: Sequence, num_substeps: int) -> list[list]:
    """Split a step's datums, in order, into ``num_substeps`` contiguous minibatches of near-equal size (the first
    ones one datum larger); fewer when there are fewer datums (no empty minibatch).

    Introduced in: chapter 10 (notebooks/10_grpo_variants).
    """
    if not _is_count(num_substeps):
        raise ValueError(f"num_substeps must be an integer >= 1, got {num_substeps!r}")
    k = min(num_substeps, len(data))
    if k == 0:
        return []
    size, extra = divmod(len(data), k)
    out, start = [], 0
    for i in range(k):
        stop = start + size + (i < extra)
        out.append(list(data[start:stop]))
        start = stop
    return out


def _is_count(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


def soft_overlong_penalty(lengths: Sequence[int], max_tokens: int, buffer: int) -> np.ndarray:
    """DAPO's soft overlong punishment, added to each completion's reward: 0 up to ``max_tokens - buffer`` tokens,
    then falling linearly to -1 at ``max_tokens``: ``(max_tokens - buffer - length) / buffer``.

    Raises:
        ValueError: ``buffer`` not in [1, max_tokens].

    Introduced in: chapter 10 (notebooks/10_grpo_variants).
    """
    if not (_is_count(buffer) and buffer <= max_tokens):
        raise ValueError(f"overlong_buffer must be an integer in [1, max_tokens={max_tokens}], got {buffer!r}")
    n = np.asarray(lengths, dtype=np.float64)
    return np.minimum(0.0, (max_tokens - buffer - n) / buffer).clip(-1.0, 0.0)


def truncated_importance_weights(trainer_lp, sampler_lp, cap: float) -> tuple[np.ndarray, np.ndarray]:
    """Truncated importance sampling (TIS): per token ``min(exp(lp_trainer - lp_sampler), cap)``, and where the
    cap binds.

    Returns:
        ``(weights, capped)``: float64 weights and a boolean mask of the tokens whose ratio exceeded ``cap``.

    Introduced in: chapter 10 (notebooks/10_grpo_variants).
    """
    ratio = exact.exp(np.asarray(trainer_lp, dtype=np.float64) - np.asarray(sampler_lp, dtype=np.float64))
    return np.minimum(ratio, cap), ratio > cap


def train_on_groups(
    training_client, groups: Sequence[Group], adam_params, skip_degenerate: bool = True,
    loss_fn: str = "importance_sampling", loss_fn_config: dict | None = None, *,
    loss_aggregation: str = "token", max_tokens: int | None = None, num_substeps: int = 1,
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
        loss_aggregation: how per-token losses are averaged (:data:`LOSS_AGGREGATIONS`; ``"token"``: the
            service's own normaliser), applied per ``forward_backward`` by :func:`aggregation_scales`.
        max_tokens: the sampling budget (the denominator of ``"constant"``).
        num_substeps: split the datums into this many minibatches (:func:`minibatches`), each with its own
            ``forward_backward`` and ``optim_step`` (tinker-cookbook's ``num_substeps``; chapter 10).

    Returns:
        The step's training metrics: ``train/datums`` sent, ``train/tokens`` (model-input tokens sent),
        ``train/tokens_skipped`` (tokens the skipped degenerate groups would have added), ``train/loss`` (the
        trainer's ``loss_mean``; NaN when nothing was sent), :func:`ratio_metrics` and the optimizer's metrics
        prefixed ``optim/``. With no datums (every group degenerate) nothing is sent and the weights stay. With
        ``num_substeps > 1``: ``train/substeps`` (minibatches sent), ``train/loss`` the mean of their losses, the
        ratio metrics over all of them (later minibatches see weights moved by earlier ones) and the last
        ``optim_step``'s metrics.

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
    losses, sent_data, outputs = [], [], []  # one minibatch, unscaled, by default (chapter 04's step)
    for part in minibatches(data, num_substeps):
        part = [scale_advantages(d, f) for d, f in zip(part, aggregation_scales(part, loss_aggregation, max_tokens))]
        out = training_client.forward_backward(part, loss_fn, sent).result()
        losses.append(float(out.metrics.get("loss_mean", float("nan"))))
        sent_data += part
        outputs += list(getattr(out, "loss_fn_outputs", None) or [])
        optim = training_client.optim_step(adam_params).result()  # only after forward_backward succeeded
    metrics["train/loss"] = float(np.mean(losses))
    if num_substeps > 1:
        metrics["train/substeps"] = float(len(losses))
    metrics.update(ratio_metrics(sent_data, SimpleNamespace(loss_fn_outputs=outputs), loss_fn, loss_fn_config))
    for k, v in (optim.metrics or {}).items():
        metrics[f"optim/{k}"] = float(v)
    return metrics


def completion_metrics(groups: Sequence[Group], max_tokens: int) -> dict[str, float]:
    """Length statistics of a step's completions (every scorer's step reports them).

    Returns:
        ``completion/tokens_mean``, ``completion/tokens_max``, ``completion/tokens_total`` (sampled tokens per
        completion and in all), ``completion/frac_max_tokens`` (share of completions that used the whole
        ``max_tokens`` budget, i.e. were cut off; an episode of chapter 12: a turn used it or a bound ended the
        episode) and ``completion/entropy`` (mean ``-logprob`` of the sampled
        tokens: an estimate of the sampling distribution's per-token entropy, in nats).

    Raises:
        ValueError: no groups, or groups without completions.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    lengths = np.array([len(s.tokens) for g in groups for s in g.sequences])
    if lengths.size == 0:
        raise ValueError("groups must hold at least one completion; got an empty step")
    episodes = [g.extras.get("episodes") for g in groups]
    if all(e is not None for e in episodes):  # chapter 12: a bound ended the episode or a turn used max_tokens
        cut = [e.truncated is not None or "length" in e.stop_reasons for group in episodes for e in group]
    else:
        cut = lengths >= max_tokens
    logprobs = [np.asarray(s.logprobs, dtype=np.float64) for g in groups for s in g.sequences if s.tokens]
    entropy = float(-np.concatenate(logprobs).mean()) if logprobs else float("nan")
    return {
        "completion/tokens_mean": float(lengths.mean()),
        "completion/tokens_max": float(lengths.max()),
        "completion/tokens_total": float(lengths.sum()),
        "completion/frac_max_tokens": float(np.mean(cut)),
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

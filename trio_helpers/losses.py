"""The policy losses PyTRIO serves, as functions of the importance ratio: objective, gradient, clipping.

For a sampled token with trainer logprob ``lp``, sampler logprob ``old`` and advantage ``A``, the ratio is
``rho = exp(lp - old)``. Each loss's per-token term (to be *minimised*; the service sums it over active tokens and
divides by the batch's token count, our reading of pytrio's planner) and its derivative with respect to ``lp``:

=====================  ===============================================  ============================================
loss                   per-token loss                                   d loss / d lp
=====================  ===============================================  ============================================
importance_sampling    ``-rho * A``                                     ``-rho * A``
ppo                    ``-min(rho * A, clip(rho, lo, hi) * A)``         ``-rho * A`` unclipped, ``0`` where clipped
cispo                  ``-stopgrad(clip(rho, lo, hi)) * A * lp``        ``-clip(rho, lo, hi) * A`` (``lo = 0``: no
                                                                        lower bound, the default)
dro                    ``-(A * lp - beta / 2 * (lp - old) ** 2)``       ``-(A - beta * log rho)``
=====================  ===============================================  ============================================

``loss_fn_config`` keys and defaults (:data:`LOSS_CONFIG`): pytrio 0.2.9 sends the dict to the service unchanged
and documents no keys, so the names and defaults here are *our reading* of the Tinker documentation (a service
with the same API shape): ``ppo`` clips the ratio to ``[0.8, 1.2]`` (PPO, Schulman et al., 2017); ``cispo`` is
one-sided, ``clip_low_threshold=0`` (no lower bound: the ratio is positive) and ``clip_high_threshold=4``, as
tinker-cookbook's loss-function tutorial documents it and as CISPO was published (MiniMax-M1, 2025, sets no lower
bound on the importance weight and tunes only the upper one; ScaleRL, Khatri et al., 2025, uses
``clip(rho, 0, eps_max)``); ``beta=0.05`` is DRO's quadratic penalty. The offline backend implements exactly
these. The loop (:func:`trio_helpers.rl.train_on_groups`) always sends the config merged with these defaults, so
the service never falls back to defaults of its own that could differ from the bounds ``train/clip_frac`` is
computed with. On the real service, check its documentation before relying on a key.

Introduced in: chapter 08 (notebooks/08_losses).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

LOSS_CONFIG: dict[str, dict[str, float]] = {
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
}
"""Policy losses and the ``loss_fn_config`` keys each takes, with defaults (our reading; see the module doc)."""


def check_loss_config(loss_fn: str, config: dict | None = None) -> dict[str, float]:
    """Validate a policy loss and its ``loss_fn_config``; return the config merged with the defaults.

    Args:
        loss_fn: one of :data:`LOSS_CONFIG` (names are case-sensitive here; pytrio lower-cases them).
        config: ``loss_fn_config`` as it will be sent (``None``: the defaults).

    Returns:
        ``{key: float}`` with every key of the loss.

    Raises:
        ValueError: an unknown loss (listing the supported ones), a key the loss does not take (naming the loss
            and its keys), a non-numeric or non-finite value, clip bounds in the wrong order
            (need ``0 <= low <= 1 <= high``; ``low = 0`` means no lower bound), or a negative ``beta``.

    Introduced in: chapter 08 (notebooks/08_losses).
    """
    if loss_fn not in LOSS_CONFIG:
        raise ValueError(f"unknown loss {loss_fn!r}; the policy losses are {', '.join(LOSS_CONFIG)}")
    defaults = LOSS_CONFIG[loss_fn]
    config = dict(config or {})
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        keys = ", ".join(defaults) if defaults else "no keys"
        raise ValueError(f"loss_fn_config key {unknown[0]!r} is not taken by loss {loss_fn!r}, which takes "
                         f"{keys}")
    for key, value in config.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
    merged = {**defaults, **{k: float(v) for k, v in config.items()}}
    if "clip_low_threshold" in merged:
        lo, hi = merged["clip_low_threshold"], merged["clip_high_threshold"]
        if not 0 <= lo <= 1 <= hi:
            raise ValueError(f"clip bounds of {loss_fn!r} must satisfy 0 <= clip_low_threshold <= 1 <= "
                             f"clip_high_threshold, got {lo} and {hi}; e.g. 0.8 and 1.2 (0 and 4 for "
                             f"cispo's one-sided default)")
    if merged.get("beta", 0.0) < 0:
        raise ValueError(f"beta of 'dro' must be >= 0, got {merged['beta']}")
    return merged


def _inputs(loss_fn: str, rho, adv, config: dict | None):
    """The checked config, ``rho`` and ``adv`` as float64 arrays, and ``rho`` clipped to the loss's bounds (for
    losses without bounds, ``rho`` itself)."""
    cfg = check_loss_config(loss_fn, config)
    rho, adv = np.asarray(rho, dtype=np.float64), np.asarray(adv, dtype=np.float64)
    if "clip_low_threshold" in cfg:
        return cfg, rho, adv, np.clip(rho, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return cfg, rho, adv, rho


def token_loss(loss_fn: str, rho, adv, config: dict | None = None):
    """The per-token loss as a function of the ratio ``rho`` and advantage ``adv`` (arrays broadcast).

    For ``cispo`` and ``dro`` the loss also depends on ``lp`` itself, not only on ``rho``; this returns it at
    ``old = 0`` (so ``lp = log rho``), which shifts it by a constant and leaves the gradient unchanged.

    Introduced in: chapter 08 (notebooks/08_losses).
    """
    cfg, rho, adv, clipped = _inputs(loss_fn, rho, adv, config)
    if loss_fn == "importance_sampling":
        return -rho * adv
    if loss_fn == "ppo":
        return -np.minimum(rho * adv, clipped * adv)
    lp = np.log(rho)
    if loss_fn == "cispo":
        return -clipped * adv * lp
    return -(adv * lp - cfg["beta"] / 2 * lp**2)


def token_gradient(loss_fn: str, rho, adv, config: dict | None = None):
    """``d loss / d lp`` per token: how hard (and which way) the update pushes the token's logprob.

    Negative values raise the token's probability. Zero where ``ppo`` clips.

    Introduced in: chapter 08 (notebooks/08_losses).
    """
    cfg, rho, adv, clipped = _inputs(loss_fn, rho, adv, config)
    if loss_fn == "importance_sampling":
        return -rho * adv
    if loss_fn == "ppo":
        return np.where(rho * adv <= clipped * adv, -rho * adv, 0.0)
    if loss_fn == "cispo":
        return -clipped * adv
    return -(adv - cfg["beta"] * np.log(rho))


def clipped_mask(loss_fn: str, rho, adv, config: dict | None = None) -> np.ndarray:
    """Which tokens the loss clips: ``ppo``, where the clipped term is the smaller one (no gradient); ``cispo``,
    where the ratio weight is outside the bounds (with the default ``clip_low_threshold=0``, only above
    ``clip_high_threshold``). Never for ``importance_sampling`` and ``dro``.

    Introduced in: chapter 08 (notebooks/08_losses).
    """
    cfg, rho, adv, clipped = _inputs(loss_fn, rho, adv, config)
    if loss_fn == "ppo":
        return (clipped * adv < rho * adv) & (clipped != rho)
    if loss_fn == "cispo":
        return (rho < cfg["clip_low_threshold"]) | (rho > cfg["clip_high_threshold"])
    return np.zeros(np.broadcast(rho, adv).shape, dtype=bool)

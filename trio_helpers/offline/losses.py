"""The offline trainer's loss functions, their exact gradients, and AdamW.

Input is a batch already validated by pytrio's own planner (``pytrio.client.training_batch.plan_training_batch``),
so the offline trainer accepts exactly what the real client would send.

**Normalisation (our reading of pytrio's contract).** pytrio computes, for each logical batch (one
``forward_backward`` call), ``total_active_tokens`` (targets that are not ``-100``, past the first position when
``auto_shift`` is on, and for ``cross_entropy`` with a non-zero weight) and ``total_advantage_tokens`` (active
tokens whose advantage is non-zero) and sends both with every chunk "so the loss is normalised over the whole logical
batch". The offline trainer therefore optimises

    L = (sum over active tokens of the per-token loss) / total_active_tokens

(``dro``: divided by ``total_advantage_tokens``). ``metrics`` report pytrio's keys: ``loss_sum`` (the numerator),
``token_count`` (active tokens) and ``loss_mean = loss_sum / token_count``.

Per-token losses, with ``lp`` the new logprob of the target, ``old`` the sampling logprob, ``A`` the advantage and
``r = exp(lp - old)``:

=====================  ==============================================================  ==========================
loss                    per-token loss                                                 config (defaults)
=====================  ==============================================================  ==========================
cross_entropy           ``-w * lp`` (``w`` = ``weights``, default 1)                    none
importance_sampling     ``-r * A``                                                      none
ppo                     ``-min(r * A, clip(r, lo, hi) * A)``                            clip_low_threshold (0.8),
                                                                                       clip_high_threshold (1.2)
cispo                   ``-stopgrad(clip(r, lo, hi)) * A * lp``                         clip_low_threshold (0: no
                                                                                       lower bound),
                                                                                       clip_high_threshold (4.0)
dro                     ``-(A * lp - beta / 2 * (lp - old) ** 2)``                      beta (0.05)
=====================  ==============================================================  ==========================

The defaults and checks are those of the book's ``trio_helpers.losses`` (``LOSS_CONFIG``, ``check_loss_config``;
a test keeps them equal): ``cispo`` is one-sided by default, as Tinker documents it and as MiniMax-M1 published it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trio_helpers.offline import exact
from trio_helpers.offline.model import NUM_FEATURES, TinyLM, sequence_row_blocks

LOSS_CONFIG_KEYS = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
}


def resolve_loss_config(loss_fn: str, config: dict[str, object] | None) -> dict[str, float]:
    """Merge ``loss_fn_config`` with the defaults of ``loss_fn``; reject keys the loss does not use."""
    defaults = LOSS_CONFIG_KEYS[loss_fn]
    config = dict(config or {})
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        allowed = ", ".join(sorted(defaults)) or "no keys"
        raise ValueError(
            f"loss_fn_config has keys {unknown} that loss {loss_fn!r} does not use; it accepts {allowed}."
        )
    merged = {**defaults, **{k: float(v) for k, v in config.items()}}
    if "clip_low_threshold" in merged and not 0 <= merged["clip_low_threshold"] <= 1 <= merged["clip_high_threshold"]:
        raise ValueError(
            "ppo/cispo clip thresholds are bounds on the ratio exp(lp - old): need 0 <= clip_low_threshold <= 1 <= "
            f"clip_high_threshold, got {merged['clip_low_threshold']} and {merged['clip_high_threshold']}."
        )
    return merged


def per_token_loss(loss_fn: str, lp, old, adv, w, cfg) -> tuple[np.ndarray, np.ndarray]:
    """Per-token loss values and their derivative with respect to ``lp`` (elementwise, numpy arrays)."""
    if loss_fn == "cross_entropy":
        return -w * lp, -w
    r = exact.exp(lp - old)
    if loss_fn == "importance_sampling":
        return -r * adv, -r * adv
    if loss_fn in ("ppo", "cispo"):
        clipped = np.clip(r, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        if loss_fn == "ppo":
            unclipped_is_min = r * adv <= clipped * adv
            loss = -np.where(unclipped_is_min, r * adv, clipped * adv)
            return loss, np.where(unclipped_is_min, -r * adv, 0.0)
        return -clipped * adv * lp, -clipped * adv
    if loss_fn == "dro":
        beta = cfg["beta"]
        gap = lp - old
        return -(adv * lp - 0.5 * beta * (gap * gap)), -adv + beta * gap
    raise ValueError(f"unsupported loss {loss_fn!r}")


@dataclass
class ForwardResult:
    per_sample_logprobs: list[np.ndarray]
    loss_sum: float
    token_count: int
    grads: dict[str, np.ndarray] | None


def run_batch(model: TinyLM, plan, loss_fn: str, cfg: dict[str, float], auto_shift: bool, backward: bool):
    """Forward (and optionally backward) over every sample of a validated ``TrainingBatchPlan``."""
    samples = [s for chunk in plan.chunks for s in chunk.samples]
    rows_of, tgt, old, adv, w, active, valid_list = [], [], [], [], [], [], []
    # The forward pass runs over distinct blocks of feature rows: the completions of one sampling request share
    # their prompt's block (see sequence_row_blocks), computed once; a row's numbers do not depend on which
    # other rows share the pass, so every logprob and gradient is the same as with every row computed.
    blocks: list[np.ndarray] = []
    block_start: dict[int, int] = {}  # id(block) -> its first row in the pass
    n_rows = 0
    for s in samples:
        tokens = s.model_input.to_ints()
        where = []
        for block in sequence_row_blocks(tokens):
            first = block_start.get(id(block))
            if first is None:
                first = block_start[id(block)] = n_rows
                blocks.append(block)
                n_rows += len(block)
            where.append(np.arange(first, first + len(block)))
        row_of_position = np.concatenate(where)
        T = len(tokens)
        target = np.asarray(s.target_tokens, dtype=np.int64)
        start = 1 if auto_shift else 0
        # with auto_shift the label at position i is predicted from the context ending at i - 1 (position 0 has
        # no label: it reads row 0, masked out below)
        pred_rows = row_of_position[np.maximum(np.arange(T) - start, 0)]
        mask = np.arange(T) >= start
        mask &= target != -100
        valid_list.append(mask.copy())
        if loss_fn == "cross_entropy":
            weights = np.asarray(s.weights, dtype=np.float64)
            mask &= weights != 0.0
        else:
            weights = np.ones(T)
        rows_of.append(pred_rows)
        tgt.append(np.where(target == -100, 0, target))
        w.append(weights)
        old.append(np.asarray(getattr(s, "logprobs", np.zeros(T)), dtype=np.float64))
        adv.append(np.asarray(getattr(s, "advantages", np.zeros(T)), dtype=np.float64))
        active.append(mask)
    keys = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
    h, shifted, norm = model.log_softmax_parts(keys)  # log_softmax = shifted - norm, row by row
    rows = np.concatenate(rows_of)
    targets = np.concatenate(tgt)
    mask = np.concatenate(active)
    lp = shifted[rows, targets] - norm[rows, 0]
    loss, dloss = per_token_loss(loss_fn, lp, np.concatenate(old), np.concatenate(adv), np.concatenate(w), cfg)
    loss = np.where(mask, loss, 0.0)
    # per-token logprobs are reported wherever a label exists (even with weight 0); 0.0 where none does
    valid = np.concatenate(valid_list)
    per_sample, start = [], 0
    for m in active:
        n = len(m)
        per_sample.append(np.where(valid[start : start + n], lp[start : start + n], 0.0))
        start += n
    token_count = int(mask.sum())
    denom = plan.totals.total_advantage_tokens if loss_fn == "dro" else plan.totals.total_active_tokens
    grads = None
    if backward and denom > 0:
        coef = np.where(mask, dloss, 0.0) / denom
        sel = coef != 0.0
        trained = rows[sel]
        grads, _ = model.adapter_grads(h[trained], keys[trained, NUM_FEATURES], shifted[trained] - norm[trained],
                                       targets[sel], coef[sel])
    elif backward:
        grads = {k: np.zeros_like(v) for k, v in model.adapter.params().items()}
    return ForwardResult(per_sample, float(loss.sum()), token_count, grads)


def adamw_step(params: dict[str, np.ndarray], grads: dict[str, np.ndarray], state: dict, hp) -> dict[str, float]:
    """One AdamW step in place, honouring every ``AdamParams`` field; returns metrics.

    ``grad_clip_norm > 0`` rescales the gradients so their global L2 norm is at most that value; weight decay is
    decoupled (``p -= lr * weight_decay * p``), as in AdamW.
    """
    norm = float(np.sqrt(sum(float((g * g).sum()) for g in grads.values())))
    factor = 1.0
    if hp.grad_clip_norm and hp.grad_clip_norm > 0 and norm > hp.grad_clip_norm:
        factor = hp.grad_clip_norm / (norm + 1e-12)
    state["step"] = state.get("step", 0) + 1
    t = state["step"]
    for name, p in params.items():
        g = grads[name] * factor
        m = state.setdefault(("m", name), np.zeros_like(p))
        v = state.setdefault(("v", name), np.zeros_like(p))
        m *= hp.beta1
        m += (1 - hp.beta1) * g
        v *= hp.beta2
        v += (1 - hp.beta2) * g * g
        m_hat = m / (1 - exact.ipow(hp.beta1, t))  # (float ** is the C library's pow: not the same bits everywhere)
        v_hat = v / (1 - exact.ipow(hp.beta2, t))
        if hp.weight_decay:
            p -= hp.learning_rate * hp.weight_decay * p
        p -= hp.learning_rate * m_hat / (np.sqrt(v_hat) + hp.eps)
    return {"grad_norm": norm, "learning_rate": float(hp.learning_rate), "step": float(t)}

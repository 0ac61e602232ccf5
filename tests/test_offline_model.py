"""The offline backend's numbers: logprob consistency, exact gradients, AdamW, determinism, snapshots, checkpoints.

Everything runs on ``offline/tiny`` (random frozen weights, instant). Gradients are checked against central finite
differences of the documented objective (see trio_helpers/offline/losses.py): ``loss_sum / total_active_tokens``
(``dro``: ``/ total_advantage_tokens``), with the denominators computed by pytrio's own planner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import pytrio as trio
from pytrio.client.training_batch import plan_training_batch
from pytrio.errors.base import ValidationError

from trio_helpers import connect
from trio_helpers.offline import exact
from trio_helpers.offline.service import TRAINING_LIMITS
from trio_helpers.offline.tokenizer import ENDOFTEXT_ID, IM_END_ID, VOCAB_SIZE

MODEL = "offline/tiny"
RANK = 8
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    return connect("offline", in_process=True, latency=0.0, home=tmp_path_factory.mktemp("offline_home"))


@pytest.fixture(scope="module")
def tok(svc):
    return svc.create_sampling_client(MODEL).get_tokenizer()


def float64_matmul(a, b):
    """numpy's float64 product in place of the exact one (for finite differences), also for pre-rounded operands."""
    return np.matmul(getattr(a, "value", a), getattr(b, "value", b))


def chat_prompt(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def params(**kw) -> trio.SamplingParams:
    return trio.SamplingParams(**{"max_tokens": 16, "seed": 0, **kw})


def mi(tokens) -> trio.ModelInput:
    return trio.ModelInput.from_ints([int(t) for t in tokens])


def set_b(tc, seed: int = 1, scale: float = 0.05) -> None:
    """Give the adapter a non-zero B (a fresh adapter has B = 0, so dL/dA would be 0)."""
    rng = np.random.default_rng(seed)
    b = tc._model.adapter.B
    b[...] = rng.normal(0.0, scale, size=b.shape)


def trained_client(svc, steps: int = 2, seed: int = 0):
    """A training client after a few cross-entropy steps (so its adapter is far from the base model)."""
    tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=seed)
    data = [xent_datum(list(b"The answer is 42.\n"))]
    for _ in range(steps):
        tc.forward_backward(data)
        tc.optim_step(trio.AdamParams(learning_rate=0.05))
    tc.forward(data).result()  # wait for the queue
    return tc


def xent_datum(tokens: list[int], weights=None) -> trio.Datum:
    inputs = {"target_tokens": np.asarray(tokens[1:], dtype=np.int64)}
    if weights is not None:
        inputs["weights"] = np.asarray(weights, dtype=np.float32)
    return trio.Datum(model_input=mi(tokens[:-1]), loss_fn_inputs=inputs)


# ---------------------------------------------------------------------------------------- logprob consistency
def _is_datum(prompt: list[int], completion: list[int], logprobs, adv: float = 0.0) -> trio.Datum:
    """The tutorial-A layout: input prompt + completion[:-1], targets [0] * (P - 1) + completion."""
    pad = len(prompt) - 1
    return trio.Datum(
        model_input=mi(prompt + completion[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray([0] * pad + completion, dtype=np.int64),
            "logprobs": np.asarray([0.0] * pad + list(logprobs), dtype=np.float32),
            "advantages": np.asarray([0.0] * pad + [adv] * len(completion), dtype=np.float32),
        },
    )


def test_sample_compute_logprobs_and_forward_agree(svc, tok):
    tc = trained_client(svc)
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = chat_prompt(tok, "What is 12 + 30?")
    res = sampler.sample(mi(prompt), num_samples=3, sampling_params=params(max_tokens=24, seed=5)).result()
    P = len(prompt)
    data = []
    for seq in res.sequences:
        assert len(seq.tokens) >= 2
        full = sampler.compute_logprobs(mi(prompt + seq.tokens)).result()
        assert full[0] is None and len(full) == P + len(seq.tokens)
        np.testing.assert_allclose(full[P:], seq.logprobs, rtol=0, atol=1e-5)
        data.append(_is_datum(prompt, seq.tokens, seq.logprobs))
    out = tc.forward(data, loss_fn="importance_sampling").result()
    for seq, lo in zip(res.sequences, out.loss_fn_outputs):
        lp = lo["logprobs"].to_numpy()
        assert lp.shape == (P - 1 + len(seq.tokens),)
        np.testing.assert_allclose(lp[P - 1 :], seq.logprobs, rtol=0, atol=1e-5)

    # auto_shift: targets aligned with the input (target[i] = token[i]); the trainer shifts them by one
    shifted = [
        trio.Datum(
            model_input=mi(prompt + seq.tokens),
            loss_fn_inputs={
                "target_tokens": np.asarray(prompt + seq.tokens, dtype=np.int64),
                "logprobs": np.asarray([0.0] * P + seq.logprobs, dtype=np.float32),
                "advantages": np.zeros(P + len(seq.tokens), dtype=np.float32),
            },
        )
        for seq in res.sequences
    ]
    out = tc.forward(shifted, loss_fn="importance_sampling", auto_shift=True).result()
    for seq, lo in zip(res.sequences, out.loss_fn_outputs):
        np.testing.assert_allclose(lo["logprobs"].to_numpy()[P:], seq.logprobs, rtol=0, atol=1e-5)
    # auto_shift drops the first label of every sample from the token count
    assert out.metrics["token_count"] == sum(P + len(s.tokens) - 1 for s in res.sequences)


def test_prompt_logprobs_and_topk(svc, tok):
    sampler = trained_client(svc).save_weights_and_get_sampling_client()
    prompt = chat_prompt(tok, "Name a prime.")
    k = 5
    res = sampler.sample(
        mi(prompt), sampling_params=params(max_tokens=3), include_prompt_logprobs=True, topk_prompt_logprobs=k
    ).result()
    expected = sampler.compute_logprobs(mi(prompt)).result()
    assert res.prompt_logprobs[0] is None and expected[0] is None
    np.testing.assert_allclose(res.prompt_logprobs[1:], expected[1:], rtol=0, atol=1e-12)
    top = res.topk_prompt_logprobs
    assert len(top) == len(prompt) and top[0] is None
    for i, entry in enumerate(top[1:], start=1):
        assert len(entry) == k
        values = [lp for _, lp in entry]
        assert values == sorted(values, reverse=True)
        assert all(0 <= t < VOCAB_SIZE for t, _ in entry)
        # the actual prompt token's logprob can never beat the best candidate
        assert expected[i] <= values[0] + 1e-12
        if prompt[i] in [t for t, _ in entry]:
            assert dict(entry)[prompt[i]] == pytest.approx(expected[i], abs=1e-12)
    # without the flags the lists stay empty
    plain = sampler.sample(mi(prompt), sampling_params=params(max_tokens=3)).result()
    assert plain.prompt_logprobs == [] and plain.topk_prompt_logprobs == []


# ------------------------------------------------------------------------------------------ finite differences
def _policy_batch(tc, rng, offsets=(-0.6, -0.05, 0.0, 0.05, 0.6)):
    """Two samples with -100 labels, zero advantages and old logprobs that put some ratios outside [0.8, 1.2]."""
    data = []
    for n in (9, 13):
        tokens = [int(t) for t in rng.integers(0, 256, size=n + 1)]
        targets = tokens[1:]
        targets[1] = -100
        data.append((tokens[:-1], targets))
    probe = [
        trio.Datum(
            model_input=mi(x),
            loss_fn_inputs={"target_tokens": np.asarray(y, dtype=np.int64)},
        )
        for x, y in data
    ]
    current = [lo["logprobs"].to_numpy().astype(np.float64) for lo in tc.forward(probe).result().loss_fn_outputs]
    out = []
    for (x, y), lp in zip(data, current):
        adv = rng.normal(0.0, 1.0, size=len(x))
        adv[[0, 3]] = 0.0
        old = lp + rng.choice(offsets, size=len(x))  # ratio exp(lp - old) in {1.82, 1.05, 1, 0.95, 0.55}
        out.append(
            trio.Datum(
                model_input=mi(x),
                loss_fn_inputs={
                    "target_tokens": np.asarray(y, dtype=np.int64),
                    "logprobs": old.astype(np.float32),
                    "advantages": adv.astype(np.float32),
                },
            )
        )
    return out


def _xent_batch(rng, auto_shift: bool):
    data = []
    for n in (8, 12):
        tokens = [int(t) for t in rng.integers(0, 256, size=n + 1)]
        x, y = (tokens[1:], tokens[1:]) if auto_shift else (tokens[:-1], tokens[1:])
        y[2] = -100
        w = rng.uniform(0.2, 2.0, size=n)
        w[4] = 0.0
        data.append(
            trio.Datum(
                model_input=mi(x),
                loss_fn_inputs={"target_tokens": np.asarray(y, dtype=np.int64), "weights": w.astype(np.float32)},
            )
        )
    return data


def _cispo_as_weighted_xent(tc, data, config):
    # cispo's documented defaults: one-sided, no lower bound (0) and 4 above
    lo, hi = (config or {}).get("clip_low_threshold", 0.0), (config or {}).get("clip_high_threshold", 4.0)
    current = tc.forward(data, loss_fn="cispo", loss_fn_config=config).result().loss_fn_outputs
    out = []
    for d, lo_out in zip(data, current):
        lp = lo_out["logprobs"].to_numpy().astype(np.float64)
        old = d.loss_fn_inputs["logprobs"].to_numpy().astype(np.float64)
        adv = d.loss_fn_inputs["advantages"].to_numpy().astype(np.float64)
        weights = np.clip(np.exp(lp - old), lo, hi) * adv
        out.append(
            trio.Datum(
                model_input=d.model_input,
                loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": weights},
            )
        )
    return out


FD_CASES = [
    ("cross_entropy", None, False),
    ("cross_entropy", None, True),
    ("importance_sampling", None, False),
    ("ppo", None, False),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, False),
    ("cispo", None, False),
    ("cispo", {"clip_low_threshold": 0.97, "clip_high_threshold": 1.01}, False),
    ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 1.01}, False),
    ("dro", None, False),
    ("dro", {"beta": 0.5}, True),
]


@pytest.mark.parametrize("loss_fn,config,auto_shift", FD_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in FD_CASES])
def test_gradients_match_finite_differences(svc, loss_fn, config, auto_shift, monkeypatch):
    """The calculus: analytic gradients against central differences, with the model's matrix products in plain
    float64 (``exact.matmul`` rounds its operands to 24 bits, a step far coarser than a useful ``eps``; the next
    test checks that the rounded products give the same gradients to that precision)."""
    monkeypatch.setattr(exact, "matmul", float64_matmul)
    rng = np.random.default_rng(7)
    tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=3)
    set_b(tc)
    data = _xent_batch(rng, auto_shift) if loss_fn == "cross_entropy" else _policy_batch(tc, rng)
    plan = plan_training_batch(
        data, loss_fn=loss_fn, auto_shift=auto_shift, limits=TRAINING_LIMITS, tokenizer_vocab_size=VOCAB_SIZE
    )
    denom = plan.totals.total_advantage_tokens if loss_fn == "dro" else plan.totals.total_active_tokens
    assert denom > 0

    def objective() -> float:
        out = tc.forward(data, loss_fn=loss_fn, loss_fn_config=config, auto_shift=auto_shift).result()
        return out.metrics["loss_sum"] / denom

    if loss_fn == "cispo":
        # CISPO's ratio is stop-gradient: its objective is -c * A * lp with c = clip(r) frozen at the current
        # weights, i.e. a cross-entropy with weights c * A (same labels), divided by CISPO's own denominator.
        frozen = _cispo_as_weighted_xent(tc, data, config)

        def objective() -> float:  # noqa: F811 - the stop-gradient surrogate replaces the plain objective
            return tc.forward(frozen, loss_fn="cross_entropy").result().metrics["loss_sum"] / denom

    tc.forward_backward(data, loss_fn=loss_fn, loss_fn_config=config, auto_shift=auto_shift).result()
    grads = {k: v.copy() for k, v in tc._grads.items()}
    adapter = tc._model.adapter
    eps = 1e-6
    for name, param in (("A", adapter.A), ("B", adapter.B)):
        g = grads[name]
        assert g.shape == param.shape and np.all(np.isfinite(g))
        assert np.abs(g).max() > 0, f"{name}: all-zero gradient"
        flat = np.argsort(-np.abs(g), axis=None)
        picks = list(flat[:3]) + list(rng.choice(g.size, size=2, replace=False))
        fd, an = [], []
        for idx in picks:
            pos = np.unravel_index(idx, g.shape)
            keep = param[pos]
            param[pos] = keep + eps
            up = objective()
            param[pos] = keep - eps
            down = objective()
            param[pos] = keep
            fd.append((up - down) / (2 * eps))
            an.append(g[pos])
        scale = np.abs(g).max()
        np.testing.assert_allclose(an, fd, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{loss_fn} d/d{name}")


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo", "dro"])
def test_rounded_products_give_the_float64_gradients_to_their_precision(svc, loss_fn, monkeypatch):
    """exact.matmul rounds each operand to its share of 53 bits (24 for the model's 32-wide products, about 20 for a
    gradient's long sums): gradients through it equal the float64 ones to about 1e-5 of their largest entry."""
    rng = np.random.default_rng(11)
    tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=3)
    set_b(tc)
    data = _xent_batch(rng, False) if loss_fn == "cross_entropy" else _policy_batch(tc, rng)
    tc.forward_backward(data, loss_fn=loss_fn).result()
    rounded = {k: v.copy() for k, v in tc._grads.items()}
    tc._grads = None
    monkeypatch.setattr(exact, "matmul", float64_matmul)
    tc.forward_backward(data, loss_fn=loss_fn).result()
    for k in ("A", "B"):
        g = tc._grads[k]
        scale = np.abs(g).max()
        assert scale > 0
        np.testing.assert_allclose(rounded[k], g, rtol=0, atol=1e-5 * scale, err_msg=k)
        assert not np.array_equal(rounded[k], g)  # the products are rounded: the bits differ


def _documented_loss(loss_fn, lp, old, adv, w, cfg):
    """The per-token losses of the table in trio_helpers/offline/losses.py, written out independently."""
    r = np.exp(lp - old)
    # the documented defaults: ppo [0.8, 1.2]; cispo one-sided, no lower bound (0) and 4 above
    default_lo, default_hi = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}.get(loss_fn, (None, None))
    lo = cfg.get("clip_low_threshold", default_lo)
    hi = cfg.get("clip_high_threshold", default_hi)
    return {
        "cross_entropy": lambda: -w * lp,
        "importance_sampling": lambda: -r * adv,
        "ppo": lambda: -np.minimum(r * adv, np.clip(r, lo, hi) * adv),
        "cispo": lambda: -np.clip(r, lo, hi) * adv * lp,
        "dro": lambda: -(adv * lp - cfg.get("beta", 0.05) / 2 * (lp - old) ** 2),
    }[loss_fn]()


@pytest.mark.parametrize("loss_fn,config,auto_shift", FD_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in FD_CASES])
def test_loss_values_match_documented_formulas(svc, loss_fn, config, auto_shift):
    rng = np.random.default_rng(17)
    tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=3)
    set_b(tc)
    data = _xent_batch(rng, auto_shift) if loss_fn == "cross_entropy" else _policy_batch(tc, rng)
    out = tc.forward(data, loss_fn=loss_fn, loss_fn_config=config, auto_shift=auto_shift).result()
    total, count = 0.0, 0
    for d, lo_out in zip(data, out.loss_fn_outputs):
        inputs = {k: v.to_numpy().astype(np.float64) for k, v in d.loss_fn_inputs.items()}
        n = len(d.model_input)
        lp = lo_out["logprobs"].to_numpy().astype(np.float64)
        active = inputs["target_tokens"] != -100
        if auto_shift:
            active[0] = False
        w = inputs.get("weights", np.ones(n))
        if loss_fn == "cross_entropy":
            active &= w != 0
        per_token = _documented_loss(
            loss_fn, lp, inputs.get("logprobs", np.zeros(n)), inputs.get("advantages", np.zeros(n)), w, config or {}
        )
        total += per_token[active].sum()
        count += int(active.sum())
        assert np.all(lp[~active & (inputs["target_tokens"] == -100)] == 0.0)  # no label, no logprob
    assert out.metrics["token_count"] == count
    assert out.metrics["loss_sum"] == pytest.approx(total, rel=1e-5, abs=1e-5)
    assert out.metrics["loss_mean"] == pytest.approx(out.metrics["loss_sum"] / count, rel=1e-12)


def test_ppo_clipped_tokens_get_no_gradient(svc):
    """PPO with every ratio above the clip range and positive advantages: the objective is flat."""
    tc = svc.create_lora_training_client(MODEL, rank=RANK)
    set_b(tc)
    x = list(b"clipped ratios")
    probe = trio.Datum(model_input=mi(x[:-1]), loss_fn_inputs={"target_tokens": np.asarray(x[1:], dtype=np.int64)})
    lp = tc.forward([probe]).result().loss_fn_outputs[0]["logprobs"].to_numpy()
    datum = trio.Datum(
        model_input=mi(x[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(x[1:], dtype=np.int64),
            "logprobs": (lp - 1.0).astype(np.float32),  # ratio e = 2.7 > 1.2
            "advantages": np.ones(len(x) - 1, dtype=np.float32),
        },
    )
    tc.forward_backward([datum], loss_fn="ppo").result()
    assert all(np.abs(g).max() == 0.0 for g in tc._grads.values())
    tc2 = svc.create_lora_training_client(MODEL, rank=RANK)
    set_b(tc2)
    tc2.forward_backward([datum], loss_fn="importance_sampling").result()
    assert np.abs(tc2._grads["B"]).max() > 0


# -------------------------------------------------------------------------------- accumulation and the optimizer
def _fresh(svc):
    tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=11)
    set_b(tc, seed=2)
    return tc


def _grads_of(svc, *batches, loss_fn="cross_entropy"):
    tc = _fresh(svc)
    for batch in batches:
        tc.forward_backward(batch, loss_fn=loss_fn).result()
    return {k: v.copy() for k, v in tc._grads.items()}


def _count(batch, loss_fn):
    totals = plan_training_batch(
        batch, loss_fn=loss_fn, auto_shift=False, limits=TRAINING_LIMITS, tokenizer_vocab_size=VOCAB_SIZE
    ).totals
    return totals.total_advantage_tokens if loss_fn == "dro" else totals.total_active_tokens


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "dro"])
def test_gradient_accumulation_follows_per_call_normalisation(svc, loss_fn):
    """losses.py: each forward_backward call is normalised over its own logical batch and calls add up.

    So two calls give g1 + g2, while one call on the union gives the token-weighted mean
    (n1 * g1 + n2 * g2) / (n1 + n2): equal to the accumulated gradient only up to that normalisation.
    """
    rng = np.random.default_rng(5)
    if loss_fn == "cross_entropy":
        d1 = [xent_datum(list(b"first batch: 2 + 2 = 4"))]
        d2 = [xent_datum(list(b"second, longer batch: 10 * 3 = 30\n"))]
    else:
        probe = _fresh(svc)
        d1, d2 = _policy_batch(probe, rng)[:1], _policy_batch(probe, rng)[1:]
    n1, n2 = _count(d1, loss_fn), _count(d2, loss_fn)
    assert n1 != n2
    g1, g2 = _grads_of(svc, d1, loss_fn=loss_fn), _grads_of(svc, d2, loss_fn=loss_fn)
    acc = _grads_of(svc, d1, d2, loss_fn=loss_fn)
    union = _grads_of(svc, d1 + d2, loss_fn=loss_fn)
    for k in ("A", "B"):
        # each call's products are rounded on their own (exact.matmul): equal to about 1e-5 of the largest entry
        tol = 1e-5 * np.abs(acc[k]).max()
        np.testing.assert_allclose(acc[k], g1[k] + g2[k], rtol=0, atol=tol)
        np.testing.assert_allclose(union[k], (n1 * g1[k] + n2 * g2[k]) / (n1 + n2), rtol=0, atol=tol)
        assert not np.allclose(acc[k], union[k])


def test_optim_step_clears_gradients(svc):
    data = [xent_datum(list(b"clear the gradients"))]
    tc = _fresh(svc)
    tc.forward_backward(data).result()
    first = {k: v.copy() for k, v in tc._grads.items()}
    tc.optim_step(trio.AdamParams(learning_rate=0.0)).result()  # lr 0: weights unchanged, grads consumed
    assert tc._grads is None
    tc.forward_backward(data).result()
    for k in first:
        np.testing.assert_allclose(tc._grads[k], first[k], rtol=1e-12)


def _adamw_reference(params, grads_per_step, hp):
    """A hand-written AdamW (decoupled weight decay, global-norm clipping, bias correction)."""
    p = {k: v.copy() for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, grads in enumerate(grads_per_step, start=1):
        norm = np.sqrt(sum((g**2).sum() for g in grads.values()))
        clip = hp.grad_clip_norm / norm if 0 < hp.grad_clip_norm < norm else 1.0
        for k in p:
            g = grads[k] * clip
            m[k] = hp.beta1 * m[k] + (1 - hp.beta1) * g
            v[k] = hp.beta2 * v[k] + (1 - hp.beta2) * g * g
            m_hat = m[k] / (1 - hp.beta1**t)
            v_hat = v[k] / (1 - hp.beta2**t)
            p[k] = p[k] - hp.learning_rate * hp.weight_decay * p[k]
            p[k] = p[k] - hp.learning_rate * m_hat / (np.sqrt(v_hat) + hp.eps)
    return p


ADAM_CASES = {
    "defaults": trio.AdamParams(),
    "learning_rate": trio.AdamParams(learning_rate=3e-2),
    "beta1": trio.AdamParams(learning_rate=3e-2, beta1=0.3),
    "beta2": trio.AdamParams(learning_rate=3e-2, beta2=0.5),
    "eps": trio.AdamParams(learning_rate=3e-2, eps=1e-2),
    "weight_decay": trio.AdamParams(learning_rate=3e-2, weight_decay=0.5),
    "grad_clip_norm": trio.AdamParams(learning_rate=3e-2, eps=1e-3, grad_clip_norm=1e-3),
}


def _run_adam(svc, hp):
    tc = _fresh(svc)
    start = {k: v.copy() for k, v in tc._model.adapter.params().items()}
    grads, metrics = [], []
    for text in (b"step one: 1 + 1 = 2", b"step two, different data: 7 * 6 = 42"):
        tc.forward_backward([xent_datum(list(text))]).result()
        grads.append({k: v.copy() for k, v in tc._grads.items()})
        metrics.append(tc.optim_step(hp).result().metrics)
    end = {k: v.copy() for k, v in tc._model.adapter.params().items()}
    return start, grads, end, metrics


@pytest.mark.parametrize("field", list(ADAM_CASES))
def test_adamw_matches_reference_and_honours_each_field(svc, field):
    hp = ADAM_CASES[field]
    start, grads, end, metrics = _run_adam(svc, hp)
    expected = _adamw_reference(start, grads, hp)
    for k in start:
        np.testing.assert_allclose(end[k], expected[k], rtol=1e-9, atol=1e-13, err_msg=f"{field}: {k}")
    assert metrics[0]["grad_norm"] == pytest.approx(np.sqrt(sum((g**2).sum() for g in grads[0].values())))
    if field != "defaults":
        # the field matters: the same run with that one field at its reference value ends elsewhere
        base = trio.AdamParams(learning_rate=3e-2) if field != "learning_rate" else trio.AdamParams()
        if field == "grad_clip_norm":
            base = trio.AdamParams(learning_rate=3e-2, eps=1e-3)
        _, _, other, _ = _run_adam(svc, base)
        assert not np.allclose(end["B"], other["B"], rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------ determinism
def test_same_seed_same_response_different_seed_differs(svc, tok):
    sampler = trained_client(svc).save_weights_and_get_sampling_client()
    prompt = mi(chat_prompt(tok, "Pick a number."))
    a = sampler.sample(prompt, num_samples=4, sampling_params=params(seed=123)).result()
    b = sampler.sample(prompt, num_samples=4, sampling_params=params(seed=123)).result()
    c = sampler.sample(prompt, num_samples=4, sampling_params=params(seed=124)).result()
    assert a == b
    assert [s.tokens for s in a.sequences] != [s.tokens for s in c.sequences]
    # a group's samples are different draws, not copies
    assert len({tuple(s.tokens) for s in a.sequences}) > 1


# ------------------------------------------------------------------------------------------ batching
_INVARIANCE_CHECK = """
import numpy as np
from trio_helpers.offline import catalog
from trio_helpers.offline.model import Adapter, TinyLM, sampler_logits
for name in ("offline/tiny", "Qwen/Qwen3.5-4B"):
    base = catalog.base_weights(name)
    adapter = Adapter.fresh(base.dim, 8, seed=1, alpha=16.0, final_row_scale=1.0)
    rng = np.random.default_rng(3)
    adapter.B[...] = rng.normal(0.0, 0.05, size=adapter.B.shape)
    adapter.C[1] = rng.normal(0.0, 0.1, size=adapter.C.shape[1])
    model = TinyLM(base, adapter)
    keys = rng.integers(0, 2**62, size=(400, 14))
    keys[:, 13] = np.arange(400) % 7 == 0  # some rows on the final-answer slot
    whole = sampler_logits(model, keys)
    for n in list(range(1, 70)) + [127, 128, 129, 255, 256, 257, 399]:
        for start in (0, 1, 5):
            part = sampler_logits(model, keys[start:start + n])
            assert np.array_equal(part, whole[start:start + n]), (name, n, start)
    assert np.array_equal(model.forward(keys)[1], whole), name
print("ok")
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_sampler_logits_are_batch_invariant(threads):
    """A row's logits are the same bits in any batch (sizes 1..69 and larger, odd and even, any offset), with
    one BLAS thread and with two, so batched sampling never depends on which requests share a step, and the
    trainer's forward pass gives the sampler's numbers."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", _INVARIANCE_CHECK.replace("{threads}", str(threads))],
                         capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_batched_sampling_gives_each_request_its_own_completions(svc, tok):
    """Requests sampled together (continuous batching) return exactly what each returns alone, whatever the
    company: other prompts, group sizes, temperatures, greedy, top-k/top-p, stop strings, another model."""
    sampler = trained_client(svc).save_weights_and_get_sampling_client()
    other = svc.create_sampling_client(MODEL)
    cases = [
        (sampler, "Ann has 3 apples.", 4, params(max_tokens=24, seed=1)),
        (sampler, "Pick a number.", 3, params(max_tokens=40, seed=2)),
        (sampler, "Ann has 3 apples.", 1, params(max_tokens=24, seed=3, temperature=0.0)),
        (sampler, "Say hi.", 2, params(max_tokens=30, seed=4, temperature=0.7, top_k=20)),
        (sampler, "Say hi.", 5, params(max_tokens=12, seed=5, top_p=0.8, stop=["\n"])),
        (other, "Pick a number.", 4, params(max_tokens=20, seed=6)),
        # requests with equal settings are drawn in one call: greedy with greedy, top-k with top-k
        (sampler, "Pick a number.", 2, params(max_tokens=24, seed=7, temperature=0.0)),
        (sampler, "Ann has 3 apples.", 3, params(max_tokens=30, seed=8, temperature=0.7, top_k=20)),
    ]
    greedy_only = [case for case in cases if case[3].temperature == 0.0]  # a batch of one setting only
    for batch in (cases, greedy_only):
        alone = [s.sample(mi(chat_prompt(tok, q)), num_samples=n, sampling_params=p).result()
                 for s, q, n, p in batch]
        futures = [s.sample(mi(chat_prompt(tok, q)), num_samples=n, sampling_params=p) for s, q, n, p in batch]
        together = [f.result() for f in futures]
        assert together == alone


def test_concurrent_sampling_requests_share_forward_passes(svc, tok, monkeypatch):
    """The engine really batches: 8 requests in flight take far fewer steps than 8 requests one by one."""
    from trio_helpers.offline import service as offline_service

    calls = []
    real = offline_service.step_sample_jobs
    monkeypatch.setattr(offline_service, "step_sample_jobs", lambda jobs: (calls.append(len(jobs)), real(jobs)))
    sampler = svc.create_sampling_client(MODEL)
    prompt = mi(chat_prompt(tok, "Pick a number."))
    sp = params(max_tokens=32, seed=None)
    futures = [sampler.sample(prompt, num_samples=2, sampling_params=sp) for _ in range(8)]
    for f in futures:
        f.result()
    assert max(calls) > 1 and len(calls) < 8 * 32, (len(calls), max(calls))


def test_trainer_reads_the_samplers_feature_rows_bit_for_bit(svc, tok):
    """Rows the sampler kept for a completion are exactly the rows recomputing them gives (for every sampled
    completion, stopped or cut by max_tokens), so reading them changes no number the trainer computes."""
    from trio_helpers.offline import model as offline_model

    sampler = svc.create_sampling_client(MODEL)
    prompt = chat_prompt(tok, "Ann has 3 apples and buys 4 more. How many now?")
    result = sampler.sample(mi(prompt), num_samples=4, sampling_params=params(max_tokens=40, seed=7)).result()
    assert {s.stop_reason for s in result.sequences} <= {"stop", "length"}
    for seq in result.sequences:
        tokens = prompt + list(seq.tokens[:-1])
        assert offline_model._SAMPLED.get(tuple(tokens)) is not None  # the sampler kept them
        np.testing.assert_array_equal(offline_model.sequence_rows(tokens),
                                      offline_model.sequence_features(tokens)[0])


def test_inverse_cdf_picks_the_first_token_past_u_of_the_mass_and_never_a_zero_one():
    """The sampler's draw equals the textbook inverse CDF (the number of cumulative sums below u * total) on
    rows with truncated (zero) tokens anywhere, and at u = 0 picks the first token with probability."""
    from trio_helpers.offline.model import _inverse_cdf

    rng = np.random.default_rng(0)
    q = rng.random((400, VOCAB_SIZE)) ** 8
    q[rng.random(q.shape) < 0.5] = 0.0  # top-k / top-p leave zeros, also first and last
    q[::7, :3] = 0.0
    q[::5, -3:] = 0.0
    u = rng.random(len(q))
    u[::11] = 0.0
    cdf = np.cumsum(q, axis=-1)
    textbook = np.minimum((cdf < (u * cdf[:, -1])[:, None]).sum(axis=-1), VOCAB_SIZE - 1)
    choice = _inverse_cdf(q, u)
    rows = np.arange(len(q))
    assert (q[rows, choice] > 0).all()
    np.testing.assert_array_equal(choice[u > 0], textbook[u > 0])
    first_nonzero = (q > 0).argmax(axis=-1)
    np.testing.assert_array_equal(choice[u == 0], first_nonzero[u == 0])


def test_cached_chat_prefixes_give_the_rows_and_context_of_a_fresh_pass(tok):
    """sequence_features reuses the rows of every cached prefix that ends with a message header (prompts
    sharing a one-shot example, a prompt and its completions); every row, and the context it returns, is
    what pushing the tokens one by one through a fresh Context gives, whatever was cached before."""
    from trio_helpers.offline import model as offline_model
    from trio_helpers.prompts import build_prompt, gsm8k_messages

    def fresh(tokens):
        ctx, rows = offline_model.Context(), []
        for t in tokens:
            ctx.push(t)
            rows.append(ctx.features())
        return np.array(rows, dtype=np.int64).reshape(len(rows), offline_model.KEY_WIDTH), ctx

    a = build_prompt(tok, gsm8k_messages("Ann has 3 apples and buys 4 more. How many now?")).to_ints()
    b = build_prompt(tok, gsm8k_messages("Bob reads 12 pages a day. How many in 5 days?")).to_ints()
    assert len(offline_model._header_ends(a)) >= 3 and a[:offline_model._header_ends(a)[-2]] != b[:len(a)]
    completion = list(b"Ann has 3 + 4 = <<3+4=7>>7 apples. \\boxed{7}") + [IM_END_ID]
    header = a.index(10)  # a cut inside the first header line (no complete header)
    cases = [a, b, a + completion, b[:-3], a[:header], [], a]
    offline_model._CACHE.items.clear()
    for _ in range(2):  # first with a cold cache, then with every prefix cached
        for tokens in cases:
            rows, ctx = offline_model.sequence_features(tokens)
            want_rows, want_ctx = fresh(tokens)
            np.testing.assert_array_equal(rows, want_rows)
            for t in completion[:12]:  # the returned context continues exactly like a fresh one
                ctx.push(t)
                want_ctx.push(t)
                assert ctx.features() == want_ctx.features()
    ends_at_header = chat_prompt(tok, "Say hi.")  # the whole sequence is a cached prefix: one shared array
    first = offline_model.sequence_features(ends_at_header)[0]
    again = offline_model.sequence_features(ends_at_header)[0]
    assert first is again and not first.flags.writeable


@pytest.mark.parametrize("auto_shift", [False, True])
def test_trainer_computes_a_shared_prompt_once_with_the_same_numbers(svc, tok, auto_shift):
    """The completions of one sampling request share their prompt's feature rows; the trainer runs them through
    its forward pass once. Logprobs, loss and gradients are the same bits as with every datum's rows computed
    in full (the sampler's rows forgotten)."""
    from trio_helpers.offline import losses
    from trio_helpers.offline import model as offline_model

    tc = trained_client(svc)
    set_b(tc, seed=3)
    prompt = chat_prompt(tok, "Ann has 3 apples and buys 4 more. How many now?")
    sampler = tc.save_weights_and_get_sampling_client()
    result = sampler.sample(mi(prompt), num_samples=4, sampling_params=params(max_tokens=40, seed=7)).result()
    data = [_is_datum(prompt, list(s.tokens), s.logprobs, adv=a)
            for s, a in zip(result.sequences, (0.5, -0.5, 1.0, -1.0))]
    data.append(_is_datum(prompt, list(b"7 apples."), [-1.0] * 9, adv=0.3))  # not sampled: rows computed
    plan = plan_training_batch(data, loss_fn="importance_sampling", auto_shift=auto_shift,
                               limits=TRAINING_LIMITS, tokenizer_vocab_size=VOCAB_SIZE)
    blocks = [offline_model.sequence_row_blocks(d.model_input.to_ints()) for d in data]
    assert all(b[0] is blocks[0][0] for b in blocks[:4]) and len(blocks[4]) == 1  # one prompt block, shared

    shared = losses.run_batch(tc._model, plan, "importance_sampling", {}, auto_shift, backward=True)
    offline_model._SAMPLED.items.clear()
    full = losses.run_batch(tc._model, plan, "importance_sampling", {}, auto_shift, backward=True)
    assert shared.loss_sum == full.loss_sum and shared.token_count == full.token_count
    for a, b in zip(shared.per_sample_logprobs, full.per_sample_logprobs, strict=True):
        np.testing.assert_array_equal(a, b)
    assert shared.grads.keys() == full.grads.keys()
    for name in full.grads:
        np.testing.assert_array_equal(shared.grads[name], full.grads[name])
    assert np.abs(full.grads["B"]).sum() > 0  # the comparison is about real gradients


def test_fresh_training_client_samples_like_the_base_model(svc, tok):
    tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=9)
    assert not tc._model.adapter.B.any()
    prompt = mi(chat_prompt(tok, "Hello?"))
    sp = params(max_tokens=20, seed=77)
    base = svc.create_sampling_client(MODEL).sample(prompt, num_samples=3, sampling_params=sp).result()
    fresh = tc.save_weights_and_get_sampling_client().sample(prompt, num_samples=3, sampling_params=sp).result()
    assert fresh == base


def test_temperature_zero_is_greedy(svc, tok):
    sampler = trained_client(svc).save_weights_and_get_sampling_client()
    prompt = chat_prompt(tok, "Greedy?")
    runs = [
        sampler.sample(mi(prompt), num_samples=2, sampling_params=params(temperature=0.0, seed=s)).result()
        for s in (1, 2)
    ]
    seq = runs[0].sequences[0]
    assert all(s.tokens == seq.tokens for r in runs for s in r.sequences)
    full = prompt + seq.tokens
    check = sampler.sample(mi(full), sampling_params=params(max_tokens=1), topk_prompt_logprobs=1).result()
    P = len(prompt)
    for i, t in enumerate(seq.tokens):
        assert check.topk_prompt_logprobs[P + i][0][0] == t  # each token was the argmax
    # the reported logprobs are the model's own (temperature-1) logprobs
    lp = sampler.compute_logprobs(mi(full)).result()
    np.testing.assert_allclose(seq.logprobs, lp[P:], atol=1e-9)


def _find(sampler, prompt, predicate, max_tokens=48):
    """The first seed whose unconstrained sample satisfies ``predicate(tokens)``; returns (seed, tokens)."""
    for seed in range(200):
        seq = sampler.sample(prompt, sampling_params=params(max_tokens=max_tokens, seed=seed)).result().sequences[0]
        hit = predicate(seq.tokens)
        if hit is not None:
            return seed, seq.tokens, hit
    raise AssertionError("no seed produced a suitable sample")


def _text_bytes(tokens) -> bytes:
    return bytes(t for t in tokens if t < 256)


def _printable(t: int) -> bool:
    return 33 <= t <= 126


def test_stop_token_ids_end_the_sequence(svc, tok):
    sampler = svc.create_sampling_client(MODEL)
    prompt = mi(chat_prompt(tok, "Stop tokens"))
    seed, tokens, k = _find(sampler, prompt, lambda ts: 5 if len(ts) > 8 else None)
    stop_id = tokens[k]
    cut = tokens.index(stop_id)
    res = sampler.sample(prompt, sampling_params=params(max_tokens=48, seed=seed, stop=[stop_id])).result()
    seq = res.sequences[0]
    assert seq.stop_reason == "stop"
    assert seq.tokens == tokens[: cut + 1] and seq.tokens[-1] == stop_id
    assert len(seq.logprobs) == len(seq.tokens)


def test_stop_strings_end_the_sequence(svc, tok):
    sampler = svc.create_sampling_client(MODEL)
    prompt = mi(chat_prompt(tok, "Stop strings"))

    def two_printable(ts):
        for i in range(2, len(ts) - 1):
            if _printable(ts[i]) and _printable(ts[i + 1]) and ts[-1] not in (IM_END_ID, ENDOFTEXT_ID):
                return i
        return None

    seed, tokens, i = _find(sampler, prompt, two_printable)
    stop = bytes(tokens[i : i + 2]).decode()
    # the first position where the generated bytes (special tokens carry none) end with the stop string
    end = next(j for j in range(len(tokens)) if _text_bytes(tokens[: j + 1]).endswith(stop.encode()))
    for stop_param in (stop, [stop, "\x00never"]):
        seq = sampler.sample(prompt, sampling_params=params(max_tokens=48, seed=seed, stop=stop_param)).result()
        seq = seq.sequences[0]
        assert seq.stop_reason == "stop"
        assert seq.tokens == tokens[: end + 1]
        assert _text_bytes(seq.tokens).endswith(stop.encode())
        assert seq.text.endswith(stop)


def test_max_tokens_gives_length(svc, tok):
    sampler = svc.create_sampling_client(MODEL)
    res = sampler.sample(mi(chat_prompt(tok, "Lengths")), num_samples=8, sampling_params=params(max_tokens=6)).result()
    reasons = [s.stop_reason for s in res.sequences]
    assert "length" in reasons
    for s in res.sequences:
        if s.stop_reason == "length":
            assert len(s.tokens) == 6
        else:  # the end-of-turn tokens always stop, as on the service
            assert s.stop_reason == "stop" and s.tokens[-1] in (IM_END_ID, ENDOFTEXT_ID) and len(s.tokens) <= 6
    assert res.output_tokens == sum(len(s.tokens) for s in res.sequences)
    assert res.input_tokens == len(chat_prompt(tok, "Lengths"))


# ------------------------------------------------------------------------------------------------- snapshots
def test_snapshot_sampler_is_frozen(svc, tok):
    tc = trained_client(svc, steps=1)
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = mi(chat_prompt(tok, "Frozen?"))
    sp = params(max_tokens=24, seed=3)
    before = sampler.sample(prompt, num_samples=2, sampling_params=sp).result()
    lp_before = sampler.compute_logprobs(prompt).result()
    data = [xent_datum(list(b"Something else entirely, repeated. " * 2))]
    for _ in range(3):
        tc.forward_backward(data)
        tc.optim_step(trio.AdamParams(learning_rate=0.1))
    after_sampler = tc.save_weights_and_get_sampling_client()
    assert sampler.sample(prompt, num_samples=2, sampling_params=sp).result() == before
    assert sampler.compute_logprobs(prompt).result() == lp_before
    # ... while the trained weights did move
    assert after_sampler.compute_logprobs(prompt).result() != lp_before


# ----------------------------------------------------------------------------------------------- checkpoints
def test_sampler_weights_round_trip(svc, tok):
    tc = trained_client(svc)
    snapshot = tc.save_weights_and_get_sampling_client()
    saved = tc.save_weights_for_sampler("round-trip").result()
    prompt = mi(chat_prompt(tok, "Checkpoint?"))
    sp = params(max_tokens=20, seed=8)
    expected = snapshot.sample(prompt, num_samples=2, sampling_params=sp).result()
    base = svc.create_sampling_client(MODEL).sample(prompt, num_samples=2, sampling_params=sp).result()
    assert expected != base
    for loaded in (svc.create_sampling_client(MODEL, model_path=saved.path), tc.create_sampling_client(saved.path)):
        assert loaded.sample(prompt, num_samples=2, sampling_params=sp).result() == expected
        assert loaded.compute_logprobs(prompt).result() == snapshot.compute_logprobs(prompt).result()


def _weights(tc):
    return {k: v.copy() for k, v in tc._model.adapter.params().items()}


def _same(a, b):
    return all(np.array_equal(a[k], b[k]) for k in a)


def test_state_round_trip_with_and_without_optimizer(svc):
    tc = trained_client(svc, steps=2)
    state = tc.save_state("state").result().path
    moments = {k: np.copy(v) for k, v in tc._adam.items()}
    assert moments.get("step") == 2

    restored = [
        (svc.create_training_client_from_state(state), False),
        (svc.create_training_client_from_state_with_optimizer(state), True),
    ]
    for with_opt in (False, True):
        fresh = svc.create_lora_training_client(MODEL, rank=RANK, seed=99)
        (fresh.load_state_with_optimizer if with_opt else fresh.load_state)(state).result()
        restored.append((fresh, with_opt))

    # one more identical step everywhere: only the clients that restored Adam's moments match the original
    data = [xent_datum(list(b"one more step"))]
    hp = trio.AdamParams(learning_rate=0.05)
    for client, with_opt in restored:
        assert _same(_weights(client), _weights(tc))
        if with_opt:
            assert client._adam["step"] == 2
            for key, value in moments.items():
                np.testing.assert_array_equal(client._adam[key], value)
        else:
            assert client._adam == {}
    tc.forward_backward(data)
    tc.optim_step(hp).result()
    for client, with_opt in restored:
        client.forward_backward(data)
        client.optim_step(hp).result()
        assert _same(_weights(client), _weights(tc)) == with_opt


def test_checkpoints_work_across_processes(svc, tok, tmp_path):
    home = tmp_path / "shared_home"
    parent = connect("offline", in_process=True, latency=0.0, home=home)
    tc = trained_client(parent)
    weights = tc.save_weights_for_sampler("xproc").result().path
    state = tc.save_state("xproc").result().path
    prompt = chat_prompt(tok, "Across processes")
    expected = {
        "logprobs": tc.create_sampling_client(weights).compute_logprobs(mi(prompt)).result()[1:],
        "B": float(tc._model.adapter.B.sum()),
        "adam_step": tc._adam["step"],
    }
    code = f"""
import json, pytrio as trio
from trio_helpers import connect
svc = connect("offline", in_process=True, latency=0.0)
sc = svc.create_sampling_client({MODEL!r}, model_path={weights!r})
lp = sc.compute_logprobs(trio.ModelInput.from_ints({prompt!r})).result()[1:]
tc = svc.create_training_client_from_state_with_optimizer({state!r})
print(json.dumps({{"logprobs": lp, "B": float(tc._model.adapter.B.sum()), "adam_step": tc._adam["step"]}}))
"""
    env = {**os.environ, "TRIO_OFFLINE_HOME": str(home), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["adam_step"] == expected["adam_step"]
    assert got["B"] == expected["B"]
    np.testing.assert_allclose(got["logprobs"], expected["logprobs"], rtol=0, atol=1e-12)


BAD_PATHS = [
    "trio-offline://run-00000000/weights/missing",  # well-formed, not there
    "trio-offline://run-00000000/state/missing",
    "s3://bucket/checkpoint",
    "tinker://run/weights/x",
    "trio-offline://run/weights",
    "trio-offline://run/other/x",
    "trio-offline://run/weights/../x",
    "trio-offline://../weights/x",
    "",
]


@pytest.mark.parametrize("path", BAD_PATHS)
def test_bad_checkpoint_paths_are_clear_validation_errors(svc, path):
    with pytest.raises(ValidationError, match="checkpoint|offline"):
        svc.create_sampling_client(MODEL, model_path=path)
    with pytest.raises(ValidationError, match="checkpoint|offline"):
        svc.create_training_client_from_state(path)
    with pytest.raises(ValidationError, match="checkpoint|offline"):
        svc.create_training_client_from_state_with_optimizer(path)
    fresh = svc.create_lora_training_client(MODEL, rank=RANK)
    with pytest.raises(ValidationError, match="checkpoint|offline"):
        fresh.load_state(path).result()


def test_sampler_weights_are_not_a_training_state(svc):
    weights = trained_client(svc, steps=1).save_weights_for_sampler("only-weights").result().path
    with pytest.raises(ValidationError, match="save_state"):
        svc.create_training_client_from_state(weights)


def test_save_state_twice_needs_overwrite(svc):
    tc = trained_client(svc, steps=1)
    first = tc.save_state("twice").result()
    with pytest.raises(ValidationError, match="overwrite"):
        tc.save_state("twice").result()
    again = tc.save_state("twice", overwrite=True).result()
    assert again.path == first.path


def test_load_state_after_training_started_is_rejected(svc):
    """pytrio: load_state must come before the first training operation (validation.already_initialized)."""
    tc = trained_client(svc, steps=1)
    state = tc.save_state("early").result().path
    with pytest.raises(ValidationError) as err:
        tc.load_state(state)
    assert err.value.code == "validation.already_initialized"
    fresh = svc.create_lora_training_client(MODEL, rank=RANK)
    fresh.load_state(state).result()
    with pytest.raises(ValidationError):  # a second load is also too late
        fresh.load_state_with_optimizer(state)


def test_load_state_rejects_another_rank(svc):
    state = trained_client(svc, steps=1).save_state("rank8").result().path
    other = svc.create_lora_training_client(MODEL, rank=16)
    with pytest.raises(ValidationError, match="rank"):
        other.load_state(state).result()


# ------------------------------------------------------------------------------------ a GRPO loop, plain pytrio
def test_grpo_loop_with_plain_pytrio_calls(tmp_path):
    service_client = connect("offline", in_process=True, latency=0.0, home=tmp_path)
    training_client = service_client.create_lora_training_client(MODEL, rank=8, seed=0)
    tokenizer = training_client.get_tokenizer()
    questions = ["What is 3 + 4?", "How many legs do 2 cats have?"]
    start = {k: v.copy() for k, v in training_client._model.adapter.params().items()}

    def reward(text: str) -> float:
        return sum(ch.isdigit() for ch in text) / max(len(text), 1)

    losses, mean_rewards = [], []
    for step in range(5):
        sampling_client = training_client.save_weights_and_get_sampling_client()
        datums, rewards_seen = [], []
        for q_index, question in enumerate(questions):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
            )
            prompt = tokenizer.encode(text, add_special_tokens=False)
            result = sampling_client.sample(
                prompt=trio.ModelInput.from_ints(prompt),
                num_samples=4,
                sampling_params=trio.SamplingParams(max_tokens=24, temperature=1.0, seed=1000 * step + q_index),
            ).result()
            rewards = [reward(seq.text) for seq in result.sequences]
            rewards_seen += rewards
            mean = sum(rewards) / len(rewards)
            for seq, r in zip(result.sequences, rewards):
                advantage = r - mean
                if advantage == 0.0 or not seq.tokens:
                    continue
                pad = len(prompt) - 1
                datums.append(
                    trio.Datum(
                        model_input=trio.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": [0] * pad + seq.tokens,
                            "logprobs": [0.0] * pad + seq.logprobs,
                            "advantages": [0.0] * pad + [advantage] * len(seq.tokens),
                        },
                    )
                )
        mean_rewards.append(sum(rewards_seen) / len(rewards_seen))
        if not datums:
            continue
        fb_future = training_client.forward_backward(datums, loss_fn="importance_sampling")
        optim_future = training_client.optim_step(trio.AdamParams(learning_rate=1e-2))
        out = fb_future.result()
        optim_future.result()
        losses.append(out.metrics["loss_mean"])
    assert len(losses) >= 3
    assert all(np.isfinite(losses))
    end = training_client._model.adapter.params()
    assert np.abs(end["B"]).max() > 0
    assert not np.array_equal(end["A"], start["A"])
    assert all(np.isfinite(v).all() for v in end.values())

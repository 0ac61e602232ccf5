"""The offline backend's API contract against pytrio 0.2.9 itself.

- signature parity: every public method of pytrio's ServiceClient / TrainingClient / SamplingClient exists on the
  offline twin with the same parameter names, kinds and defaults, and the same sync/async-ness (the list of methods
  is read from pytrio, minus an explicit exclusion list, so a pytrio upgrade that adds a method fails here);
- return types: sync calls return ``APIFuture``s of pytrio's own types, ``_async`` twins return what pytrio's do;
- validation parity: the offline trainer accepts and rejects training batches exactly when pytrio's own planner
  (``plan_training_batch``) does, with the same exception type; sampling and LoRA-rank validation.
"""

from __future__ import annotations

import asyncio
import inspect

import numpy as np
import pytest
import pytrio as trio
from pytrio.client.training_batch import plan_training_batch
from pytrio.errors.base import ValidationError
from pytrio.types import (
    APIFuture,
    ForwardBackwardOutput,
    OptimStepResponse,
    SampleResponse,
    SampleSequence,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
)

from trio_helpers import connect
from trio_helpers.offline import catalog
from trio_helpers.offline.service import (
    TRAINING_LIMITS,
    OfflineSamplingClient,
    OfflineServiceClient,
    OfflineTrainingClient,
)
from trio_helpers.offline.tokenizer import VOCAB_SIZE

MODEL = "offline/tiny"
RANK = 8

# What the offline backend deliberately does not offer (each entry must still exist in pytrio, see below).
EXCLUDED = {
    "ServiceClient": {
        "create_rest_client",  # checkpoint/run metadata REST API of the hosted service; nothing to list offline
        "get_server_capabilities",  # per-model server limits of the hosted service
        "get_server_capabilities_async",
    },
    "TrainingClient": {
        "forward_backward_custom",  # needs torch (the custom loss is a torch function); the offline model is numpy
        "forward_backward_custom_async",
    },
    "SamplingClient": set(),
}

# The methods the book relies on: if pytrio ever drops one of them, the parity test must say so.
REQUIRED = {
    "ServiceClient": {
        "create_lora_training_client", "create_sampling_client", "create_training_client_from_state",
        "create_training_client_from_state_with_optimizer", "get_supported_models",
    },
    "TrainingClient": {
        "forward", "forward_backward", "optim_step", "save_weights_for_sampler", "save_state", "load_state",
        "load_state_with_optimizer", "save_weights_and_get_sampling_client", "create_sampling_client",
        "get_tokenizer",
    },
    "SamplingClient": {"sample", "compute_logprobs", "get_tokenizer"},
}
ASYNC_TWINLESS = {"get_supported_models", "get_tokenizer"}

PAIRS = [
    ("ServiceClient", trio.ServiceClient, OfflineServiceClient),
    ("TrainingClient", trio.TrainingClient, OfflineTrainingClient),
    ("SamplingClient", trio.SamplingClient, OfflineSamplingClient),
]


def public_methods(cls) -> set[str]:
    """Public functions defined on ``cls`` or its bases (properties and attributes excluded)."""
    names = set()
    for klass in cls.__mro__[:-1]:  # skip object
        for name, value in vars(klass).items():
            if not name.startswith("_") and inspect.isfunction(value):
                names.add(name)
    return names


def param_shape(func) -> list[tuple[str, inspect._ParameterKind, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(func).parameters.values()]


# --------------------------------------------------------------------------------------------- signature parity
@pytest.mark.parametrize("label,real,offline", PAIRS, ids=[p[0] for p in PAIRS])
def test_exclusions_and_required_methods_exist_in_pytrio(label, real, offline):
    methods = public_methods(real)
    assert EXCLUDED[label] <= methods, f"stale exclusions for {label}: {EXCLUDED[label] - methods}"
    required = REQUIRED[label] | {f"{n}_async" for n in REQUIRED[label] - ASYNC_TWINLESS}
    assert required <= methods, f"pytrio {label} lacks {required - methods}"


@pytest.mark.parametrize("label,real,offline", PAIRS, ids=[p[0] for p in PAIRS])
def test_signature_parity(label, real, offline):
    wanted = sorted(public_methods(real) - EXCLUDED[label])
    assert wanted, label
    missing = [name for name in wanted if not callable(getattr(offline, name, None))]
    assert not missing, f"offline {label} lacks {missing}"
    for name in wanted:
        assert param_shape(getattr(offline, name)) == param_shape(getattr(real, name)), f"{label}.{name}"
        assert inspect.iscoroutinefunction(getattr(offline, name)) == inspect.iscoroutinefunction(
            getattr(real, name)
        ), f"{label}.{name}: sync/async mismatch"


def test_offline_does_not_offer_the_excluded_methods_by_accident():
    # an excluded name that the offline class does have should be moved out of EXCLUDED and compared instead
    for label, _real, offline in PAIRS:
        assert not [n for n in EXCLUDED[label] if hasattr(offline, n)], label


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    return connect("offline", in_process=True, latency=0.0, home=tmp_path_factory.mktemp("offline_home"))


@pytest.fixture(scope="module")
def tokenizer(svc):
    return svc.create_sampling_client(MODEL).get_tokenizer()


def ce_datum(tokens: list[int]) -> trio.Datum:
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64)},
    )


def prompt(text: str = "Hello offline world") -> trio.ModelInput:
    return trio.ModelInput.from_ints(list(text.encode()))


# ------------------------------------------------------------------------------------------------ return types
def test_sync_calls_return_api_futures_of_pytrio_types(svc):
    assert MODEL in svc.get_supported_models()
    tc = svc.create_lora_training_client(MODEL, rank=RANK)
    assert isinstance(tc, OfflineTrainingClient)
    data = [ce_datum(list(b"abcdefgh"))]

    fut = tc.forward(data)
    assert isinstance(fut, APIFuture)
    out = fut.result()
    assert isinstance(out, ForwardBackwardOutput)
    assert set(out.metrics) == {"loss_sum", "loss_mean", "token_count"}
    assert out.loss_fn_outputs[0]["logprobs"].shape == [7]

    fut = tc.forward_backward(data)
    assert isinstance(fut, APIFuture) and isinstance(fut.result(), ForwardBackwardOutput)
    fut = tc.optim_step(trio.AdamParams(learning_rate=1e-3))
    assert isinstance(fut, APIFuture) and isinstance(fut.result(), OptimStepResponse)

    fut = tc.save_weights_for_sampler("w")
    assert isinstance(fut, APIFuture)
    saved = fut.result()
    assert isinstance(saved, SaveWeightsForSamplerResponse)
    assert saved.model == MODEL and saved.size > 0 and saved.path.startswith("trio-offline://")

    fut = tc.save_state("s")
    assert isinstance(fut, APIFuture)
    state = fut.result()
    assert isinstance(state, SaveWeightsResponse) and state.model == MODEL and state.size > 0

    fresh = svc.create_lora_training_client(MODEL, rank=RANK)
    fut = fresh.load_state(state.path)
    assert isinstance(fut, APIFuture) and isinstance(fut.result(), dict)
    fresh2 = svc.create_lora_training_client(MODEL, rank=RANK)
    fut = fresh2.load_state_with_optimizer(state.path)
    assert isinstance(fut, APIFuture) and isinstance(fut.result(), dict)

    sc = tc.save_weights_and_get_sampling_client()
    assert isinstance(sc, OfflineSamplingClient)
    assert isinstance(tc.create_sampling_client(saved.path), OfflineSamplingClient)
    assert isinstance(svc.create_sampling_client(MODEL, model_path=saved.path), OfflineSamplingClient)
    assert isinstance(svc.create_training_client_from_state(state.path), OfflineTrainingClient)
    assert isinstance(svc.create_training_client_from_state_with_optimizer(state.path), OfflineTrainingClient)

    fut = sc.sample(prompt(), num_samples=2, sampling_params=trio.SamplingParams(max_tokens=5, seed=0))
    assert isinstance(fut, APIFuture)
    res = fut.result()
    assert isinstance(res, SampleResponse) and len(res.sequences) == 2
    assert all(isinstance(s, SampleSequence) and isinstance(s.text, str) for s in res.sequences)
    fut = sc.compute_logprobs(prompt())
    assert isinstance(fut, APIFuture)
    lps = fut.result()
    assert isinstance(lps, list) and lps[0] is None and len(lps) == len(prompt())
    assert len(tc.get_tokenizer()) == len(sc.get_tokenizer()) == VOCAB_SIZE


def test_async_twins_return_what_pytrio_returns(svc):
    async def main():
        tc = await svc.create_lora_training_client_async(MODEL, rank=RANK)
        assert isinstance(tc, OfflineTrainingClient)
        data = [ce_datum(list(b"abcdefgh"))]

        # forward/forward_backward/optim_step/save_*/load_state*: await once -> APIFuture, await again -> result
        fut = await tc.forward_async(data)
        assert isinstance(fut, APIFuture) and isinstance(await fut, ForwardBackwardOutput)
        fut = await tc.forward_backward_async(data)
        assert isinstance(fut, APIFuture) and isinstance(await fut, ForwardBackwardOutput)
        fut = await tc.optim_step_async(trio.AdamParams(learning_rate=1e-3))
        assert isinstance(fut, APIFuture) and isinstance(await fut, OptimStepResponse)
        fut = await tc.save_weights_for_sampler_async("aw")
        assert isinstance(fut, APIFuture)
        saved = await fut
        assert isinstance(saved, SaveWeightsForSamplerResponse)
        fut = await tc.save_state_async("as")
        assert isinstance(fut, APIFuture)
        state = await fut
        assert isinstance(state, SaveWeightsResponse)
        fresh = await svc.create_lora_training_client_async(MODEL, rank=RANK)
        fut = await fresh.load_state_async(state.path)
        assert isinstance(fut, APIFuture) and isinstance(await fut, dict)
        fresh2 = await svc.create_lora_training_client_async(MODEL, rank=RANK)
        fut = await fresh2.load_state_with_optimizer_async(state.path)
        assert isinstance(fut, APIFuture) and isinstance(await fut, dict)

        # sample/compute_logprobs/save_weights_and_get_sampling_client/create_*: await once -> the value
        sc = await tc.save_weights_and_get_sampling_client_async()
        assert isinstance(sc, OfflineSamplingClient)
        res = await sc.sample_async(prompt(), sampling_params=trio.SamplingParams(max_tokens=4, seed=1))
        assert isinstance(res, SampleResponse)
        lps = await sc.compute_logprobs_async(prompt())
        assert isinstance(lps, list) and lps[0] is None
        assert isinstance(await tc.create_sampling_client_async(saved.path), OfflineSamplingClient)
        assert isinstance(await svc.create_sampling_client_async(MODEL), OfflineSamplingClient)
        assert isinstance(await svc.create_sampling_client_async(MODEL, saved.path), OfflineSamplingClient)
        assert isinstance(await svc.create_training_client_from_state_async(state.path), OfflineTrainingClient)
        restored = await svc.create_training_client_from_state_with_optimizer_async(state.path)
        assert isinstance(restored, OfflineTrainingClient)

    asyncio.run(main())


# --------------------------------------------------------------------------------- training-batch validation
def _tensor(values, dtype):
    return TensorData.from_numpy(np.asarray(values, dtype=dtype))


def policy_datum(n=6, *, tokens=None, targets=None, logprobs=None, advantages=None, drop=()):
    tokens = list(range(65, 65 + n)) if tokens is None else tokens
    inputs = {
        "target_tokens": _tensor(list(range(66, 66 + n)) if targets is None else targets, np.int64),
        "logprobs": _tensor([-1.0] * n if logprobs is None else logprobs, np.float32),
        "advantages": _tensor([0.5] * n if advantages is None else advantages, np.float32),
    }
    for key in drop:
        del inputs[key]
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def xent_datum(n=6, *, tokens=None, targets=None, weights=None, target_dtype=np.int64, drop=()):
    tokens = list(range(65, 65 + n)) if tokens is None else tokens
    inputs = {"target_tokens": _tensor(list(range(66, 66 + n)) if targets is None else targets, target_dtype)}
    if weights is not None:
        inputs["weights"] = _tensor(weights, np.float32)
    for key in drop:
        del inputs[key]
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


V = VOCAB_SIZE
# (id, data, loss_fn, auto_shift, should pytrio accept it?)
BATCH_CASES = [
    ("xent-ok", [xent_datum()], "cross_entropy", False, True),
    ("xent-weights-ok", [xent_datum(weights=[1, 0, 0.5, 2, 1, 0])], "cross_entropy", False, True),
    ("xent-auto-shift-ok", [xent_datum(targets=list(range(65, 71)))], "cross_entropy", True, True),
    ("xent-minus100-ok", [xent_datum(targets=[-100, -100, 67, 68, -100, 70])], "cross_entropy", False, True),
    ("xent-all-weights-zero-ok", [xent_datum(weights=[0] * 6)], "cross_entropy", False, True),
    ("xent-last-token-id-ok", [xent_datum(tokens=[V - 1] * 6, targets=[V - 1] * 6)], "cross_entropy", False, True),
    ("xent-extra-field-ok", [policy_datum()], "cross_entropy", False, True),
    ("xent-case-insensitive", [xent_datum()], "Cross_Entropy", False, True),
    ("xent-padded-name", [xent_datum()], "  CROSS_ENTROPY ", False, True),
    ("ppo-case-insensitive", [policy_datum()], "PPO", False, True),
    ("is-ok", [policy_datum(), policy_datum(n=3)], "importance_sampling", False, True),
    ("cispo-ok", [policy_datum()], "cispo", False, True),
    ("dro-ok", [policy_datum(advantages=[0, 0, 1, -1, 0, 2])], "dro", False, True),
    ("ppo-minus100-ok", [policy_datum(targets=[-100, 67, 68, -100, 70, 71])], "ppo", False, True),
    ("empty-batch", [], "cross_entropy", False, False),
    ("empty-sample", [xent_datum(tokens=[], targets=[])], "cross_entropy", False, False),
    ("empty-sample-policy", [policy_datum(tokens=[], targets=[], logprobs=[], advantages=[])], "ppo", False, False),
    ("unknown-loss", [xent_datum()], "kl_divergence", False, False),
    ("xent-missing-targets", [xent_datum(drop=("target_tokens",), weights=[1] * 6)], "cross_entropy", False, False),
    ("ppo-missing-advantages", [policy_datum(drop=("advantages",))], "ppo", False, False),
    ("is-missing-logprobs", [policy_datum(drop=("logprobs",))], "importance_sampling", False, False),
    ("dro-on-xent-datum", [xent_datum()], "dro", False, False),
    ("targets-too-short", [xent_datum(targets=[66, 67, 68])], "cross_entropy", False, False),
    ("weights-too-long", [xent_datum(weights=[1.0] * 7)], "cross_entropy", False, False),
    ("logprobs-wrong-length", [policy_datum(logprobs=[-1.0] * 5)], "cispo", False, False),
    ("advantages-wrong-length", [policy_datum(advantages=[1.0] * 8)], "ppo", False, False),
    ("float-targets", [xent_datum(target_dtype=np.float32)], "cross_entropy", False, False),
    ("nan-weight", [xent_datum(weights=[1, 1, float("nan"), 1, 1, 1])], "cross_entropy", False, False),
    ("inf-logprob", [policy_datum(logprobs=[-1, -float("inf"), -1, -1, -1, -1])], "importance_sampling", False, False),
    ("nan-advantage", [policy_datum(advantages=[0, 0, float("nan"), 0, 0, 0])], "dro", False, False),
    ("input-token-out-of-vocab", [xent_datum(tokens=[65, 66, V, 67, 68, 69])], "cross_entropy", False, False),
    ("negative-input-token", [xent_datum(tokens=[65, -1, 66, 67, 68, 69])], "cross_entropy", False, False),
    ("target-out-of-vocab", [xent_datum(targets=[66, 67, 68, V + 5, 70, 71])], "cross_entropy", False, False),
    ("policy-target-out-of-vocab", [policy_datum(targets=[66, 67, 68, 69, 70, V])], "ppo", False, False),
    ("negative-target-not-minus100", [xent_datum(targets=[66, -5, 68, 69, 70, 71])], "cross_entropy", False, False),
    ("one-bad-sample-spoils-batch", [xent_datum(), xent_datum(targets=[1, 2])], "cross_entropy", False, False),
]


def _outcome(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type is what we compare
        return type(exc)
    return None


@pytest.mark.parametrize("case", BATCH_CASES, ids=[c[0] for c in BATCH_CASES])
@pytest.mark.parametrize("method", ["forward", "forward_backward"])
def test_batch_acceptance_matches_pytrio_planner(svc, tokenizer, case, method):
    _, data, loss_fn, auto_shift, accepted = case
    expected = _outcome(
        lambda: plan_training_batch(
            data, loss_fn=loss_fn, auto_shift=auto_shift, limits=TRAINING_LIMITS, tokenizer_vocab_size=len(tokenizer)
        )
    )
    assert (expected is None) == accepted, f"pytrio's planner itself: {expected}"
    tc = svc.create_lora_training_client(MODEL, rank=RANK)
    # pytrio validates before submitting: the error is raised by the call itself, not by .result()
    got = _outcome(lambda: getattr(tc, method)(data, loss_fn=loss_fn, auto_shift=auto_shift))
    assert got is expected
    if accepted:
        out = getattr(tc, method)(data, loss_fn=loss_fn, auto_shift=auto_shift).result()
        assert len(out.loss_fn_outputs) == len(data)
        assert np.isfinite(out.metrics["loss_sum"])


def test_validation_error_codes(svc):
    tc = svc.create_lora_training_client(MODEL, rank=RANK)
    with pytest.raises(ValidationError) as err:
        tc.forward_backward([])
    assert err.value.code == "validation.empty_training_data"
    with pytest.raises(ValidationError) as err:
        tc.forward_backward([xent_datum(targets=[66, 67, 68, V, 70, 71])])
    assert err.value.code == "validation.token_id_out_of_range"


def test_rejected_batch_changes_nothing(svc):
    tc = svc.create_lora_training_client(MODEL, rank=RANK)
    with pytest.raises(ValueError):
        tc.forward_backward([xent_datum(), xent_datum(target_dtype=np.float32)])
    assert tc._grads is None


def test_unknown_loss_config_key_is_rejected(svc):
    tc = svc.create_lora_training_client(MODEL, rank=RANK)
    with pytest.raises(ValueError, match="clip_low_threshold"):
        tc.forward_backward([policy_datum()], "ppo", {"clip_low": 0.9})


# ----------------------------------------------------------------------------------------- sampling validation
@pytest.fixture(scope="module")
def sampler(svc):
    return svc.create_sampling_client(MODEL)


def test_empty_prompt_rejected(sampler):
    empty = trio.ModelInput.from_ints([])
    with pytest.raises(ValidationError) as err:
        sampler.sample(empty, sampling_params=trio.SamplingParams(max_tokens=4))
    assert err.value.code == "validation.empty_prompt"
    with pytest.raises(ValidationError):
        sampler.compute_logprobs(empty)
    with pytest.raises(ValidationError):
        asyncio.run(sampler.sample_async(empty, sampling_params=trio.SamplingParams(max_tokens=4)))
    with pytest.raises(ValidationError):
        asyncio.run(sampler.compute_logprobs_async(empty))


@pytest.mark.parametrize("max_tokens", [None, 0, -3])
def test_max_tokens_must_be_positive(sampler, max_tokens):
    params = trio.SamplingParams(max_tokens=max_tokens)
    with pytest.raises(ValidationError) as err:
        sampler.sample(prompt(), sampling_params=params)
    assert err.value.code == "validation.invalid_sampling_request"
    with pytest.raises(ValidationError):
        asyncio.run(sampler.sample_async(prompt(), sampling_params=params))


def test_default_sampling_params_are_rejected_like_pytrio(sampler):
    # pytrio's default SamplingParams() has max_tokens=None, so a bare sample(prompt) is an error there too
    with pytest.raises(ValidationError):
        sampler.sample(prompt())


@pytest.mark.parametrize("rank", [3, 65, 0])
def test_lora_rank_bounds(svc, rank):
    with pytest.raises(ValidationError) as err:
        svc.create_lora_training_client(MODEL, rank=rank)
    assert err.value.code == "validation.invalid_lora_rank"
    with pytest.raises(ValidationError):
        asyncio.run(svc.create_lora_training_client_async(MODEL, rank=rank))


@pytest.mark.parametrize("rank", [4, 64])
def test_lora_rank_bounds_inclusive(svc, rank):
    tc = svc.create_lora_training_client(MODEL, rank=rank)
    assert tc._model.adapter.rank == rank


def test_unknown_model_lists_catalog(svc):
    for call in (
        lambda: svc.create_sampling_client("gpt2"),
        lambda: svc.create_lora_training_client("gpt2", rank=8),
        lambda: asyncio.run(svc.create_sampling_client_async("gpt2")),
    ):
        with pytest.raises(ValidationError) as err:
            call()
        message = str(err.value)
        assert "gpt2" in message
        for name in catalog.model_names():
            assert name in message


# --------------------------------------------------------- sampler and trainer numerics
LONG_PROMPT = "Natalia sold clips to 48 of her friends in April, then half as many in May."


def _sampler_vs_trainer(precision, home, seed=3):
    """Mean |sample logprob - trainer logprob| over the sampled tokens, and the numbers."""
    svc = connect("offline", in_process=True, latency=0.0, sampler_logit_precision=precision, home=home)
    tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=1)
    sampler = tc.save_weights_and_get_sampling_client()
    tokens = list(LONG_PROMPT.encode())
    params = trio.SamplingParams(max_tokens=24, seed=seed)  # T = 1, no truncation
    res = sampler.sample(trio.ModelInput.from_ints(tokens), num_samples=4,
                         sampling_params=params).result()
    data, sampled = [], []
    for seq in res.sequences:
        full = tokens + seq.tokens
        targets = np.asarray(full[1:], dtype=np.int64)
        targets[: len(tokens) - 1] = -100
        data.append(trio.Datum(model_input=trio.ModelInput.from_ints(full[:-1]),
                               loss_fn_inputs={"target_tokens": targets}))
        sampled.append(np.asarray(seq.logprobs))
    out = tc.forward(data).result()
    trainer = [o["logprobs"].to_numpy()[len(tokens) - 1:] for o in out.loss_fn_outputs]
    prompt_lp = sampler.compute_logprobs(trio.ModelInput.from_ints(full)).result()
    diff = np.concatenate([np.abs(s - t) for s, t in zip(sampled, trainer)])
    return {"mean_abs": float(diff.mean()), "sampled": sampled, "trainer": trainer,
            "tokens": [seq.tokens for seq in res.sequences],
            "logprobs_of_last": np.asarray(prompt_lp[len(tokens):])}


def test_sampler_and_trainer_agree_by_default(tmp_path):
    got = _sampler_vs_trainer(None, tmp_path)
    assert got["mean_abs"] < 1e-5
    for s, t in zip(got["sampled"], got["trainer"]):
        np.testing.assert_allclose(s, t, atol=1e-5)
    # compute_logprobs (the sampler side) agrees with the trainer too
    np.testing.assert_allclose(got["logprobs_of_last"], got["trainer"][-1], atol=1e-5)


def test_sampler_logit_precision_makes_them_disagree_by_a_controlled_amount(tmp_path):
    means = {}
    for precision in ("float32", "float16", "bfloat16", "float8_e4m3"):
        got = _sampler_vs_trainer(precision, tmp_path)
        means[precision] = got["mean_abs"]
        # compute_logprobs is served by the sampler: it matches the sample's own logprobs,
        # not the trainer's
        np.testing.assert_allclose(got["logprobs_of_last"], got["sampled"][-1], atol=1e-9)
    assert 0 < means["float32"] < 1e-5
    assert means["float32"] < means["float16"] < means["bfloat16"] < means["float8_e4m3"]
    # small, as between an inference engine and a trainer
    assert 1e-4 < means["bfloat16"] < 0.1


def test_rounded_sampler_stays_deterministic_and_leaves_the_trainer_alone(tmp_path):
    a = _sampler_vs_trainer("bfloat16", tmp_path)
    b = _sampler_vs_trainer("bfloat16", tmp_path)
    assert a["tokens"] == b["tokens"]
    for x, y in zip(a["sampled"], b["sampled"]):
        np.testing.assert_array_equal(x, y)
    # the trainer computes the same numbers whatever the sampler's precision
    data = [ce_datum(list(b"the trainer is never rounded"))]
    outs = []
    for precision in (None, "float8_e4m3"):
        svc = connect("offline", in_process=True, latency=0.0, sampler_logit_precision=precision,
                      home=tmp_path)
        tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=1)
        outs.append(tc.forward_backward(data).result())
    assert outs[0] == outs[1]


def test_round_mantissa_matches_numpy_float16_and_bfloat16_bits():
    from trio_helpers.offline.precision import round_mantissa

    x = np.random.default_rng(0).normal(scale=8.0, size=2000)
    as_f16 = x.astype(np.float16).astype(np.float64)
    as_f32 = x.astype(np.float32).astype(np.float64)
    np.testing.assert_array_equal(round_mantissa(x, 10), as_f16)
    np.testing.assert_array_equal(round_mantissa(x, 23), as_f32)
    # bfloat16 is float32 with the low 16 bits rounded off (ties to even)
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    bf16 = rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    np.testing.assert_array_equal(round_mantissa(x.astype(np.float32), 7), bf16)


@pytest.mark.parametrize("bad", ["bf16", "float64", 16, ""])
def test_sampler_logit_precision_is_validated(bad):
    with pytest.raises(ValueError, match="sampler_logit_precision"):
        connect("offline", in_process=True, sampler_logit_precision=bad)

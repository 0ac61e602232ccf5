"""Tests of trio_helpers.datums: shapes and alignment of the builders, their errors, and the contract with pytrio.

The contract checks use pytrio's own planner (``plan_training_batch``) and the offline trainer's ``forward`` on the
``offline/tiny`` model (random weights, no fitting), so they run in about a second.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from pytrio import Datum, ModelInput, SamplingParams
from pytrio.client.training_batch import plan_training_batch
from pytrio.model.limits import TrainingLimits

from trio_helpers.datums import (
    IGNORE,
    alignment_rows,
    cross_entropy_datum,
    format_alignment,
    importance_sampling_datum,
)

PROMPT = [10, 11, 12, 13]
COMPLETION = [20, 21, 22]
LOGPROBS = [-0.5, -1.25, -2.0]
NO_LIMITS = TrainingLimits(max_batch_size=None, max_tokens_per_request=None, max_seq_len=None)
VOCAB = 261  # the offline tokenizer's size


class CharTokenizer:
    """Decodes id i as chr(i): enough for alignment_rows, without loading transformers."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def fields(datum: Datum) -> dict[str, list]:
    return {name: tensor.data for name, tensor in datum.loss_fn_inputs.items()}


def active_tokens(datum: Datum, loss_fn: str, auto_shift: bool = False) -> int:
    plan = plan_training_batch(
        [datum], loss_fn=loss_fn, auto_shift=auto_shift, limits=NO_LIMITS, tokenizer_vocab_size=VOCAB
    )
    return plan.totals.total_active_tokens


# --- shapes and alignment --------------------------------------------------------------------------------


def test_importance_sampling_datum_is_shifted_and_masked() -> None:
    d = importance_sampling_datum(PROMPT, COMPLETION, LOGPROBS, 0.5)
    f = fields(d)
    assert d.model_input.to_ints() == PROMPT + COMPLETION[:-1]
    assert f["target_tokens"] == [IGNORE] * 3 + COMPLETION
    assert f["logprobs"] == [0.0] * 3 + LOGPROBS  # exactly representable in float32
    assert f["advantages"] == [0.0] * 3 + [0.5] * 3
    assert set(f) == {"target_tokens", "logprobs", "advantages"}


def test_every_field_has_the_input_length_and_pytrio_dtypes() -> None:
    d = importance_sampling_datum(PROMPT, COMPLETION, LOGPROBS, 1.0)
    n = len(PROMPT) + len(COMPLETION) - 1
    assert len(d.model_input) == n
    dtypes = {name: (t.dtype, t.shape) for name, t in d.loss_fn_inputs.items()}
    assert dtypes == {"target_tokens": ("int64", [n]), "logprobs": ("float32", [n]), "advantages": ("float32", [n])}
    assert d.loss_fn_inputs["target_tokens"].to_numpy().dtype == np.int64


def test_logprobs_are_sent_as_float32() -> None:
    d = importance_sampling_datum(PROMPT, COMPLETION, [-0.1, -0.2, -0.3], 0.0)
    assert fields(d)["logprobs"][-3:] == [float(np.float32(v)) for v in (-0.1, -0.2, -0.3)]


def test_cross_entropy_datum_default_and_custom_weights() -> None:
    d = cross_entropy_datum(PROMPT, COMPLETION)
    f = fields(d)
    assert d.model_input.to_ints() == PROMPT + COMPLETION[:-1]
    assert f["target_tokens"] == [IGNORE] * 3 + COMPLETION
    assert f["weights"] == [0.0] * 3 + [1.0] * 3
    assert {n: t.dtype for n, t in d.loss_fn_inputs.items()} == {"target_tokens": "int64", "weights": "float32"}

    weighted = cross_entropy_datum(PROMPT, COMPLETION, weights=[1.0, 0.0, 0.25])
    assert fields(weighted)["weights"] == [0.0] * 3 + [1.0, 0.0, 0.25]


def test_scalar_and_per_token_advantages() -> None:
    scalar = importance_sampling_datum(PROMPT, COMPLETION, LOGPROBS, -0.75)
    assert fields(scalar)["advantages"][-3:] == [-0.75] * 3
    per_token = importance_sampling_datum(PROMPT, COMPLETION, LOGPROBS, [0.5, -0.25, 1.0])
    assert fields(per_token)["advantages"] == [0.0] * 3 + [0.5, -0.25, 1.0]
    numpy_scalar = importance_sampling_datum(PROMPT, COMPLETION, LOGPROBS, np.float32(0.5))
    assert fields(numpy_scalar)["advantages"][-3:] == [0.5] * 3
    numpy_array = importance_sampling_datum(PROMPT, COMPLETION, np.array(LOGPROBS), np.array([1, 2, 3]))
    assert fields(numpy_array)["advantages"][-3:] == [1.0, 2.0, 3.0]


def test_numpy_integer_tokens_and_model_input_prompt_are_accepted() -> None:
    reference = importance_sampling_datum(PROMPT, COMPLETION, LOGPROBS, 1.0)
    as_numpy_scalars = importance_sampling_datum([np.int64(t) for t in PROMPT], [np.int32(t) for t in COMPLETION], LOGPROBS, 1.0)
    as_arrays = importance_sampling_datum(np.array(PROMPT, dtype=np.int32), np.array(COMPLETION, dtype=np.uint16), LOGPROBS, 1.0)
    as_model_input = importance_sampling_datum(ModelInput.from_ints(PROMPT), COMPLETION, LOGPROBS, 1.0)
    assert as_numpy_scalars == reference
    assert as_arrays == reference
    assert as_model_input == reference
    assert all(type(t) is int for t in as_arrays.loss_fn_inputs["target_tokens"].data)


def test_one_token_completion_trains_the_last_prompt_position() -> None:
    d = importance_sampling_datum(PROMPT, [7], [-0.5], 1.0)
    assert d.model_input.to_ints() == PROMPT
    assert fields(d)["target_tokens"] == [IGNORE] * 3 + [7]
    assert active_tokens(d, "importance_sampling") == 1


def test_one_token_prompt_has_no_masked_positions() -> None:
    d = cross_entropy_datum([5], COMPLETION)
    assert d.model_input.to_ints() == [5] + COMPLETION[:-1]
    assert fields(d)["target_tokens"] == COMPLETION


# --- errors: each names the field and the fix ------------------------------------------------------------

ERROR_CASES = [
    # (id, call, exception type, substrings the message must contain)
    ("empty prompt", lambda: importance_sampling_datum([], COMPLETION, LOGPROBS, 1.0), ValueError, ["prompt is empty"]),
    ("empty completion", lambda: importance_sampling_datum(PROMPT, [], [], 1.0), ValueError, ["completion is empty", "Skip this sample"]),
    ("empty completion (ce)", lambda: cross_entropy_datum(PROMPT, []), ValueError, ["completion is empty"]),
    ("logprobs too short", lambda: importance_sampling_datum(PROMPT, COMPLETION, LOGPROBS[:-1], 1.0), ValueError,
     ["logprobs has 2 entries", "completion has 3 tokens", "SampleSequence.logprobs"]),
    ("advantages too long", lambda: importance_sampling_datum(PROMPT, COMPLETION, LOGPROBS, [1.0] * 4), ValueError,
     ["advantages has 4 entries", "one advantage per completion token"]),
    ("weights wrong length", lambda: cross_entropy_datum(PROMPT, COMPLETION, weights=[1.0]), ValueError,
     ["weights has 1 entries", "one weight per token"]),
    ("logprobs cover prompt + completion", lambda: importance_sampling_datum(PROMPT, COMPLETION, [-1.0] * 7, 1.0),
     ValueError, ["logprobs has 7 entries", "values[len(prompt):]"]),
    ("float tokens", lambda: importance_sampling_datum(PROMPT, [20.0, 21.0, 22.0], LOGPROBS, 1.0), TypeError,
     ["completion[0] = 20.0", "must be integers"]),
    ("float token array", lambda: importance_sampling_datum(PROMPT, np.zeros(3), LOGPROBS, 1.0), TypeError,
     ["completion has dtype float64", ".astype(np.int64)"]),
    ("bool token", lambda: cross_entropy_datum([True, 2], COMPLETION), TypeError, ["prompt[0] = True", "integers"]),
    ("text instead of tokens", lambda: cross_entropy_datum("2+2=", COMPLETION), TypeError, ["prompt must be a list of token ids", "tokenizer"]),
    ("negative token", lambda: importance_sampling_datum(PROMPT, [20, -100, 22], LOGPROBS, 1.0), ValueError,
     ["completion[1] = -100 is negative", "do not pad completion with -100"]),
    ("2-D token array", lambda: cross_entropy_datum(np.array([PROMPT]), COMPLETION), ValueError, ["prompt must be a 1-D"]),
    ("logprobs None", lambda: importance_sampling_datum(PROMPT, COMPLETION, None, 1.0), ValueError,
     ["logprobs is None", "SampleSequence.logprobs"]),
    ("compute_logprobs leading None", lambda: importance_sampling_datum(PROMPT, COMPLETION, [None, -1.0, -2.0], 1.0),
     ValueError, ["logprobs[0] is None", "compute_logprobs", "values[len(prompt):]"]),
    ("full compute_logprobs output", lambda: importance_sampling_datum(PROMPT, COMPLETION, [None] + [-1.0] * 6, 1.0),
     ValueError, ["logprobs[0] is None", "values[len(prompt):]"]),
    ("nan logprob", lambda: importance_sampling_datum(PROMPT, COMPLETION, [-1.0, math.nan, -1.0], 1.0), ValueError,
     ["logprobs[1] = nan is not finite"]),
    ("inf advantage", lambda: importance_sampling_datum(PROMPT, COMPLETION, LOGPROBS, math.inf), ValueError,
     ["advantages = inf is not finite"]),
    ("nan advantage in list", lambda: importance_sampling_datum(PROMPT, COMPLETION, LOGPROBS, [0.0, 0.0, math.nan]),
     ValueError, ["advantages[2] = nan"]),
    ("string logprob", lambda: importance_sampling_datum(PROMPT, COMPLETION, [-1.0, "x", -1.0], 1.0), TypeError,
     ["logprobs[1] = 'x'", "not a number"]),
    ("scalar logprobs", lambda: importance_sampling_datum(PROMPT, COMPLETION, -1.0, 1.0), TypeError,
     ["logprobs must be a list", "SampleSequence.logprobs"]),
    ("bool advantage", lambda: importance_sampling_datum(PROMPT, COMPLETION, LOGPROBS, True), TypeError,
     ["advantages must be a list"]),
]


@pytest.mark.parametrize("call, error, fragments", [case[1:] for case in ERROR_CASES], ids=[case[0] for case in ERROR_CASES])
def test_errors_name_the_field_and_the_fix(call, error, fragments: list[str]) -> None:
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# --- the contract with pytrio's planner and the offline trainer ------------------------------------------


def test_planner_accepts_the_datums_and_counts_only_completion_targets() -> None:
    is_datum = importance_sampling_datum(PROMPT, COMPLETION, LOGPROBS, 0.5)
    assert active_tokens(is_datum, "importance_sampling") == len(COMPLETION)
    ce_datum = cross_entropy_datum(PROMPT, COMPLETION, weights=[1.0, 0.0, 1.0])
    assert active_tokens(ce_datum, "cross_entropy") == 2  # weight 0 is not counted either


def test_zero_padding_would_count_prompt_positions() -> None:
    """Why the builders use -100: tutorial A's target-0 padding makes prompt positions active tokens."""
    d = importance_sampling_datum(PROMPT, COMPLETION, LOGPROBS, 0.5)
    targets = [0 if t == IGNORE else t for t in fields(d)["target_tokens"]]
    zero_padded = Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "target_tokens": targets})
    assert active_tokens(zero_padded, "importance_sampling") == len(PROMPT) - 1 + len(COMPLETION)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A training client on offline/tiny, a sampler of the same weights, and one sample of it."""
    from trio_helpers import connect

    service = connect("offline", latency=0.0, home=tmp_path_factory.mktemp("offline_home"))
    client = service.create_lora_training_client("offline/tiny", rank=8, seed=0)
    sampler = client.save_weights_and_get_sampling_client()
    prompt = ModelInput.from_ints(list(b"Question: 2+2?\nAnswer:"))
    seq = sampler.sample(prompt, num_samples=1, sampling_params=SamplingParams(max_tokens=24, seed=3)).result().sequences[0]
    assert len(seq.tokens) >= 2, "the test needs a completion of at least two tokens"
    return client, sampler, prompt, seq


def test_offline_forward_reproduces_the_sampler_logprobs(tiny) -> None:
    client, _, prompt, seq = tiny
    d = importance_sampling_datum(prompt, seq.tokens, seq.logprobs, 1.0)
    out = client.forward([d], loss_fn="importance_sampling").result()
    lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    P = len(prompt)
    assert lp.shape == (len(d.model_input),)
    np.testing.assert_allclose(lp[P - 1 :], seq.logprobs, rtol=0, atol=1e-5)
    assert not lp[: P - 1].any(), "prompt positions (target -100) report logprob 0.0"
    assert out.metrics["token_count"] == len(seq.tokens)
    # same weights in sampler and trainer: every ratio is 1, so the IS loss per token is -advantage
    assert out.metrics["loss_mean"] == pytest.approx(-1.0, abs=1e-5)


def test_unshifted_targets_do_not_reproduce_the_sampler(tiny) -> None:
    client, _, prompt, seq = tiny
    P, C = len(prompt), len(seq.tokens)
    unshifted = Datum(
        model_input=ModelInput.from_ints(prompt.to_ints() + seq.tokens),
        loss_fn_inputs={"target_tokens": [IGNORE] * P + seq.tokens, "logprobs": [0.0] * P + seq.logprobs,
                        "advantages": [0.0] * P + [1.0] * C},
    )
    wrong = client.forward([unshifted], loss_fn="importance_sampling").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(wrong[P:] - np.array(seq.logprobs)).max() > 1e-2
    # ... but it is exactly the auto_shift=True layout of the same sample
    shifted = client.forward([unshifted], loss_fn="importance_sampling", auto_shift=True).result()
    np.testing.assert_allclose(shifted.loss_fn_outputs[0]["logprobs"].to_numpy()[P:], seq.logprobs, rtol=0, atol=1e-5)
    assert active_tokens(unshifted, "importance_sampling", auto_shift=True) == C


def test_compute_logprobs_completion_slice_is_what_the_builder_wants(tiny) -> None:
    _, sampler, prompt, seq = tiny
    scored = sampler.compute_logprobs(ModelInput.from_ints(prompt.to_ints() + seq.tokens)).result()
    assert scored[0] is None
    with pytest.raises(ValueError, match=r"logprobs\[0\] is None"):
        importance_sampling_datum(prompt, seq.tokens, scored, 1.0)
    d = importance_sampling_datum(prompt, seq.tokens, scored[len(prompt) :], 1.0)
    np.testing.assert_allclose(fields(d)["logprobs"][len(prompt) - 1 :], seq.logprobs, rtol=1e-6, atol=1e-7)


# --- alignment_rows / format_alignment ----------------------------------------------------------------------


def test_alignment_rows_of_an_importance_sampling_datum() -> None:
    d = importance_sampling_datum([ord(c) for c in "ab="], [ord("4"), ord(".")], [-0.5, -0.25], 2.0)
    rows = alignment_rows(d, CharTokenizer())
    assert rows == [
        {"pos": 0, "input": "a", "target": "-", "logprob": 0.0, "advantage": 0.0, "trained": False},
        {"pos": 1, "input": "b", "target": "-", "logprob": 0.0, "advantage": 0.0, "trained": False},
        {"pos": 2, "input": "=", "target": "4", "logprob": -0.5, "advantage": 2.0, "trained": True},
        {"pos": 3, "input": "4", "target": ".", "logprob": -0.25, "advantage": 2.0, "trained": True},
    ]


def test_alignment_rows_window_and_weights() -> None:
    d = cross_entropy_datum([ord(c) for c in "xyz"], [ord("1"), ord("2"), ord("3")], weights=[1.0, 0.0, 0.5])
    rows = alignment_rows(d, CharTokenizer(), start=2, stop=99)
    assert [r["pos"] for r in rows] == [2, 3, 4]
    assert [(r["input"], r["target"], r["weight"], r["trained"]) for r in rows] == [
        ("z", "1", 1.0, True), ("1", "2", 0.0, False), ("2", "3", 0.5, True),
    ]
    assert "logprob" not in rows[0] and "advantage" not in rows[0]
    assert [r["pos"] for r in alignment_rows(d, CharTokenizer(), start=-2)] == [3, 4]


def test_alignment_rows_with_the_offline_tokenizer_decodes_special_tokens() -> None:
    from trio_helpers.offline.tokenizer import IM_END_ID, get_offline_tokenizer

    tok = get_offline_tokenizer()
    d = cross_entropy_datum(tok.encode("2+2=", add_special_tokens=False), [ord("4"), IM_END_ID])
    assert [(r["input"], r["target"]) for r in alignment_rows(d, tok)] == [
        ("2", "-"), ("+", "-"), ("2", "-"), ("=", "4"), ("4", "<|im_end|>"),
    ]


def test_alignment_rows_needs_targets() -> None:
    d = Datum(model_input=ModelInput.from_ints([1, 2]), loss_fn_inputs={"weights": [1.0, 1.0]})
    with pytest.raises(ValueError, match="no target_tokens"):
        alignment_rows(d, CharTokenizer())


def test_format_alignment_table() -> None:
    d = importance_sampling_datum([ord(c) for c in "a\n"], [ord("b"), ord("c")], [-1.5e-6, -0.25], 0.5)
    lines = format_alignment(alignment_rows(d, CharTokenizer())).splitlines()
    assert lines[0].split() == ["pos", "input", "target", "logprob", "advantage", "trained"]
    assert lines[1].split() == ["0", "'a'", "-", "0", "0", "no"]
    assert lines[2].split() == ["1", "'\\n'", "'b'", "-1.5e-06", "0.5", "yes"]
    assert lines[3].split() == ["2", "'b'", "'c'", "-0.25", "0.5", "yes"]
    assert len({len(line) for line in lines}) == 1, "columns are right-aligned to a common width"
    assert format_alignment([]) == "(no positions)"

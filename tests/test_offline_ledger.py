"""The usage ledger of the offline backend: exact counts for small hand-checkable calls.

- every kind of request is counted as the service would bill or limit it (tokens, steps,
  runs, checkpoints), per service and per client, each request once however often retried;
- differences and sums of snapshots ("what did this cell cost"), never negative;
- exact under concurrency; failed and refused requests count no work;
- the printed table fits in 92 characters.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import numpy as np
import pytest
import pytrio as trio
from pytrio.errors.base import PyTrioError, ValidationError

from trio_helpers import connect
from trio_helpers.backend import usage_of
from trio_helpers.offline.ledger import Usage, print_usage, usage_table

MODEL = "offline/tiny"
RANK = 8
PROMPT = trio.ModelInput.from_ints(list(b"sixteen tokens!!"))  # 16 byte tokens
assert PROMPT.length == 16
HP = trio.AdamParams(learning_rate=1e-2)


def xent(text: bytes, ignore: int = 0, zero_weights: int = 0) -> trio.Datum:
    """A next-byte datum of len(text) - 1 tokens: the first ``ignore`` targets are -100 and
    the last ``zero_weights`` targets have weight 0."""
    tokens = list(text)
    targets = np.asarray(tokens[1:], dtype=np.int64)
    targets[:ignore] = -100
    weights = np.ones(len(targets), dtype=np.float32)
    if zero_weights:
        weights[-zero_weights:] = 0.0
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )


def policy(text: bytes, ignore: int) -> trio.Datum:
    """An importance-sampling datum; zero advantages still count as active tokens."""
    tokens = list(text)
    n = len(tokens) - 1
    targets = np.asarray(tokens[1:], dtype=np.int64)
    targets[:ignore] = -100
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": targets,
                        "logprobs": np.full(n, -1.0, dtype=np.float32),
                        "advantages": np.zeros(n, dtype=np.float32)},
    )


def only(usage: Usage) -> dict[str, float]:
    """The non-zero fields, so that a test states every count it expects."""
    return {k: v for k, v in vars(usage).items() if v}


@pytest.fixture
def svc(tmp_path):
    return connect("offline", in_process=True, latency=0.0, home=tmp_path)


# ------------------------------------------------------------------------- exact counts
def test_sampling_counts(svc):
    sampler = svc.create_sampling_client(MODEL)
    assert only(svc.usage()) == {"requests": 1, "sampling_runs": 1}
    assert only(sampler.usage()) == {}  # its creation is the service's request

    res = sampler.sample(PROMPT, num_samples=3,
                         sampling_params=trio.SamplingParams(max_tokens=5, seed=0)).result()
    sampled = sum(len(seq.tokens) for seq in res.sequences)
    assert 3 <= sampled <= 15 and sampled == res.output_tokens
    lps = sampler.compute_logprobs(PROMPT).result()
    assert len(lps) == 16
    # the prompt is counted once per sample call (SampleResponse.input_tokens), not x3
    assert res.input_tokens == 16
    assert only(sampler.usage()) == {"requests": 2, "samples": 3, "prompt_tokens": 16,
                                     "sampled_tokens": sampled, "logprob_tokens": 16}
    assert only(svc.usage()) == {"requests": 3, "sampling_runs": 1, "samples": 3,
                                 "prompt_tokens": 16, "sampled_tokens": sampled,
                                 "logprob_tokens": 16}


def test_training_counts(svc):
    tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=0)
    assert only(svc.usage()) == {"requests": 1, "training_runs": 1}
    # 18 model-input tokens each: 18 - 4 ignored = 14 active; 18 - 2 - 3 zero weights = 13
    batch = [xent(b"twenty bytes of txt", ignore=4), xent(b"twenty bytes of tx2", ignore=2,
                                                      zero_weights=3)]
    assert [d.model_input.length for d in batch] == [18, 18]
    tc.forward_backward(batch).result()
    tc.optim_step(HP).result()
    tc.forward([xent(b"eleven byte", ignore=1)]).result()  # 10 tokens, 9 active
    # policy loss: -100 targets are inactive, zero advantages are still active
    tc.forward_backward([policy(b"abcdefghij", ignore=3)], "importance_sampling").result()
    # auto_shift: the first position has no target (pytrio's planner starts at token 1)
    tokens = list(b"shifted!")
    targets = np.asarray(tokens, dtype=np.int64)
    shifted = trio.Datum(model_input=trio.ModelInput.from_ints(tokens),
                         loss_fn_inputs={"target_tokens": targets})
    tc.forward([shifted], auto_shift=True).result()
    tc.optim_step(HP).result()
    expected = {"requests": 6, "forward_backward_tokens": 18 + 18 + 9,
                "forward_backward_active_tokens": (18 - 4) + (18 - 2 - 3) + (9 - 3),
                "forward_tokens": 10 + 8, "forward_active_tokens": 9 + 7, "optim_steps": 2}
    assert only(tc.usage()) == expected
    assert only(svc.usage()) == {**expected, "requests": 7, "training_runs": 1}


def test_checkpoint_and_client_counts(svc):
    tc = svc.create_lora_training_client(MODEL, rank=RANK)  # 1 request (service only)
    state = tc.save_state("s").result()  # 1
    weights = tc.save_weights_for_sampler("w").result()  # 1
    snapshot = tc.save_weights_and_get_sampling_client()  # 2: training event + control call
    loaded = tc.create_sampling_client(weights.path)  # 1 control call, made through tc
    svc.create_sampling_client(MODEL, model_path=weights.path)  # 1 (service only)
    resumed = svc.create_training_client_from_state_with_optimizer(state.path)  # 1
    assert only(tc.usage()) == {"requests": 5, "states_saved": 1,
                                "sampler_weights_saved": 1, "sampler_snapshots": 1,
                                "sampling_runs": 2}
    assert only(svc.usage()) == {"requests": 8, "training_runs": 2, "states_saved": 1,
                                 "sampler_weights_saved": 1, "sampler_snapshots": 1,
                                 "sampling_runs": 3}
    for client in (snapshot, loaded, resumed):
        assert only(client.usage()) == {}


# ------------------------------------------------------------------- retries and failures
def test_retried_requests_count_their_work_once(tmp_path):
    """On the offline server, through pytrio's client: 503s before and after the work change no count but
    ``retries``."""
    def run(fault_rate):
        svc = connect("offline", latency=0.0, fault_rate=fault_rate, seed=5, home=tmp_path)
        tc = svc.create_lora_training_client(MODEL, rank=RANK)
        sampler = tc.save_weights_and_get_sampling_client()
        for i in range(6):
            tc.forward_backward([xent(b"count me once please", ignore=2)])
            tc.optim_step(HP)
            params = trio.SamplingParams(max_tokens=4, seed=i)
            sampler.sample(PROMPT, num_samples=2, sampling_params=params).result()
        tc.save_state("end").result()
        return usage_of(svc)

    clean, faulty = run(0.0), run(0.5)
    assert faulty.retries > 0 and clean.retries == 0
    assert replace(faulty, retries=0) == clean
    assert faulty.forward_backward_tokens == 6 * 19 and faulty.optim_steps == 6


def test_refused_requests_count_no_work(tmp_path):
    """An outage: the attempts answered 503 are retries; the work they carried is never counted."""
    svc = connect("offline", latency=0.0, outage_after=2, home=tmp_path)
    tc = svc.create_lora_training_client(MODEL, rank=RANK)  # 0
    tc.optim_step(HP).result()  # 1
    with pytest.raises(PyTrioError):
        tc.forward_backward([xent(b"never computed")]).result()  # 2: the window runs out
    usage = usage_of(svc)
    assert (usage.requests, usage.optim_steps, usage.forward_backward_tokens) == (2, 1, 0)
    assert usage.retries > 0


def test_work_that_fails_on_the_service_counts_the_request_only(svc):
    other = svc.create_lora_training_client(MODEL, rank=16)
    path = other.save_state("rank16").result().path
    tc = svc.create_lora_training_client(MODEL, rank=RANK)
    before = svc.usage()
    with pytest.raises(ValidationError):  # rank mismatch: found when the request runs
        tc.load_state(path).result()
    assert only(svc.usage() - before) == {"requests": 1}
    with pytest.raises(ValidationError):  # rejected before sending: not a request
        tc.forward_backward([])
    assert only(svc.usage() - before) == {"requests": 1}


# ------------------------------------------------------------------------ arithmetic
def test_difference_is_what_a_cell_cost(svc):
    sampler = svc.create_sampling_client(MODEL)
    before = svc.usage()
    sampler.compute_logprobs(PROMPT).result()
    sampler.compute_logprobs(PROMPT).result()
    cost = svc.usage() - before
    assert only(cost) == {"requests": 2, "logprob_tokens": 32}
    assert before + cost == svc.usage()
    assert sum((sampler.usage(), before), Usage()) == svc.usage()
    with pytest.raises(ValueError, match="earlier snapshot"):
        before - svc.usage()
    assert Usage() - Usage() == Usage()
    with pytest.raises(TypeError):
        svc.usage() + 1


def test_counts_are_exact_under_concurrency(svc):
    sampler = svc.create_sampling_client(MODEL)
    sp = trio.SamplingParams(max_tokens=3, seed=1)

    async def burst():
        return await asyncio.gather(
            *[sampler.sample_async(PROMPT, num_samples=2, sampling_params=sp)
              for _ in range(24)]
        )

    def thread_work():
        for _ in range(10):
            sampler.compute_logprobs(PROMPT).result()

    threads = [threading.Thread(target=thread_work) for _ in range(4)]
    for t in threads:
        t.start()
    results = asyncio.run(burst())
    for t in threads:
        t.join()
    sampled = sum(r.output_tokens for r in results)
    assert only(sampler.usage()) == {"requests": 24 + 40, "samples": 48,
                                     "prompt_tokens": 24 * 16, "sampled_tokens": sampled,
                                     "logprob_tokens": 40 * 16}


# ------------------------------------------------------------------------------ the table
def test_table_fits_and_hides_zero_rows(svc):
    sampler = svc.create_sampling_client(MODEL)
    sampler.compute_logprobs(PROMPT).result()
    table = usage_table(svc.usage())
    assert table.splitlines() == [
        "                                     usage",
        "requests                                 2",
        "compute_logprobs tokens                 16",
        "sampling clients created                 1",
    ]
    assert str(svc.usage()) == table
    full = usage_table(svc.usage(), all_rows=True).splitlines()
    assert len(full) == 1 + len(vars(Usage()))


def test_table_compares_columns(svc, capsys):
    tc = svc.create_lora_training_client(MODEL, rank=RANK)
    before = svc.usage()
    tc.forward_backward([xent(b"one more datum")]).result()
    columns = {"service": svc.usage(), "trainer": tc.usage(), "cell": svc.usage() - before,
               "empty": Usage(), "sum": tc.usage() + before}
    print_usage(columns)
    out = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in out) <= 92
    assert out[0].split() == list(columns)
    row = next(line for line in out if line.startswith("forward_backward tokens"))
    assert row.split()[-5:] == ["13", "13", "13", "0", "13"]
    with pytest.raises(ValueError, match="at most 5 columns"):
        usage_table({str(i): Usage() for i in range(6)})
    with pytest.raises(ValueError, match="title"):
        usage_table({"a much too long title": Usage()})
    with pytest.raises(TypeError):
        usage_table({"x": 3})

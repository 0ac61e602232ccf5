"""Faults, retries and outages of the offline backend, against pytrio 0.2.9's transport.

- ``fault_rate``: every request still succeeds, retried inside the client, and a faulty run
  is bit-identical to a fault-free one with the same seeds (faults cost simulated time,
  never correctness);
- the simulated backoff follows pytrio's knobs (``trio.configure``), grows with faults,
  stays inside the training / sampling / control windows, and its jitter is seeded;
- ``outage_after``: from that request on, pytrio's own error surfaces once the window is
  exhausted, quickly in real time, for sampling, training and control calls; a training
  client whose operation failed this way refuses the operations queued behind it
  (``training.run_broken``) and applies none of them.

The exact error objects pytrio raises are checked in ``test_offline_contract.py``.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import pytrio as trio
from pytrio.config.config import configuration
from pytrio.errors.actor import ActorAPIError, ActorEventSubmitError
from pytrio.errors.base import PyTrioError, ValidationError
from pytrio.errors.control import ControlAPIError

from trio_helpers import connect
from trio_helpers.offline.transport import (
    CONTROL,
    MIN_FAILED_ATTEMPT_SECONDS,
    SAMPLING,
    TRAINING,
    RetrySettings,
    plan_attempts,
)

MODEL = "offline/tiny"
RANK = 8
PROMPT = trio.ModelInput.from_ints(list(b"Once upon a time"))
HP = trio.AdamParams(learning_rate=5e-2)
RETRY_FIELDS = (
    "retry_initial_delay_seconds", "retry_multiplier", "retry_max_delay_seconds",
    "retry_jitter_ratio", "training_retry_timeout_seconds",
    "sampling_retry_timeout_seconds", "control_retry_timeout_seconds",
)


from test_offline_async import DATA  # the same two cross-entropy datums  # noqa: E402


@pytest.fixture
def pytrio_config():
    """``trio.configure`` in a test; pytrio's configuration is restored afterwards."""
    saved = {name: getattr(configuration, name) for name in RETRY_FIELDS}
    yield trio.configure
    trio.configure(**saved)


# ------------------------------------------------------------------------------ faults cost
# time, not results
def workload(svc):
    """Every kind of request: sampling, logprobs, training, checkpoints, control calls."""
    out = []
    tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=2)
    first = tc.save_weights_and_get_sampling_client()
    six = trio.SamplingParams(max_tokens=6)  # no seed: the service's seed stream
    out.append(first.sample(PROMPT, num_samples=2, sampling_params=six).result())
    out.append(first.compute_logprobs(PROMPT).result())
    for _ in range(3):
        fb = tc.forward_backward(DATA)  # submitted back to back, as a pipelined loop does
        opt = tc.optim_step(HP)
        out += [fb.result(), opt.result()]
    out.append(tc.forward(DATA).result())
    state = tc.save_state("state").result()
    weights = tc.save_weights_for_sampler("weights").result()
    out.append((state.size, weights.size))
    loaded = tc.create_sampling_client(weights.path)
    seeded = trio.SamplingParams(max_tokens=8, seed=5)
    out.append(loaded.sample(PROMPT, sampling_params=seeded).result())
    resumed = svc.create_training_client_from_state_with_optimizer(state.path)
    out.append(resumed.forward_backward(DATA).result())
    out.append(resumed.optim_step(HP).result())
    snapshot = tc.save_weights_and_get_sampling_client()
    out.append(snapshot.sample(PROMPT, num_samples=3, sampling_params=six).result())
    base = svc.create_sampling_client(MODEL)
    out.append(base.compute_logprobs(PROMPT).result())
    params = dict(tc._model.adapter.params())
    params.update({f"resumed {k}": v for k, v in resumed._model.adapter.params().items()})
    return out, params


def test_faulty_run_is_bit_identical_to_a_fault_free_run(tmp_path):
    clean = connect("offline", in_process=True, latency=0.0, fault_rate=0.0, seed=1, home=tmp_path)
    faulty = connect("offline", in_process=True, latency=0.0, fault_rate=0.3, seed=1, home=tmp_path)
    clean_out, clean_params = workload(clean)
    faulty_out, faulty_params = workload(faulty)
    assert faulty_out == clean_out
    for name, value in clean_params.items():
        np.testing.assert_array_equal(faulty_params[name], value)
    assert clean.usage().retries == 0 and clean.usage().retry_seconds == 0.0
    assert faulty.usage().retries > 5  # faults did happen (about 0.43 retries per request)
    assert faulty.usage().failed_requests == 0
    assert faulty.usage().requests == clean.usage().requests


def test_async_api_under_faults_matches_the_sync_fault_free_run(tmp_path):
    sp = trio.SamplingParams(max_tokens=6, seed=3)

    async def main(svc):
        tc = await svc.create_lora_training_client_async(MODEL, rank=RANK, seed=2)
        fb = await tc.forward_backward_async(DATA)
        opt = await tc.optim_step_async(HP)
        sampler = await tc.save_weights_and_get_sampling_client_async()
        samples = await asyncio.gather(
            *[sampler.sample_async(PROMPT, sampling_params=sp) for _ in range(6)]
        )
        return await fb, await opt, samples, await sampler.compute_logprobs_async(PROMPT)

    clean = asyncio.run(main(connect("offline", in_process=True, latency=0.0, seed=4, home=tmp_path)))
    faulty_svc = connect("offline", in_process=True, latency=0.001, fault_rate=0.4, seed=4, home=tmp_path)
    assert asyncio.run(main(faulty_svc)) == clean
    assert faulty_svc.usage().retries > 0


def test_retry_time_grows_with_the_fault_rate(tmp_path):
    totals = []
    for rate in (0.0, 0.2, 0.5):
        svc = connect("offline", in_process=True, latency=0.0, fault_rate=rate, seed=0, home=tmp_path)
        sampler = svc.create_sampling_client(MODEL)
        for i in range(40):
            params = trio.SamplingParams(max_tokens=2, seed=i)
            sampler.sample(PROMPT, sampling_params=params).result()
        totals.append(svc.usage())
    assert [u.requests for u in totals] == [41, 41, 41]
    assert totals[0].retries == 0 < totals[1].retries < totals[2].retries
    seconds = [u.retry_seconds for u in totals]
    assert 0.0 == seconds[0] < seconds[1] < seconds[2]
    # pytrio's default first wait is 1 s, so every retry costs at least a simulated second
    assert totals[2].retry_seconds >= totals[2].retries * 1.0


def test_jitter_is_seeded_and_only_moves_time(tmp_path, pytrio_config):
    pytrio_config(retry_jitter_ratio=0.5)

    def run(seed):
        svc = connect("offline", in_process=True, latency=0.0, fault_rate=0.5, seed=seed, home=tmp_path)
        tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=0)
        outs = [tc.forward_backward(DATA).result() for _ in range(12)]
        return svc.usage(), outs

    a, b, c = run(7), run(7), run(8)
    assert a == b  # same seed: the same faults and the same jittered waits
    assert a[0].retry_seconds != c[0].retry_seconds  # another seed: other faults and jitter
    assert a[1] == c[1]  # ... and the same results


# ----------------------------------------------------------------------- pytrio's backoff
# and its windows
def test_plan_follows_pytrio_backoff_and_window():
    settings = RetrySettings(initial_delay=1.0, multiplier=2.0, max_delay=8.0, jitter=0.0,
                             training_window=40.0, sampling_window=40.0, control_window=5.0)
    # a request that fails twice, then succeeds: waits 1 and 2, three attempts of 0.5 s
    # latency
    fails = iter([True, True, False])
    no_jitter = lambda: 0.0  # noqa: E731
    attempts, waits, seconds, exhausted = plan_attempts(
        TRAINING, settings, 0.5, lambda i: next(fails), no_jitter
    )
    assert (attempts, waits, seconds, exhausted) == (3, (1.0, 2.0), 4.5, False)
    # training, service down: 1, 2, 4, 8, 8, 8 ... capped, the last wait cut at the window's
    # end, no attempt
    down = lambda i: True  # noqa: E731
    attempts, waits, seconds, exhausted = plan_attempts(TRAINING, settings, 0.5, down,
                                                        no_jitter)
    assert exhausted and waits[:5] == (1.0, 2.0, 4.0, 8.0, 8.0)
    assert seconds == pytest.approx(0.5 + 40.0)  # the window opens at the first failure
    assert sum(waits) + 0.5 * (attempts - 1) == pytest.approx(40.0)
    # sampling (pytrio's streaming path): one last attempt at the end of the window
    s_attempts, _, s_seconds, _ = plan_attempts(SAMPLING, settings, 0.5, down, no_jitter)
    assert s_attempts == attempts + 1 and s_seconds == pytest.approx(0.5 + 40.0 + 0.5)
    # control calls use the control window
    *_, c_seconds, c_exhausted = plan_attempts(CONTROL, settings, 0.5, down, no_jitter)
    assert c_exhausted and c_seconds == pytest.approx(5.5)


def test_jittered_waits_stay_within_the_ratio():
    settings = RetrySettings(initial_delay=1.0, multiplier=3.0, max_delay=100.0,
                             jitter=0.25, training_window=1000.0)
    rng = np.random.default_rng(0)
    _, waits, _, _ = plan_attempts(TRAINING, settings, 0.0, lambda i: True, rng.random)
    for i, wait in enumerate(waits[:-1]):  # the last one is cut at the window's end
        base = min(3.0**i, 100.0)
        assert base <= wait <= base * 1.25
    assert len(set(waits[:-1])) == len(waits) - 1  # really jittered
    # without latency a failed attempt still costs a millisecond, so a zero-delay loop ends
    zero = RetrySettings(initial_delay=0.0, training_window=0.01)
    attempts, _, seconds, exhausted = plan_attempts(TRAINING, zero, 0.0, lambda i: True,
                                                    rng.random)
    assert exhausted and seconds >= 0.01
    assert attempts <= 0.01 / MIN_FAILED_ATTEMPT_SECONDS + 2


def test_service_reads_pytrio_configuration_when_created(pytrio_config):
    pytrio_config(retry_initial_delay_seconds=0.5, retry_multiplier=3.0,
                  retry_max_delay_seconds=4.0, retry_jitter_ratio=0.0,
                  training_retry_timeout_seconds=20.0,
                  sampling_retry_timeout_seconds=30.0, control_retry_timeout_seconds=10.0)
    svc = connect("offline", in_process=True, latency=0.0)
    expected = RetrySettings(0.5, 3.0, 4.0, 0.0, 20.0, 30.0, 10.0)
    assert svc._runtime.retry_settings == expected
    # as in pytrio, the configuration is copied when the client is created
    pytrio_config(training_retry_timeout_seconds=99.0)
    assert svc._runtime.retry_settings.training_window == 20.0
    assert connect("offline", in_process=True)._runtime.retry_settings.training_window == 99.0


def test_small_windows_let_transient_faults_surface(tmp_path, pytrio_config):
    """As on the service, shrinking the windows makes a run fragile: faults outlast them."""
    pytrio_config(retry_initial_delay_seconds=1.0, sampling_retry_timeout_seconds=0.5)
    svc = connect("offline", in_process=True, latency=0.0, fault_rate=0.5, seed=3, home=tmp_path)
    sampler = svc.create_sampling_client(MODEL)
    outcomes = []
    for i in range(30):
        try:
            params = trio.SamplingParams(max_tokens=2, seed=i)
            sampler.sample(PROMPT, sampling_params=params).result()
            outcomes.append("ok")
        except ActorAPIError as err:
            assert err.status_code == 503 and err.retryable
            outcomes.append("failed")
    assert "ok" in outcomes and "failed" in outcomes
    assert svc.usage().failed_requests == outcomes.count("failed")


# ------------------------------------------------------------------------------------------
# --------- outages
def test_outage_surfaces_pytrio_error_for_sampling(tmp_path, pytrio_config):
    pytrio_config(sampling_retry_timeout_seconds=120.0)
    svc = connect("offline", in_process=True, latency=0.0, outage_after=3, home=tmp_path)
    sampler = svc.create_sampling_client(MODEL)  # request 0
    sp = trio.SamplingParams(max_tokens=4, seed=0)
    sampler.sample(PROMPT, sampling_params=sp).result()  # 1
    sampler.compute_logprobs(PROMPT).result()  # 2
    t0 = time.perf_counter()
    with pytest.raises(ActorAPIError) as info:
        sampler.sample(PROMPT, sampling_params=sp).result()  # 3: the service is down
    assert time.perf_counter() - t0 < 5.0  # 120 simulated seconds at retry_time_scale 0.001
    err = info.value
    assert type(err) is ActorAPIError
    assert (err.status_code, err.code, err.retryable) == (503, "actor.request_failed", True)
    assert err.message == "Actor request failed with HTTP 503"
    with pytest.raises(ActorAPIError):
        sampler.compute_logprobs(PROMPT).result()
    usage = svc.usage()
    assert usage.requests == 5 and usage.failed_requests == 2
    assert usage.simulated_seconds >= 2 * 120.0


def test_outage_with_pytrio_default_windows_is_fast_in_real_time(tmp_path):
    assert configuration.training_retry_timeout_seconds == 15 * 60  # pytrio's default
    svc = connect("offline", in_process=True, latency=0.01, outage_after=1, home=tmp_path)
    tc = svc.create_lora_training_client(MODEL, rank=RANK)
    t0 = time.perf_counter()
    with pytest.raises(ActorEventSubmitError):
        tc.forward_backward(DATA).result()
    assert time.perf_counter() - t0 < 5.0  # about 0.9 s
    assert svc.usage().simulated_seconds >= 15 * 60


def test_training_outage_breaks_the_client_nothing_queued_applies(tmp_path, pytrio_config):
    pytrio_config(training_retry_timeout_seconds=60.0)
    svc = connect("offline", in_process=True, latency=0.0, outage_after=3, home=tmp_path)
    tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=1)  # request 0
    tc.forward_backward(DATA).result()  # 1
    tc.optim_step(HP).result()  # 2
    weights = {k: v.copy() for k, v in tc._model.adapter.params().items()}
    grads_before, adam_step = tc._grads, tc._adam["step"]

    fb = tc.forward_backward(DATA)  # 3: fails once the training window is exhausted
    opt = tc.optim_step(HP)  # submitted before awaiting fb: queued behind it
    save = tc.save_state("after-outage")
    with pytest.raises(ActorEventSubmitError) as info:
        fb.result()
    assert (info.value.status_code, info.value.code, info.value.retryable) == (
        503, "actor.request_failed", True)
    assert info.value.task_cuid == tc.run_id
    for queued in (opt, save):
        with pytest.raises(PyTrioError) as broken:
            queued.result()
        assert broken.value.code == "training.run_broken" and not broken.value.retryable
    # nothing was applied: no gradient, no step, no checkpoint
    for name, value in weights.items():
        np.testing.assert_array_equal(tc._model.adapter.params()[name], value)
    assert tc._grads is grads_before is None and tc._adam["step"] == adam_step == 1
    assert not list(tmp_path.rglob("after-outage*"))
    # later calls are refused at once (after validation), as pytrio's coordinator does
    with pytest.raises(PyTrioError, match="broken") as later:
        tc.optim_step(HP)
    assert later.value.code == "training.run_broken"
    with pytest.raises(PyTrioError, match="broken"):
        tc.save_weights_and_get_sampling_client()
    # opt and save were never sent
    assert svc.usage().requests == 4 and svc.usage().failed_requests == 1


def test_async_training_outage(tmp_path, pytrio_config):
    pytrio_config(training_retry_timeout_seconds=30.0)

    async def main():
        svc = connect("offline", in_process=True, latency=0.0, outage_after=1, home=tmp_path)
        tc = await svc.create_lora_training_client_async(MODEL, rank=RANK)
        fb = await tc.forward_backward_async(DATA)
        opt = await tc.optim_step_async(HP)
        results = []
        for fut in (opt, fb):  # awaited in reverse order
            try:
                await fut
            except PyTrioError as err:
                results.append((type(err).__name__, err.code))
        return results

    assert asyncio.run(main()) == [("PyTrioError", "training.run_broken"),
                                   ("ActorEventSubmitError", "actor.request_failed")]


def test_control_calls_fail_during_an_outage(tmp_path, pytrio_config):
    pytrio_config(control_retry_timeout_seconds=30.0)
    svc = connect("offline", in_process=True, latency=0.0, outage_after=2, home=tmp_path)
    tc = svc.create_lora_training_client(MODEL, rank=RANK)  # request 0
    # save_weights_and_get_sampling_client is two requests: the training event (1), then a
    # control call (2)
    with pytest.raises(ControlAPIError) as info:
        tc.save_weights_and_get_sampling_client()
    err = info.value
    assert (err.status_code, err.code) == (503, "control.request_failed") and err.retryable
    assert err.message == "Control request failed with HTTP 503"
    with pytest.raises(ControlAPIError):
        svc.create_sampling_client(MODEL)
    with pytest.raises(ControlAPIError):
        svc.create_lora_training_client(MODEL, rank=RANK)
    assert svc.usage().requests == 5 and svc.usage().failed_requests == 3


def test_outage_from_the_first_request(tmp_path):
    svc = connect("offline", in_process=True, latency=0.0, outage_after=0, retry_time_scale=0.0,
                  home=tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(ControlAPIError):
        svc.create_lora_training_client(MODEL, rank=RANK)
    assert time.perf_counter() - t0 < 2.0  # retry_time_scale=0: no real sleep at all
    assert svc.usage().simulated_seconds >= 15 * 60


def test_validation_errors_are_not_requests(tmp_path):
    svc = connect("offline", in_process=True, latency=0.0, outage_after=0, home=tmp_path)
    with pytest.raises(ValidationError):
        svc.create_lora_training_client(MODEL, rank=2)
    assert svc.usage().requests == 0


# ------------------------------------------------------------------------------------------
# ------- options
@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), True])
def test_fault_rate_bounds(bad):
    with pytest.raises(ValueError, match="fault_rate"):
        connect("offline", in_process=True, fault_rate=bad)


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_outage_after_must_be_a_request_index(bad):
    with pytest.raises(ValueError, match="outage_after"):
        connect("offline", in_process=True, outage_after=bad)


@pytest.mark.parametrize("bad", [-0.001, 2.0, float("nan"), "fast"])
def test_retry_time_scale_bounds(bad):
    with pytest.raises(ValueError, match="retry_time_scale"):
        connect("offline", in_process=True, retry_time_scale=bad)


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan")])
def test_latency_must_be_finite_and_non_negative(bad):
    with pytest.raises(ValueError, match="latency"):
        connect("offline", in_process=True, latency=bad)


def test_error_messages_are_one_line():
    bad = ({"fault_rate": 2}, {"outage_after": -1}, {"retry_time_scale": 5},
           {"latency": -1})
    for kwargs in bad:
        with pytest.raises(ValueError) as info:
            connect("offline", in_process=True, **kwargs)
        assert "\n" not in str(info.value)

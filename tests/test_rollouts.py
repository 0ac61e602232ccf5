"""Concurrent rollouts and user-level retries (trio_helpers.rollouts, chapter 05).

No timing assertions: the concurrency checks count requests in flight from the start/end events, ordering checks
use a fake sampler whose responses arrive in a known, shuffled order, and the retry checks compare results with a
fault-free run of the same seeds. Transient faults of the offline backend are retried inside its clients (as
pytrio's transport does), so user-level retries are exercised with fake samplers that fail on purpose. Pipelined
rollouts are a mode of the training loop: ``tests/test_loop.py``.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import pytrio as trio
from pytrio.errors.actor import ActorAPIError
from pytrio.errors.base import PyTrioError, ValidationError

from trio_helpers import connect
from trio_helpers.backend import usage_of
from trio_helpers.data import load_gsm8k
from trio_helpers.grpo import GRPOConfig, run_grpo
from trio_helpers.loop import TIMING_PREFIX
from trio_helpers.rollouts import (
    RequestLimiter,
    RetriesExhausted,
    RetryPolicy,
    gather_or_cancel,
    is_retryable,
    run_sync,
    sample_groups_async,
    with_retries,
)

TINY = "offline/tiny"
FAST = RetryPolicy(max_attempts=8, initial_delay=0.0, multiplier=1.0, max_delay=0.0)


def transient(message: str = "busy") -> ActorAPIError:
    return ActorAPIError(message, status_code=503, code="actor.unavailable", retryable=True, operation="sample")


def prompts(n: int) -> list:
    return [trio.ModelInput.from_ints(list(f"prompt number {i}:".encode())) for i in range(n)]


def params_for(i: int):
    return trio.SamplingParams(max_tokens=8, seed=1000 + i)


def without_timing(rows) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING_PREFIX)} for row in rows]


def tokens(groups) -> list[list[list[int]]]:
    return [[list(s.tokens) for s in group] for group in groups]


class InFlight:
    """An ``on_event`` recorder: the events in order and the peak number of attempts in flight."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.now = 0
        self.peak = 0

    def __call__(self, kind: str, index: int, t: float) -> None:
        self.events.append((kind, index))
        self.now += 1 if kind == "start" else -1
        self.peak = max(self.peak, self.now)

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.events if k == kind)


class FakeSampler:
    """``sample_async`` that answers prompt ``i`` after ``delays[i]`` seconds with a sequence naming ``i``.

    ``fail[i]`` is raised by every attempt of prompt ``i``; ``flaky`` prompts fail their first ``flaky[i]``
    attempts with a transient error, then succeed."""

    def __init__(self, delays, fail=None, flaky=None) -> None:
        self.delays = delays
        self.fail = fail or {}
        self.flaky = dict(flaky or {})
        self.calls: list[int] = []
        self.finished: list[int] = []

    async def sample_async(self, prompt, num_samples=1, sampling_params=None):
        i = prompt.to_ints()[0]
        self.calls.append(i)
        await asyncio.sleep(self.delays[i])
        if self.flaky.get(i, 0) > 0:
            self.flaky[i] -= 1
            raise transient(f"prompt {i} busy")
        if i in self.fail:
            raise self.fail[i]
        self.finished.append(i)
        return SimpleNamespace(sequences=[SimpleNamespace(tokens=[i, k]) for k in range(num_samples)])


def fake_prompts(n: int) -> list:
    return [trio.ModelInput.from_ints([i]) for i in range(n)]


# ------------------------------------------------------------------------------------------- concurrency, order
@pytest.mark.parametrize("limit", [1, 3])
def test_concurrency_limit_is_respected_and_reached(tmp_path, limit):
    service = connect("offline", latency=0.02, home=tmp_path)
    sampler = service.create_sampling_client(TINY)
    recorder = InFlight()
    groups = run_sync(sample_groups_async(sampler, prompts(10), 2, params_for, max_concurrency=limit,
                                          on_event=recorder, progress=False))
    assert recorder.peak == limit  # never more than the limit, and the limit is used
    assert recorder.count("start") == recorder.count("end") == 10 and recorder.count("error") == 0
    assert [len(g) for g in groups] == [2] * 10


def test_concurrency_limit_holds_while_retrying():
    sampler = FakeSampler([0.01] * 12, flaky={i: 2 for i in range(0, 12, 3)})
    recorder = InFlight()
    groups = run_sync(sample_groups_async(sampler, fake_prompts(12), 2, params_for, max_concurrency=4,
                                          retries=FAST, on_event=recorder, progress=False))
    assert recorder.count("error") == 8  # four flaky prompts, two failed attempts each
    assert recorder.peak <= 4  # a request keeps its slot while it backs off
    assert [[s.tokens for s in g] for g in groups] == [[[i, k] for k in range(2)] for i in range(12)]


def test_results_are_in_prompt_order_whatever_the_completion_order():
    delays = [0.06, 0.0, 0.04, 0.01, 0.05, 0.02]  # responses arrive as 1, 3, 5, 2, 4, 0
    sampler = FakeSampler(delays)
    groups = run_sync(sample_groups_async(sampler, fake_prompts(6), 3, params_for, progress=False))
    assert sampler.finished != sorted(sampler.finished)  # they really completed out of order
    assert [[s.tokens for s in g] for g in groups] == [[[i, k] for k in range(3)] for i in range(6)]


def test_offline_results_do_not_depend_on_concurrency(tmp_path):
    service = connect("offline", latency=0.005, home=tmp_path)
    sampler = service.create_sampling_client(TINY)
    wide = run_sync(sample_groups_async(sampler, prompts(6), 3, params_for, max_concurrency=6, progress=False))
    narrow = run_sync(sample_groups_async(sampler, prompts(6), 3, params_for, max_concurrency=1, progress=False))
    sequential = [sampler.sample(p, num_samples=3, sampling_params=params_for(i)).result().sequences
                  for i, p in enumerate(prompts(6))]
    assert tokens(wide) == tokens(narrow) == tokens(sequential)


def test_progress_bar_advances_once_per_prompt(monkeypatch):
    import tqdm.auto

    updates: list[int] = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total = total

        def update(self, n=1):
            updates.append(n)

        def close(self):
            updates.append(-1)

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    run_sync(sample_groups_async(FakeSampler([0.0] * 5), fake_prompts(5), 1, params_for, progress=True))
    assert updates == [1] * 5 + [-1]


# ------------------------------------------------------------------------------------------------------ retries
def test_offline_faults_are_retried_inside_the_client_and_never_reach_user_code(tmp_path):
    clean = connect("offline", latency=0.0, home=tmp_path)
    faulty = connect("offline", latency=0.0, fault_rate=0.3, seed=11, home=tmp_path)
    expected = run_sync(sample_groups_async(clean.create_sampling_client(TINY), prompts(16), 3, params_for,
                                            progress=False))
    recorder = InFlight()
    got = run_sync(sample_groups_async(faulty.create_sampling_client(TINY), prompts(16), 3, params_for,
                                       retries=None, on_event=recorder, progress=False))
    assert usage_of(faulty).retries > 0  # faults did happen (pytrio's client retried them) ...
    assert recorder.count("error") == 0 and recorder.count("start") == 16  # ... and none reached this code
    assert tokens(got) == tokens(expected)  # the fault-free samples, exactly


def test_user_level_retries_lose_and_duplicate_nothing():
    sampler = FakeSampler([0.0] * 16, flaky={i: 1 + i % 3 for i in range(0, 16, 2)})
    recorder = InFlight()
    got = run_sync(sample_groups_async(sampler, fake_prompts(16), 3, params_for, retries=FAST, on_event=recorder,
                                       progress=False))
    failures = sum(1 + i % 3 for i in range(0, 16, 2))
    assert recorder.count("error") == failures and recorder.count("start") == 16 + failures
    ends = [i for kind, i in recorder.events if kind == "end"]
    assert sorted(ends) == list(range(16))  # every prompt succeeded exactly once
    assert sorted(sampler.finished) == list(range(16))
    assert [[s.tokens for s in g] for g in got] == [[[i, k] for k in range(3)] for i in range(16)]


def test_non_retryable_errors_are_raised_at_once():
    for error in (ValidationError("bad prompt", code="validation.empty_prompt"),
                  PyTrioError("not transient", retryable=False), ValueError("a bug"), KeyError("x")):
        calls = []

        async def call(error=error, calls=calls):
            calls.append(1)
            raise error

        with pytest.raises(type(error)):
            run_sync(with_retries(call, RetryPolicy(max_attempts=5, initial_delay=0.0)))
        assert len(calls) == 1, f"{type(error).__name__} was retried"


def test_non_retryable_error_in_a_batch_cancels_the_rest():
    error = ValidationError("prompt 2 is invalid", code="validation.failed")
    sampler = FakeSampler([0.0, 0.2, 0.0, 0.2], fail={2: error})
    with pytest.raises(ValidationError, match="prompt 2 is invalid"):
        run_sync(sample_groups_async(sampler, fake_prompts(4), 2, params_for, progress=False))
    assert sampler.calls.count(2) == 1  # not retried
    assert 1 not in sampler.finished and 3 not in sampler.finished  # the slow ones were cancelled


def test_with_retries_gives_up_after_max_attempts_with_the_count_in_the_message():
    calls, retried = [], []
    last = transient("still busy")

    async def call():
        calls.append(1)
        raise last if len(calls) == 3 else transient()

    policy = RetryPolicy(max_attempts=3, initial_delay=0.001, multiplier=2.0, max_delay=0.01)
    with pytest.raises(RetriesExhausted, match="gave up after 3 attempts") as info:
        run_sync(with_retries(call, policy, on_retry=lambda a, e, d: retried.append((a, d)), what="sample (prompt 7)"))
    assert len(calls) == 3
    assert info.value.attempts == 3 and info.value.last_error is last and info.value.__cause__ is last
    assert "sample (prompt 7)" in str(info.value) and "still busy" in str(info.value)
    assert retried == [(1, 0.001), (2, 0.002)]  # one wait after each failed attempt except the last


def test_with_retries_returns_the_first_success():
    calls = []

    async def call():
        calls.append(1)
        if len(calls) < 3:
            raise transient()
        return "ok"

    assert run_sync(with_retries(call, FAST)) == "ok" and len(calls) == 3


def test_retry_exhaustion_in_a_batch_is_raised(tmp_path):
    sampler = FakeSampler([0.0] * 3, fail={1: transient()})
    with pytest.raises(RetriesExhausted, match=r"sample \(prompt 1\) gave up after 2 attempts"):
        run_sync(sample_groups_async(sampler, fake_prompts(3), 1, params_for, progress=False,
                                     retries=RetryPolicy(max_attempts=2, initial_delay=0.0)))
    assert sampler.calls.count(1) == 2


def test_retry_policy_backoff_is_exponential_capped_and_validated():
    assert RetryPolicy().delays() == [0.05, 0.1, 0.2]
    assert RetryPolicy(max_attempts=6, initial_delay=0.1, multiplier=3.0, max_delay=0.5).delays() == pytest.approx(
        [0.1, 0.3, 0.5, 0.5, 0.5])
    assert RetryPolicy(max_attempts=1).delays() == []
    for bad in ({"max_attempts": 0}, {"initial_delay": -1.0}, {"multiplier": 0.5}, {"max_delay": 0.01},
                {"max_attempts": 2.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RetryPolicy(**bad)
    assert is_retryable(transient()) and not is_retryable(ValueError()) and not is_retryable(PyTrioError("x"))


def test_sample_groups_async_validates_its_arguments():
    for kwargs, field in (({"group_size": 0}, "group_size"), ({"max_concurrency": 0}, "max_concurrency")):
        args = {"group_size": 1, "max_concurrency": 2, **kwargs}
        with pytest.raises(ValueError, match=field):
            run_sync(sample_groups_async(FakeSampler([0.0]), fake_prompts(1), args["group_size"], params_for,
                                         max_concurrency=args["max_concurrency"], progress=False))


def test_run_sync_works_inside_a_running_event_loop():
    async def inner():
        await asyncio.sleep(0)
        return 42

    async def outer():  # like a Jupyter cell: a loop is already running
        return run_sync(inner())

    assert asyncio.run(outer()) == 42


# ---------------------------------------------------------------------------------------------- the limiter
def test_request_limiter_validates_its_arguments():
    with pytest.raises(ValueError, match="max_concurrency must be an integer >= 1"):
        RequestLimiter(0)
    with pytest.raises(ValueError, match="max_concurrency"):
        RequestLimiter(True)
    with pytest.raises(TypeError, match="retries must be a RetryPolicy or None"):
        RequestLimiter(2, retries=3)


def test_request_limiter_bounds_every_request_it_is_given():
    limiter, recorder = RequestLimiter(3, FAST, on_event=None), InFlight()
    limiter.on_event = recorder

    async def request(i):
        await asyncio.sleep(0.005)
        return i * i

    async def main():
        return await gather_or_cancel(limiter.call(lambda i=i: request(i), what=f"r{i}", index=i)
                                      for i in range(10))

    assert run_sync(main()) == [i * i for i in range(10)]
    assert recorder.peak == 3 and recorder.count("end") == 10


def test_gather_or_cancel_cancels_the_others_when_one_fails():
    finished = []

    async def slow(i):
        await asyncio.sleep(0.2)
        finished.append(i)

    async def broken():
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        run_sync(gather_or_cancel([slow(0), broken(), slow(1)]))
    assert finished == []


def test_without_a_retry_policy_the_first_transient_error_is_raised_as_is():
    error = transient("first failure")
    sampler = FakeSampler([0.0, 0.0], fail={1: error})
    with pytest.raises(ActorAPIError, match="first failure"):
        run_sync(sample_groups_async(sampler, fake_prompts(2), 1, params_for, retries=None, progress=False))
    assert sampler.calls.count(1) == 1


# ----------------------------------------------------------------------------------- the loop's sampling retries
RECORDS = load_gsm8k("train", source="offline")


def test_the_loop_retries_failed_sampling_and_matches_a_clean_run(tmp_path, monkeypatch):
    """A transient sampling error that reaches the loop (after pytrio's own retries) costs a retry, not a sample:
    every mode's rows equal a fault-free run's."""
    from trio_helpers.offline.service import OfflineSamplingClient

    base = GRPOConfig(base_model=TINY, lora_rank=8, steps=3, batch_size=2, group_size=3, max_tokens=8, seed=3,
                      max_concurrency=4)
    def reward(text, record):  # signal for the untrained tiny model
        return float(len(text) % 2)

    original, failed = OfflineSamplingClient.sample_async, []

    async def fails_once(self, prompt, num_samples=1, sampling_params=None, **kwargs):
        sampling_params = sampling_params or trio.SamplingParams()
        key = (tuple(prompt.to_ints()), sampling_params.seed)
        if key not in failed:  # the first attempt of every request fails
            failed.append(key)
            raise transient()
        return await original(self, prompt, num_samples, sampling_params, **kwargs)

    monkeypatch.setattr(OfflineSamplingClient, "sample_async", fails_once)
    for rollout in ("sync", "async", "pipeline"):
        config = GRPOConfig(**{**base.__dict__, "rollout": rollout})
        monkeypatch.setattr(OfflineSamplingClient, "sample_async", original)
        local = connect("offline", latency=0.0, home=tmp_path, in_process=True)
        clean = run_grpo(local, RECORDS, config, reward_fn=reward)
        monkeypatch.setattr(OfflineSamplingClient, "sample_async", fails_once)
        failed.clear()
        local = connect("offline", latency=0.0, home=tmp_path, in_process=True)
        faulty = run_grpo(local, RECORDS, config, reward_fn=reward, retries=FAST)
        assert len(failed) == config.steps * config.batch_size, rollout
        assert without_timing(faulty.history) == without_timing(clean.history), rollout
        assert sum(row["train/datums"] for row in clean.history) > 0

"""Concurrent rollouts, retries and pipelined GRPO (trio_helpers.rollouts, chapter 05).

No timing assertions: the concurrency checks count requests in flight from the start/end events, ordering checks
use a fake sampler whose responses arrive in a known, shuffled order, and the retry checks compare results with a
fault-free run of the same seeds.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import pytrio as trio
from pytrio.errors.actor import ActorAPIError
from pytrio.errors.base import PyTrioError, ValidationError

from trio_helpers import connect
from trio_helpers.data import load_gsm8k
from trio_helpers.grpo import GRPOConfig, run_grpo
from trio_helpers.rollouts import (
    RetriesExhausted,
    RetryPolicy,
    is_retryable,
    run_grpo_pipelined,
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
    """``sample_async`` that answers prompt ``i`` after ``delays[i]`` seconds with a sequence naming ``i``."""

    def __init__(self, delays, fail=None) -> None:
        self.delays = delays
        self.fail = fail or {}
        self.calls: list[int] = []
        self.finished: list[int] = []

    async def sample_async(self, prompt, num_samples=1, sampling_params=None):
        i = prompt.to_ints()[0]
        self.calls.append(i)
        await asyncio.sleep(self.delays[i])
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


def test_concurrency_limit_holds_while_retrying(tmp_path):
    service = connect("offline", latency=0.01, fault_rate=0.3, seed=3, home=tmp_path)
    sampler = service.create_sampling_client(TINY)
    recorder = InFlight()
    run_sync(sample_groups_async(sampler, prompts(12), 2, params_for, max_concurrency=4, retries=FAST,
                                 on_event=recorder, progress=False))
    assert recorder.count("error") > 0  # faults did happen
    assert recorder.peak <= 4


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
def test_retries_lose_and_duplicate_nothing_under_faults(tmp_path):
    clean = connect("offline", latency=0.0, home=tmp_path)
    faulty = connect("offline", latency=0.0, fault_rate=0.3, seed=11, home=tmp_path)
    expected = run_sync(sample_groups_async(clean.create_sampling_client(TINY), prompts(16), 3, params_for,
                                            progress=False))
    recorder = InFlight()
    got = run_sync(sample_groups_async(faulty.create_sampling_client(TINY), prompts(16), 3, params_for,
                                       retries=FAST, on_event=recorder, progress=False))
    assert recorder.count("error") > 0  # some requests failed and were retried
    assert recorder.count("start") == 16 + recorder.count("error")
    ends = [i for kind, i in recorder.events if kind == "end"]
    assert sorted(ends) == list(range(16))  # every prompt succeeded exactly once
    assert [len(g) for g in got] == [3] * 16
    assert tokens(got) == tokens(expected)  # and returned exactly the fault-free samples


def test_non_retryable_errors_are_raised_at_once():
    for error in (ValidationError("bad prompt", code="validation.empty_prompt"),
                  PyTrioError("not transient", retryable=False), ValueError("a bug"), KeyError("x")):
        calls = []

        async def call(error=error):
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


# --------------------------------------------------------------------------------------------------- pipelining
RECORDS = load_gsm8k("train", source="offline")


def small_config(**overrides) -> GRPOConfig:
    values = dict(steps=4, batch_size=2, group_size=4, max_tokens=48, seed=3, learning_rate=2e-4,
                  max_concurrency=4)
    return GRPOConfig(**{**values, **overrides})


@pytest.mark.parametrize("max_staleness, expected", [(0, [0, 0, 0, 0, 0]), (1, [0, 1, 1, 1, 1]),
                                                      (2, [0, 1, 2, 2, 2])])
def test_pipelined_run_keeps_staleness_within_the_bound(tmp_path, max_staleness, expected):
    service = connect("offline", latency=0.005, home=tmp_path)
    events = []
    result = run_grpo_pipelined(service, RECORDS, small_config(base_model=TINY, steps=5, max_tokens=16),
                                max_staleness=max_staleness, progress=False,
                                on_event=lambda kind, step, t: events.append((kind, step)))
    assert [row["step"] for row in result.history] == list(range(5))
    assert [row["staleness"] for row in result.history] == expected
    assert all(row["staleness"] <= max_staleness for row in result.history)
    assert [row["sampler_version"] for row in result.history] == [max(0, s - max_staleness) for s in range(5)]
    assert result.final_path is not None
    # batch s starts sampling before batch s - max_staleness trains: the overlap the schedule allows
    order = {event: i for i, event in enumerate(events)}
    for s in range(1, 5):
        assert (order[("sample_start", s)] < order[("train_start", s - 1)]) == (max_staleness >= 1)
        assert order[("sample_end", s)] < order[("train_start", s)]


def test_pipelined_without_staleness_reproduces_run_grpo(tmp_path):
    service = connect("offline", latency=0.0, home=tmp_path)
    config = small_config(steps=3)
    plain = run_grpo(service, RECORDS, config, progress=False).history
    piped = run_grpo_pipelined(service, RECORDS, config, max_staleness=0, progress=False).history
    for key in ("reward", "frac_degenerate", "datums", "train_tokens", "loss", "completion_tokens_mean"):
        assert [row[key] for row in piped] == [row[key] for row in plain], key


def test_pipelined_results_do_not_depend_on_timing(tmp_path):
    config = small_config(steps=3)
    runs = []
    for latency in (0.0, 0.02):
        service = connect("offline", latency=latency, home=tmp_path)
        runs.append(run_grpo_pipelined(service, RECORDS, config, max_staleness=1, progress=False).history)
    for key in ("reward", "datums", "loss", "staleness"):
        assert [row[key] for row in runs[0]] == [row[key] for row in runs[1]], key


def test_pipelined_rejects_a_negative_staleness(tmp_path):
    service = connect("offline", latency=0.0, home=tmp_path)
    with pytest.raises(ValueError, match="max_staleness"):
        run_grpo_pipelined(service, RECORDS, small_config(base_model=TINY), max_staleness=-1, progress=False)


def test_without_a_retry_policy_the_first_transient_error_is_raised_as_is():
    error = transient("first failure")
    sampler = FakeSampler([0.0, 0.0], fail={1: error})
    with pytest.raises(ActorAPIError, match="first failure"):
        run_sync(sample_groups_async(sampler, fake_prompts(2), 1, params_for, retries=None, progress=False))
    assert sampler.calls.count(1) == 1


def test_pipelined_run_retries_failed_sampling_and_matches_a_clean_run(tmp_path, monkeypatch):
    """Transient sampling failures cost retries, not samples: the run's numbers equal a fault-free run's."""
    from trio_helpers.offline.service import OfflineSamplingClient

    config = small_config(steps=3)
    clean = run_grpo_pipelined(connect("offline", latency=0.0, home=tmp_path), RECORDS, config, progress=False)
    original, failed = OfflineSamplingClient.sample_async, []

    async def fails_once(self, prompt, num_samples=1, sampling_params=trio.SamplingParams(), **kwargs):
        key = (tuple(prompt.to_ints()), sampling_params.seed)
        if key not in failed:  # the first attempt of every request fails
            failed.append(key)
            raise transient()
        return await original(self, prompt, num_samples, sampling_params, **kwargs)

    monkeypatch.setattr(OfflineSamplingClient, "sample_async", fails_once)
    faulty = run_grpo_pipelined(connect("offline", latency=0.0, home=tmp_path), RECORDS, config, progress=False,
                                retries=FAST)
    assert len(failed) == config.steps * config.batch_size
    for key in ("reward", "datums", "train_tokens", "loss"):
        assert [row[key] for row in faulty.history] == [row[key] for row in clean.history], key

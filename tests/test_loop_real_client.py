"""The loop's guarantees (issue 10) through pytrio's own client: ``run_grpo`` and ``run_opd`` driving pytrio 0.2.9's
unmodified ``ServiceClient`` against the offline server (``trio_helpers.offline.server``) on 127.0.0.1.

- fault-free, every scorer and mode gives the rows and final weights of the same run on the in-process backend
  (``test_loop.straight``): the loop sees no difference between the two clients;
- with seeded 503s on 20% of attempts (before or after the work) pytrio's own retries absorb every fault: the
  same rows and weights, and no event runs twice;
- an outage stops the run cleanly (pytrio's errors reach the loop as a :class:`RunStopped`) and a resume on a
  healthy server reproduces the uninterrupted run: near the end of a run in every mode, and from every request
  of a short run;
- an ``optim_step`` is never sent after a failed ``forward_backward``.

pytrio's retry delays and windows are shortened through ``pytrio.configure`` (its defaults wait 1 s doubling to
30 s within 15 minutes).
"""

from __future__ import annotations

import gc
from dataclasses import replace

import numpy as np
import pytest
import test_loop
from test_loop import KINDS, MODES, make_config, run, weights_fingerprint, without_timing
from test_loop_failures import NO_WAIT, assert_stopped_cleanly, whole_rows

from trio_helpers import connect
from trio_helpers.backend import OFFLINE_SERVER_RETRIES
from trio_helpers.loop import RunStopped, read_checkpoints
from trio_helpers.offline.server import OfflineServer, service_client
from trio_helpers.offline.service import OfflineOptions

home, straight = test_loop.home, test_loop.straight  # fixtures: the offline home, the in-process reference runs
FAST = OFFLINE_SERVER_RETRIES  # what connect("offline") and the recipes use

# an outage: pytrio gives up on a request after 0.2 s of retrying instead of 2
SHORT = {**FAST, **{f"{plane}_retry_timeout_seconds": 0.2 for plane in ("training", "sampling", "control")}}


_SERVERS: list[OfflineServer] = []


@pytest.fixture(autouse=True)
def stop_servers():
    """After each test, the clients it dropped are collected here, on the main thread, while their servers still
    answer (pytrio closes a session from its client's finalizer and blocks whichever thread runs it), then the
    servers stop."""
    yield
    gc.collect()
    while _SERVERS:
        _SERVERS.pop().stop()


def served(home, pytrio_options=FAST, **options):
    """A fresh offline server with ``options`` (stopped after the test) and pytrio's own client for it."""
    server = OfflineServer(options=OfflineOptions(latency=0.0, home=home, **options)).start()
    _SERVERS.append(server)
    return server, service_client(server, **pytrio_options)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_pytrio_client_gives_the_in_process_run(kind, mode, straight, home, tmp_path) -> None:
    clean = straight(kind, mode)
    _, service = served(home)
    result = run(kind, service, replace(clean.config, run_dir=str(tmp_path / "run")))
    assert without_timing(result.history) == clean.rows
    np.testing.assert_array_equal(weights_fingerprint(service, result.final_path), clean.fingerprint)


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_seed_faults_the_same_attempts(kind, straight, home, tmp_path) -> None:
    """Faults are drawn from what identifies a request (never pytrio's random ids or the arrival order), so two
    concurrent runs with the same seed retry the same number of times: the ledger is the same, retries included."""
    clean = straight(kind, "async")
    ledgers = []
    for attempt in range(2):
        server, service = served(home, fault_rate=0.2, seed=5)
        run(kind, service, replace(clean.config, run_dir=str(tmp_path / f"run{attempt}")), retries=None)
        ledgers.append((server.usage(), server.stats["faults_before"], server.stats["faults_after"]))
    assert ledgers[0][0].retries > 0 and ledgers[0] == ledgers[1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_pytrio_retries_absorb_faults_on_the_wire(kind, mode, straight, home, tmp_path) -> None:
    clean = straight(kind, mode)
    server, service = served(home, fault_rate=0.2, seed=0)
    result = run(kind, service, replace(clean.config, run_dir=str(tmp_path / "faulty")), retries=None)
    stats = server.stats
    assert stats["faults_before"] + stats["faults_after"] > 0, stats  # (both kinds: test_offline_server.py)
    assert set(server.executions().values()) == {1}  # a re-sent event was answered, never run again
    assert without_timing(result.history) == clean.rows
    np.testing.assert_array_equal(weights_fingerprint(service, result.final_path), clean.fingerprint)


@pytest.mark.parametrize("kind", KINDS)
def test_an_outage_stops_cleanly_and_resume_completes_the_run(kind, straight, home, tmp_path) -> None:
    """An outage from each of the last 10 numbered requests of the run on: a clean stop each time, and where a
    state was saved, a resume on a healthy server that reproduces the uninterrupted run."""
    clean = straight(kind, "sync")
    probe, probe_service = served(home)
    run(kind, probe_service, replace(clean.config, run_dir=str(tmp_path / "probe")))
    total = probe.stats["new_requests"]
    resumed_from = set()
    for n in range(total - 10, total):
        config = replace(clean.config, run_dir=str(tmp_path / f"outage-{n}"))
        _, service = served(home, SHORT, outage_after=n)
        with pytest.raises(RunStopped) as info:
            run(kind, service, config, retries=NO_WAIT)
        stopped = info.value
        rows = assert_stopped_cleanly(stopped, config.run_dir)
        assert without_timing(rows) == clean.rows[: stopped.completed], f"outage from request {n}"
        if stopped.checkpoint is None:
            continue
        resumed_from.add(stopped.checkpoint["step"])
        _, service = served(home)
        resumed = run(kind, service, config, resume=True)
        assert without_timing(whole_rows(config.run_dir)) == clean.rows, f"outage from request {n}"
        np.testing.assert_array_equal(weights_fingerprint(service, resumed.final_path), clean.fingerprint)
    assert 3 in resumed_from  # some resume started from the checkpoint of step 3 and redid step 3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_an_outage_near_the_end_stops_every_mode_cleanly(kind, mode, straight, home, tmp_path) -> None:
    """In every mode, an outage from the run's last sampling (or teacher) request on, with the loop's default
    retry policy: sampling is retried at user level (4 attempts), then the run stops after step 3's checkpoint, and
    a resume on a healthy server reproduces the uninterrupted run."""
    clean = straight(kind, mode)
    probe, probe_service = served(home)
    run(kind, probe_service, replace(clean.config, run_dir=str(tmp_path / "probe")))
    # a run ends with forward_backward, optim_step, save_state, save_weights_for_sampler: the outage starts at the
    # request before those
    config = replace(clean.config, run_dir=str(tmp_path / "run"))
    _, outage = served(home, SHORT, outage_after=probe.stats["new_requests"] - 5)
    with pytest.raises(RunStopped) as info:
        run(kind, outage, config)
    stopped = info.value
    rows = assert_stopped_cleanly(stopped, config.run_dir)
    assert stopped.checkpoint["step"] == 3 and stopped.completed == 3
    assert "(after pytrio's retries and 4 attempts of ours)" in stopped.call
    assert without_timing(rows) == clean.rows[: stopped.completed]
    _, healthy = served(home)
    resumed = run(kind, healthy, config, resume=True)
    assert resumed.start_step == 3
    assert [r["step"] for r in whole_rows(config.run_dir)] == [0, 1, 2, 3], "a step missing or doubled"
    assert without_timing(whole_rows(config.run_dir)) == without_timing(resumed.history) == clean.rows
    np.testing.assert_array_equal(weights_fingerprint(healthy, resumed.final_path), clean.fingerprint)


@pytest.mark.parametrize("kind", KINDS)
def test_an_outage_at_any_request_stops_cleanly_and_resumes_exactly(kind, home, tmp_path) -> None:
    """The first failing request swept over every numbered request of a 2-step run that saves after every step:
    the sampler refresh (a training event and a control call), sampling, the teacher's compute_logprobs,
    forward_backward, optim_step, save_state and the final weights."""
    small = {"group_size": 1} if kind == "opd" else {}
    config = make_config(kind, steps=2, save_every=1, max_tokens=4, run_dir=str(tmp_path / "clean"), **small)
    probe, probe_service = served(home)
    clean = run(kind, probe_service, config)
    total = probe.stats["new_requests"]
    first = 2 if kind == "opd" else 1  # before that, the run cannot start (creating the teacher / trainer)
    resumed_from = []
    for n in range(first, total):
        broken = replace(config, run_dir=str(tmp_path / f"outage-{n}"))
        _, service = served(home, SHORT, outage_after=n)
        with pytest.raises(RunStopped) as info:
            run(kind, service, broken, retries=NO_WAIT)
        assert_stopped_cleanly(info.value, broken.run_dir)
        resumed_from.append(None if info.value.checkpoint is None else info.value.checkpoint["step"])
        if info.value.checkpoint is None:
            continue
        _, healthy = served(home)
        resumed = run(kind, healthy, broken, resume=True)
        assert without_timing(whole_rows(broken.run_dir)) == without_timing(clean.history), f"outage from {n}"
        assert [c["step"] for c in resumed.checkpoints] == [1, 2]
    # outages before the first checkpoint (nothing to resume), after it, and after the last
    assert set(resumed_from) == {None, 1, 2}, resumed_from


class SpyTrainingClient:
    """A training client that records the training calls made on it and how many requests the server had
    numbered by then."""

    def __init__(self, inner, server) -> None:
        self.inner, self.server = inner, server
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in ("forward_backward", "optim_step", "save_state"):
            return attr

        def call(*args, **kwargs):
            self.calls.append((name, self.server.stats["new_requests"]))
            return attr(*args, **kwargs)

        return call


@pytest.mark.parametrize("kind", KINDS)
def test_no_optim_step_follows_a_failed_forward_backward(kind, home, tmp_path) -> None:
    config = make_config(kind, steps=3, save_every=1, run_dir=str(tmp_path / "probe"))

    def spied(server, service):
        return SpyTrainingClient(service.create_lora_training_client(config.base_model, rank=config.lora_rank,
                                                                     seed=config.seed), server)

    probe_server, probe_service = served(home)
    probe = spied(probe_server, probe_service)
    run(kind, probe_service, config, training_client=probe)
    # in a sync run every earlier request has been numbered when forward_backward is sent: the count is its index
    fb_requests = [n for name, n in probe.calls if name == "forward_backward"]
    assert len(fb_requests) >= 3
    target = fb_requests[2]  # the third forward_backward: two optimizer steps and their checkpoints before it

    server, outage = served(home, SHORT, outage_after=target)
    spy = spied(server, outage)
    run_dir = tmp_path / "run"
    with pytest.raises(RunStopped) as info:
        run(kind, outage, replace(config, run_dir=str(run_dir)), training_client=spy)
    assert info.value.call == "a training call (forward_backward or optim_step)"
    assert_stopped_cleanly(info.value, run_dir)
    names = [name for name, _ in spy.calls]
    assert names[-1] == "forward_backward" and spy.calls[-1][1] == target  # it failed ...
    assert names.count("optim_step") == names.count("forward_backward") - 1  # ... and no optim_step followed it
    # The server's trainer is still in the state of the last checkpoint (read from the server: the run's
    # session is down, and pytrio offers no way to read Adam's counter).
    trainer = server._runs[spy.inner.training_run_cuid].state
    last = read_checkpoints(run_dir)[-1]
    local = connect("offline", in_process=True, latency=0.0, home=home)
    restored = local.create_training_client_from_state_with_optimizer(last["path"])
    assert trainer._adam["step"] == restored._adam["step"] == names.count("optim_step")
    for key, value in restored._model.adapter.params().items():
        np.testing.assert_array_equal(trainer._model.adapter.params()[key], value)

"""The loop's guarantees (issue 10) through pytrio's own client: ``run_grpo`` and ``run_opd`` driving pytrio 0.2.9's
unmodified ``ServiceClient`` against the offline server (``trio_helpers.offline.server``) on 127.0.0.1.

- fault-free, every scorer and mode gives the rows and final weights of the same run on the in-process backend
  (``test_loop.straight``): the loop sees no difference between the two clients;
- with seeded 503s on 20% of attempts (before or after the work) pytrio's own retries absorb every fault: the
  same rows and weights, and no event runs twice;
- an outage stops the run cleanly (pytrio's errors reach the loop as a :class:`RunStopped`) and a resume on a
  healthy server reproduces the uninterrupted run.

pytrio's retry delays and windows are shortened through ``pytrio.configure`` (its defaults wait 1 s doubling to
30 s within 15 minutes).
"""

from __future__ import annotations

import gc
from dataclasses import replace

import numpy as np
import pytest
import test_loop
from test_loop import KINDS, MODES, run, weights_fingerprint, without_timing
from test_loop_failures import NO_WAIT, assert_stopped_cleanly, whole_rows

from trio_helpers.backend import OFFLINE_SERVER_RETRIES
from trio_helpers.loop import RunStopped
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

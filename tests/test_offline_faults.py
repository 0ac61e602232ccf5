"""The offline backend's fault options, and what pytrio's client does with a training run the server stopped
answering.

Faults, retries and outages happen on the wire, between pytrio's own client and the offline server
(``trio_helpers.offline.server``): seeded 503s before or after the work (``fault_rate``) and outages
(``outage_after``). ``test_offline_server.py`` checks that they change nothing or surface pytrio's own errors,
``test_loop_real_client.py`` what the training loop makes of them. The in-process engine has no transport and
refuses both options.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import pytrio as trio
from pytrio.errors.base import PyTrioError

from trio_helpers import connect
from trio_helpers.backend import OFFLINE_SERVER_RETRIES
from trio_helpers.offline.server import OfflineServer, server_of, service_client
from trio_helpers.offline.service import OfflineOptions

MODEL = "offline/tiny"
RANK = 8
HP = trio.AdamParams(learning_rate=5e-2)
SHORT = {**OFFLINE_SERVER_RETRIES, "training_retry_timeout_seconds": 0.2, "control_retry_timeout_seconds": 0.2}

from test_offline_async import DATA  # the same two cross-entropy datums  # noqa: E402


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), True])
def test_fault_rate_bounds(bad):
    with pytest.raises(ValueError, match="fault_rate"):
        connect("offline", fault_rate=bad)


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_outage_after_must_be_a_request_index(bad):
    with pytest.raises(ValueError, match="outage_after"):
        connect("offline", outage_after=bad)


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan")])
def test_latency_must_be_finite_and_non_negative(bad):
    with pytest.raises(ValueError, match="latency"):
        connect("offline", latency=bad)


@pytest.mark.parametrize("in_process", [False, True])
def test_error_messages_are_one_line(in_process):
    for kwargs in ({"fault_rate": 2}, {"outage_after": -1}, {"latency": -1}):
        with pytest.raises(ValueError) as info:
            connect("offline", in_process=in_process, **kwargs)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("option, value", [("fault_rate", 0.2), ("outage_after", 0), ("outage_after", 3)])
def test_the_in_process_engine_refuses_faults_in_one_line(option, value):
    """It has no transport to fail: the line names the option, its value and the fix."""
    with pytest.raises(ValueError) as info:
        connect("offline", in_process=True, **{option: value})
    assert str(info.value) == (f"{option}={value!r} needs the offline server: faults happen on the wire, where "
                               "pytrio's client retries them; drop in_process=True")
    assert connect("offline", in_process=True, fault_rate=0.0, outage_after=None).usage().requests == 0


def test_an_outage_at_forward_backward_applies_nothing_queued_behind_it(tmp_path):
    """pytrio's client sends a training run's events one at a time; when one fails for good (the outage outlasts
    its window), the ``optim_step`` and ``save_state`` submitted behind it fail too, and the server applied
    none of them."""
    # numbered requests: 0 creates the run, 1 forward_backward, 2 optim_step; from 3 on the server is down
    server = OfflineServer(options=OfflineOptions(latency=0.0, outage_after=3, home=tmp_path)).start()
    try:
        service = service_client(server, **SHORT)
        assert server_of(service) is server
        tc = service.create_lora_training_client(MODEL, rank=RANK, seed=1)
        tc.forward_backward(DATA).result()
        tc.optim_step(HP).result()
        trainer = server._runs[tc.training_run_cuid].state
        weights = {k: v.copy() for k, v in trainer._model.adapter.params().items()}

        fb = tc.forward_backward(DATA)  # 3: refused until the training window runs out
        opt = tc.optim_step(HP)  # submitted before awaiting fb: queued behind it
        save = tc.save_state("after-outage")
        for future in (fb, opt, save):
            with pytest.raises(PyTrioError):
                future.result()
        assert trainer._adam["step"] == 1 and trainer._grads is None
        for name, value in weights.items():
            np.testing.assert_array_equal(trainer._model.adapter.params()[name], value)
        assert not list(tmp_path.rglob("after-outage*"))
        assert server.usage().optim_steps == 1 and server.usage().retries > 0
        del service, tc, fb, opt, save
        gc.collect()  # pytrio closes the session from its finalizer, while the server still answers
    finally:
        server.stop()

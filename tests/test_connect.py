"""``trio_helpers.connect``: backend choice, options, the bounded remote settings, and a cheap ``import``.

No test here reaches the network or sets an API key: the remote path only ever meets a monkeypatched
``pytrio.ServiceClient`` / ``pytrio.configure``.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import pytrio

import trio_helpers
from trio_helpers import backend
from trio_helpers.offline.service import OfflineServiceClient

REPO = Path(__file__).resolve().parents[1]


class FakeServiceClient:
    """Stands in for pytrio.ServiceClient: records that it was built, touches nothing."""

    instances: list["FakeServiceClient"] = []

    def __init__(self, api_key=None):
        self.api_key = api_key
        FakeServiceClient.instances.append(self)


@pytest.fixture
def fake_remote(monkeypatch):
    """Replace pytrio's network entry points; return the list of configure() calls."""
    calls: list[dict] = []
    FakeServiceClient.instances = []
    monkeypatch.setattr(pytrio, "ServiceClient", FakeServiceClient)
    monkeypatch.setattr(pytrio, "configure", lambda **kw: calls.append(kw))
    return calls


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("TRIO_BACKEND", raising=False)
    monkeypatch.delenv("PYTRIO_API_KEY", raising=False)


def test_offline_returns_the_offline_client(no_env, tmp_path, capsys):
    svc = trio_helpers.connect("offline", latency=0.0, home=tmp_path)
    assert isinstance(svc, OfflineServiceClient)
    assert svc.options.latency == 0.0 and svc.options.home == tmp_path
    assert "offline/tiny" in svc.get_supported_models()
    assert capsys.readouterr().out == ""  # an explicit choice prints nothing


@pytest.mark.parametrize("spelling", ["offline", "OFFLINE", " Offline "])
def test_backend_name_is_case_and_space_insensitive(no_env, spelling):
    assert isinstance(trio_helpers.connect(spelling, latency=0.0), OfflineServiceClient)


def test_trio_backend_env_is_respected(no_env, monkeypatch, fake_remote, capsys):
    monkeypatch.setenv("TRIO_BACKEND", "offline")
    assert isinstance(trio_helpers.connect(latency=0.0), OfflineServiceClient)
    monkeypatch.setenv("TRIO_BACKEND", "remote")
    assert isinstance(trio_helpers.connect(), FakeServiceClient)
    assert len(fake_remote) == 1
    # the argument wins over the environment
    assert isinstance(trio_helpers.connect("offline", latency=0.0), OfflineServiceClient)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("bad", ["bogus", "tinker", "local"])
def test_invalid_backend(no_env, monkeypatch, bad):
    with pytest.raises(ValueError, match="backend must be one of"):
        trio_helpers.connect(bad)
    monkeypatch.setenv("TRIO_BACKEND", bad)
    with pytest.raises(ValueError, match="TRIO_BACKEND"):
        trio_helpers.connect()


def test_auto_without_credentials_picks_offline_and_says_so(no_env, monkeypatch, fake_remote, capsys):
    monkeypatch.setattr(backend, "has_pytrio_credentials", lambda: False)
    svc = trio_helpers.connect(latency=0.0)  # default: auto
    assert isinstance(svc, OfflineServiceClient)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "offline" in out and "trio login" in out
    assert fake_remote == [] and FakeServiceClient.instances == []
    assert isinstance(trio_helpers.connect("auto", latency=0.0), OfflineServiceClient)


def test_auto_with_credentials_picks_remote(no_env, monkeypatch, fake_remote, capsys):
    monkeypatch.setattr(backend, "has_pytrio_credentials", lambda: True)
    client = trio_helpers.connect("auto")
    assert isinstance(client, FakeServiceClient)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "remote" in out and "TRIO_BACKEND=offline" in out


def test_remote_passes_bounded_timeouts(no_env, fake_remote):
    trio_helpers.connect("remote")
    assert fake_remote == [backend.REMOTE_TIMEOUTS]
    # bounded: an unreachable service fails in well under a minute, not after ~15 minutes of retries
    assert backend.REMOTE_TIMEOUTS["retry_max_attempts"] <= 3
    assert all(backend.REMOTE_TIMEOUTS[k] <= 30 for k in backend.REMOTE_TIMEOUTS if k.endswith("seconds"))


def test_remote_timeouts_are_overridable(no_env, fake_remote):
    trio_helpers.connect("remote", request_timeout_seconds=99, retry_max_attempts=7, log_level="DEBUG")
    (settings,) = fake_remote
    assert settings["request_timeout_seconds"] == 99 and settings["retry_max_attempts"] == 7
    assert settings["log_level"] == "DEBUG"
    assert settings["control_retry_timeout_seconds"] == backend.REMOTE_TIMEOUTS["control_retry_timeout_seconds"]


def test_remote_timeout_names_are_real_configure_keywords():
    # guards against drift: pytrio.configure silently collects unknown keywords
    accepted = set(inspect.signature(pytrio.configure).parameters)
    assert set(backend.REMOTE_TIMEOUTS) <= accepted


def test_unknown_offline_options(no_env):
    with pytest.raises(ValueError, match="request_timeout_seconds"):
        trio_helpers.connect("offline", request_timeout_seconds=5)
    with pytest.raises(ValueError, match="latncy"):
        trio_helpers.connect("offline", latncy=0.1)


def test_offline_options_are_passed_through(no_env, tmp_path):
    svc = trio_helpers.connect("offline", latency=0.5, fault_rate=0.25, seed=9, home=str(tmp_path))
    assert (svc.options.latency, svc.options.fault_rate, svc.options.seed) == (0.5, 0.25, 9)
    assert svc.options.home == tmp_path


def test_offline_home_defaults_to_env(no_env, monkeypatch, tmp_path):
    monkeypatch.setenv("TRIO_OFFLINE_HOME", str(tmp_path / "h"))
    assert trio_helpers.connect("offline").options.home == tmp_path / "h"


def test_has_pytrio_credentials_reads_env_and_pytrio_state(no_env, monkeypatch):
    from pytrio.config.config import auth_state

    monkeypatch.setattr(auth_state, "api_key", "")
    assert backend.has_pytrio_credentials() is False
    monkeypatch.setenv("PYTRIO_API_KEY", "   ")
    assert backend.has_pytrio_credentials() is False  # blank does not count


def test_import_is_cheap():
    code = (
        "import json, sys, trio_helpers; "
        "print(json.dumps(sorted(m for m in ('transformers', 'datasets', 'pytrio', 'numpy', 'torch') "
        "if m in sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip())
    assert not {"transformers", "datasets", "pytrio", "torch"} & set(loaded), loaded

"""``trio_helpers.connect``: backend choice, options, the start-up probe, the active backend, a cheap ``import``.

No test here reaches the network or sets an API key: the remote path only ever meets a monkeypatched
``pytrio.ServiceClient`` / ``pytrio.configure`` and a fake probe call; "logged in" is a monkeypatched
``has_pytrio_credentials``.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import pytrio

import trio_helpers
from trio_helpers import backend
from trio_helpers.offline.server import server_of
from trio_helpers.offline.service import OfflineServiceClient

REPO = Path(__file__).resolve().parents[1]


class FakeServiceClient:
    """Stands in for pytrio.ServiceClient: records that it was built, touches nothing."""

    instances: list["FakeServiceClient"] = []

    def __init__(self, api_key=None):
        self.api_key = api_key
        FakeServiceClient.instances.append(self)


class ConfigureCalls(list):
    """The keyword dicts passed to pytrio.configure, plus the configurations the probe saw (``.probes``)."""

    def __init__(self):
        super().__init__()
        self.probes: list = []
        FakeServiceClient.instances = []


@pytest.fixture(autouse=True)
def fresh_backend_state(monkeypatch):
    """Every test starts before any connect(), and the module state is restored afterwards (the fake remote
    clients never reach the process's record of sessions for end_sessions)."""
    monkeypatch.setattr(backend, "_ACTIVE", None)
    monkeypatch.setattr(backend, "_SESSIONS", weakref.WeakSet())


@pytest.fixture
def fake_remote(monkeypatch):
    """Replace pytrio's network entry points and the probe's call; return the list of configure() calls.

    The fake probe records the configuration it was given in ``calls.probes``; no API key is ever set.
    """
    calls = ConfigureCalls()
    probes = calls.probes
    monkeypatch.setattr(pytrio, "ServiceClient", FakeServiceClient)
    monkeypatch.setattr(pytrio, "configure", lambda **kw: calls.append(kw))
    monkeypatch.setattr(backend, "_verify_with_pytrio", lambda cfg: probes.append(cfg))
    return calls


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("TRIO_BACKEND", raising=False)
    monkeypatch.delenv("PYTRIO_API_KEY", raising=False)


@pytest.fixture
def logged_in(monkeypatch):
    """pytrio "finds" a credential, without any key being set anywhere."""
    monkeypatch.setattr(backend, "has_pytrio_credentials", lambda: True)


def test_offline_returns_pytrio_client_for_an_offline_server(no_env, tmp_path, capsys):
    import pytrio

    from trio_helpers.offline.server import server_of

    svc = trio_helpers.connect("offline", latency=0.0, home=tmp_path)
    assert type(svc) is pytrio.ServiceClient  # pytrio's own client, not an imitation
    served = server_of(svc)
    assert served is not None and served.base_url.startswith("http://127.0.0.1:")
    assert served.options.latency == 0.0 and served.options.home == tmp_path
    assert "offline/tiny" in [m.model_name for m in svc.get_server_capabilities().supported_models]
    assert capsys.readouterr().out == ""  # an explicit choice prints nothing


def test_in_process_returns_the_offline_engine_client(no_env, tmp_path, capsys):
    svc = trio_helpers.connect("offline", latency=0.0, home=tmp_path, in_process=True)
    assert isinstance(svc, OfflineServiceClient)
    assert svc.options.latency == 0.0 and svc.options.home == tmp_path
    assert "offline/tiny" in svc.get_supported_models()
    assert capsys.readouterr().out == ""


def test_in_process_is_refused_for_the_remote_backend(no_env, fake_remote, logged_in):
    with pytest.raises(ValueError, match="in_process=True is an option of the offline backend"):
        trio_helpers.connect("remote", in_process=True)
    assert FakeServiceClient.instances == [] and fake_remote == []  # refused before anything was created


@pytest.mark.parametrize("spelling", ["offline", "OFFLINE", " Offline "])
def test_backend_name_is_case_and_space_insensitive(no_env, spelling):
    assert isinstance(trio_helpers.connect(spelling, latency=0.0, in_process=True), OfflineServiceClient)


def test_trio_backend_env_is_respected(no_env, monkeypatch, fake_remote, logged_in, capsys):
    monkeypatch.setenv("TRIO_BACKEND", "offline")
    assert isinstance(trio_helpers.connect(latency=0.0, in_process=True), OfflineServiceClient)
    monkeypatch.setenv("TRIO_BACKEND", "remote")
    assert isinstance(trio_helpers.connect(), FakeServiceClient)
    assert fake_remote == []  # no options: pytrio's own settings are left alone
    # the argument wins over the environment
    assert isinstance(trio_helpers.connect("offline", latency=0.0, in_process=True), OfflineServiceClient)
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
    svc = trio_helpers.connect(latency=0.0, in_process=True)  # default: auto
    assert isinstance(svc, OfflineServiceClient)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "offline" in out and "trio login" in out
    assert fake_remote == [] and FakeServiceClient.instances == []
    assert isinstance(trio_helpers.connect("auto", latency=0.0, in_process=True), OfflineServiceClient)


def test_auto_with_credentials_picks_remote(no_env, fake_remote, logged_in, capsys):
    client = trio_helpers.connect("auto")
    assert isinstance(client, FakeServiceClient)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "remote" in out and "TRIO_BACKEND=offline" in out


def test_remote_keeps_pytrio_retry_windows_and_probes_under_short_ones(no_env, fake_remote, logged_in):
    from pytrio.config.config import Configuration, configuration

    before = configuration.model_dump()
    client = trio_helpers.connect("remote")
    assert isinstance(client, FakeServiceClient)
    assert fake_remote == []  # nothing process-wide was configured
    assert configuration.model_dump() == before  # in particular the 15-minute retry windows
    (probe_cfg,) = fake_remote.probes
    assert probe_cfg is not configuration  # the probe ran on a private copy
    for name, value in backend.REMOTE_TIMEOUTS.items():
        assert getattr(probe_cfg, name) == value
    assert probe_cfg.training_retry_timeout_seconds == Configuration.model_fields[
        "training_retry_timeout_seconds"].default
    assert backend.active_backend() == "remote"


def test_probe_bounds_fail_well_under_30_seconds():
    # pytrio: first request (full timeout), then retries until the window closes, the last one finishing late
    t = backend.REMOTE_TIMEOUTS
    assert 2 * t["request_timeout_seconds"] + t["control_retry_timeout_seconds"] <= 25


def test_remote_options_are_configured_before_the_client(no_env, fake_remote, logged_in):
    trio_helpers.connect("remote", training_retry_timeout_seconds=3600, log_level="DEBUG")
    assert fake_remote == [{"training_retry_timeout_seconds": 3600, "log_level": "DEBUG"}]


def test_remote_without_credentials_is_one_line_with_the_fix(no_env, fake_remote, monkeypatch):
    from pytrio.errors.auth import AuthError

    monkeypatch.setattr(backend, "has_pytrio_credentials", lambda: False)
    with pytest.raises(backend.MissingCredentialsError) as info:
        trio_helpers.connect("remote")
    message = str(info.value)
    assert "\n" not in message and "trio login" in message and "PYTRIO_API_KEY" in message
    assert isinstance(info.value, AuthError) and info.value.code == "auth.missing_api_key"
    assert FakeServiceClient.instances == [] and fake_remote.probes == [] and fake_remote == []
    assert backend.active_backend() is None


def test_unreachable_service_fails_at_start_up_in_one_line(no_env, fake_remote, logged_in, monkeypatch):
    from pytrio.errors.control import ControlAPIError

    def unreachable(cfg):
        raise ControlAPIError("All connection attempts failed", operation="GET /api/v1/api-keys/verify",
                              retryable=True)

    monkeypatch.setattr(backend, "_verify_with_pytrio", unreachable)
    with pytest.raises(backend.ServiceUnreachableError) as info:
        trio_helpers.connect("remote")
    message = str(info.value)
    assert "\n" not in message and "cannot reach" in message and "TRIO_BACKEND=offline" in message
    assert FakeServiceClient.instances == []  # the real client is never created


def test_probe_passes_non_retryable_errors_through(logged_in):
    from pytrio.errors.auth import AuthError

    def rejected(cfg):
        raise AuthError("API key revoked", code="api_key_revoked")

    with pytest.raises(AuthError, match="revoked"):
        backend.probe_remote(verify=rejected)

    def empty(cfg):
        raise AuthError("API key cannot be empty", code="auth.missing_api_key")

    with pytest.raises(backend.MissingCredentialsError):
        backend.probe_remote(verify=empty)


def test_probe_timeout_names_are_real_configure_keywords():
    # guards against drift: pytrio.configure silently collects unknown keywords
    accepted = set(inspect.signature(pytrio.configure).parameters)
    assert set(backend.REMOTE_TIMEOUTS) <= accepted


def test_resolve_backend_matches_connect_without_printing(no_env, monkeypatch, capsys):
    monkeypatch.setattr(backend, "has_pytrio_credentials", lambda: False)
    assert backend.resolve_backend() == "offline"
    monkeypatch.setattr(backend, "has_pytrio_credentials", lambda: True)
    assert backend.resolve_backend() == "remote" and backend.resolve_backend("offline") == "offline"
    monkeypatch.setenv("TRIO_BACKEND", "offline")
    assert backend.resolve_backend() == "offline" and backend.resolve_backend("auto") == "remote"
    assert capsys.readouterr().out == ""
    assert backend.active_backend() is None  # resolving connects nothing


def test_active_backend_follows_connect(no_env, monkeypatch, fake_remote, logged_in):
    monkeypatch.setenv("TRIO_BACKEND", "remote")
    assert backend.active_backend() is None and backend.backend_in_use() == "remote"
    trio_helpers.connect("offline", latency=0.0, in_process=True)
    assert backend.active_backend() == "offline" and backend.backend_in_use() == "offline"
    trio_helpers.connect("remote")
    assert backend.active_backend() == "remote"


def test_bad_trio_backend_is_one_line_listing_the_choices(no_env, monkeypatch):
    monkeypatch.setenv("TRIO_BACKEND", "gpu")
    for call in (trio_helpers.connect, backend.resolve_backend, backend.backend_in_use):
        with pytest.raises(ValueError) as info:
            call()
        assert "\n" not in str(info.value) and "offline, remote, auto" in str(info.value)


def test_unknown_offline_options(no_env):
    with pytest.raises(ValueError, match="request_timeout_seconds"):
        trio_helpers.connect("offline", request_timeout_seconds=5)
    with pytest.raises(ValueError, match="latncy"):
        trio_helpers.connect("offline", latncy=0.1)


def test_offline_options_are_passed_through(no_env, tmp_path):
    svc = trio_helpers.connect("offline", latency=0.5, seed=9, home=str(tmp_path), in_process=True)
    assert (svc.options.latency, svc.options.seed, svc.options.home) == (0.5, 9, tmp_path)
    served = server_of(trio_helpers.connect("offline", latency=0.5, fault_rate=0.25, seed=9, home=str(tmp_path)))
    assert (served.options.latency, served.options.fault_rate, served.options.seed) == (0.5, 0.25, 9)
    assert served.options.home == tmp_path


def test_offline_home_defaults_to_env(no_env, monkeypatch, tmp_path):
    monkeypatch.setenv("TRIO_OFFLINE_HOME", str(tmp_path / "h"))
    assert trio_helpers.connect("offline", in_process=True).options.home == tmp_path / "h"


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

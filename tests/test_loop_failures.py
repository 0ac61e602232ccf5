"""The issue's "done when", as tests: the loop (and its recipes) under transient faults, outages and interruptions.

- transient faults (``connect("offline", in_process=True, fault_rate=0.2)``) are retried inside the offline
  clients, as pytrio's transport does: GRPO and OPD, sync, async and pipelined, complete with the rows and final
  weights of the fault-free run (no user-level retries are allowed in those runs, so nothing can have reached the
  loop);
- an outage (``outage_after=N``: every request from the N-th on fails once its retry window ran out) stops a run
  cleanly with :class:`trio_helpers.loop.RunStopped`: whole rows of finished steps only, ``checkpoints.json``
  intact, and a resume on a healthy service reproduces the uninterrupted run; whatever request the outage
  starts at;
- an ``optim_step`` is never sent after a failed ``forward_backward``;
- the recipes: faults in every mode, an outage and Ctrl-C (a real SIGINT to ``python -m``), each followed by the
  resume command the recipe printed, and a torn last line of ``metrics.jsonl``: :class:`RecipeDoneWhen`, defined
  here once and run by ``test_recipe_grpo.py`` and ``test_recipe_opd.py`` (so each file stays small); backend
  flags refused with ``--backend remote``, no login, a service down from the start: here.

The loop's runs are the small ones of ``test_loop.py`` (its helpers and uninterrupted reference runs are reused),
on the in-process backend; ``test_loop_real_client.py`` runs them through pytrio's own client. pytrio's retry
windows are cut to 20 simulated seconds where an outage is simulated, so that its requests give up after about
20 ms of real time instead of 0.9 s (the offline backend sleeps 1 ms per simulated second of retrying). The
recipes run pytrio's own client against the offline server (``connect("offline")``), whose faults
are 503s on the wire and whose retry windows are ``OFFLINE_SERVER_RETRIES``' 2 s of real time.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import pytrio
import test_loop
from test_loop import (
    KINDS,
    MODES,
    TEACHER,
    TINY,
    make_config,
    run,
    weights_fingerprint,
    without_timing,
)

from trio_helpers import connect
from trio_helpers.backend import usage_of
from trio_helpers.loop import RunStopped, read_checkpoints
from trio_helpers.recipes import evaluate as evaluate_recipe
from trio_helpers.recipes import grpo as grpo_recipe
from trio_helpers.recipes import opd as opd_recipe
from trio_helpers.rollouts import RetryPolicy

home, straight = test_loop.home, test_loop.straight  # fixtures: the offline home, the uninterrupted runs
ROOT = Path(__file__).resolve().parents[1]
NO_WAIT = RetryPolicy(max_attempts=2, initial_delay=0.0, multiplier=1.0, max_delay=0.0)


@pytest.fixture
def short_windows(monkeypatch):
    """pytrio's training, sampling and control retry windows cut from 900 to 20 seconds (the offline service
    reads them from pytrio's configuration when it is created, as pytrio's own client does)."""
    from pytrio.config.config import configuration

    for name in ("training_retry_timeout_seconds", "sampling_retry_timeout_seconds",
                 "control_retry_timeout_seconds"):
        monkeypatch.setattr(configuration, name, 20)


def whole_rows(run_dir) -> list[dict]:
    """The rows of ``metrics.jsonl``, asserting that every line is a complete JSON object."""
    text = (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), "the last row is cut off"
    return [json.loads(line) for line in text.splitlines()]


def assert_stopped_cleanly(stopped: RunStopped, run_dir) -> list[dict]:
    """What a stopped run leaves behind: whole rows of steps 0..k-1, the failing step k named in the message,
    and a ``checkpoints.json`` whose last entry is the state the message offers to resume from."""
    rows = whole_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(stopped.completed))
    assert stopped.step == stopped.completed  # the failed step is the first one not logged
    message = str(stopped)
    assert message.startswith(f"step {stopped.step}: {stopped.call} failed: ") and "\n" not in message
    checkpoints = read_checkpoints(run_dir)  # parses: written atomically
    assert all(c["step"] <= stopped.completed for c in checkpoints)
    if checkpoints:
        assert stopped.checkpoint == checkpoints[-1]
        assert f"resume from the saved state after step {checkpoints[-1]['step']}" in message
    else:
        assert stopped.checkpoint is None and "cannot resume" in message
    return rows


# ------------------------------------------------------------------------------------------ transient faults
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_transient_faults_cost_time_not_results(kind, mode, straight, home, tmp_path) -> None:
    clean = straight(kind, mode)
    service = connect("offline", in_process=True, latency=0.0, fault_rate=0.2, seed=0, home=home)
    result = run(kind, service, replace(clean.config, run_dir=str(tmp_path / "faulty")), retries=None)
    usage = service.usage()
    assert usage.retries > 0 and usage.failed_requests == 0  # faults happened, and the client absorbed them
    assert usage.requests == clean.requests  # each request was served once, however often it was retried
    assert without_timing(result.history) == clean.rows
    np.testing.assert_array_equal(weights_fingerprint(service, result.final_path), clean.fingerprint)


# ---------------------------------------------------------------------------------------------------- outages
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_an_outage_stops_the_run_cleanly_and_resume_completes_it(kind, mode, straight, home, tmp_path,
                                                                 short_windows) -> None:
    clean = straight(kind, mode)
    config = replace(clean.config, run_dir=str(tmp_path / "run"))
    # a run ends with forward_backward, optim_step, save_state, save_weights_for_sampler: the outage starts at the
    # request before those, the last sampling (or teacher) request of the last step
    outage = connect("offline", in_process=True, latency=0.0, outage_after=clean.requests - 5, home=home)
    with pytest.raises(RunStopped) as info:
        run(kind, outage, config)  # the default retry policy: sampling is retried at user level, then gives up
    stopped = info.value
    rows = assert_stopped_cleanly(stopped, config.run_dir)
    assert stopped.checkpoint["step"] == 3 and stopped.completed == 3
    assert "(after pytrio's retries and 4 attempts of ours)" in stopped.call
    assert without_timing(rows) == clean.rows[: stopped.completed]

    healthy = connect("offline", in_process=True, latency=0.0, home=home)
    resumed = run(kind, healthy, config, resume=True)
    assert resumed.start_step == 3
    assert [r["step"] for r in whole_rows(config.run_dir)] == [0, 1, 2, 3], "a step missing or doubled"
    assert without_timing(whole_rows(config.run_dir)) == without_timing(resumed.history) == clean.rows
    np.testing.assert_array_equal(weights_fingerprint(healthy, resumed.final_path), clean.fingerprint)


@pytest.mark.parametrize("kind", KINDS)
def test_an_outage_at_any_request_stops_cleanly_and_resumes_exactly(kind, home, tmp_path, short_windows) -> None:
    """Sweep the first failing request over every request of a 2-step run that saves after every step (12
    requests for GRPO, 17 for OPD): the sampler refresh (a training event and a control call), sampling, the
    teacher's compute_logprobs, forward_backward, optim_step, save_state, and the final weights."""
    small = {"group_size": 1} if kind == "opd" else {}
    config = make_config(kind, steps=2, save_every=1, max_tokens=4, run_dir=str(tmp_path / "clean"), **small)
    clean_service = connect("offline", in_process=True, latency=0.0, home=home)
    clean = run(kind, clean_service, config)
    total = clean_service.usage().requests
    first = 2 if kind == "opd" else 1  # before that, the run cannot start (creating the teacher / trainer)
    for n in range(first, total):
        run_dir = tmp_path / f"outage-{n}"
        broken = replace(config, run_dir=str(run_dir))
        with pytest.raises(RunStopped) as info:
            run(kind, connect("offline", in_process=True, latency=0.0, outage_after=n, home=home), broken,
                retries=NO_WAIT)
        assert_stopped_cleanly(info.value, run_dir)
        if info.value.checkpoint is None:
            continue
        resumed = run(kind, connect("offline", in_process=True, latency=0.0, home=home), broken, resume=True)
        assert without_timing(whole_rows(run_dir)) == without_timing(clean.history), f"outage from request {n}"
        assert [c["step"] for c in resumed.checkpoints] == [1, 2]


# --------------------------------------------------------------------------- no optim_step after a failed fb
class SpyTrainingClient:
    """A training client that records the training calls made on it and the service's request count then."""

    def __init__(self, inner, service) -> None:
        self.inner, self.service = inner, service
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in ("forward_backward", "optim_step", "save_state"):
            return attr

        def call(*args, **kwargs):
            self.calls.append((name, self.service.usage().requests))
            return attr(*args, **kwargs)

        return call


@pytest.mark.parametrize("kind", KINDS)
def test_no_optim_step_follows_a_failed_forward_backward(kind, home, tmp_path, short_windows) -> None:
    config = make_config(kind, steps=3, save_every=1, run_dir=str(tmp_path / "probe"))

    def spied(service):
        return SpyTrainingClient(service.create_lora_training_client(config.base_model, rank=config.lora_rank,
                                                                     seed=config.seed), service)

    probe_service = connect("offline", in_process=True, latency=0.0, home=home)
    probe = spied(probe_service)
    run(kind, probe_service, config, training_client=probe)
    # in a sync run every earlier request has finished when forward_backward is sent: the count is its index
    fb_requests = [n for name, n in probe.calls if name == "forward_backward"]
    assert len(fb_requests) >= 3
    target = fb_requests[2]  # the third forward_backward: two optimizer steps and their checkpoints before it

    outage = connect("offline", in_process=True, latency=0.0, outage_after=target, home=home)
    spy = spied(outage)
    run_dir = tmp_path / "run"
    with pytest.raises(RunStopped) as info:
        run(kind, outage, replace(config, run_dir=str(run_dir)), training_client=spy)
    assert info.value.call == "a training call (forward_backward or optim_step)"
    assert_stopped_cleanly(info.value, run_dir)
    names = [name for name, _ in spy.calls]
    assert names[-1] == "forward_backward" and spy.calls[-1][1] == target  # it failed ...
    assert names.count("optim_step") == names.count("forward_backward") - 1  # ... and no optim_step followed it
    # The trainer's state is still that of the last checkpoint (read through the offline client's internals:
    # a broken training client can no longer save, and pytrio offers no other way to read Adam's counter).
    last = read_checkpoints(run_dir)[-1]
    local = connect("offline", in_process=True, latency=0.0, home=home)
    restored = local.create_training_client_from_state_with_optimizer(
        last["path"])
    assert spy.inner._adam["step"] == restored._adam["step"] == names.count("optim_step")
    for key, value in restored._model.adapter.params().items():
        np.testing.assert_array_equal(spy.inner._model.adapter.params()[key], value)


# ------------------------------------------------------------------------------------------------ the recipes
@dataclass(frozen=True)
class Recipe:
    """A recipe under test: its module, the flags of a small run that trains, and its base model."""

    name: str
    module: object
    flags: tuple[str, ...]
    base_model: str

    @property
    def prog(self) -> str:
        return self.module.build_parser().prog


COMMON = ("--backend", "offline", "--lora-rank", "8", "--steps", "3", "--seed", "0", "--save-every", "1")
GRPO_RECIPE = Recipe("grpo", grpo_recipe, (*COMMON, "--base-model", "Qwen/Qwen3.5-4B", "--batch-size", "1",
                                           "--group-size", "2", "--max-tokens", "128"), "Qwen/Qwen3.5-4B")
"""GRPO needs the fitted student and 128 tokens to earn rewards; with seed 0 steps 0 and 2 train."""
OPD_RECIPE = Recipe("opd", opd_recipe, (*COMMON, "--base-model", TINY, "--teacher-base-model", TEACHER,
                                        "--batch-size", "2", "--group-size", "2", "--max-tokens", "12",
                                        "--sample-size", "16"), TINY)
"""OPD distils the fitted teacher into the tiny model: every step trains."""
RECIPES = (GRPO_RECIPE, OPD_RECIPE)
MODE_FLAGS = {"sync": (), "async": ("--async",), "pipeline": ("--pipeline",)}


@dataclass
class RecipeRun:
    code: int
    out: str
    err: str
    services: list

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]

    def final_path(self) -> str:
        return next(line.split(": ", 1)[1] for line in self.out.splitlines() if line.startswith("final weights: "))


def run_recipe(recipe: Recipe, argv, monkeypatch) -> RecipeRun:
    """``main(argv)`` in this process, with its stdout, stderr, exit status and the services it connected."""
    services: list = []
    connect_from_args = recipe.module.connect_from_args

    def spy(parser, args, argv=None):
        services.append(connect_from_args(parser, args, argv))
        return services[-1]

    out, err = io.StringIO(), io.StringIO()
    with monkeypatch.context() as mp:
        mp.setattr(recipe.module, "connect_from_args", spy)
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = recipe.module.main(list(argv))
            except SystemExit as exit_:
                code = exit_.code
    return RecipeRun(code, out.getvalue(), err.getvalue(), services)


def resume_argv(recipe: Recipe, line: str) -> list[str]:
    """The arguments of the resume command printed on ``line`` (``... with: python -m <module> <args>``)."""
    command = shlex.split(line.split(" with: ", 1)[1])
    assert command[:3] == ["python", "-m", recipe.module.__name__] and command[-1] == "--resume", command
    assert "--outage-after" not in command
    return command[3:]


class RecipeDoneWhen:
    """The issue's done-when for a recipe. Subclassed (as ``Test...``, with ``recipe`` set) by
    ``test_recipe_grpo.py`` and ``test_recipe_opd.py``, so that each recipe's runs count towards its own file."""

    recipe: Recipe
    outage_mode: str = "sync"  # the loop's own tests stop and resume every mode; here one per recipe suffices
    sigint_mode: str = "sync"

    @pytest.fixture(scope="class")
    @classmethod
    def recipe_home(cls, tmp_path_factory) -> Path:
        return tmp_path_factory.mktemp(f"{cls.recipe.name}-home")

    @pytest.fixture(autouse=True)
    def _offline(self, recipe_home, tmp_path, monkeypatch) -> None:
        monkeypatch.setenv("TRIO_OFFLINE_HOME", str(recipe_home))
        monkeypatch.chdir(tmp_path)

    @pytest.fixture(scope="class")
    @classmethod
    def clean(cls, recipe_home, tmp_path_factory):
        """``clean(mode)``: the fault-free run of that mode (rows, final-weights fingerprint, request count)."""
        cache: dict[str, tuple[list[dict], np.ndarray, int]] = {}

        def get(mode: str):
            if mode not in cache:
                run_dir = tmp_path_factory.mktemp(f"{cls.recipe.name}-clean-{mode}")
                with pytest.MonkeyPatch.context() as mp:
                    mp.setenv("TRIO_OFFLINE_HOME", str(recipe_home))
                    done = run_recipe(cls.recipe, [*cls.flags(mode), "--run-dir", str(run_dir)], mp)
                assert done.code == 0, done.err
                rows = without_timing(whole_rows(run_dir))
                assert [r["step"] for r in rows] == [0, 1, 2]
                assert any(r["train/datums"] > 0 for r in rows), "nothing trained: the comparison proves little"
                requests = usage_of(done.services[0]).requests  # before the fingerprint's own requests
                cache[mode] = (rows, cls.fingerprint(done.services[0], done.final_path()), requests)
            return cache[mode]

        return get

    @classmethod
    def flags(cls, mode: str) -> list[str]:
        return [*cls.recipe.flags, *MODE_FLAGS[mode]]

    @classmethod
    def fingerprint(cls, service, path: str) -> np.ndarray:
        return weights_fingerprint(service, path, cls.recipe.base_model)

    @pytest.mark.parametrize("mode", MODES)
    def test_fault_rate_costs_time_not_results(self, mode, clean, monkeypatch) -> None:
        rows, fingerprint, requests = clean(mode)
        done = run_recipe(self.recipe, [*self.flags(mode), "--fault-rate", "0.2", "--run-dir", "faulty"],
                          monkeypatch)
        assert done.code == 0, done.err
        assert type(done.services[0]) is pytrio.ServiceClient  # offline, the recipes run pytrio's own client
        usage = usage_of(done.services[0])  # the server's ledger: its retries are the attempts answered 503
        assert usage.retries > 0 and usage.failed_requests == 0 and usage.requests == requests
        assert without_timing(whole_rows("faulty")) == rows
        np.testing.assert_array_equal(self.fingerprint(done.services[0], done.final_path()), fingerprint)

    def test_outage_stops_in_two_lines_and_the_printed_resume_completes_the_run(self, clean, monkeypatch) -> None:
        mode = self.outage_mode
        rows, fingerprint, requests = clean(mode)
        flags = [*self.flags(mode), "--run-dir", "run", "--outage-after", str(requests - 5)]
        stopped = run_recipe(self.recipe, flags, monkeypatch)
        assert stopped.code == 1
        assert "Traceback" not in stopped.err and len(stopped.err_lines) == 2, stopped.err
        error, resume = stopped.err_lines
        assert error.startswith(f"{self.recipe.prog}: error: step 2: ") and " failed: " in error
        assert resume.startswith(f"{self.recipe.prog}: resume with: python -m {self.recipe.module.__name__} ")
        assert without_timing(whole_rows("run")) == rows[:2] and read_checkpoints("run")[-1]["step"] == 2

        resumed = run_recipe(self.recipe, resume_argv(self.recipe, resume), monkeypatch)
        assert resumed.code == 0, resumed.err
        assert without_timing(whole_rows("run")) == rows, "rows differ, or a step is missing or doubled"
        np.testing.assert_array_equal(self.fingerprint(resumed.services[0], resumed.final_path()), fingerprint)

    def test_a_torn_last_row_does_not_block_resume(self, clean, monkeypatch) -> None:
        rows, fingerprint, requests = clean("sync")
        stopped = run_recipe(self.recipe, [*self.flags("sync"), "--run-dir", "run", "--outage-after",
                                           str(requests - 5)], monkeypatch)
        assert stopped.code == 1
        with open("run/metrics.jsonl", "a", encoding="utf-8") as fh:  # a hard kill in the middle of a write
            fh.write(json.dumps({"step": 2, **rows[2]})[:40])
        resumed = run_recipe(self.recipe, resume_argv(self.recipe, stopped.err_lines[-1]), monkeypatch)
        assert resumed.code == 0, resumed.err
        assert "metrics.jsonl" in resumed.err and "partial last row" in resumed.err
        assert without_timing(whole_rows("run")) == rows
        np.testing.assert_array_equal(self.fingerprint(resumed.services[0], resumed.final_path()), fingerprint)

    def test_ctrl_c_exits_130_in_one_line_and_the_printed_resume_completes_the_run(self, clean, recipe_home,
                                                                                   tmp_path, monkeypatch) -> None:
        """A real SIGINT to ``python -m`` (the only place where the process boundary matters).

        Python turns SIGINT into KeyboardInterrupt only if the signal was not ignored when it started, and a
        command started in the background by a non-interactive shell (``make test &``, ``nohup``) inherits
        SIGINT ignored. The child therefore restores the default disposition, as in a terminal, and then execs
        the recipe's ``python -m``."""
        rows, fingerprint, _ = clean(self.sigint_mode)
        argv = [*self.flags(self.sigint_mode), "--run-dir", str(tmp_path / "run"), "--latency", "0.05"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TRIO_OFFLINE_HOME": str(recipe_home)}
        as_in_a_terminal = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                            "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
        process = subprocess.Popen([sys.executable, "-c", as_in_a_terminal, "-m", self.recipe.module.__name__,
                                    *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.monotonic() + 120
        try:
            while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
                assert process.poll() is None, process.communicate()
                assert time.monotonic() < deadline, "no second row within 120 s"
                time.sleep(0.01)
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
        assert process.returncode == 130, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert "Traceback" not in err and len(lines) == 1, err
        assert lines[0].startswith(f"{self.recipe.prog}: interrupted; finished steps are in metrics.jsonl; "
                                   "resume from the last saved state with: python -m ")
        done = [r["step"] for r in whole_rows(tmp_path / "run")]
        assert done == list(range(len(done))) and 2 <= len(done) <= 3

        resumed = run_recipe(self.recipe, resume_argv(self.recipe, lines[0]), monkeypatch)
        assert resumed.code == 0, resumed.err
        assert without_timing(whole_rows(tmp_path / "run")) == rows
        np.testing.assert_array_equal(self.fingerprint(resumed.services[0], resumed.final_path()), fingerprint)


# ------------------------------------------------------------------------------------- the real service's flags
ALL_RECIPES = {"grpo": grpo_recipe, "opd": opd_recipe, "evaluate": evaluate_recipe}


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("the test tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    """No API key anywhere pytrio looks: not in the environment, no profile under HOME, none already loaded."""
    from pytrio.config import config as pytrio_config

    monkeypatch.delenv("PYTRIO_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(pytrio_config.auth_state, "api_key", "")


def _main_exit(module, argv, capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return info.value.code, [line for line in err.splitlines() if line.strip()]


@pytest.mark.parametrize("flag, value", [("--latency", "0.1"), ("--fault-rate", "0.2"), ("--outage-after", "3")])
@pytest.mark.parametrize("name", ALL_RECIPES)
def test_backend_flags_are_refused_with_the_real_service(name, flag, value, capsys, no_network,
                                                         monkeypatch) -> None:
    module = ALL_RECIPES[name]
    monkeypatch.setattr(module, "connect_from_args", lambda *a: pytest.fail("a service was created"))
    code, lines = _main_exit(module, ["--backend", "remote", flag, value], capsys)
    errors = [line for line in lines if ": error: " in line]
    assert code == 2 and len(errors) == 1, lines
    assert errors[0] == (f"{module.build_parser().prog}: error: {flag} simulate the offline backend and cannot "
                         "apply to the real service; drop them or use --backend offline")
    assert all(line.startswith(("usage:", " ")) for line in lines if line is not errors[0])  # argparse's usage


@pytest.mark.parametrize("name", ALL_RECIPES)
def test_the_real_service_without_a_login_is_one_line(name, capsys, no_network, no_credentials) -> None:
    code, lines = _main_exit(ALL_RECIPES[name], ["--backend", "remote"], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{ALL_RECIPES[name].build_parser().prog}: error: ") and "trio login" in lines[0]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_a_service_down_from_the_start_is_one_line(recipe, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRIO_OFFLINE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    done = run_recipe(recipe, [*recipe.flags, "--outage-after", "0"], monkeypatch)
    assert done.code == 1 and "Traceback" not in done.err and len(done.err_lines) == 1, done.err
    assert done.err_lines[0].startswith(f"{recipe.prog}: error: the run could not start: ControlAPIError: ")
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("checkpoints.json"))

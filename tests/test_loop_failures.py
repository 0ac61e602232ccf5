"""The issue's "done when", as tests: the recipes under transient faults, outages and interruptions.

The loop's own guarantees under faults and outages (GRPO and OPD, sync, async and pipelined; an outage at any
request; no ``optim_step`` after a failed ``forward_backward``) are tested through pytrio's own client in
``test_loop_real_client.py``: faults happen on the wire, between pytrio's client and the offline server.

Here, the recipes: faults in every mode, an outage and Ctrl-C (a real SIGINT to ``python -m``), each followed by the
resume command the recipe printed, and a torn last line of ``metrics.jsonl``: :class:`RecipeDoneWhen`, defined
here once and run by ``test_recipe_grpo.py`` and ``test_recipe_opd.py`` (so each file stays small); backend
flags refused with ``--backend remote``, no login, a service down from the start: here. The recipes run pytrio's
own client against the offline server (``connect("offline")``), whose faults are 503s on the wire and whose retry
windows are ``OFFLINE_SERVER_RETRIES``' 2 s of real time. This module also holds the helpers that check a stopped
run (:func:`assert_stopped_cleanly`).
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import pytrio
from test_loop import (
    MODES,
    TEACHER,
    TINY,
    weights_fingerprint,
    without_timing,
)

from trio_helpers.backend import usage_of
from trio_helpers.loop import RunStopped, read_checkpoints
from trio_helpers.recipes import evaluate as evaluate_recipe
from trio_helpers.recipes import grpo as grpo_recipe
from trio_helpers.recipes import opd as opd_recipe
from trio_helpers.rollouts import RetryPolicy

ROOT = Path(__file__).resolve().parents[1]
NO_WAIT = RetryPolicy(max_attempts=2, initial_delay=0.0, multiplier=1.0, max_delay=0.0)


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
        assert usage.retries > 0 and usage.requests == requests
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

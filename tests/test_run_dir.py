"""Tests of issue 25's run directory: one run owns it (identity, lock), its files are written atomically, and a
path that cannot work is refused before any client is created.

The disk-full cases run on a real 64 kB tmpfs when the test can mount one (root), and on a monkeypatched write
that raises ``ENOSPC`` everywhere; the read-only case on a read-only bind mount (``chmod`` does not stop root).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from test_loop import CountingService, make_config, records, run, snapshot  # noqa: F401

import trio_helpers.loop as loop
import trio_helpers.tracking as tracking
from trio_helpers import connect
from trio_helpers.loop import RunStopped, read_checkpoints
from trio_helpers.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIO_OFFLINE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def service(home):
    return CountingService(connect("offline", latency=0.0, home=home))


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*.tmp"))


def _mount(*args) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """A 64 kB tmpfs (skipped where the test cannot mount one)."""
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)):
        pytest.skip("cannot mount a tmpfs here (the monkeypatched ENOSPC tests cover the same paths)")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory whose mount is read-only (a bind mount remounted ro); skipped where mounting is impossible."""
    where = tmp_path / "ro"
    where.mkdir()
    (where / "old").mkdir()
    if os.geteuid() != 0 or not _mount("--bind", str(where), str(where)):
        pytest.skip("cannot bind-mount here")
    if not _mount("-o", "remount,bind,ro", str(where)):
        subprocess.run(["umount", "-l", str(where)], check=False)
        pytest.skip("cannot remount read-only here")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def fill(directory: Path) -> Path:
    """Fill the file system of ``directory`` to the last byte; returns the filler file."""
    filler = directory / f"filler-{uuid.uuid4().hex[:6]}"
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"x" * 1024)
        except OSError as err:
            assert err.errno == errno.ENOSPC
        try:
            while True:
                fh.write(b"x")
        except OSError:
            pass
    return filler


# ------------------------------------------------------------------------------------------- atomic writes
def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch) -> None:
    path = tmp_path / "state.json"
    tracking.write_atomic(path, "old\n")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as info:
        tracking.write_atomic(path, "new\n")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert path.read_text() == "old\n" and leftovers(tmp_path) == []


def test_write_atomic_on_a_full_tmpfs(small_disk) -> None:
    path = small_disk / "state.json"
    tracking.write_atomic(path, "old\n")
    fill(small_disk)
    with pytest.raises(OSError) as info:
        tracking.write_atomic(path, "x" * 10_000)
    assert info.value.errno == errno.ENOSPC
    assert path.read_text() == "old\n" and leftovers(small_disk) == []


# ------------------------------------------------------------------------------------------ foreign state
def _saved_run(service, tmp_path, name="run", kind="grpo", **overrides):
    config = make_config(kind, steps=2, save_every=1, run_dir=str(tmp_path / name), **overrides)
    run(kind, service, config)
    return config


def test_resume_refuses_metrics_of_another_run(service, tmp_path) -> None:
    config = _saved_run(service, tmp_path, "a")
    other = _saved_run(service, tmp_path, "b", seed=5)
    (tmp_path / "a" / "metrics.jsonl").write_bytes((tmp_path / "b" / "metrics.jsonl").read_bytes())
    before, created = snapshot(tmp_path / "a"), len(service.created)
    with pytest.raises(ValueError, match="metrics.jsonl does not hold the rows its run logged"):
        run("grpo", service, replace(config, steps=3), resume=True)
    assert snapshot(tmp_path / "a") == before and len(service.created) == created
    assert other.seed == 5


def test_resume_refuses_a_directory_of_another_algorithm(service, tmp_path) -> None:
    grpo = _saved_run(service, tmp_path, "g")
    opd = make_config("opd", steps=3, save_every=1, run_dir=grpo.run_dir)
    before, created = snapshot(tmp_path / "g"), len(service.created)
    with pytest.raises(ValueError, match="it holds a run of algorithm 'grpo' and this run is 'opd'"):
        run("opd", service, opd, resume=True)
    assert snapshot(tmp_path / "g") == before and len(service.created) == created


def test_resume_refuses_run_files_without_an_identity(service, tmp_path) -> None:
    config = _saved_run(service, tmp_path, "n")
    (tmp_path / "n" / "config.json").unlink()
    with pytest.raises(ValueError, match="has run files but no config.json"):
        run("grpo", service, replace(config, steps=3), resume=True)


def test_resume_refuses_other_data(service, tmp_path) -> None:
    from trio_helpers.grpo import run_grpo
    from test_loop import parity_reward

    config = _saved_run(service, tmp_path, "d")
    with pytest.raises(ValueError, match="trained on other data"):
        run_grpo(service, list(records("grpo"))[1:], replace(config, steps=3), reward_fn=parity_reward,
                 resume=True)


def test_a_resume_of_its_own_run_still_works(service, tmp_path) -> None:
    config = _saved_run(service, tmp_path, "ok")
    saved = json.loads((tmp_path / "ok" / "config.json").read_text())
    assert saved["algorithm"] == "grpo" and saved["data"]["records"] == 32 and len(saved["run_id"]) == 16
    assert {c["run_id"] for c in read_checkpoints(config.run_dir)} == {saved["run_id"]}
    result = run("grpo", service, replace(config, steps=3), resume=True)
    assert [r["step"] for r in read_metrics(config.run_dir)] == [0, 1, 2] and result.start_step == 2
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["run_id"] == saved["run_id"]


# ---------------------------------------------------------------------------------------------------- lock
def test_a_second_live_run_on_the_same_directory_is_refused(service, tmp_path) -> None:
    config = make_config("grpo", steps=2, run_dir=str(tmp_path / "busy"))
    (tmp_path / "busy").mkdir()
    held = loop.lock_run_dir(tmp_path / "busy")
    try:
        with pytest.raises(ValueError, match="is in use by another run that is still running"):
            run("grpo", service, config)
        assert service.created == [] and list((tmp_path / "busy").iterdir()) == []
    finally:
        os.close(held)
    run("grpo", service, config)  # released: the directory is free again
    held = loop.lock_run_dir(tmp_path / "busy")  # and the finished run released it too
    os.close(held)


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path) -> None:
    target = tmp_path / "killed"
    target.mkdir()
    code = ("import sys, time; from trio_helpers.loop import lock_run_dir; lock_run_dir(sys.argv[1]); "
            "print('locked', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(target)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match="in use by another run"):
            loop.lock_run_dir(target)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        os.close(loop.lock_run_dir(target))  # the kernel released the dead run's lock: taken over, no stale file
        assert list(target.iterdir()) == []
    finally:
        child.kill()
        child.wait()


# ------------------------------------------------------------------------------ paths, before any client
def test_a_file_as_run_dir_is_refused_before_any_client(service, tmp_path) -> None:
    (tmp_path / "file").write_text("not a directory\n")
    with pytest.raises(ValueError, match="run_dir '.*file' is a file, not a directory"):
        run("grpo", service, make_config("grpo", run_dir=str(tmp_path / "file")))
    assert service.created == []


def test_a_read_only_run_dir_is_refused_before_any_client(service, read_only_dir) -> None:
    with pytest.raises(ValueError, match="is not writable: Read-only file system; choose a run_dir you can"):
        run("grpo", service, make_config("grpo", run_dir=str(read_only_dir / "old")))
    with pytest.raises(ValueError, match="is not writable: Read-only file system"):
        run("grpo", service, make_config("grpo", run_dir=str(read_only_dir / "new" / "run")))
    assert service.created == []


def test_a_full_disk_is_refused_before_any_client(service, small_disk) -> None:
    fill(small_disk)
    with pytest.raises(ValueError, match="is not writable: No space left on device; free some space"):
        run("grpo", service, make_config("grpo", run_dir=str(small_disk / "run")))
    assert service.created == [] and leftovers(small_disk) == []


# ------------------------------------------------------------------------- a full disk in the middle of a run
def _fail_writes_of(monkeypatch, name: str) -> None:
    """Every write_atomic of a file called ``name`` fails with ENOSPC at its fsync (the temporary file exists)."""
    real_open, failing = os.open, set()

    def spy_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if Path(path).name.startswith(f".{name}."):
            failing.add(fd)
        return fd

    real_fsync = os.fsync

    def fsync(fd):
        if fd in failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(tracking.os, "open", spy_open)
    monkeypatch.setattr(tracking.os, "fsync", fsync)


def test_a_full_disk_while_a_state_is_listed_keeps_the_previous_state(service, tmp_path, monkeypatch) -> None:
    config = make_config("grpo", steps=4, save_every=1, run_dir=str(tmp_path / "full"))

    def full_after_step_1(out):
        if out.step == 1:
            _fail_writes_of(monkeypatch, "checkpoints.json")

    with pytest.raises(RunStopped) as info:
        run("grpo", service, config, on_step=full_after_step_1)
    message = str(info.value)
    assert "No space left on device" in message and "resume from the saved state after step 2" in message
    assert [c["step"] for c in read_checkpoints(config.run_dir)] == [1, 2]
    assert leftovers(tmp_path / "full") == []
    monkeypatch.undo()
    resumed = run("grpo", service, config, resume=True)
    assert resumed.start_step == 2 and [r["step"] for r in resumed.history] == [0, 1, 2, 3]


def test_a_disk_that_fills_during_a_run_stops_it_cleanly(service, small_disk, home) -> None:
    config = make_config("grpo", steps=6, save_every=1, run_dir=str(small_disk / "run"))
    filler = []

    def fill_after_step_1(out):
        if out.step == 1:
            filler.append(fill(small_disk))

    with pytest.raises(RunStopped) as info:
        run("grpo", service, config, on_step=fill_after_step_1)
    assert "No space left on device" in str(info.value)
    listed = [c["step"] for c in read_checkpoints(config.run_dir)]
    assert listed[:2] == [1, 2] and leftovers(small_disk) == []
    filler[0].unlink()
    resumed = run("grpo", service, config, resume=True)
    assert resumed.start_step == listed[-1]
    assert [r["step"] for r in read_metrics(config.run_dir)] == list(range(6))

"""``make test-service``: its skip path without a credential, and the invariant checks it applies to chapters.

The real-service run itself cannot be tested here (no credential, no network); what it checks can: the same
functions are run on objects that offline chapters produce, and must accept them and catch broken ones.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import invariants  # noqa: E402


def test_without_a_credential_it_says_so_in_one_line_and_exits_0(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTRIO_API_KEY"}
    env["HOME"] = str(tmp_path)  # no `trio login` profile there
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_service.py")], capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "no PyTRIO credential" in lines[0] and "Nothing was sent" in lines[0]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    os.environ.setdefault("TRIO_OFFLINE_HOME", str(tmp_path_factory.mktemp("home")))
    from trio_helpers import connect
    from trio_helpers.data import load_gsm8k
    from trio_helpers.grpo import GRPOConfig, run_grpo

    service = connect("offline", latency=0.0)
    config = GRPOConfig(base_model="offline/tiny", lora_rank=8, steps=3, batch_size=2, group_size=2,
                        max_tokens=16, seed=0, weights_name=None)
    return run_grpo(service, load_gsm8k("train", source="offline"), config)


def test_a_healthy_run_passes(tiny_run) -> None:
    checked, problems = invariants.check_namespace({"run": tiny_run})
    assert (checked, problems) == (1, [])


@pytest.mark.parametrize("breakage, message", [
    (lambda h: h.pop(1), "not 0..1 once each"),
    (lambda h: h[0].pop("train/tokens"), "lacks the documented keys ['train/tokens']"),
    (lambda h: h[2].update({"reward/mean": 1.5}), "outside [0, 1]"),
])
def test_a_broken_history_is_caught(tiny_run, breakage, message) -> None:
    broken = copy.copy(tiny_run)
    broken.history = copy.deepcopy(tiny_run.history)
    breakage(broken.history)
    _, problems = invariants.check_namespace({"run": broken})
    assert len(problems) == 1 and message in problems[0]


def test_datums_are_checked_with_pytrios_planner() -> None:
    from trio_helpers.datums import importance_sampling_datum

    good = [importance_sampling_datum([1, 2, 3], [4, 5], [-0.1, -0.2], 1.0)]
    assert invariants.check_namespace({"data": good}, vocab_size=261) == (1, [])
    bad = copy.deepcopy(good)
    bad[0].loss_fn_inputs["target_tokens"] = bad[0].loss_fn_inputs["target_tokens"].__class__.from_numpy(
        np.array([-100, -100, 999], dtype=np.int64))
    checked, problems = invariants.check_namespace({"data": bad}, vocab_size=261)
    assert checked == 1 and "planner rejects" in problems[0]


def test_evaluation_tables_have_one_row_per_problem_and_sample() -> None:
    rows = [{"problem_id": i, "sample": 0, "correct": True} for i in range(3)]
    assert invariants.check_namespace({"results": rows}) == (1, [])
    _, problems = invariants.check_namespace({"results": rows + rows[:1]})
    assert "1 duplicate" in problems[0]


def test_the_injected_check_runs_after_a_chapter(monkeypatch) -> None:
    """The mechanism make test-service uses, on an offline chapter: every cell runs, then the checks."""
    import check_service

    monkeypatch.setenv("TRIO_BACKEND", "offline")
    seconds, report, error = check_service.run_chapter(ROOT / "notebooks" / "03_datum_alignment.ipynb")
    assert error is None
    assert report["checked"] >= 1 and report["problems"] == []

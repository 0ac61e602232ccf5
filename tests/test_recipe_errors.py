"""Issue 25: every error a user can cause in a recipe is one line (flag or path, value, fix), exit 2 for usage
errors, never a traceback; resume hints name flags; the ledger reports retries; sampling limits are refused before
any request. In-process through ``main(argv)`` on the offline backend."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from test_loop_failures import GRPO_RECIPE, OPD_RECIPE, run_recipe
from test_run_dir import fill, read_only_dir, small_disk  # noqa: F401 - fixtures

import trio_helpers.loop as loop
from trio_helpers.recipes import evaluate as evaluate_recipe
from trio_helpers.recipes import grpo as grpo_recipe

TINY = ["--backend", "offline", "--base-model", "offline/tiny", "--lora-rank", "8", "--batch-size", "2",
        "--group-size", "2", "--max-tokens", "8", "--steps", "2"]
EVAL = ["--backend", "offline", "--eval-samples", "4", "--max-tokens", "8", "--n-boot", "100"]


@pytest.fixture(autouse=True)
def offline_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIO_OFFLINE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


def one_error(done, prog) -> str:
    assert "Traceback" not in done.err, done.err
    errors = [line for line in done.err_lines if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith(f"{prog}: error: "), done.err
    return errors[0]


def test_a_resume_of_another_algorithms_directory_is_refused_before_any_client(monkeypatch) -> None:
    assert run_recipe(GRPO_RECIPE, [*TINY, "--save-every", "1", "--run-dir", "g"], monkeypatch).code == 0
    done = run_recipe(OPD_RECIPE, [*TINY, "--save-every", "1", "--run-dir", "g", "--sample-size", "8",
                                   "--resume"], monkeypatch)
    assert done.code == 2 and done.services == []
    assert "it holds a run of algorithm 'grpo' and this run is 'opd'" in one_error(done, OPD_RECIPE.prog)
    assert json.loads(Path("g/config.json").read_text())["algorithm"] == "grpo"


def test_a_directory_held_by_a_live_run_is_refused(monkeypatch) -> None:
    Path("busy").mkdir()
    held = loop.lock_run_dir("busy")
    try:
        done = run_recipe(GRPO_RECIPE, [*TINY, "--run-dir", "busy"], monkeypatch)
    finally:
        os.close(held)
    assert done.code == 2 and done.services == []
    assert "is in use by another run that is still running" in one_error(done, GRPO_RECIPE.prog)


def test_a_file_as_run_dir_is_one_line_before_any_client(monkeypatch) -> None:
    Path("f").write_text("x\n")
    done = run_recipe(GRPO_RECIPE, [*TINY, "--run-dir", "f"], monkeypatch)
    assert done.code == 2 and done.services == []
    assert "run_dir 'f' is a file, not a directory" in one_error(done, GRPO_RECIPE.prog)


def test_a_read_only_run_dir_is_one_line(monkeypatch, read_only_dir) -> None:
    done = run_recipe(GRPO_RECIPE, [*TINY, "--run-dir", str(read_only_dir / "old")], monkeypatch)
    assert done.code == 2 and done.services == []
    assert "is not writable: Read-only file system" in one_error(done, GRPO_RECIPE.prog)


def test_a_disk_full_during_the_run_is_one_line_with_the_resume_command(monkeypatch, small_disk) -> None:
    run_dir = small_disk / "run"
    real = grpo_recipe.run_grpo

    def filling(*args, **kwargs):
        kwargs["on_step"] = lambda out: out.step == 1 and fill(small_disk)
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo_recipe, "run_grpo", filling)
    done = run_recipe(GRPO_RECIPE, [*TINY, "--steps", "5", "--save-every", "1", "--run-dir", str(run_dir)],
                      monkeypatch)
    assert done.code == 1, done.err
    line = one_error(done, GRPO_RECIPE.prog)
    assert "No space left on device" in line and "free some space" in line
    assert any(" resume with: " in x for x in done.err_lines) and not list(small_disk.rglob("*.tmp"))


def test_evaluate_out_as_a_directory_is_refused_before_sampling(monkeypatch, capsys) -> None:
    Path("records").mkdir()
    monkeypatch.setattr(evaluate_recipe, "connect_from_args", lambda *a: pytest.fail("a service was created"))
    with pytest.raises(SystemExit) as info:
        evaluate_recipe.main([*EVAL, "--out", "records"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--out 'records' is a directory; pass a file name" in err
    assert "Traceback" not in err and not list(Path(".").glob("*.tmp"))


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_evaluate_with_a_missing_or_empty_data_folder_is_one_line(folder, capsys) -> None:
    Path("empty").mkdir()
    with pytest.raises(SystemExit) as info:
        evaluate_recipe.main([*EVAL, "--data-source", "local", "--data-path", folder])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err, err
    line = [x for x in err.splitlines() if ": error: " in x]
    assert len(line) == 1 and f"cannot load the data (--data-source local --data-path {folder})" in line[0]


def test_evaluate_without_network_for_the_hub_is_one_line(monkeypatch, capsys) -> None:
    import trio_helpers.data as data

    def offline(split):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(data, "_load_gsm8k_hf", offline)
    with pytest.raises(SystemExit) as info:
        evaluate_recipe.main([*EVAL, "--data-source", "hf"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and "Traceback" not in err
    assert "cannot load the data (--data-source hf): ConnectionError: Couldn't reach" in err


def test_evaluate_writes_a_usage_json_with_retries(capsys) -> None:
    assert evaluate_recipe.main([*EVAL, "--fault-rate", "0.3", "--out", "base.jsonl"]) == 0
    out = capsys.readouterr().out
    usage = json.loads(Path("base.usage.json").read_text())
    assert usage["offline"]["retries"] > 0
    assert "retries (inside the client)" in out and "usage: base.usage.json" in out


def test_trio_backend_in_capitals_still_refuses_offline_flags(monkeypatch, capsys) -> None:
    monkeypatch.setenv("TRIO_BACKEND", "REMOTE")
    with pytest.raises(SystemExit) as info:
        grpo_recipe.main(["--outage-after", "3"])
    assert info.value.code == 2 and "--outage-after simulate the offline backend" in capsys.readouterr().err


def test_an_outage_from_the_start_names_the_simulated_outage(monkeypatch) -> None:
    done = run_recipe(GRPO_RECIPE, [*TINY, "--outage-after", "0", "--run-dir", "o"], monkeypatch)
    assert done.code == 1
    assert "simulated outage: --outage-after 0" in one_error(done, GRPO_RECIPE.prog)


def test_ctrl_c_before_the_first_state_does_not_print_a_resume_command(monkeypatch) -> None:
    real = grpo_recipe.run_grpo

    def interrupted(*args, **kwargs):
        def stop(out):
            raise KeyboardInterrupt

        return real(*args, **{**kwargs, "on_step": stop})

    monkeypatch.setattr(grpo_recipe, "run_grpo", interrupted)
    done = run_recipe(GRPO_RECIPE, [*TINY, "--save-every", "2", "--run-dir", "c"], monkeypatch)
    assert done.code == 130 and "resume with" not in done.err and "--resume" in done.err
    assert "no state was saved yet" in done.err and "save_every" not in done.err


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_temperature_is_refused_by_the_offline_service(value) -> None:
    import pytrio as trio
    from pytrio.errors.actor import ActorAPIError
    from pytrio.errors.base import ValidationError

    from trio_helpers import connect

    params = trio.SamplingParams(max_tokens=4, temperature=value)
    sampler = connect("offline", latency=0.0, in_process=True).create_sampling_client("offline/tiny")
    with pytest.raises(ValidationError, match="need a finite temperature"):
        sampler.sample(trio.ModelInput.from_ints([1, 2, 3]), num_samples=5, sampling_params=params).result()
    # through pytrio's client the value travels as JSON (where it has no finite spelling): the server refuses it,
    # and pytrio raises its own error for a refused sampling request
    sampler = connect("offline", latency=0.0).create_sampling_client("offline/tiny")
    with pytest.raises(ActorAPIError, match="temperature") as info:
        sampler.sample(trio.ModelInput.from_ints([1, 2, 3]), num_samples=5, sampling_params=params).result()
    assert info.value.code.startswith("validation.")


def test_max_tokens_beyond_the_sequence_limit_is_refused_everywhere(capsys) -> None:
    import pytrio as trio
    from pytrio.errors.actor import ActorAPIError
    from pytrio.errors.base import ValidationError

    from trio_helpers import connect
    from trio_helpers.offline.service import MAX_SEQ_LEN

    assert loop.MAX_SEQ_LEN == MAX_SEQ_LEN
    params = trio.SamplingParams(max_tokens=1_000_000_000)
    for in_process, error in ((True, ValidationError), (False, ActorAPIError)):
        sampler = connect("offline", latency=0.0, in_process=in_process).create_sampling_client("offline/tiny")
        with pytest.raises(error, match="exceeds the model's max_seq_len 8192"):
            sampler.sample(trio.ModelInput.from_ints([1, 2, 3]), num_samples=1, sampling_params=params).result()
    for module in (grpo_recipe, evaluate_recipe):
        with pytest.raises(SystemExit) as info:
            module.main(["--backend", "offline", "--max-tokens", "1000000000",
                         *(["--dry-run"] if module is grpo_recipe else [])])
        err = capsys.readouterr().err
        assert info.value.code == 2 and "must be < 8192" in err, err

"""Tests of chapter 09's pieces: SFT datums and steps (``trio_helpers.sft``) and the loop's KL penalty to the
reference (``ref_kl_coef``), in the library and in the GRPO recipe.

Everything runs on the offline backend's random ``offline/tiny`` model (instant, no fitting), except where a
fitted model is named on purpose (the reference-mismatch check never loads it).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from pytrio.client.training_batch import plan_training_batch
from pytrio.errors.base import PyTrioError
from pytrio.model.limits import TrainingLimits

from trio_helpers import connect
from trio_helpers.backend import usage_of
from trio_helpers.grpo import GRPOConfig, run_grpo
from trio_helpers.prompts import build_prompt, gsm8k_messages
from trio_helpers.recipes import grpo as recipe
from trio_helpers.sft import (
    END_OF_TURN,
    boxed_demonstration,
    end_of_turn_id,
    gsm8k_sft_datums,
    run_sft,
    sft_datum,
)

TINY = "offline/tiny"
RECORDS = [
    {"question": "Ann has 3 apples and buys 4 more. How many apples does she have?",
     "answer": "She has 3+4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A box holds 12 pens. How many pens are in 2 boxes?",
     "answer": "There are 12*2 = <<12*2=24>>24 pens.\n#### 24"},
    {"question": "Tom earns $1,000 a week. How much does he earn in 2 weeks?",
     "answer": "He earns 1000*2 = <<1000*2=2000>>2000 dollars.\n#### 2,000"},
]


@pytest.fixture(autouse=True)
def offline_home(tmp_path, monkeypatch):
    """Checkpoints go to a temporary offline home; relative run dirs to tmp_path."""
    monkeypatch.setenv("TRIO_OFFLINE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def service():
    return connect("offline", latency=0.0)


@pytest.fixture
def tokenizer(service):
    return service.create_sampling_client(TINY).get_tokenizer()


# ------------------------------------------------------------------------------------------- demonstrations
def test_boxed_demonstration_rewrites_only_the_final_line() -> None:
    demo = boxed_demonstration(RECORDS[0])
    assert demo == "She has 3+4 = <<3+4=7>>7 apples.\n\\boxed{7}"
    assert boxed_demonstration(RECORDS[2]).endswith("\\boxed{2000}")  # thousands comma removed, as graded
    assert boxed_demonstration({"question": "q", "answer": "#### 5"}) == "\\boxed{5}"


@pytest.mark.parametrize("record, message", [
    ({"question": "q", "answer": ""}, "record 4 has an empty 'answer'"),
    ({"question": "q", "answer": "   \n"}, "record 4 has an empty 'answer'"),
    ({"question": "q"}, "record 4 has an empty 'answer'"),
    ({"question": "q", "answer": "The answer is 5."}, "record 4: its 'answer' has no final '#### N' line"),
    ({"question": "q", "answer": "steps\n####  "}, "record 4: its 'answer' has no final '#### N' line"),
    (["q", "a"], "record 4 is a list"),
])
def test_records_without_a_demonstration_are_refused_by_index(record, message) -> None:
    with pytest.raises(ValueError, match=message):
        boxed_demonstration(record, 4)


# ------------------------------------------------------------------------------------------------- datums
def test_sft_datum_masks_the_prompt_and_trains_demonstration_and_end_of_turn(tokenizer) -> None:
    demo = boxed_demonstration(RECORDS[0])
    datum = sft_datum(tokenizer, RECORDS[0]["question"], demo)
    prompt = build_prompt(tokenizer, gsm8k_messages(RECORDS[0]["question"])).to_ints()
    completion = tokenizer.encode(demo, add_special_tokens=False) + [end_of_turn_id(tokenizer)]
    targets = np.asarray(datum.loss_fn_inputs["target_tokens"].data)
    weights = np.asarray(datum.loss_fn_inputs["weights"].data)

    assert datum.model_input.to_ints() == prompt + completion[:-1]
    assert targets.tolist() == [-100] * (len(prompt) - 1) + completion
    assert weights.tolist() == [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    assert tokenizer.decode([int(targets[-1])]) == END_OF_TURN
    plan = plan_training_batch([datum], loss_fn="cross_entropy", auto_shift=False,
                               limits=TrainingLimits(max_batch_size=None, max_tokens_per_request=None,
                                                     max_seq_len=8192),
                               tokenizer_vocab_size=len(tokenizer))
    assert plan.totals.total_active_tokens == len(completion)  # the prompt is neither trained nor counted


def test_an_empty_demonstration_is_refused_naming_the_example(tokenizer) -> None:
    for empty in ("", "  \n "):
        with pytest.raises(ValueError, match=r"record 7: the demonstration is empty"):
            sft_datum(tokenizer, "How many?", empty, name="record 7")
    with pytest.raises(ValueError, match=r"record 7: the question is empty"):
        sft_datum(tokenizer, " ", "\\boxed{1}", name="record 7")


def test_gsm8k_sft_datums_names_the_bad_record(tokenizer) -> None:
    assert len(gsm8k_sft_datums(tokenizer, RECORDS)) == 3
    with pytest.raises(ValueError, match=r"record 2 has an empty 'answer'"):
        gsm8k_sft_datums(tokenizer, [RECORDS[0], RECORDS[1], {"question": "q", "answer": ""}])
    with pytest.raises(ValueError, match=r"record 1: the question is empty"):
        gsm8k_sft_datums(tokenizer, [RECORDS[0], {"question": "", "answer": "#### 3"}])
    with pytest.raises(ValueError, match="records is empty"):
        gsm8k_sft_datums(tokenizer, [])


def test_end_of_turn_falls_back_to_eos_and_refuses_neither() -> None:
    class NoChat:
        eos_token_id = 5

        def get_vocab(self):
            return {"a": 0}

    assert end_of_turn_id(NoChat()) == 5
    NoChat.eos_token_id = None
    with pytest.raises(ValueError, match="no <|im_end|> token and no eos_token_id"):
        end_of_turn_id(NoChat())


# --------------------------------------------------------------------------------------------------- training
def test_run_sft_lowers_the_loss_on_the_demonstrations(service, tokenizer) -> None:
    client = service.create_lora_training_client(TINY, rank=8, seed=0)
    data = gsm8k_sft_datums(tokenizer, RECORDS)
    losses = run_sft(client, data, steps=6, learning_rate=1e-2)
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert losses[-1] < 0.9 * losses[0]
    after = client.forward(data, "cross_entropy").result().metrics["loss_mean"]
    assert after < losses[-1]  # the last step's update helped too
    assert usage_of(service).optim_steps == 6


def test_run_sft_batches_wrap_around_and_wait_for_forward_backward() -> None:
    calls = []

    class Future:
        def __init__(self, name, value):
            self.name, self.value = name, value

        def result(self):
            calls.append(f"{self.name} done")
            return self.value

    class Client:
        def forward_backward(self, batch, loss_fn):
            calls.append(f"forward_backward {loss_fn} {batch}")
            return Future("forward_backward", type("Out", (), {"metrics": {"loss_mean": 1.0}})())

        def optim_step(self, adam):
            calls.append(f"optim_step {adam.learning_rate}")
            return Future("optim_step", None)

    assert run_sft(Client(), ["a", "b", "c"], steps=2, learning_rate=0.5, batch_size=2) == [1.0, 1.0]
    assert calls == ["forward_backward cross_entropy ['a', 'b']", "forward_backward done", "optim_step 0.5",
                     "optim_step done", "forward_backward cross_entropy ['c', 'a']", "forward_backward done",
                     "optim_step 0.5", "optim_step done"]


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, "steps must be an integer >= 1"),
    ({"steps": 1.5}, "steps must be an integer >= 1"),
    ({"steps": True}, "steps must be an integer >= 1"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1 or None"),
    ({"learning_rate": 0}, "learning_rate must be a finite number > 0"),
    ({"learning_rate": float("nan")}, "learning_rate must be a finite number > 0"),
])
def test_run_sft_refuses_bad_settings_before_any_request(kwargs, message) -> None:
    class NoCalls:
        def __getattr__(self, name):
            raise AssertionError(f"{name} was called")

    settings = {"steps": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        run_sft(NoCalls(), ["datum"], **settings)
    with pytest.raises(ValueError, match="datums is empty"):
        run_sft(NoCalls(), [], steps=1)


# ------------------------------------------------------------------------------------ the KL penalty in the loop
def _kl_config(**changes) -> GRPOConfig:
    values = dict(base_model=TINY, lora_rank=8, steps=2, batch_size=2, group_size=2, max_tokens=8,
                  ref_kl_coef=0.05, weights_name=None)
    values.update(changes)
    return GRPOConfig(**values)


def test_negative_or_non_finite_coefficients_are_refused() -> None:
    for bad in (-0.05, float("inf"), "0.1"):
        with pytest.raises(ValueError, match="ref_kl_coef must be a finite number >= 0"):
            GRPOConfig(ref_kl_coef=bad).validate()
    with pytest.raises(ValueError, match="ref_model_path is set but ref_kl_coef is 0"):
        GRPOConfig(ref_model_path="trio-offline://run-00000000/weights/x").validate()


def test_a_reference_trained_from_another_base_is_refused_before_any_request(service, tmp_path) -> None:
    other = service.create_lora_training_client(TINY, rank=8, seed=0)
    path = other.save_weights_for_sampler("tiny-ref").result().path
    before = usage_of(service)
    config = _kl_config(base_model="Qwen/Qwen3.5-4B", ref_model_path=path, run_dir="runs/mismatch")
    # pytrio raises the service's refusal as its ControlAPIError (a PyTrioError, like ValidationError)
    with pytest.raises(PyTrioError, match="was trained from 'offline/tiny', not 'Qwen/Qwen3.5-4B'") as info:
        run_grpo(service, RECORDS, config)
    assert info.value.code == "validation.checkpoint_model_mismatch"
    spent = usage_of(service) - before
    assert (spent.requests, spent.training_runs, spent.sampling_runs) == (0, 0, 0)
    assert not (tmp_path / "runs" / "mismatch").exists()


def test_a_reference_from_the_same_base_is_accepted(service) -> None:
    ref = service.create_lora_training_client(TINY, rank=8, seed=1)
    path = ref.save_weights_for_sampler("tiny-ref").result().path
    result = run_grpo(service, RECORDS, _kl_config(ref_model_path=path, skip_degenerate=False))
    assert len(result.history) == 2 and "kl/ref_mean" in result.history[0]


def test_skipped_degenerate_groups_cost_no_reference_requests(service) -> None:
    # The random tiny model never writes a right answer: every group is degenerate and skipped.
    before = usage_of(service)
    skipped = run_grpo(service, RECORDS, _kl_config())
    assert (usage_of(service) - before).logprob_tokens == 0  # no datums, so no reference logprobs
    assert all("kl/ref_mean" not in row for row in skipped.history)


def test_the_penalty_starts_at_zero_and_grows_as_the_policy_moves(service) -> None:
    def odd_bytes(text: str, record: dict) -> float:  # random text: a reward that differs within groups
        return float(sum(text.encode()) % 2)

    before = usage_of(service)
    config = _kl_config(learning_rate=1e-2, max_tokens=16, group_size=4, steps=3)
    run = run_grpo(service, RECORDS, config, reward_fn=odd_bytes)
    trained = [row for row in run.history if row["train/datums"] > 0]
    assert trained[0]["step"] == 0 and len(trained) >= 2
    assert (usage_of(service) - before).logprob_tokens > 0
    assert all("kl/ref_mean" in row for row in trained)
    assert abs(trained[0]["kl/ref_mean"]) < 1e-12  # a fresh adapter samples like the reference
    assert all(abs(row["kl/ref_mean"]) > 1e-6 for row in trained[1:])  # later, the policy has moved


# --------------------------------------------------------------------------------------------------- the recipe
RECIPE = ["--backend", "offline", "--latency", "0", "--base-model", TINY, "--lora-rank", "8", "--steps", "2",
          "--batch-size", "2", "--group-size", "2", "--max-tokens", "8", "--no-progress"]


def test_the_recipe_runs_with_ref_kl_coef_0_05(tmp_path, capsys) -> None:
    status = recipe.main([*RECIPE, "--ref-kl-coef", "0.05", "--keep-degenerate", "--run-dir", "runs/kl"])
    assert status == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "kl" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    assert abs(rows[0]["kl/ref_mean"]) < 1e-12 and "kl/ref_seq_mean" in rows[1]
    saved = json.loads((tmp_path / "runs" / "kl" / "config.json").read_text())
    assert saved["ref_kl_coef"] == 0.05
    assert "final weights:" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--ref-kl-coef", "-0.05"], "argument --ref-kl-coef: must be a number >= 0, got -0.05"),
    (["--ref-kl-coef", "much"], "argument --ref-kl-coef: must be a number >= 0"),
    (["--ref-model-path", "trio-offline://run-00000000/weights/x"], "ref_model_path is set but ref_kl_coef is 0"),
])
def test_the_recipe_refuses_bad_kl_flags_with_status_2(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        recipe.main([*RECIPE, *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err

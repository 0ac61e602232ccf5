"""Part 2 of the offline backend: fitted base models (determinism, cache) and learning that only training causes."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import pytrio as trio

from trio_helpers import connect
from trio_helpers.data import load_gsm8k
from trio_helpers.offline import catalog, fit, report
from trio_helpers.offline.model import sequence_features
from trio_helpers.offline.tokenizer import get_offline_tokenizer
from trio_helpers.prompts import gsm8k_messages, render_prompt

SMALL = replace(catalog.STUDENT, dim=8, table_size=1 << 10)


@pytest.fixture
def small_corpus(monkeypatch):
    records = load_gsm8k("train", source="offline")[:12]
    monkeypatch.setattr(fit, "_corpus_records", lambda: (records, []))
    monkeypatch.setattr(fit, "EPOCHS", {"student": 1, "teacher": 1})
    return records


def test_fit_is_deterministic(small_corpus):
    a = fit.fit_base(SMALL, verbose=False)
    b = fit.fit_base(SMALL, verbose=False)
    for name in ("E", "W", "b"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert np.abs(a.E).sum() > 0


def test_cache_round_trip_and_no_refit(small_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("TRIO_OFFLINE_CACHE", str(tmp_path))
    first = fit.load_or_fit(SMALL)
    files = list(tmp_path.glob("student-*.npz"))
    assert len(files) == 1

    def must_not_fit(*args, **kwargs):
        raise AssertionError("a cached model must be loaded, not fitted again")

    monkeypatch.setattr(fit, "fit_base", must_not_fit)
    again = fit.load_or_fit(SMALL)
    for name in ("E", "W", "b"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))


def test_cache_key_changes_with_the_spec(small_corpus):
    assert fit._fingerprint(SMALL) != fit._fingerprint(replace(SMALL, dim=16))


def test_features_do_not_depend_on_the_process_hash_seed():
    """Python salts str/bytes hashes per process; the model's features must not use them."""
    tok = get_offline_tokenizer()
    text = render_prompt(tok, gsm8k_messages("Ann has 3 apples and buys 4 more. How many now?")) + "She has 3+4"
    tokens = tok.encode(text, add_special_tokens=False)
    here = sequence_features(tokens)[0]
    code = (
        "import sys, numpy as np; from trio_helpers.offline.model import sequence_features; "
        f"np.save(sys.stdout.buffer, sequence_features({tokens!r})[0])"
    )
    for seed in ("1", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        import io

        np.testing.assert_array_equal(np.load(io.BytesIO(out.stdout)), here)


def test_student_and_teacher_are_mixed_and_ordered():
    """The fitted student is sometimes right (mixed groups); the teacher is better (positive KL to shrink)."""
    service = connect("offline", latency=0.0)
    tok = get_offline_tokenizer()
    train = load_gsm8k("train", source="offline")
    student = service.create_sampling_client(report.STUDENT)
    teacher = service.create_sampling_client(report.TEACHER)
    p_student = report.pass_at_1(trio, student, tok, train, 24, 4, 1.0, seed=0)
    p_teacher = report.pass_at_1(trio, teacher, tok, train, 24, 4, 1.0, seed=0)
    assert 0.1 <= p_student <= 0.85
    assert p_teacher > p_student


def test_grpo_learns_only_through_training():
    """A short GRPO run raises the reward; the same run with learning rate 0 does not move at all.

    This fails if forward_backward, the importance-sampling loss or optim_step is broken.
    """
    service = connect("offline", latency=0.0)
    tok = get_offline_tokenizer()
    train = load_gsm8k("train", source="offline")
    learned = report.grpo(trio, service, tok, train, steps=12, seed=0, lr=4e-5)
    frozen = report.grpo(trio, service, tok, train, steps=12, seed=0, lr=0.0)
    assert np.mean(learned[-4:]) >= np.mean(learned[:4]) + 0.05
    assert np.mean(learned[-4:]) > np.mean(frozen[-4:])


def test_book_models_are_the_ones_its_outputs_were_made_with():
    """Fitting is exact (trio_helpers/offline/exact.py), so any machine fits the very weights behind the committed
    outputs (tests/test_portability.py fits them again under other SIMD levels and thread counts)."""
    for spec in (fit.STUDENT, fit.TEACHER, fit.TOOL):
        assert fit.weights_digest(fit.load_or_fit(spec)) == catalog.BOOK_WEIGHTS[spec.role], spec.role



def test_a_tool_reply_keeps_the_question_and_gives_the_copy_feature_its_number():
    """Chapter 12's feature change: a user turn that starts with ``<tool_response>`` (Qwen3's rendering of a tool
    message; no text of the other corpora starts so) keeps the question (its key moves on by one reply, so each
    turn of an episode has its own) and sets the "last calculator result" that the copy feature reads, as a
    ``<<expr=result>>`` note does."""
    from trio_helpers.calculator import tool_call_text, tool_reply_text

    tok = get_offline_tokenizer()
    prompt = render_prompt(tok, gsm8k_messages("Ann has 48 apples and gives away half. How many are left?"))
    turn = "Half of 48 is 48/2 = \n" + tool_call_text("48/2")
    ids = tok.encode(prompt + turn, add_special_tokens=False)
    before = sequence_features(ids)[1]
    after = sequence_features(ids + tok.encode(tool_reply_text("24"), add_special_tokens=False))[1]
    assert after.n_numbers == before.n_numbers  # still the question's count of numbers
    assert after.prompt_key not in (before.prompt_key, 0)  # its key, moved on to the next turn
    assert after.last_result == b"24" and after.n_results == before.n_results + 1
    error = sequence_features(ids + tok.encode(tool_reply_text("error: division by zero"),
                                               add_special_tokens=False))[1]
    assert error.prompt_key == after.prompt_key and error.last_result == before.last_result


def test_the_tool_models_corpus_is_the_episode_the_environment_builds():
    """The tool model is fitted on solutions written exactly as CalculatorEnv's episodes hold them."""
    from trio_helpers.calculator import tool_call_text, tool_reply_text

    record = {"question": "q", "answer": "He earns 22*7 = $<<22*7=154>>154 each day.\n#### 154"}
    assert fit.tool_transcript(record, "boxed") == (
        "He earns 22*7 = $\n" + tool_call_text("22*7") + tool_reply_text("154") + "154 each day.\n\\boxed{154}")

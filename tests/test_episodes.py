"""Episodes (trio_helpers.episodes, chapter 12): whole-episode datums with hand-checked masks, and the multi-turn
rollout on the offline backend with a scripted environment.

The datum checks spell out every position of a small episode by hand. The rollout checks compare each model turn
with what the sampler returns for the same prefix and seed, and run the episode's datum through the offline
trainer's ``forward``: its logprobs at the model's positions must equal the sampler's, which holds only if every
target is aligned.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytrio as trio
from pytrio.client.training_batch import plan_training_batch
from pytrio.model.limits import TrainingLimits
from pytrio.types import TensorData

from trio_helpers import connect
from trio_helpers.datums import IGNORE, importance_sampling_datum
from trio_helpers.episodes import (
    ENV,
    MODEL,
    Environment,
    Episode,
    Segment,
    StepResult,
    episode_datum,
    episode_rows,
    run_episode_async,
    run_episodes,
    run_episodes_async,
    turn_seed,
)

NO_LIMITS = TrainingLimits(max_batch_size=None, max_tokens_per_request=None, max_seq_len=None)
VOCAB = 261  # the offline tokenizer's size


class CharTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def fields(datum) -> dict[str, list]:
    return {name: tensor.data for name, tensor in datum.loss_fn_inputs.items()}


def totals(datum):
    plan = plan_training_batch([datum], loss_fn="importance_sampling", auto_shift=False, limits=NO_LIMITS,
                               tokenizer_vocab_size=VOCAB)
    return plan.totals


# prompt 1 2 3 | model 10 11 | env 20 21 22 | model 12 13     (logprobs exactly representable in float32)
SMALL = Episode(
    prompt=[1, 2, 3],
    segments=[Segment(MODEL, [10, 11], [-0.5, -0.25]), Segment(ENV, [20, 21, 22]),
              Segment(MODEL, [12, 13], [-0.125, -2.0])],
)


# --- datums by hand ------------------------------------------------------------------------------------------
def test_small_episode_datum_by_hand() -> None:
    d = episode_datum(SMALL, 0.5)
    f = fields(d)
    assert SMALL.tokens == [1, 2, 3, 10, 11, 20, 21, 22, 12, 13]
    assert d.model_input.to_ints() == [1, 2, 3, 10, 11, 20, 21, 22, 12]  # every token but the last
    #                      pos:  0     1     2   3   4     5     6     7   8
    #            input token:    1     2     3  10  11    20    21    22  12
    assert f["target_tokens"] == [IGNORE, IGNORE, 10, 11, IGNORE, IGNORE, IGNORE, 12, 13]
    assert f["logprobs"] == [0.0, 0.0, -0.5, -0.25, 0.0, 0.0, 0.0, -0.125, -2.0]
    assert f["advantages"] == [0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.5, 0.5]
    # position 4 reads the model's last token 11 and would predict the environment's 20: not a target.
    # position 7 reads the environment's 22 and predicts the model's 12: a target (the model wrote 12 after it).
    assert {name: t.dtype for name, t in d.loss_fn_inputs.items()} == {
        "target_tokens": "int64", "logprobs": "float32", "advantages": "float32"}
    assert isinstance(d.loss_fn_inputs["target_tokens"], TensorData)


def test_per_token_advantages_follow_the_model_tokens() -> None:
    f = fields(episode_datum(SMALL, [1.0, 2.0, 3.0, 4.0]))
    assert f["advantages"] == [0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 3.0, 4.0]


def test_planner_counts_only_model_tokens() -> None:
    t = totals(episode_datum(SMALL, 0.5))
    assert t.total_active_tokens == 4 == SMALL.model_tokens
    assert t.total_advantage_tokens == 4


def test_one_turn_episode_is_chapter_03s_datum() -> None:
    one = Episode(prompt=[1, 2, 3], segments=[Segment(MODEL, [10, 11, 12], [-0.5, -0.25, -1.0])])
    assert episode_datum(one, 0.5) == importance_sampling_datum([1, 2, 3], [10, 11, 12], [-0.5, -0.25, -1.0], 0.5)


def test_trailing_environment_tokens_are_left_out() -> None:
    closed = Episode(prompt=SMALL.prompt, segments=SMALL.segments + [Segment(ENV, [30, 31])])
    assert episode_datum(closed, 0.5) == episode_datum(SMALL, 0.5)


def test_episode_properties() -> None:
    assert SMALL.sources == ["prompt"] * 3 + ["model"] * 2 + ["env"] * 3 + ["model"] * 2
    assert SMALL.turns == 2 and SMALL.model_tokens == 4


def test_episode_rows_say_who_wrote_each_target() -> None:
    d = episode_datum(SMALL, 0.5)
    rows = episode_rows(SMALL, d, CharTokenizer())
    assert [r["by"] for r in rows] == ["prompt", "prompt", "model", "model", "env", "env", "env", "model", "model"]
    assert [r["trained"] for r in rows] == [r["by"] == "model" for r in rows]
    assert list(rows[0]) == ["pos", "input", "target", "by", "logprob", "advantage", "trained"]
    assert rows[7]["input"] == chr(22) and rows[7]["target"] == chr(12) and rows[7]["by"] == "model"
    assert rows[4]["target"] == "-"
    with pytest.raises(ValueError, match="built from"):
        episode_rows(Episode(prompt=[1, 2]), d, CharTokenizer())


@pytest.mark.parametrize("episode, advantage, error, match", [
    (Episode(prompt=[1, 2], segments=[Segment(ENV, [5])]), 1.0, ValueError, "no model tokens"),
    (SMALL, [1.0, 2.0], ValueError, "advantage has 2 entries"),
    (SMALL, float("nan"), ValueError, "not finite"),
    (SMALL, "1", TypeError, "advantage"),
    (Episode(prompt=[1], segments=[Segment(MODEL, [2, 3], [-1.0])]), 1.0, ValueError, "logprobs has 1"),
    (Episode(prompt=[], segments=[Segment(MODEL, [2], [-1.0])]), 1.0, ValueError, "prompt is empty"),
    (Episode(prompt=[1], segments=[Segment("user", [2]), Segment(MODEL, [3], [-1.0])]), 1.0, ValueError,
     "neither"),
])
def test_episode_datum_errors(episode, advantage, error, match) -> None:
    with pytest.raises(error, match=match):
        episode_datum(episode, advantage)


def test_turn_seed() -> None:
    assert turn_seed(None, 3) is None
    assert turn_seed(7, 0) == 7
    seeds = {turn_seed(s, t) for s in range(100) for t in range(4)}
    assert len(seeds) == 400  # neighbouring episodes' turns never share a seed


# --- the rollout on the offline backend ----------------------------------------------------------------------
class Scripted:
    """Replies ``[ok k]`` in a user turn after each model turn; ends after ``turns`` turns with reward 1.5."""

    stop = ["."]

    def __init__(self, tokenizer, turns: int = 3) -> None:
        self.tokenizer, self.turns = tokenizer, turns
        self.seen: list[tuple[str, list[int]]] = []

    def reset(self, record: dict) -> list[int]:
        self.seen = []
        return self.tokenizer.encode(f"<|im_start|>user\n{record['question']}<|im_end|>\n<|im_start|>assistant\n",
                                     add_special_tokens=False)

    def reply(self, k: int) -> list[int]:
        return self.tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n[ok {k}]<|im_end|>\n<|im_start|>assistant\n",
                                     add_special_tokens=False)

    def step(self, text: str, tokens: list[int]) -> StepResult:
        self.seen.append((text, list(tokens)))
        k = len(self.seen)
        if k >= self.turns:
            return StepResult([], done=True, reward=1.5, info={"steps": 1})
        return StepResult(self.reply(k), info={"steps": 1})


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return connect("offline", latency=0.0, home=tmp_path_factory.mktemp("offline_home"))


@pytest.fixture(scope="module")
def offline(service):
    client = service.create_lora_training_client("offline/tiny", rank=8, seed=0)
    sampler = client.save_weights_and_get_sampling_client()
    return client, sampler, sampler.get_tokenizer()


RECORDS = [{"question": f"What is {a} + {b}?"} for a, b in ((2, 3), (10, 4), (7, 7), (1, 8))]


def params(seed: int = 5, max_tokens: int = 12):
    return trio.SamplingParams(max_tokens=max_tokens, seed=seed, stop=Scripted.stop)


def test_scripted_env_is_an_environment(offline) -> None:
    assert isinstance(Scripted(offline[2]), Environment)


@pytest.fixture(scope="module")
def student(service):
    """The offline student: fitted on GSM8K-style text, so its turns do end at the stop string ``.``."""
    return service.create_sampling_client("Qwen/Qwen3.5-4B")


@pytest.mark.parametrize("model", ["offline/tiny", "Qwen/Qwen3.5-4B"])
def test_rollout_pieces_line_up(offline, student, model) -> None:
    sampler = offline[1] if model == "offline/tiny" else student
    tok = sampler.get_tokenizer()
    env = Scripted(tok, turns=3)
    ep = asyncio.run(run_episode_async(sampler, env, RECORDS[0], params(max_tokens=40)))
    assert ep.done and ep.truncated is None and ep.reward == 1.5 and ep.info == {"steps": 3}
    assert [s.source for s in ep.segments] == [MODEL, ENV, MODEL, ENV, MODEL]
    assert ep.prompt == Scripted(tok).reset(RECORDS[0])
    # each model turn is what the sampler gives for the prefix before it, with that turn's seed
    prefix = list(ep.prompt)
    turn = 0
    for segment in ep.segments:
        if segment.source == MODEL:
            p = trio.SamplingParams(max_tokens=40, seed=turn_seed(5, turn), stop=Scripted.stop)
            again = sampler.sample(trio.ModelInput.from_ints(prefix), 1, p).result().sequences[0]
            assert segment.tokens == again.tokens and segment.logprobs == again.logprobs
            assert env.seen[turn] == (again.text, again.tokens)  # the environment saw the turn as sampled
            assert len(segment.tokens) <= 40
            turn += 1
        else:
            assert segment.tokens == env.reply(turn)
        prefix += segment.tokens
    assert prefix == ep.tokens
    # a turn that stopped at the stop string ends with it (the offline backend keeps it, as in chapter 01)
    for segment, reason in zip([s for s in ep.segments if s.source == MODEL], ep.stop_reasons):
        if reason == "stop" and tok.decode(segment.tokens[-1:]) != "<|im_end|>":
            assert tok.decode(segment.tokens).endswith(".")
    if model == "Qwen/Qwen3.5-4B":
        assert "stop" in ep.stop_reasons, "the student should end some turn at '.'; the check above would be vacuous"


def test_rollout_datum_matches_the_trainer(offline) -> None:
    client, sampler, tok = offline
    ep = asyncio.run(run_episode_async(sampler, Scripted(tok, 3), RECORDS[1], params(seed=11)))
    d = episode_datum(ep, 1.0)
    f = fields(d)
    sources = ep.sources
    model_positions = [i for i in range(len(d.model_input)) if sources[i + 1] == MODEL]
    assert [i for i, t in enumerate(f["target_tokens"]) if t != IGNORE] == model_positions
    assert len(model_positions) == ep.model_tokens
    out = client.forward([d], loss_fn="importance_sampling").result()
    lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    sampled = np.concatenate([s.logprobs for s in ep.segments if s.source == MODEL])
    np.testing.assert_allclose(lp[model_positions], sampled, rtol=0, atol=1e-5)
    others = np.ones(len(lp), bool)
    others[model_positions] = False
    assert not lp[others].any(), "prompt and environment positions are not targets"
    assert out.metrics["token_count"] == ep.model_tokens


def test_rollout_turn_bound(offline) -> None:
    _, sampler, tok = offline
    ep = asyncio.run(run_episode_async(sampler, Scripted(tok, turns=10), RECORDS[2], params(), max_turns=2))
    assert ep.truncated == "turns" and not ep.done and ep.turns == 2 and ep.reward == 0.0
    assert [s.source for s in ep.segments] == [MODEL, ENV, MODEL]


@pytest.mark.parametrize("room", [1, 5, 20, 40])
def test_rollout_token_bound(offline, room) -> None:
    _, sampler, tok = offline
    env = Scripted(tok, turns=10)
    prompt_len = len(env.reset(RECORDS[3]))
    bound = prompt_len + room
    ep = asyncio.run(run_episode_async(sampler, env, RECORDS[3], params(max_tokens=8), max_turns=10,
                                       max_total_tokens=bound))
    assert ep.truncated == "tokens" and not ep.done
    assert len(ep.tokens) <= bound
    assert ep.segments[-1].source == MODEL  # a reply that does not fit is dropped
    if room <= 8:
        assert ep.turns == 1 and len(ep.segments[0].tokens) <= room


def test_rollout_argument_errors(offline) -> None:
    _, sampler, tok = offline
    with pytest.raises(ValueError, match="max_turns"):
        asyncio.run(run_episode_async(sampler, Scripted(tok), RECORDS[0], params(), max_turns=0))
    with pytest.raises(ValueError, match="max_tokens"):
        asyncio.run(run_episode_async(sampler, Scripted(tok), RECORDS[0], trio.SamplingParams(seed=1)))
    with pytest.raises(ValueError, match="max_total_tokens"):
        asyncio.run(run_episode_async(sampler, Scripted(tok), RECORDS[0], params(), max_total_tokens=5))

    class Bad(Scripted):
        def step(self, text, tokens):
            return ([], True, 1.0)

    with pytest.raises(ValueError, match="StepResult"):
        asyncio.run(run_episode_async(sampler, Bad(tok), RECORDS[0], params()))


def test_concurrent_equals_sequential(offline) -> None:
    _, sampler, tok = offline
    make_env = lambda record: Scripted(tok, turns=2)  # noqa: E731

    def seeded(i):
        return params(seed=100 + i)

    concurrent = asyncio.run(run_episodes_async(sampler, make_env, RECORDS, seeded, max_concurrency=4))
    sequential = run_episodes(sampler, make_env, RECORDS, seeded, max_concurrency=1)
    assert [e.tokens for e in concurrent] == [e.tokens for e in sequential]
    assert [e.reward for e in concurrent] == [1.5] * len(RECORDS)
    for record, ep in zip(RECORDS, concurrent):  # in record order, whatever finished first
        assert ep.prompt == Scripted(tok).reset(record)


def test_calculator_env_rollout_on_the_student(student) -> None:
    """The real environment end to end: the offline student knows no tool format, so it answers in one turn."""
    from trio_helpers.calculator import STOP, CalculatorEnv

    sampler = student
    tok = sampler.get_tokenizer()
    records = [{"question": "Natalia sold 48 clips in April and half as many in May. How many in May?",
                "answer": "#### 24"}]
    episodes = run_episodes(sampler, lambda r: CalculatorEnv(tok), records,
                            lambda i: trio.SamplingParams(max_tokens=64, seed=i, stop=STOP), max_turns=3)
    ep = episodes[0]
    assert ep.turns >= 1 and ep.reward in (0.0, 1.0)
    assert ep.done or ep.truncated
    episode_datum(ep, 1.0)  # builds


class ScriptedSampler:
    """``sample_async`` that returns the given turns in order (each as a one-sequence response), logprob -1 each;
    records the prompts it was asked to continue."""

    def __init__(self, tokenizer, turns: list[str]) -> None:
        self.tokenizer, self.turns, self.prompts = tokenizer, list(turns), []

    async def sample_async(self, prompt, num_samples=1, sampling_params=None):
        from types import SimpleNamespace

        self.prompts.append(prompt.to_ints())
        text = self.turns.pop(0)
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        seq = SimpleNamespace(tokens=tokens, logprobs=[-1.0] * len(tokens), text=text, stop_reason="stop")
        return SimpleNamespace(sequences=[seq])


def test_calculator_episode_by_hand(offline) -> None:
    """A scripted tool call, the calculator's reply and a final answer: every mask checked against the text."""
    from trio_helpers.calculator import CalculatorEnv, tool_call_text, tool_reply_text

    tok = offline[2]
    call = "Half of 48: " + tool_call_text("48/2")
    answer = "So \\boxed{24}.<|im_end|>"
    sampler = ScriptedSampler(tok, [call, answer])
    record = {"question": "Natalia sold 48 clips in April and half as many in May. How many in May?",
              "answer": "#### 24"}
    env = CalculatorEnv(tok)
    ep = asyncio.run(run_episode_async(sampler, env, record, trio.SamplingParams(max_tokens=200, stop=env.stop)))
    assert ep.done and ep.reward == 1.0 and ep.info == {"tool_calls": 1, "tool_errors": 0}
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    reply = tool_reply_text("24")
    assert [(s.source, tok.decode(s.tokens)) for s in ep.segments] == [
        (MODEL, call), (ENV, reply), (MODEL, answer)]
    assert sampler.prompts == [ep.prompt, ep.prompt + enc(call) + enc(reply)]  # turn 2 continues after the reply
    d = episode_datum(ep, 1.0)
    targets = fields(d)["target_tokens"]
    P, C, R, A = len(ep.prompt), len(enc(call)), len(enc(reply)), len(enc(answer))
    assert len(targets) == P + C + R + A - 1
    assert targets == [IGNORE] * (P - 1) + enc(call) + [IGNORE] * R + enc(answer)
    rows = episode_rows(ep, d, tok)
    assert all(r["target"] == "-" and not r["trained"] for r in rows if r["by"] == "env")
    assert "".join(r["input"] for r in rows[P + C : P + C + R]) == reply  # the reply is read, never predicted
    assert [r["pos"] for r in rows if r["trained"]] == (list(range(P - 1, P - 1 + C))
                                                        + list(range(P - 1 + C + R, P - 1 + C + R + A)))

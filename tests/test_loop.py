"""Tests of the one training loop (trio_helpers.loop) with both scorers: sampler versions, the three rollout modes,
resume, and the checks that run before anything is created.

Every run is on the offline backend without latency (one test adds some on purpose), with ``offline/tiny`` as the
trained model: GRPO grades it with a parity reward (about half its completions earn 1, so groups carry signal
and every step trains), OPD distils the fitted teacher into it (the KL is large, so every step moves the weights).
Checkpoints go to a temporary offline home. Helpers used by ``test_loop_failures.py`` too live here.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from trio_helpers import connect
from trio_helpers.distillation import OPDConfig, OPDScorer, run_opd
from trio_helpers.grpo import GRPOConfig, GRPOScorer, run_grpo
from trio_helpers.loop import (
    TIMING_PREFIX,
    LoopConfig,
    read_checkpoints,
    run_loop,
    sampler_version,
)
from trio_helpers.tracking import read_metrics

TINY = "offline/tiny"
TEACHER = "Qwen/Qwen3.6-27B"
KINDS = ("grpo", "opd")
MODES = ("sync", "async", "pipeline")
PROBE = list(range(40, 104))  # token ids whose logprobs fingerprint a set of weights


# ------------------------------------------------------------------------------------------------- helpers
def parity_reward(text: str, record: dict) -> float:
    """1 for a completion of odd length: the untrained tiny model earns it about half the time."""
    return float(len(text) % 2)


@functools.cache
def records(kind: str) -> tuple:
    from trio_helpers.data import load_deepmath, load_gsm8k

    if kind == "grpo":
        return tuple(load_gsm8k("train", source="offline")[:32])
    return tuple(load_deepmath(source="offline", sample_size=32, seed=0))


def make_config(kind: str, **overrides) -> LoopConfig:
    """A small config of either scorer: 4 steps of 1 prompt, at most 12 tokens per completion; GRPO 3
    completions per prompt (with seed 1 no group of the first steps ties, in any mode), OPD 2."""
    values = dict(base_model=TINY, lora_rank=8, steps=4, batch_size=1, group_size=2, max_tokens=12, seed=0,
                  learning_rate=1e-3, max_concurrency=4)
    if kind == "grpo":
        return GRPOConfig(**{**values, "group_size": 3, "seed": 1, **overrides})
    return OPDConfig(**{**values, "teacher_base_model": TEACHER, **overrides})


def canonical(kind: str, mode: str, **overrides) -> LoopConfig:
    """The reference run of a (scorer, mode): 4 steps, a checkpoint after 3 steps (a resume point, where the
    pipeline drains), pipelining up to 2 updates stale. Its sampler versions per step are:
    sync/async ``0 1 2 3``, pipeline ``0 0 0 3``."""
    return make_config(kind, steps=4, save_every=3, rollout=mode, max_staleness=2, **overrides)


def run(kind: str, service, config: LoopConfig, **options):
    """``run_grpo`` (with the parity reward) or ``run_opd``, with the same keyword options."""
    if kind == "grpo":
        return run_grpo(service, list(records(kind)), config, reward_fn=parity_reward, **options)
    return run_opd(service, list(records(kind)), config, **options)


def without_timing(rows) -> list[dict]:
    """Rows without their wall-clock ``time/*`` keys: what must be identical between equivalent runs."""
    return [{k: v for k, v in row.items() if not k.startswith(TIMING_PREFIX)} for row in rows]


def weights_fingerprint(service, path: str, base_model: str = TINY) -> np.ndarray:
    """Logprobs of :data:`PROBE` under the sampler weights saved at ``path`` (public API only)."""
    from pytrio import ModelInput

    sampler = service.create_sampling_client(base_model, model_path=path)
    return np.array(sampler.compute_logprobs(ModelInput.from_ints(PROBE)).result()[1:])


@dataclass
class Baseline:
    """An uninterrupted run: its config, result, phase events, final-weights fingerprint and request count."""

    config: LoopConfig
    result: object
    events: list
    fingerprint: np.ndarray
    requests: int

    @property
    def rows(self) -> list[dict]:
        return without_timing(self.result.history)


class InterruptAt:
    """An ``on_step`` callback that raises KeyboardInterrupt once step ``step`` is logged (a Ctrl-C there)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __call__(self, out) -> None:
        if out.step == self.step:
            raise KeyboardInterrupt(f"simulated Ctrl-C after step {out.step}")


class CountingService:
    """Wraps a service and records every ``create_*`` call made through it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.created: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not name.startswith("create_"):
            return attr

        def create(*args, **kwargs):
            self.created.append(name)
            return attr(*args, **kwargs)

        return create


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """The module's offline home (checkpoints), also as ``TRIO_OFFLINE_HOME``."""
    path = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRIO_OFFLINE_HOME", str(path))
        yield path


@pytest.fixture(scope="module")
def service(home):
    return connect("offline", in_process=True, latency=0.0, home=home)


_BASELINES: dict[tuple[str, str], Baseline] = {}  # shared by the modules that import this one


@pytest.fixture(scope="module")
def straight(home, tmp_path_factory):
    """``straight(kind, mode)``: the :func:`canonical` run of that scorer and mode, run once per test session
    on a fresh fault-free service (so its request count is its own)."""
    cache = _BASELINES

    def get(kind: str, mode: str) -> Baseline:
        if (kind, mode) not in cache:
            service = connect("offline", in_process=True, latency=0.0, home=home)
            config = canonical(kind, mode, run_dir=str(tmp_path_factory.mktemp(f"straight-{kind}-{mode}")))
            events: list[tuple[str, int]] = []
            result = run(kind, service, config, on_event=lambda what, step, t: events.append((what, step)))
            requests = service.usage().requests
            cache[kind, mode] = Baseline(config, result, events, weights_fingerprint(service, result.final_path),
                                         requests)
        return cache[kind, mode]

    return get


# ------------------------------------------------------------------------------------------ sampler versions
def _versions(config: LoopConfig, steps: int = 9, start: int = 0) -> list[int]:
    return [sampler_version(config, s, start) for s in range(start, steps)]


def test_sampler_version_of_sync_refresh_and_pipeline() -> None:
    assert _versions(LoopConfig()) == list(range(9))  # a fresh sampler every step: on-policy
    assert _versions(LoopConfig(sampler_refresh_steps=3)) == [0, 0, 0, 3, 3, 3, 6, 6, 6]
    assert _versions(LoopConfig(rollout="pipeline", max_staleness=1)) == [0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert _versions(LoopConfig(rollout="pipeline", max_staleness=3)) == [0, 0, 0, 0, 1, 2, 3, 4, 5]
    # async rollouts change how requests are sent, not which weights they see
    assert _versions(LoopConfig(rollout="async", sampler_refresh_steps=2)) == _versions(
        LoopConfig(sampler_refresh_steps=2))


def test_checkpoints_are_resume_points_where_the_pipeline_drains() -> None:
    # save_every=3: steps 0, 3, 6 start from a checkpoint, so they sample the weights of that checkpoint
    piped = LoopConfig(rollout="pipeline", max_staleness=2, save_every=3, run_dir="r")
    assert _versions(piped) == [0, 0, 0, 3, 3, 3, 6, 6, 6]
    assert _versions(replace(piped, max_staleness=1)) == [0, 0, 1, 3, 3, 4, 6, 6, 7]
    refresh = LoopConfig(sampler_refresh_steps=2, save_every=3, run_dir="r")
    assert _versions(refresh) == [0, 0, 2, 3, 3, 5, 6, 6, 8]


@pytest.mark.parametrize("config", [
    LoopConfig(), LoopConfig(sampler_refresh_steps=2, save_every=3, run_dir="r"),
    LoopConfig(rollout="pipeline", max_staleness=2, save_every=2, run_dir="r"),
    LoopConfig(rollout="pipeline", max_staleness=4, save_every=3, run_dir="r"),
], ids=["sync", "refresh2-save3", "pipe2-save2", "pipe4-save3"])
def test_a_run_resumed_at_a_checkpoint_samples_what_the_uninterrupted_run_sampled(config) -> None:
    every = config.save_every or 1
    for start in range(0, 12, every):
        assert _versions(config, 12, start) == _versions(config, 12)[start:], f"resumed at {start}"
    for s in range(12):
        v = sampler_version(config, s)
        assert v <= s and s - v <= (config.max_staleness if config.rollout == "pipeline" else
                                    config.sampler_refresh_steps - 1)


def test_max_staleness_must_be_at_least_one_and_excludes_refresh_steps() -> None:
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="max_staleness must be an integer >= 1"):
            GRPOConfig(rollout="pipeline", max_staleness=bad).validate()
    with pytest.raises(ValueError, match="sampler_refresh_steps=2 with rollout='pipeline'"):
        OPDConfig(rollout="pipeline", sampler_refresh_steps=2).validate()


# ----------------------------------------------------------------------------------------- the three modes
def _order(events) -> dict[tuple[str, int], int]:
    return {event: i for i, event in enumerate(events)}


def _keys(result) -> set[str]:
    return set().union(*result.history)


@pytest.mark.parametrize("kind", KINDS)
def test_sync_and_async_give_identical_rows_and_weights(kind, straight, service) -> None:
    sync, concurrent = straight(kind, "sync"), straight(kind, "async")
    assert [r["step"] for r in sync.rows] == [0, 1, 2, 3]
    assert sync.rows == concurrent.rows
    np.testing.assert_array_equal(sync.fingerprint, concurrent.fingerprint)
    assert all(r["train/datums"] > 0 for r in sync.rows), "a step trained on nothing: the test proves less"
    initial = service.create_lora_training_client(TINY, rank=8, seed=0).save_weights_for_sampler("init").result()
    assert not np.array_equal(weights_fingerprint(service, initial.path), sync.fingerprint), "no learning"
    for b in (sync, concurrent):
        assert [r["sampler/version"] for r in b.rows] == [0, 1, 2, 3]  # on-policy: a fresh sampler each step
        assert all(r["sampler/staleness"] == 0 for r in b.rows)
        order = _order(b.events)
        assert all(order[("sample_start", s)] > order[("train_end", s - 1)] for s in range(1, 4))


@pytest.mark.parametrize("kind", KINDS)
def test_every_mode_logs_the_same_vocabulary(kind, straight) -> None:
    keys = {mode: _keys(straight(kind, mode).result) for mode in MODES}
    assert keys["sync"] == keys["async"] == keys["pipeline"]
    shared = {"step", "completion/tokens_mean", "completion/tokens_max", "completion/tokens_total",
              "completion/frac_max_tokens", "train/datums", "train/tokens", "train/tokens_skipped", "train/loss",
              "train/lr", "train/ratio_mean", "train/ratio_max", "train/policy_lag", "sampler/version",
              "sampler/staleness", "time/refresh_s", "time/sample_s", "time/wait_s", "time/train_s",
              "time/step_s"}
    own = {"grpo": {"reward/mean", "reward/frac_degenerate"},
           "opd": {"kl/teacher_mean", "kl/teacher_std", "kl/teacher_seq_mean"}}[kind]
    assert shared | own <= keys["sync"]
    assert any(k.startswith("optim/") for k in keys["sync"])  # whatever optim_step reports, prefixed
    assert not keys["sync"] & ({"reward/mean", "kl/teacher_mean"} - own)  # each scorer logs its own signal
    families = {"reward", "kl", "completion", "train", "optim", "sampler", "time"}  # the documented ones
    assert {k.split("/")[0] for k in keys["sync"] - {"step"}} <= families


@pytest.mark.parametrize("kind", KINDS)
def test_pipeline_staleness_stays_within_its_bound_and_drains_at_checkpoints(kind, straight) -> None:
    piped = straight(kind, "pipeline")
    versions = [r["sampler/version"] for r in piped.rows]
    assert versions == [sampler_version(piped.config, s) for s in range(4)] == [0, 0, 0, 3]
    staleness = [r["sampler/staleness"] for r in piped.rows]
    assert staleness == [s - v for s, v in enumerate(versions)] == [0, 1, 2, 0]
    assert max(staleness) <= piped.config.max_staleness
    assert [c["step"] for c in piped.result.checkpoints] == [3, 4]
    order = _order(piped.events)
    for s in (1, 2):  # the overlap the schedule allows: batch s is sampled before batch s - 1 trains
        assert order[("sample_start", s)] < order[("train_start", s - 1)]
    assert order[("sample_start", 3)] > order[("train_end", 2)]  # step 3 waits for the weights of checkpoint 3
    assert all(order[("sample_end", s)] < order[("train_start", s)] for s in range(4))
    sync = straight(kind, "sync")
    assert piped.rows[0] == sync.rows[0]  # both sample the initial weights; later steps differ by staleness
    if kind == "opd":  # every OPD step trains, so a stale sampler's logprobs differ from the trainer's
        lag = [r["train/policy_lag"] for r in piped.rows]
        assert all((lag_ > 1e-6) == (stale > 0) for lag_, stale in zip(lag, staleness)), lag
        assert max(r["train/policy_lag"] for r in sync.rows) < 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_pipeline_results_do_not_depend_on_timing(kind, straight, home, tmp_path) -> None:
    fast = straight(kind, "pipeline")
    service = connect("offline", in_process=True, latency=0.02, home=home)
    config = replace(fast.config, run_dir=str(tmp_path / "slow"))  # where the metrics go changes nothing
    slow = run(kind, service, config)
    assert without_timing(slow.history) == fast.rows
    np.testing.assert_array_equal(weights_fingerprint(service, slow.final_path), fast.fingerprint)


def test_sampler_refresh_steps_reuses_a_sampler(service) -> None:
    config = make_config("opd", rollout="async", sampler_refresh_steps=2)
    rows = run("opd", service, config).history
    assert [r["sampler/version"] for r in rows] == [sampler_version(config, s) for s in range(4)] == [0, 0, 2, 2]
    assert [r["sampler/staleness"] for r in rows] == [0, 1, 0, 1]
    lag = [r["train/policy_lag"] for r in rows]
    assert lag[0] < 1e-6 and lag[2] < 1e-6  # a fresh sampler: trainer and sampler logprobs agree
    assert lag[1] > 1e-6 and lag[3] > 1e-6  # one update old: they differ


# --------------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_resume_reproduces_the_uninterrupted_run(kind, mode, straight, service, tmp_path) -> None:
    config = canonical(kind, mode, run_dir=str(tmp_path / "interrupted"))
    with pytest.raises(KeyboardInterrupt):
        run(kind, service, config, on_step=InterruptAt(3))
    assert [r["step"] for r in read_metrics(config.run_dir)] == [0, 1, 2, 3]
    assert [c["step"] for c in read_checkpoints(config.run_dir)] == [3]

    resumed = run(kind, service, config, resume=True)  # redoes step 3, logged after the checkpoint
    assert resumed.start_step == 3
    assert [r["step"] for r in read_metrics(config.run_dir)] == [0, 1, 2, 3], "each step once, none missing"
    assert [c["step"] for c in resumed.checkpoints] == [3, 4]
    reference = straight(kind, mode)
    assert without_timing(resumed.history) == without_timing(read_metrics(config.run_dir)) == reference.rows
    np.testing.assert_array_equal(weights_fingerprint(service, resumed.final_path), reference.fingerprint)


def test_resume_may_extend_a_finished_run(service, tmp_path) -> None:
    config = make_config("opd", steps=1, save_every=1, run_dir=str(tmp_path / "run"))
    run("opd", service, config)
    longer = run("opd", service, replace(config, steps=2), resume=True)
    assert longer.start_step == 1 and [r["step"] for r in longer.history] == [0, 1]
    assert [c["step"] for c in longer.checkpoints] == [1, 2]
    direct = run("opd", service, replace(config, steps=2, run_dir=str(tmp_path / "direct")))
    assert without_timing(longer.history) == without_timing(direct.history)


# --------------------------------------------------------------------------------------- refused up front
@pytest.mark.parametrize("field, value, match", [
    ("group_size", 1, "group_size=1: GRPO compares completions"),
    ("temperature", 0.0, "temperature=0 samples the same completion"),
    ("lora_rank", "32", "lora_rank must be an integer in \\[4, 64\\].*'32'"),
    ("lora_rank", 32.5, "lora_rank must be an integer in \\[4, 64\\].*32.5"),
    ("lora_rank", True, "lora_rank"),
    ("advantage", "median", "advantage must be one of"),
])
def test_grpo_configs_that_can_never_learn_or_run_are_refused(field, value, match) -> None:
    with pytest.raises(ValueError, match=match):
        replace(GRPOConfig(), **{field: value}).validate()


def test_greedy_grpo_is_allowed_when_degenerate_groups_are_kept() -> None:
    GRPOConfig(temperature=0.0, skip_degenerate=False).validate()
    OPDConfig(group_size=1).validate()  # distillation learns from a single completion


@pytest.mark.parametrize("value", ["32", 32.5, None])
def test_opd_rank_must_be_an_integer(value) -> None:
    with pytest.raises(ValueError, match="lora_rank must be an integer"):
        OPDConfig(lora_rank=value).validate()


@pytest.mark.parametrize("kind, bad, message", [
    ("grpo", {"question": "What is 2 + 2?"}, "record 3 has no 'answer' text"),
    ("grpo", {"answer": "#### 4"}, "record 3 has no 'question' text"),
    ("grpo", "What is 2 + 2?", "record 3 is a str, not a dict"),
    ("opd", {"prompt": "Prove it."}, "record 3 has no 'question' text"),
    ("opd", {"question": "   "}, "record 3 has no 'question' text"),
])
def test_records_without_the_needed_fields_are_rejected_before_anything_is_created(kind, bad, message, home,
                                                                                  tmp_path) -> None:
    inner = connect("offline", in_process=True, latency=0.0, home=home)
    service = CountingService(inner)
    good = list(records(kind))[:3]
    if kind == "grpo":
        good = [{"question": "What is 1 + 1?", "answer": "#### 2"}] * 3
    config = make_config(kind, run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=message):
        (run_grpo if kind == "grpo" else run_opd)(service, [*good, bad, *good], config)
    assert service.created == [] and inner.usage().requests == 0
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_an_invalid_config_creates_and_writes_nothing(kind, home, tmp_path) -> None:
    inner = connect("offline", in_process=True, latency=0.0, home=home)
    service = CountingService(inner)
    with pytest.raises(ValueError, match="lora_rank"):
        run(kind, service, make_config(kind, lora_rank="8", run_dir=str(tmp_path / "run")))
    assert service.created == [] and inner.usage().requests == 0 and not (tmp_path / "run").exists()


def test_an_invalid_resume_writes_nothing(home, tmp_path) -> None:
    service = CountingService(connect("offline", in_process=True, latency=0.0, home=home))
    with pytest.raises(ValueError, match="no saved state"):
        run("grpo", service, make_config("grpo", run_dir=str(tmp_path / "missing")), resume=True)
    assert not (tmp_path / "missing").exists()
    with pytest.raises(ValueError, match="needs config.run_dir"):
        run("grpo", service, make_config("grpo"), resume=True)

    config = make_config("grpo", steps=2, save_every=1, run_dir=str(tmp_path / "run"))
    run("grpo", service, config)
    before, created = snapshot(tmp_path / "run"), len(service.created)
    with pytest.raises(ValueError, match="batch_size: saved 1, now 3"):
        run("grpo", service, replace(config, batch_size=3), resume=True)
    with pytest.raises(ValueError, match="advantage: saved 'mean', now 'std'"):
        run("grpo", service, replace(config, advantage="std"), resume=True)
    with pytest.raises(ValueError, match="do not pass training_client"):
        run("grpo", service, config, resume=True, training_client=object())
    assert snapshot(tmp_path / "run") == before and len(service.created) == created
    assert json.loads((tmp_path / "run" / "config.json").read_text())["batch_size"] == 1


def test_run_grpo_and_run_opd_are_run_loop_with_a_scorer(straight, service, tmp_path) -> None:
    for kind, scorer_of in (("grpo", lambda c: GRPOScorer(c, parity_reward)), ("opd", OPDScorer)):
        reference = straight(kind, "sync")
        config = replace(reference.config, run_dir=str(tmp_path / kind))
        direct = run_loop(service, list(records(kind)), config, scorer_of(config))
        assert without_timing(direct.history) == reference.rows


# ------------------------------------------------------------------------------- steps that train nothing
def test_a_step_that_trains_nothing_saves_no_second_sampler(service, home) -> None:
    """With a constant reward every group is degenerate: nothing is sent, no optimizer step, so the weights of the
    next version are the ones already saved, and the loop samples them again instead of saving them again."""
    fresh = connect("offline", in_process=True, latency=0.0, home=home)
    config = make_config("grpo", rollout="sync")
    saves = []
    rows = run_grpo(CountingService(fresh), list(records("grpo")), config, reward_fn=lambda text, record: 1.0,
                    on_event=lambda what, step, t: saves.append(what) if what == "sample_start" else None).history
    assert [r["train/datums"] for r in rows] == [0, 0, 0, 0]
    assert [r["sampler/version"] for r in rows] == [0, 1, 2, 3]  # versions still count steps
    assert len(saves) == 4 and fresh.usage().sampler_snapshots == 1  # one save for four steps


def test_the_loop_sends_the_loss_config_its_clip_metrics_assume(service, monkeypatch) -> None:
    """loss_fn_config=None: the service would apply its own defaults; the loop sends the merged defaults it
    computes train/clip_frac with."""
    from trio_helpers.losses import LOSS_CONFIG
    from trio_helpers.offline.service import OfflineTrainingClient

    sent = []
    original = OfflineTrainingClient.forward_backward

    def spy(self, data, loss_fn="cross_entropy", loss_fn_config=None, *args, **kwargs):
        sent.append((loss_fn, loss_fn_config))
        return original(self, data, loss_fn, loss_fn_config, *args, **kwargs)

    monkeypatch.setattr(OfflineTrainingClient, "forward_backward", spy)
    run("grpo", service, make_config("grpo", steps=1, loss_fn="ppo"))
    run("grpo", service, make_config("grpo", steps=1, loss_fn="ppo", loss_fn_config={"clip_high_threshold": 1.5}))
    run("grpo", service, make_config("grpo", steps=1))
    assert sent == [("ppo", LOSS_CONFIG["ppo"]), ("ppo", {**LOSS_CONFIG["ppo"], "clip_high_threshold": 1.5}),
                    ("importance_sampling", None)]


def test_a_kl_penalty_needs_temperature_one() -> None:
    with pytest.raises(ValueError, match=r"ref_kl_coef > 0 needs temperature 1, got temperature 0.7"):
        make_config("grpo", ref_kl_coef=0.1, temperature=0.7).validate()
    make_config("grpo", ref_kl_coef=0.1).validate()

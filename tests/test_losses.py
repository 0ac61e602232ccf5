"""Tests of the policy losses as functions of the ratio (``trio_helpers.losses``) and of the recipes' ``--loss-fn``.

- ``token_gradient`` is the derivative of ``token_loss`` with respect to the trainer logprob ``lp`` (central finite
  differences in ``lp``; for ``cispo`` with its stop-gradient weight held fixed, as the loss defines it);
- both equal the offline trainer's exact per-token losses (``trio_helpers.offline.losses.per_token_loss``), so the
  curves of chapter 08 are the losses the offline backend trains with;
- clip masks at known points, including hand-computed cases of ``cispo``'s one-sided clip (the default, as Tinker
  documents it and MiniMax-M1 published it) and its equality with ``importance_sampling`` below the upper bound;
  the offline trainer's defaults and checks are the book's; bad input: an unknown loss lists the supported ones, a key the loss does not take names
  the loss and its keys, clip bounds in the wrong order are refused;
- the GRPO and OPD recipes train with ``--loss-fn ppo`` and ``--loss-fn cispo`` (tiny offline runs).

Introduced in: chapter 08 (notebooks/08_losses).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from trio_helpers.grpo import GRPOConfig
from trio_helpers.losses import LOSS_CONFIG, check_loss_config, clipped_mask, token_gradient, token_loss
from trio_helpers.offline.losses import per_token_loss

LOSSES = tuple(LOSS_CONFIG)
# Ratios on both sides of ppo's bounds (0.8, 1.2) and cispo's upper one (4), none on a kink (there the derivative is
# one-sided).
RHO = np.array([0.3, 0.55, 0.79, 0.81, 0.95, 1.0, 1.05, 1.19, 1.21, 1.6, 3.0, 3.99, 4.01, 9.0])
ADVANTAGES = (1.0, -0.7, 0.25)


@pytest.mark.parametrize("adv", ADVANTAGES)
@pytest.mark.parametrize("loss", LOSSES)
def test_gradient_is_the_finite_difference_of_the_loss_in_lp(loss, adv) -> None:
    lp, h = np.log(RHO), 1e-6
    if loss == "cispo":
        # -stopgrad(clip(rho)) * A * lp: the clipped weight is a constant for the gradient
        cfg = LOSS_CONFIG["cispo"]
        weight = np.clip(RHO, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        numeric = (-weight * adv * (lp + h) - (-weight * adv * (lp - h))) / (2 * h)
    else:
        numeric = (token_loss(loss, np.exp(lp + h), adv) - token_loss(loss, np.exp(lp - h), adv)) / (2 * h)
    np.testing.assert_allclose(token_gradient(loss, RHO, adv), numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("loss", LOSSES)
def test_loss_and_gradient_are_the_offline_trainers(loss) -> None:
    """At ``old = 0`` (so ``lp = log rho``) the chapter's functions equal the offline trainer's exact ones."""
    for adv in ADVANTAGES:
        lp = np.log(RHO)
        value, grad = per_token_loss(loss, lp, np.zeros_like(lp), np.full_like(lp, adv), np.ones_like(lp),
                                     LOSS_CONFIG[loss])
        np.testing.assert_allclose(token_loss(loss, RHO, adv), value, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(token_gradient(loss, RHO, adv), grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss", LOSSES)
def test_on_policy_every_loss_pushes_like_reinforce(loss) -> None:
    """At rho = 1 every loss's gradient is -A: the four losses coincide on-policy."""
    adv = np.array([1.0, -0.5, 2.0])
    np.testing.assert_allclose(token_gradient(loss, np.ones(3), adv), -adv)
    assert not clipped_mask(loss, np.ones(3), adv).any()


def test_ppo_clips_only_once_the_ratio_moved_the_way_the_advantage_wants() -> None:
    rho = np.array([0.7, 1.0, 1.3])
    assert clipped_mask("ppo", rho, 1.0).tolist() == [False, False, True]
    assert clipped_mask("ppo", rho, -1.0).tolist() == [True, False, False]
    assert token_gradient("ppo", rho, 1.0).tolist() == pytest.approx([-0.7, -1.0, 0.0])
    assert token_gradient("ppo", rho, -1.0).tolist() == pytest.approx([0.0, 1.0, 1.3])
    assert not clipped_mask("ppo", rho, 0.0).any()  # no advantage, nothing to clip
    wider = {"clip_high_threshold": 1.5}
    assert clipped_mask("ppo", rho, 1.0, wider).tolist() == [False, False, False]


def test_cispo_is_one_sided_by_default_hand_computed() -> None:
    """Default bounds (0, 4): the weight is min(rho, 4); nothing is clipped from below, however small the ratio."""
    rho = np.array([0.02, 0.5, 1.0, 3.0, 5.0, 10.0])
    assert clipped_mask("cispo", rho, 1.0).tolist() == [False, False, False, False, True, True]
    assert clipped_mask("cispo", rho, -1.0).tolist() == [False, False, False, False, True, True]
    # push = -d loss / d lp = clip(rho, 0, 4) * A, by hand:
    assert (-token_gradient("cispo", rho, 1.0)).tolist() == [0.02, 0.5, 1.0, 3.0, 4.0, 4.0]
    assert (-token_gradient("cispo", rho, -0.5)).tolist() == [-0.01, -0.25, -0.5, -1.5, -2.0, -2.0]
    # the objective sg(w) * A * lp at old = 0: w = 0.5, A = 2 -> 0.5 * 2 * log(0.5); w = 4 (clipped), A = 1 -> 4 * log 5
    assert token_loss("cispo", np.array([0.5, 5.0]), np.array([2.0, 1.0])).tolist() == pytest.approx(
        [-1.0 * np.log(0.5), -4.0 * np.log(5.0)])


def test_cispo_with_a_lower_bound_clips_both_sides() -> None:
    rho = np.array([0.7, 1.0, 1.3])
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    for adv in (1.0, -1.0):
        assert clipped_mask("cispo", rho, adv, config).tolist() == [True, False, True]
        assert token_gradient("cispo", rho, adv, config).tolist() == pytest.approx([-0.8 * adv, -adv, -1.2 * adv])
    one_sided = {"clip_low_threshold": 0.0, "clip_high_threshold": 1.2}  # low = 0 is accepted: no lower bound
    assert clipped_mask("cispo", rho, 1.0, one_sided).tolist() == [False, False, True]
    assert token_gradient("cispo", rho, 1.0, one_sided).tolist() == pytest.approx([-0.7, -1.0, -1.2])


@pytest.mark.parametrize("config", [None, {"clip_high_threshold": 1.2}, {"clip_high_threshold": 8.0}])
def test_one_sided_cispo_pushes_like_importance_sampling_below_the_upper_bound(config) -> None:
    """Where no ratio exceeds the upper bound, one-sided cispo's gradient is importance_sampling's, bit for bit;
    above it, the weight is the bound."""
    hi = check_loss_config("cispo", config)["clip_high_threshold"]
    rng = np.random.default_rng(0)
    rho = np.exp(rng.uniform(np.log(1e-3), np.log(hi), 200))
    adv = rng.normal(size=200)
    assert (token_gradient("cispo", rho, adv, config) == token_gradient("importance_sampling", rho, adv)).all()
    assert not clipped_mask("cispo", rho, adv, config).any()
    above = hi * np.array([1.01, 2.0, 50.0])
    np.testing.assert_array_equal(token_gradient("cispo", above, 1.0, config), -hi)
    assert clipped_mask("cispo", above, 1.0, config).all()


def test_offline_trainer_has_the_books_defaults_and_checks() -> None:
    from trio_helpers.offline.losses import LOSS_CONFIG_KEYS, resolve_loss_config

    for loss, defaults in LOSS_CONFIG.items():
        assert LOSS_CONFIG_KEYS[loss] == defaults
        assert resolve_loss_config(loss, None) == check_loss_config(loss)
    assert LOSS_CONFIG["cispo"] == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    for loss in ("ppo", "cispo"):
        for good in ({"clip_low_threshold": 0}, {"clip_low_threshold": 1, "clip_high_threshold": 1}):
            assert resolve_loss_config(loss, good) == check_loss_config(loss, good)
        for bad in ({"clip_low_threshold": -0.1}, {"clip_low_threshold": 1.1}, {"clip_high_threshold": 0.9}):
            with pytest.raises(ValueError):
                check_loss_config(loss, bad)
            with pytest.raises(ValueError):
                resolve_loss_config(loss, bad)


@pytest.mark.parametrize("loss", ["importance_sampling", "dro"])
def test_importance_sampling_and_dro_never_clip(loss) -> None:
    assert not clipped_mask(loss, np.array([0.01, 1.0, 50.0]), np.array([1.0, -1.0, 1.0])).any()


def test_defaults_and_overrides() -> None:
    assert check_loss_config("importance_sampling") == {}
    assert check_loss_config("ppo") == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert check_loss_config("cispo") == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert check_loss_config("cispo", {"clip_high_threshold": 1.28}) == {"clip_low_threshold": 0.0,
                                                                         "clip_high_threshold": 1.28}
    assert check_loss_config("ppo", {"clip_low_threshold": 0}) == {"clip_low_threshold": 0.0,
                                                                   "clip_high_threshold": 1.2}
    assert check_loss_config("dro", {"beta": 0}) == {"beta": 0.0}


def test_unknown_loss_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="unknown loss 'reinforce'; the policy losses are importance_sampling, "
                                         "ppo, cispo, dro"):
        check_loss_config("reinforce")


@pytest.mark.parametrize(
    "loss, config, message",
    [
        ("ppo", {"beta": 0.1}, "key 'beta' is not taken by loss 'ppo', which takes clip_low_threshold, "
                               "clip_high_threshold"),
        ("dro", {"clip_low_threshold": 0.8}, "key 'clip_low_threshold' is not taken by loss 'dro', which takes "
                                             "beta"),
        ("importance_sampling", {"clip_low_threshold": 0.8}, "not taken by loss 'importance_sampling', which "
                                                             "takes no keys"),
    ],
)
def test_a_key_the_loss_does_not_take_names_the_loss_and_its_keys(loss, config, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_loss_config(loss, config)


@pytest.mark.parametrize(
    "config",
    [
        {"clip_low_threshold": 1.2, "clip_high_threshold": 0.8},  # swapped
        {"clip_low_threshold": 1.1},  # low above 1
        {"clip_high_threshold": 0.9},  # high below 1
        {"clip_low_threshold": -0.2},  # low negative (0 is accepted: no lower bound)
    ],
)
@pytest.mark.parametrize("loss", ["ppo", "cispo"])
def test_clip_bounds_in_the_wrong_order_are_refused(loss, config) -> None:
    with pytest.raises(ValueError, match=rf"clip bounds of '{loss}' must satisfy 0 <= clip_low_threshold <= 1 <= "
                                         "clip_high_threshold"):
        check_loss_config(loss, config)


@pytest.mark.parametrize("value", ["0.2", True, float("nan"), None])
def test_values_must_be_finite_numbers(value) -> None:
    with pytest.raises(ValueError, match=r"loss_fn_config\['clip_low_threshold'\] must be a finite number"):
        check_loss_config("ppo", {"clip_low_threshold": value})


def test_negative_beta_is_refused() -> None:
    with pytest.raises(ValueError, match="beta of 'dro' must be >= 0"):
        check_loss_config("dro", {"beta": -0.1})


def test_the_loop_config_refuses_the_same_before_any_request() -> None:
    with pytest.raises(ValueError, match="not taken by loss 'cispo'"):
        GRPOConfig(loss_fn="cispo", loss_fn_config={"beta": 1.0}).validate()
    with pytest.raises(ValueError, match="loss_fn must be one of"):
        GRPOConfig(loss_fn="reinforce").validate()
    GRPOConfig(loss_fn="ppo", loss_fn_config={"clip_high_threshold": 1.28}).validate()


# ------------------------------------------------------------------------------------------------ the recipes
TINY = ["--backend", "offline", "--base-model", "offline/tiny", "--lora-rank", "8", "--batch-size", "2",
        "--group-size", "2", "--max-tokens", "8", "--steps", "2", "--no-swanlab"]


@pytest.fixture
def offline_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIO_OFFLINE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("loss", ["ppo", "cispo"])
def test_grpo_recipe_trains_with_the_loss(loss, offline_home, capsys) -> None:
    from trio_helpers.recipes import grpo

    code = grpo.main([*TINY, "--loss-fn", loss, "--loss-config", "clip_high_threshold=1.28", "--pipeline",
                      "--max-staleness", "1", "--run-dir", "runs/g"])
    assert code == 0, capsys.readouterr().err
    config = json.loads((offline_home / "runs/g/config.json").read_text())
    assert config["loss_fn"] == loss and config["loss_fn_config"] == {"clip_high_threshold": 1.28}
    rows = _rows(offline_home / "runs/g")
    assert [r["step"] for r in rows] == [0, 1]
    trained = [r for r in rows if r["train/datums"] > 0]
    assert all(0.0 <= r["train/clip_frac"] <= 1.0 and r["train/ratio_max"] > 0 for r in trained)


@pytest.mark.parametrize("loss", ["ppo", "cispo"])
def test_opd_recipe_trains_with_the_loss(loss, offline_home, capsys) -> None:
    from trio_helpers.recipes import opd

    code = opd.main([*TINY, "--loss-fn", loss, "--run-dir", "runs/o", "--sample-size", "4"])
    assert code == 0, capsys.readouterr().err
    config = json.loads((offline_home / "runs/o/config.json").read_text())
    assert config["loss_fn"] == loss and config["loss_fn_config"] is None
    rows = _rows(offline_home / "runs/o")
    assert [r["step"] for r in rows] == [0, 1] and all(r["train/datums"] == 4 for r in rows)
    assert all(0.0 <= r["train/clip_frac"] <= 1.0 for r in rows)


def test_recipe_refuses_a_key_the_loss_does_not_take(offline_home, capsys) -> None:
    from trio_helpers.recipes import grpo

    with pytest.raises(SystemExit) as exc:
        grpo.main([*TINY, "--loss-fn", "ppo", "--loss-config", "beta=0.1"])
    assert exc.value.code == 2
    assert "key 'beta' is not taken by loss 'ppo'" in capsys.readouterr().err
    assert not (offline_home / "runs").exists()  # refused before anything was written

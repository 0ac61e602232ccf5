"""Invariants every chapter states, checked on the objects a chapter's code left behind (for ``make test-service``).

On the real service a model's outputs differ from the committed offline ones, so ``make test-service`` compares no
outputs. Instead, after each chapter has run, :func:`check_namespace` looks at what the chapter computed and checks
what the book says must hold whatever the model: every run's history has the documented metric keys, steps
``0..N-1`` once each and rewards in [0, 1]; every list of ``pytrio.Datum`` passes pytrio's own planner
(``plan_training_batch``); every evaluation table has one row per problem and sample. Each check returns a
message for every violation (an empty list: all good).
"""

from __future__ import annotations

BASE_KEYS = ("step", "completion/tokens_mean", "completion/frac_max_tokens", "train/datums", "train/tokens",
             "train/loss", "train/lr", "sampler/version", "sampler/staleness", "time/step_s")
SCORER_KEYS = {"grpo": ("reward/mean", "reward/frac_degenerate"), "opd": ("kl/teacher_mean", "kl/teacher_std")}


def check_run(name: str, result) -> list[str]:
    """A :class:`trio_helpers.loop.RunResult`: documented keys, contiguous steps, rewards in [0, 1]."""
    problems = []
    history = result.history
    steps = [row.get("step") for row in history]
    if steps != list(range(len(history))):
        problems.append(f"{name}: steps are {steps[:8]}..., not 0..{len(history) - 1} once each")
    scorer = getattr(getattr(result, "scorer", None), "name", None)
    wanted = BASE_KEYS + SCORER_KEYS.get(scorer, ())
    for row in history:
        missing = [k for k in wanted if k not in row]
        if missing:
            problems.append(f"{name}: step {row.get('step')} lacks the documented keys {missing}")
            break
    for row in history:
        r = row.get("reward/mean")
        if r is not None and not (0.0 <= r <= 1.0):
            problems.append(f"{name}: step {row.get('step')} has reward/mean {r}, outside [0, 1]")
    return problems


def check_datums(name: str, data: list, vocab_size: int) -> list[str]:
    """A list of ``pytrio.Datum``: pytrio's planner accepts each datum for the loss its fields imply
    (``importance_sampling`` when it carries logprobs and advantages, else ``cross_entropy``)."""
    from pytrio.client.training_batch import plan_training_batch
    from pytrio.model.limits import TrainingLimits

    problems = []
    for i, datum in enumerate(data):
        keys = set(datum.loss_fn_inputs)
        loss = "importance_sampling" if {"advantages", "logprobs"} <= keys else "cross_entropy"
        try:
            plan_training_batch([datum], loss_fn=loss, auto_shift=False,
                                limits=TrainingLimits(None, None, None), tokenizer_vocab_size=vocab_size)
        except Exception as err:  # noqa: BLE001 - the planner's own verdict is the message
            problems.append(f"{name}[{i}]: pytrio's planner rejects this {loss} datum: "
                            f"{type(err).__name__}: {err}")
    return problems


def check_eval_records(name: str, records: list) -> list[str]:
    """An evaluation table (``trio_helpers.evaluation.evaluate``): one row per (problem, sample)."""
    keys = [(r.get("problem_id"), r.get("sample")) for r in records]
    if len(set(keys)) != len(keys):
        return [f"{name}: {len(keys) - len(set(keys))} duplicate (problem, sample) rows"]
    return []


def check_namespace(namespace: dict, vocab_size: int | None = None) -> tuple[int, list[str]]:
    """Check every run, datum list and evaluation table found among a chapter's variables.

    Returns:
        ``(number of objects checked, problems)``.
    """
    from pytrio import Datum

    from trio_helpers.loop import RunResult

    checked, problems = 0, []
    for name, value in sorted(namespace.items()):
        if name.startswith("_"):
            continue
        if isinstance(value, RunResult):
            checked += 1
            problems += check_run(name, value)
        elif isinstance(value, list) and value and all(isinstance(d, Datum) for d in value):
            checked += 1
            size = vocab_size or _vocab_size(namespace)
            problems += check_datums(name, value, size)
        elif isinstance(value, list) and value and all(isinstance(r, dict) and "problem_id" in r
                                                         and "correct" in r for r in value):
            checked += 1
            problems += check_eval_records(name, value)
    return checked, problems


def _vocab_size(namespace: dict) -> int:
    tok = namespace.get("tokenizer")
    return len(tok) if tok is not None else 2**31 - 1

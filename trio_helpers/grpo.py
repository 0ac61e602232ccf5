"""The synchronous GRPO loop on GSM8K: configuration, one step, and a whole run with logging and checkpoints.

One step (:func:`grpo_step`) refreshes a sampler from the current weights, samples a group of completions for
every prompt of the batch, grades them, turns rewards into group-relative advantages, builds datums and submits
``forward_backward`` and ``optim_step`` back to back. A run (:func:`run_grpo`) repeats it, logs one row of metrics
per step (:class:`trio_helpers.tracking.MetricsLogger`), saves the training state every ``save_every`` steps so an
interrupted run can resume, and ends by saving the weights for a sampler.

The pieces (advantages, degenerate groups, datums, the training call) live in :mod:`trio_helpers.rl`; the
concurrent variants in :mod:`trio_helpers.rollouts` (chapter 05). ``python -m trio_helpers.recipes.grpo`` runs the
same code from the command line.

Introduced in: chapter 04 (notebooks/04_grpo_sync).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from trio_helpers.rl import StepResult, cosine_lr, make_group, rollout_metrics, sample_groups, train_on_groups

LR_SCHEDULES = ("constant", "cosine")
ADVANTAGES = ("mean", "std")
ROLLOUTS = ("sync", "async")
SWANLAB_MODES = ("online", "offline", "disabled")
ADAM_BETAS = (0.9, 0.95)
"""Adam's beta1 and beta2 in every step (the tutorials' values)."""

CHECKPOINTS_FILE = "checkpoints.json"
CONFIG_FILE = "config.json"
RESUME_KEYS = ("base_model", "lora_rank", "batch_size", "group_size", "seed", "all_data", "advantage")
"""Settings a resumed run must share with the run it continues (otherwise it would be a different experiment)."""

RewardFn = Callable[[str, dict], float]
"""``reward_fn(completion_text, record) -> float``."""


@dataclass
class GRPOConfig:
    """Every setting of a GRPO run (the tutorials' flags, plus resume, schedule and rollout choices).

    Attributes:
        base_model: model to fine-tune with LoRA.
        lora_rank: LoRA rank, in [4, 64].
        steps: training steps (ignored with ``all_data``: then one pass over the records).
        batch_size: prompts per step.
        group_size: completions sampled per prompt.
        max_tokens: sampling budget per completion; longer completions are cut off.
        temperature, top_p: sampling parameters.
        seed: seeds the LoRA initialisation and every sampling request (per step and prompt).
        learning_rate: Adam's learning rate (the peak one with ``lr_schedule="cosine"``).
        lr_schedule: ``"constant"`` or ``"cosine"`` (decay to 0 over the run, tutorial C).
        advantage: ``"mean"`` (reward minus group mean, tutorial A) or ``"std"`` (also divided by the group's
            standard deviation, tutorial C).
        skip_degenerate: send no datums for groups whose rewards are all equal.
        all_data: one pass over the records without wrap-around (the last batch may be smaller).
        save_every: ``save_state`` every this many steps (0 = never); needs ``run_dir`` to resume from.
        weights_name: name of the final ``save_weights_for_sampler`` checkpoint.
        run_dir: directory for ``metrics.jsonl``, ``checkpoints.json`` and ``config.json`` (None = memory only).
        swanlab: ``"online"``, ``"offline"`` or ``"disabled"``.
        rollout: ``"sync"`` (one prompt after another) or ``"async"`` (concurrently, chapter 05).
        max_concurrency: sampling requests in flight at once with ``rollout="async"``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    base_model: str = "Qwen/Qwen3.5-4B"
    lora_rank: int = 32
    steps: int = 10
    batch_size: int = 4
    group_size: int = 4
    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 42
    learning_rate: float = 4e-5
    lr_schedule: str = "constant"
    advantage: str = "mean"
    skip_degenerate: bool = True
    all_data: bool = False
    save_every: int = 0
    weights_name: str = "final"
    run_dir: str | None = None
    swanlab: str = "disabled"
    rollout: str = "sync"
    max_concurrency: int = 8

    def validate(self) -> None:
        """Check every field; raises ``ValueError`` naming the field, the value and the fix.

        Introduced in: chapter 04 (notebooks/04_grpo_sync).
        """
        for name in ("steps", "batch_size", "group_size", "max_tokens", "max_concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.save_every, bool) or not isinstance(self.save_every, int) or self.save_every < 0:
            raise ValueError(f"save_every must be an integer >= 0 (0 = never save state), got {self.save_every!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or not 4 <= self.lora_rank <= 64:
            raise ValueError(f"lora_rank must be an integer in [4, 64] (the service's LoRA ranks), got {self.lora_rank!r}")
        if not (isinstance(self.learning_rate, (int, float)) and math.isfinite(self.learning_rate)
                and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be a finite number > 0, got {self.learning_rate!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        for name, allowed in (("lr_schedule", LR_SCHEDULES), ("advantage", ADVANTAGES), ("rollout", ROLLOUTS),
                              ("swanlab", SWANLAB_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {getattr(self, name)!r}")
        if not isinstance(self.base_model, str) or not self.base_model.strip():
            raise ValueError(f"base_model must be a model name such as 'Qwen/Qwen3.5-4B', got {self.base_model!r}")
        if (not isinstance(self.weights_name, str) or not self.weights_name or "/" in self.weights_name
                or self.weights_name.startswith(".")):
            raise ValueError(f"weights_name must be a non-empty name without '/' (e.g. 'final'), got {self.weights_name!r}")
        if self.save_every and self.run_dir is None:
            raise ValueError(f"save_every={self.save_every} needs run_dir: checkpoints.json (the list of saved states "
                             "that resume reads) lives there; set run_dir, e.g. 'runs/grpo'")


def total_steps_for(config: GRPOConfig, n_records: int) -> int:
    """Steps in the run: ``config.steps``, or with ``all_data`` one pass, ``ceil(n_records / batch_size)``.

    Raises:
        ValueError: no records.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if n_records < 1:
        raise ValueError("records is empty: a GRPO run needs at least one problem")
    return math.ceil(n_records / config.batch_size) if config.all_data else config.steps


def batch_for_step(records: Sequence[dict], step: int, batch_size: int, all_data: bool) -> list[tuple[int, dict]]:
    """The ``(record index, record)`` pairs of one step's batch.

    Without ``all_data`` batches run through the records in order and wrap around (step ``s`` takes indices
    ``s*B .. s*B+B-1`` modulo the number of records), so any number of steps works. With ``all_data`` there is
    no wrap-around: the last batch holds what is left, and a step past the end is an error.

    Raises:
        ValueError: negative step or batch size < 1, no records, or (``all_data``) a step past the last batch.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    n = len(records)
    if n == 0:
        raise ValueError("records is empty: a GRPO run needs at least one problem")
    if step < 0 or batch_size < 1:
        raise ValueError(f"step must be >= 0 and batch_size >= 1, got step={step}, batch_size={batch_size}")
    start = step * batch_size
    if all_data:
        if start >= n:
            raise ValueError(f"step {step} is past the end of the data: with all_data, {n} records make "
                             f"{math.ceil(n / batch_size)} steps of batch_size {batch_size}")
        return [(i, records[i]) for i in range(start, min(start + batch_size, n))]
    return [((start + j) % n, records[(start + j) % n]) for j in range(batch_size)]


def request_seed(seed: int, step: int, prompt_index: int) -> int:
    """A sampling seed for one request, a deterministic mix of ``(seed, step, prompt_index)`` below ``2**31``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    return int(np.random.SeedSequence([seed, step, prompt_index]).generate_state(1)[0] & 0x7FFFFFFF)


def sampling_params_for(config: GRPOConfig, step: int, prompt_index: int, stop=None):
    """``SamplingParams`` of one prompt's request: the config's budget and temperature, a seed per request.

    Seeding every request by ``(config.seed, step, prompt_index)`` makes a run reproducible whatever order requests
    complete in, and makes a resumed run sample exactly what the interrupted one would have.

    Args:
        config: the run's settings.
        step, prompt_index: which request.
        stop: stop token ids or strings (``trio_helpers.prompts.stop_token_ids(tokenizer)``).

    Returns:
        ``pytrio.SamplingParams``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    import pytrio as trio

    return trio.SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, top_p=config.top_p,
                               seed=request_seed(config.seed, step, prompt_index), stop=stop)


def learning_rate_at(config: GRPOConfig, step: int, total_steps: int) -> float:
    """The learning rate of ``step``: constant, or cosine-decayed over ``total_steps``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if config.lr_schedule == "cosine":
        return cosine_lr(step, total_steps, config.learning_rate)
    return float(config.learning_rate)


def gsm8k_reward(text: str, record: dict) -> float:
    """1.0 when the last ``\\boxed{}`` of ``text`` equals the record's gold answer, else 0.0 (chapter 02's grader).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    from trio_helpers.grading import extract_gsm8k_answer, grade_answer

    return float(grade_answer(text, extract_gsm8k_answer(record["answer"])))


def batch_prompts(tokenizer, records_batch: Sequence[tuple[int, dict]]) -> list:
    """The chat prompts (``pytrio.ModelInput``) of a batch, chapter 01's one-shot GSM8K format.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    from trio_helpers.prompts import build_prompt, gsm8k_messages

    return [build_prompt(tokenizer, gsm8k_messages(record["question"])) for _, record in records_batch]


def grade_groups(records_batch, prompts, sequences, advantage: str = "mean", reward_fn: RewardFn | None = None) -> list:
    """Grade each prompt's completions and compute their group advantages.

    Args:
        records_batch: the batch's ``(index, record)`` pairs.
        prompts: their prompts.
        sequences: one list of ``SampleSequence`` per prompt.
        advantage: ``"mean"`` or ``"std"``.
        reward_fn: ``reward_fn(text, record)``; default :func:`gsm8k_reward`.

    Returns:
        One :class:`trio_helpers.rl.Group` per prompt, in batch order.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    reward_fn = reward_fn or gsm8k_reward
    return [
        make_group(i, prompt, seqs, lambda text, rec=record: reward_fn(text, rec), normalize=advantage)
        for i, ((_, record), prompt, seqs) in enumerate(zip(records_batch, prompts, sequences))
    ]


def _rollouts_module():
    """``trio_helpers.rollouts`` (chapter 05), or an ImportError that says what to do instead."""
    try:
        from trio_helpers import rollouts
    except ImportError as err:
        raise ImportError("rollout='async' needs trio_helpers.rollouts (chapter 05), which is not available here; "
                          "use rollout='sync'") from err
    if not hasattr(rollouts, "sample_groups_async"):
        raise ImportError("trio_helpers.rollouts has no sample_groups_async yet; use rollout='sync'")
    return rollouts


def grpo_step(
    training_client,
    records_batch: Sequence[tuple[int, dict]],
    config: GRPOConfig,
    step: int,
    tokenizer,
    *,
    total_steps: int | None = None,
    reward_fn: RewardFn | None = None,
) -> StepResult:
    """One synchronous GRPO step: refresh the sampler, sample, grade, compute advantages, build datums, train.

    Args:
        training_client: the ``TrainingClient`` being trained.
        records_batch: the step's ``(index, record)`` pairs (:func:`batch_for_step`).
        config: the run's settings.
        step: 0-based step index (seeds the sampling requests and the learning-rate schedule).
        tokenizer: the model's tokenizer (``training_client.get_tokenizer()``).
        total_steps: length of the run, for the cosine schedule (default ``config.steps``).
        reward_fn: ``reward_fn(text, record)``; default :func:`gsm8k_reward`.

    Returns:
        :class:`trio_helpers.rl.StepResult`: the graded groups and the step's metrics (rollout statistics from
        :func:`trio_helpers.rl.rollout_metrics`, training statistics from :func:`trio_helpers.rl.train_on_groups`,
        ``lr``, and wall-clock times ``time/refresh_s``, ``time/sample_s``, ``time/train_s``, ``time/step_s``).

    Raises:
        ValueError: an invalid config; ImportError: ``rollout="async"`` without :mod:`trio_helpers.rollouts`.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    import pytrio as trio

    from trio_helpers.prompts import stop_token_ids

    config.validate()
    t0 = time.perf_counter()
    sampler = training_client.save_weights_and_get_sampling_client()  # current weights: on-policy sampling
    t1 = time.perf_counter()
    prompts = batch_prompts(tokenizer, records_batch)
    stop = stop_token_ids(tokenizer)

    def params_for(i: int):
        return sampling_params_for(config, step, i, stop=stop)

    if config.rollout == "async":
        rollouts = _rollouts_module()
        sequences = rollouts.run_sync(rollouts.sample_groups_async(
            sampler, prompts, config.group_size, params_for, max_concurrency=config.max_concurrency, progress=False))
    else:
        sequences = sample_groups(sampler, prompts, config.group_size, params_for)
    groups = grade_groups(records_batch, prompts, sequences, config.advantage, reward_fn)
    t2 = time.perf_counter()
    lr = learning_rate_at(config, step, total_steps or config.steps)
    adam = trio.AdamParams(learning_rate=lr, beta1=ADAM_BETAS[0], beta2=ADAM_BETAS[1])
    train = train_on_groups(training_client, groups, adam, skip_degenerate=config.skip_degenerate)
    t3 = time.perf_counter()
    metrics = {**rollout_metrics(groups, config.max_tokens), **train, "lr": lr,
               "time/refresh_s": t1 - t0, "time/sample_s": t2 - t1, "time/train_s": t3 - t2, "time/step_s": t3 - t0}
    return StepResult(metrics=metrics, groups=groups)


# ------------------------------------------------------------------------------------------------ runs, checkpoints
@dataclass
class GRPOResult:
    """What a run returns.

    Attributes:
        history: one dict per step (``{"step": s, **metrics}``), steps 0..N-1, including the steps done before a
            resume (read back from ``metrics.jsonl``).
        final_path: the ``save_weights_for_sampler`` path of the final weights (load it with
            ``service.create_sampling_client(base_model, model_path=final_path)``).
        checkpoints: ``[{"step": completed_steps, "path": save_state_path}, ...]`` of this run directory.
        start_step: 0 for a fresh run, the checkpoint's step for a resumed one.
        run_dir: the run directory (or None).
        training_client: the trained ``TrainingClient`` (e.g. to keep training or sampling).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    history: list[dict]
    final_path: str | None
    checkpoints: list[dict] = field(default_factory=list)
    start_step: int = 0
    run_dir: str | None = None
    training_client: object = field(default=None, repr=False)


@dataclass
class RunState:
    """The moving parts of a run between :func:`open_run` and :func:`finish_run` (shared with chapter 05's loops).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    config: GRPOConfig
    training_client: object
    tokenizer: object
    logger: object
    start_step: int
    total_steps: int
    run_dir: Path | None
    checkpoints: list[dict]
    owns_logger: bool


def read_checkpoints(run_dir: str | os.PathLike) -> list[dict]:
    """The saved states listed in ``run_dir/checkpoints.json`` (oldest first); ``[]`` if there is none.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    path = Path(run_dir) / CHECKPOINTS_FILE
    if not path.exists():
        return []
    return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # atomic: an interruption never leaves half a file


def open_run(service, records: Sequence[dict], config: GRPOConfig, logger=None, resume: bool = False) -> RunState:
    """Create (or, with ``resume``, restore) the training client, the logger and the run directory.

    A fresh run creates a LoRA training client seeded with ``config.seed`` and writes ``config.json``; it
    replaces an existing ``metrics.jsonl``/``checkpoints.json`` in ``run_dir``. A resumed run reads the last entry
    of ``checkpoints.json``, restores weights *and* Adam's state with
    ``create_training_client_from_state_with_optimizer``, continues at that entry's step, and drops logged rows of
    later steps (they are redone), so ``metrics.jsonl`` ends up with each step exactly once.

    Raises:
        ValueError: invalid config or records; ``resume`` without ``run_dir``, without a checkpoint, or with
            settings (``RESUME_KEYS``) that differ from the saved ``config.json``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    from trio_helpers.tracking import MetricsLogger

    config.validate()
    if config.rollout == "async":
        _rollouts_module()  # fail before any client is created
    records = list(records)
    if records and not all(isinstance(r, dict) and "question" in r and "answer" in r for r in records[:1]):
        raise ValueError("records must be GSM8K-style dicts with 'question' and 'answer' (trio_helpers.data.load_gsm8k)")
    total = total_steps_for(config, len(records))
    run_dir = Path(config.run_dir) if config.run_dir is not None else None
    if resume:
        if run_dir is None:
            raise ValueError("resume=True needs config.run_dir: the run directory holds checkpoints.json and metrics.jsonl")
        checkpoints = read_checkpoints(run_dir)
        if not checkpoints:
            raise ValueError(f"resume=True, but run_dir {str(run_dir)!r} has no saved state in {CHECKPOINTS_FILE}; "
                             "start the run with save_every > 0, or pass resume=False to start fresh")
        saved = json.loads((run_dir / CONFIG_FILE).read_text(encoding="utf-8")) if (run_dir / CONFIG_FILE).exists() else {}
        changed = {k: (saved[k], getattr(config, k)) for k in RESUME_KEYS if k in saved and saved[k] != getattr(config, k)}
        if changed:
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in changed.items())
            raise ValueError(f"cannot resume run_dir {str(run_dir)!r} with different settings ({detail}); use the "
                             "saved settings, or a new run_dir with resume=False")
        last = checkpoints[-1]
        training_client = service.create_training_client_from_state_with_optimizer(last["path"])
        start = int(last["step"])
    else:
        checkpoints = []
        training_client = service.create_lora_training_client(config.base_model, rank=config.lora_rank, seed=config.seed)
        start = 0
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            _write_json(run_dir / CHECKPOINTS_FILE, [])
    if run_dir is not None:
        _write_json(run_dir / CONFIG_FILE, asdict(config))
    owns = logger is None
    if owns:
        logger = MetricsLogger(run_dir, swanlab=config.swanlab, config=asdict(config), resume=resume)
    if resume and hasattr(logger, "truncate"):
        logger.truncate(start)
    return RunState(config, training_client, training_client.get_tokenizer(), logger, start, total, run_dir,
                    checkpoints, owns)


def record_step(run: RunState, step: int, metrics: dict) -> dict:
    """Log one finished step and, every ``save_every`` steps, save the training state and list it.

    Returns:
        The logged row.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    row = run.logger.log(step, metrics)
    done = step + 1
    every = run.config.save_every
    if every and done % every == 0 and done < run.total_steps:
        save_checkpoint(run, done)
    return row


def save_checkpoint(run: RunState, done: int) -> dict:
    """``save_state`` after ``done`` completed steps (weights + optimizer) and append it to ``checkpoints.json``.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    path = run.training_client.save_state(f"step-{done:06d}").result().path
    entry = {"step": done, "path": path}
    run.checkpoints.append(entry)
    if run.run_dir is not None:
        _write_json(run.run_dir / CHECKPOINTS_FILE, run.checkpoints)
    return entry


def finish_run(run: RunState) -> GRPOResult:
    """Save the final state (when checkpointing is on, so the run can be extended later) and the final sampler
    weights, close the logger if the run created it, and return the result.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if run.config.save_every and (not run.checkpoints or run.checkpoints[-1]["step"] != run.total_steps):
        save_checkpoint(run, run.total_steps)
    final = run.training_client.save_weights_for_sampler(run.config.weights_name).result().path
    history = sorted(run.logger.history(), key=lambda r: r["step"])
    if run.owns_logger:
        run.logger.close()
    return GRPOResult(history=history, final_path=final, checkpoints=list(run.checkpoints), start_step=run.start_step,
                      run_dir=str(run.run_dir) if run.run_dir is not None else None,
                      training_client=run.training_client)


def run_grpo(
    service,
    records: Sequence[dict],
    config: GRPOConfig,
    logger=None,
    resume: bool = False,
    progress: bool = True,
    *,
    reward_fn: RewardFn | None = None,
    on_step: Callable[[dict], None] | None = None,
) -> GRPOResult:
    """Run synchronous GRPO: :func:`grpo_step` for every step, logged, checkpointed, resumable.

    Args:
        service: a ``ServiceClient`` (``trio_helpers.connect()``).
        records: GSM8K-style ``{"question", "answer"}`` records (``trio_helpers.data.load_gsm8k``).
        config: the run's settings (validated first).
        logger: where metrics go; default a :class:`trio_helpers.tracking.MetricsLogger` on ``config.run_dir``
            (memory only without one), mirrored to SwanLab per ``config.swanlab``.
        resume: continue from the last state in ``config.run_dir/checkpoints.json`` (see :func:`open_run`).
        progress: show a ``tqdm.auto`` progress bar over the steps.
        reward_fn: ``reward_fn(text, record)``; default :func:`gsm8k_reward`.
        on_step: called with each logged row (e.g. to print a line per step).

    Returns:
        :class:`GRPOResult` (history of every step, final sampler weights path, checkpoints).

    Raises:
        ValueError: invalid config, empty records, or an impossible resume (see :func:`open_run`).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    from tqdm.auto import tqdm

    run = open_run(service, records, config, logger=logger, resume=resume)
    records = list(records)
    bar = tqdm(total=run.total_steps, initial=run.start_step, desc="GRPO", unit="step", disable=not progress)
    try:
        for step in range(run.start_step, run.total_steps):
            batch = batch_for_step(records, step, config.batch_size, config.all_data)
            result = grpo_step(run.training_client, batch, config, step, run.tokenizer,
                               total_steps=run.total_steps, reward_fn=reward_fn)
            row = record_step(run, step, result.metrics)
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward']:.3f}", degenerate=f"{row['frac_degenerate']:.2f}")
            if on_step is not None:
                on_step(row)
    except BaseException:
        if run.owns_logger:
            run.logger.close()
        raise
    finally:
        bar.close()
    return finish_run(run)


def config_from_dict(values: dict) -> GRPOConfig:
    """A :class:`GRPOConfig` from a dict (e.g. a saved ``config.json``), ignoring unknown keys.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    names = {f.name for f in fields(GRPOConfig)}
    return GRPOConfig(**{k: v for k, v in values.items() if k in names})

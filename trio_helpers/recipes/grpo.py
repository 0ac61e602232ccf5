"""GRPO on GSM8K from the command line: chapter 04's loop (``trio_helpers.grpo.run_grpo``) behind the tutorials' flags.

Examples::

    python -m trio_helpers.recipes.grpo --steps 3 --batch-size 2 --group-size 2 --max-tokens 64 --backend offline
    python -m trio_helpers.recipes.grpo --steps 100 --batch-size 4 --group-size 4 --max-tokens 512 --no-swanlab
    python -m trio_helpers.recipes.grpo --steps 100 --save-every 10 --run-dir runs/gsm8k --resume   # continue

It prints one line per step and, at the end, the path of the final sampler weights. Metrics go to
``RUN_DIR/metrics.jsonl`` (and SwanLab with ``--swanlab``); saved states to ``RUN_DIR/checkpoints.json``.

Introduced in: chapter 04 (notebooks/04_grpo_sync).
"""

from __future__ import annotations

import argparse

from trio_helpers.recipes import int_at_least as _int_at_least
import importlib
import inspect
import math
import sys
import time

from trio_helpers.grpo import ADVANTAGES, LR_SCHEDULES, SWANLAB_MODES, GRPOConfig, run_grpo

DEFAULT_RUN_DIR = "runs/grpo"


# --- argument types: each names what it wants, argparse adds the flag ------------------------------------------
def _lora_rank(text: str) -> int:
    value = _int_at_least(1)(text)
    if not 4 <= value <= 64:
        raise argparse.ArgumentTypeError(f"must be an integer in [4, 64] (the service's LoRA ranks), got {value}")
    return value


def _float_in(name: str, ok, low_desc: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {low_desc}, got {text!r}") from None
        if not math.isfinite(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"must be a number {low_desc}, got {text}")
        return value

    parse.__name__ = name
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The recipe's argument parser (defaults from :class:`trio_helpers.grpo.GRPOConfig`).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    d = GRPOConfig()
    p = argparse.ArgumentParser(
        prog="python -m trio_helpers.recipes.grpo",
        description="GRPO on GSM8K with PyTRIO (chapter 04 of the book); the same loop as the chapter.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    pos = _int_at_least(1)
    p.add_argument("--steps", type=pos, default=d.steps, help="training steps (ignored with --all-data)")
    p.add_argument("--batch-size", type=pos, default=d.batch_size, help="prompts per step")
    p.add_argument("--group-size", type=pos, default=d.group_size, help="completions per prompt")
    p.add_argument("--max-tokens", type=pos, default=d.max_tokens, help="sampling budget per completion")
    p.add_argument("--base-model", default=d.base_model, help="model to fine-tune with LoRA")
    p.add_argument("--lora-rank", type=_lora_rank, default=d.lora_rank, help="LoRA rank, 4..64")
    p.add_argument("--learning-rate", type=_float_in("positive number", lambda v: v > 0, "> 0"),
                   default=d.learning_rate, help="Adam learning rate (peak, with --lr-schedule cosine)")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=d.lr_schedule, help="learning-rate schedule")
    p.add_argument("--temperature", type=_float_in("number >= 0", lambda v: v >= 0, ">= 0"),
                   default=d.temperature, help="sampling temperature")
    p.add_argument("--top-p", type=_float_in("number in (0, 1]", lambda v: 0 < v <= 1, "in (0, 1]"),
                   default=d.top_p, help="nucleus sampling threshold")
    p.add_argument("--seed", type=_int_at_least(0), default=d.seed, help="seed of the adapter and of every request")
    p.add_argument("--advantage", choices=ADVANTAGES, default=d.advantage,
                   help="'mean': reward - group mean; 'std': also divided by the group's std")
    p.add_argument("--keep-degenerate", action="store_true",
                   help="send datums of groups whose rewards are all equal (zero advantage) instead of skipping them")
    p.add_argument("--all-data", action="store_true", help="one pass over the training split, no wrap-around")
    p.add_argument("--swanlab", nargs="?", const="online", default="disabled", choices=SWANLAB_MODES,
                   help="log to SwanLab: online (needs `swanlab login`), offline (sync later) or disabled")
    p.add_argument("--no-swanlab", dest="swanlab", action="store_const", const="disabled", help="no SwanLab logging")
    p.add_argument("--weights-name", default=d.weights_name, help="name of the final sampler weights")
    p.add_argument("--backend", choices=("offline", "remote", "auto"), default=None,
                   help="service backend (default: $TRIO_BACKEND, else auto)")
    p.add_argument("--async", dest="use_async", action="store_true",
                   help="sample each step's prompts concurrently (chapter 05, trio_helpers.rollouts)")
    p.add_argument("--pipeline", action="store_true",
                   help="sample step t+1 while step t trains (chapter 05, trio_helpers.rollouts.run_grpo_pipelined)")
    p.add_argument("--max-concurrency", type=pos, default=d.max_concurrency,
                   help="sampling requests in flight with --async")
    p.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help="directory for metrics.jsonl and checkpoints.json")
    p.add_argument("--save-every", type=_int_at_least(0), default=d.save_every,
                   help="save the training state every N steps (0 = never)")
    p.add_argument("--resume", action="store_true", help="continue from the last saved state in --run-dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown on a terminal)")
    return p


def config_from_args(args: argparse.Namespace) -> GRPOConfig:
    """The :class:`trio_helpers.grpo.GRPOConfig` that parsed arguments describe.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    return GRPOConfig(
        base_model=args.base_model, lora_rank=args.lora_rank, steps=args.steps, batch_size=args.batch_size,
        group_size=args.group_size, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        seed=args.seed, learning_rate=args.learning_rate, lr_schedule=args.lr_schedule, advantage=args.advantage,
        skip_degenerate=not args.keep_degenerate, all_data=args.all_data, save_every=args.save_every,
        weights_name=args.weights_name, run_dir=args.run_dir, swanlab=args.swanlab,
        rollout="async" if args.use_async else "sync", max_concurrency=args.max_concurrency,
    )


def step_line(row: dict, total: int) -> str:
    """One printed line per step (rewards, degenerate share, datums, tokens, loss, learning rate, time).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    loss = row.get("loss")
    loss_text = f"{loss:8.4f}" if isinstance(loss, float) else f"{'-':>8}"
    width = len(str(total))
    return (f"step {row['step'] + 1:>{width}}/{total}  reward {row['reward']:.3f}  "
            f"degenerate {row['frac_degenerate']:.2f}  datums {int(row['datums']):>4}  "
            f"train tokens {int(row['train_tokens']):>7} (skipped {int(row['train_tokens_skipped']):>7})  "
            f"loss {loss_text}  lr {row['lr']:.2e}  {row['time/step_s']:.1f}s")


def _pipelined_runner():
    try:
        rollouts = importlib.import_module("trio_helpers.rollouts")
    except ImportError:
        return None
    return getattr(rollouts, "run_grpo_pipelined", None)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run GRPO, print a line per step and the final weights path; returns the exit status.

    Flag errors exit with status 2 and a message naming the flag (argparse); a run that cannot start (e.g.
    ``--resume`` without a saved state) exits with status 1.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(args)
    try:
        config.validate()
    except ValueError as err:
        parser.error(str(err))
    if args.use_async or args.pipeline:
        try:
            rollouts = importlib.import_module("trio_helpers.rollouts")
        except ImportError:
            rollouts = None
        if args.use_async and not hasattr(rollouts, "sample_groups_async"):
            parser.error("--async needs trio_helpers.rollouts.sample_groups_async (chapter 05), which is not "
                         "available in this installation; run without --async")
        if args.pipeline and _pipelined_runner() is None:
            parser.error("--pipeline needs trio_helpers.rollouts.run_grpo_pipelined (chapter 05), which is not "
                         "available in this installation; run without --pipeline")

    from trio_helpers import connect
    from trio_helpers.data import load_gsm8k

    start = time.perf_counter()
    service = connect(args.backend)
    source = "offline" if getattr(service, "backend", None) == "offline" else "auto"
    records = load_gsm8k("train", source=source)
    total = math.ceil(len(records) / config.batch_size) if config.all_data else config.steps
    progress = not args.no_progress and sys.stderr.isatty()

    def on_step(row: dict) -> None:
        line = step_line(row, total)
        if progress:
            from tqdm.auto import tqdm

            tqdm.write(line)
        else:
            print(line, flush=True)

    runner = run_grpo
    if args.pipeline:
        runner = _pipelined_runner()
    kwargs = {"resume": args.resume, "progress": progress, "on_step": on_step}
    accepted = inspect.signature(runner).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    print(f"GRPO: {config.base_model}, {total} steps x {config.batch_size} prompts x {config.group_size} samples, "
          f"max_tokens {config.max_tokens}, lr {config.learning_rate:g} ({config.lr_schedule}), "
          f"advantage {config.advantage}, rollout {'pipelined' if args.pipeline else config.rollout}"
          + (", resuming" if args.resume else ""), flush=True)
    try:
        result = runner(service, records, config, **kwargs)
    except ValueError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    rewards = [row["reward"] for row in result.history]
    k = min(5, len(rewards))
    if rewards:
        print(f"mean reward: first {k} steps {sum(rewards[:k]) / k:.3f}, last {k} steps {sum(rewards[-k:]) / k:.3f}")
    sent = sum(row["train_tokens"] for row in result.history)
    skipped = sum(row["train_tokens_skipped"] for row in result.history)
    print(f"training tokens sent {int(sent)}, saved by skipping degenerate groups {int(skipped)}")
    print(f"metrics: {config.run_dir}/metrics.jsonl")
    if result.checkpoints:
        print(f"last saved state (resume with --resume --run-dir {config.run_dir}): {result.checkpoints[-1]['path']}")
    print(f"total time {time.perf_counter() - start:.1f}s")
    print(f"final weights: {result.final_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

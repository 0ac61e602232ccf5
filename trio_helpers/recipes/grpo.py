"""GRPO on GSM8K from the command line: chapter 04's loop behind the *GRPO* example's flags.

Examples::

    python -m trio_helpers.recipes.grpo --steps 3 --batch-size 2 --group-size 2 --max-tokens 64 --backend offline
    python -m trio_helpers.recipes.grpo --steps 100 --batch-size 4 --group-size 4 --max-tokens 512 --no-swanlab
    python -m trio_helpers.recipes.grpo --steps 100 --save-every 10 --run-dir runs/gsm8k --resume   # continue
    python -m trio_helpers.recipes.grpo --env calculator --base-model offline/tool --steps 3 --backend offline

It prints one line per step (steps are 0-based, as in ``metrics.jsonl``) and, at the end, the path of the final
sampler weights. Metrics go to ``RUN_DIR/metrics.jsonl`` (and SwanLab with ``--swanlab``); saved states to
``RUN_DIR/checkpoints.json``. Exit statuses: see :mod:`trio_helpers.recipes`.

Introduced in: chapter 04 (notebooks/04_grpo_sync).
"""

from __future__ import annotations

import argparse
import sys
import time

from trio_helpers.grpo import ADVANTAGES, GRPOConfig, GRPOScorer, run_grpo
from trio_helpers.loop import total_steps_for
from trio_helpers.recipes import (
    check_settings,
    connect_from_args,
    int_at_least,
    load_data,
    loop_parser,
    print_dry_run,
    print_run_end,
    run_and_report,
)

DEFAULT_RUN_DIR = "runs/grpo"


def build_parser() -> argparse.ArgumentParser:
    """The recipe's argument parser: the loop's shared flags plus GRPO's (defaults from :class:`GRPOConfig`).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    d = GRPOConfig()
    p = loop_parser("python -m trio_helpers.recipes.grpo",
                    "GRPO on GSM8K with PyTRIO (chapter 04 of the book); the same loop as the chapter.", d,
                    DEFAULT_RUN_DIR)
    g = p.add_argument_group("GRPO")
    g.add_argument("--advantage", choices=ADVANTAGES, default=d.advantage,
                   help="'mean': reward - group mean; 'std': also divided by the group's std; 'none': raw reward")
    from trio_helpers.grpo import OVERLONG

    g.add_argument("--overlong", choices=OVERLONG, default=d.overlong,
                   help="completions cut off at --max-tokens: keep, drop from the loss, or DAPO's soft penalty")
    g.add_argument("--overlong-buffer", type=int_at_least(0), default=d.overlong_buffer,
                   help="with --overlong penalty: the penalty ramps to -1 over this many last tokens")
    from trio_helpers.grpo import ENVIRONMENTS

    g.add_argument("--env", choices=tuple(ENVIRONMENTS), default=d.env,
                   help="sample each group member as a multi-turn episode with this tool environment "
                        "(chapter 12); --max-tokens then bounds each model turn")
    g.add_argument("--max-turns", type=int_at_least(2), default=d.max_turns,
                   help="with --env: model turns per episode (the calculator answers max-turns - 1 calls)")
    g.add_argument("--keep-degenerate", action="store_true",
                   help="send datums of groups whose rewards are all equal (zero advantage) instead of skipping")
    return p


def config_from_args(args: argparse.Namespace) -> GRPOConfig:  # noqa: F811 - the recipe's own mapping
    """The :class:`GRPOConfig` that parsed arguments describe.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    from trio_helpers.recipes import config_from_args as shared

    return shared(args, GRPOConfig, skip_degenerate=not args.keep_degenerate)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run GRPO, print a line per step and the final weights path; returns the exit status.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(args)
    check_settings(parser, args, config, "grpo")
    parser._resumable, parser._run_dir = bool(config.save_every), config.run_dir
    if args.dry_run:
        from trio_helpers.data import load_gsm8k

        print_dry_run(config, load_gsm8k("train", source="offline"), run_grpo, GRPOScorer(config).prompt)
        return 0

    from trio_helpers.data import load_gsm8k

    start = time.perf_counter()
    service = connect_from_args(parser, args, argv)
    records = load_data(parser, lambda: load_gsm8k("train"), "GSM8K train split, --backend")
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    total = total_steps_for(config, len(records))
    print(f"GRPO: {config.base_model}, {total} steps x {config.batch_size} prompts x {config.group_size} "
          f"samples, max_tokens {config.max_tokens}, lr {config.learning_rate:g} ({config.lr_schedule}), "
          f"advantage {config.advantage}, rollout {config.rollout}" + (", resuming" if args.resume else ""),
          flush=True)
    result, status = run_and_report(parser, argv, lambda: run_grpo(
        service, records, config, resume=args.resume, progress=progress, print_every=1))
    if status:
        return status
    rewards = result.series("reward/mean")
    k = min(5, len(rewards))
    print(f"mean reward: first {k} steps {rewards[:k].mean():.3f}, last {k} steps {rewards[-k:].mean():.3f}")
    sent, skipped = result.series("train/tokens").sum(), result.series("train/tokens_skipped").sum()
    print(f"training tokens sent {int(sent)}, saved by skipping degenerate groups {int(skipped)}")
    print_run_end(result, config, service, start)
    return 0


if __name__ == "__main__":
    sys.exit(main())

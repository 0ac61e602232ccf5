"""On-policy distillation from the command line: chapter 06's loop behind the *On-Policy Distillation* example's
flags.

Examples::

    python -m trio_helpers.recipes.opd --steps 2 --batch-size 2 --group-size 2 --max-tokens 64 --backend offline
    python -m trio_helpers.recipes.opd --steps 10 --batch-size 2 --group-size 2 --num-shards 1 --sample-size 1000
    python -m trio_helpers.recipes.opd --async --sampler-refresh-steps 2 --swanlab offline

Prompts come from DeepMath-103K (``trio_helpers.data.load_deepmath``): on the offline backend the package's
DeepMath-style set, otherwise local parquet shards in ``--data-dir`` or, if they are missing, a download of the
first ``--num-shards`` shards from ModelScope. The loop, its flags, resume and failure handling are GRPO's (one
loop, :mod:`trio_helpers.loop`); only the scorer differs. Exit statuses: see :mod:`trio_helpers.recipes`.

Introduced in: chapter 06 (notebooks/06_opd).
"""

from __future__ import annotations

import argparse
import sys
import time

from trio_helpers.distillation import OPDConfig, OPDScorer, run_opd
from trio_helpers.recipes import (
    check_settings,
    connect_from_args,
    load_data,
    int_at_least,
    loop_parser,
    number_where,
    print_dry_run,
    print_run_end,
    run_and_report,
)

DEFAULT_RUN_DIR = "runs/opd"
NUM_SHARDS = 10  # DeepMath-103K has 10 parquet shards


def build_parser() -> argparse.ArgumentParser:
    """The recipe's argument parser: the loop's shared flags plus the teacher's and the data's.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    d = OPDConfig()
    p = loop_parser("python -m trio_helpers.recipes.opd",
                    "On-policy distillation on DeepMath prompts with PyTRIO (chapter 06 of the book).", d,
                    DEFAULT_RUN_DIR)
    g = p.add_argument_group("distillation")
    g.add_argument("--teacher-base-model", default=d.teacher_base_model, help="the teacher's base model")
    g.add_argument("--teacher-model-path", default=None,
                   help="sampler weights of a fine-tuned teacher (a save_weights_for_sampler path)")
    g.add_argument("--kl-penalty-coef", type=number_where("a number > 0", lambda v: v > 0),
                   default=d.kl_penalty_coef, help="advantage = -coef * (student_logprob - teacher_logprob)")
    g.add_argument("--enable-thinking", action="store_true", help="render prompts with thinking switched on")
    g = p.add_argument_group("data")
    g.add_argument("--sample-size", type=int, default=1000, help="prompts kept after shuffling (<= 0: all)")
    g.add_argument("--num-shards", type=int_at_least(1, NUM_SHARDS), default=1,
                   help="DeepMath-103K parquet shards to use (about 10k problems each)")
    g.add_argument("--data-dir", default="deepmath", help="where the DeepMath shards are (or are downloaded to)")
    return p


def config_from_args(args: argparse.Namespace) -> OPDConfig:
    """The :class:`~trio_helpers.distillation.OPDConfig` that parsed arguments describe.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    from trio_helpers.recipes import config_from_args as shared

    return shared(args, OPDConfig)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, load prompts, run OPD, print a line per step and the final weights path.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(args)
    check_settings(parser, args, config, "opd")
    parser._resumable, parser._run_dir = bool(config.save_every), config.run_dir
    if args.dry_run:
        from trio_helpers.data import load_deepmath

        print_dry_run(config, load_deepmath(sample_size=0, seed=args.seed, source="offline"), run_opd, OPDScorer(config).prompt)
        return 0

    from trio_helpers.data import load_deepmath

    start = time.perf_counter()
    service = connect_from_args(parser, args, argv)
    records = load_data(parser, lambda: load_deepmath(sample_size=args.sample_size, seed=args.seed,
                                                      num_shards=args.num_shards, local_dir=args.data_dir),
                        f"--data-dir {args.data_dir} --num-shards {args.num_shards}")
    if not records:
        parser.error(f"no prompts loaded (--sample-size {args.sample_size}, --num-shards {args.num_shards})")
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    print(f"OPD: student {config.base_model}, teacher {config.teacher_base_model}, {config.steps} steps x "
          f"{config.batch_size} prompts x {config.group_size} samples, max_tokens {config.max_tokens}, "
          f"rollout {config.rollout}" + (", resuming" if args.resume else ""), flush=True)
    result, status = run_and_report(parser, argv, lambda: run_opd(
        service, records, config, resume=args.resume, progress=progress, print_every=1))
    if status:
        return status
    kl = result.series("kl/teacher_mean")
    print(f"reverse KL to the teacher (sampled, per token): first step {kl[0]:.4f}, last step {kl[-1]:.4f}")
    print_run_end(result, config, service, start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""On-policy distillation from the command line: chapter 06's loop (``trio_helpers.distillation.run_opd``).

Examples::

    python -m trio_helpers.recipes.opd --steps 2 --batch-size 2 --group-size 2 --max-tokens 64 --backend offline
    python -m trio_helpers.recipes.opd --steps 10 --batch-size 2 --group-size 2 --num-shards 1 --sample-size 1000
    python -m trio_helpers.recipes.opd --async --sampler-refresh-steps 2 --swanlab-mode offline

Prompts come from DeepMath-103K (``trio_helpers.data.load_deepmath``): on the offline backend the package's
DeepMath-style set, otherwise local parquet shards in ``--data-dir`` or, if they are missing, a download of the
first ``--num-shards`` shards from ModelScope. It prints one line per step and, at the end, the path of the final
sampler weights; metrics go to ``--run-dir``/metrics.jsonl (and SwanLab unless ``--swanlab-mode disabled``).

Introduced in: chapter 06 (notebooks/06_opd).
"""

from __future__ import annotations

import argparse
import math
import time

from trio_helpers.distillation import OPDConfig, config_dict, format_step, run_opd

DEFAULT_RUN_DIR = "runs/opd"
NUM_SHARDS = 10  # DeepMath-103K has 10 parquet shards


def _int_in(low: int, high: int | None = None):
    want = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {want}, got {value}")
        return value

    parse.__name__ = want
    return parse


def _int_any(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _float_where(want: str, ok):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if not math.isfinite(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
        return value

    parse.__name__ = want
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The recipe's argument parser (defaults from :class:`trio_helpers.distillation.OPDConfig`, tutorial B's).

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    from trio_helpers.tracking import SWANLAB_MODES

    d = OPDConfig()
    p = argparse.ArgumentParser(
        prog="python -m trio_helpers.recipes.opd",
        description="On-policy distillation on DeepMath prompts with PyTRIO (chapter 06 of the book).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    pos = _int_in(1)
    p.add_argument("--steps", type=pos, default=d.steps, help="training steps")
    p.add_argument("--batch-size", type=pos, default=d.batch_size, help="prompts per step")
    p.add_argument("--group-size", type=pos, default=d.group_size, help="student completions per prompt")
    p.add_argument("--max-tokens", type=pos, default=d.max_tokens, help="sampling budget per completion")
    p.add_argument("--sample-size", type=_int_any, default=1000,
                   help="prompts kept after shuffling the data (<= 0: all)")
    p.add_argument("--num-shards", type=_int_in(1, NUM_SHARDS), default=1,
                   help=f"DeepMath-103K parquet shards to use (1..{NUM_SHARDS}, about 10k problems each)")
    p.add_argument("--data-dir", default="deepmath", help="where the DeepMath shards are (or are downloaded to)")
    p.add_argument("--base-model", default=d.base_model, help="the student, trained with LoRA")
    p.add_argument("--teacher-base-model", default=d.teacher_base_model, help="the teacher's base model")
    p.add_argument("--teacher-model-path", default=None,
                   help="sampler weights of a fine-tuned teacher (a save_weights_for_sampler path)")
    p.add_argument("--lora-rank", type=_int_in(4, 64), default=d.lora_rank, help="LoRA rank of the student")
    p.add_argument("--learning-rate", type=_float_where("a number > 0", lambda v: v > 0), default=d.learning_rate,
                   help="Adam learning rate")
    p.add_argument("--kl-penalty-coef", type=_float_where("a number > 0", lambda v: v > 0),
                   default=d.kl_penalty_coef, help="advantage = -coef * (student_logprob - teacher_logprob)")
    p.add_argument("--sampler-refresh-steps", type=pos, default=d.sampler_refresh_steps,
                   help="rebuild the student's sampler from its current weights every N steps")
    p.add_argument("--temperature", type=_float_where("a number > 0", lambda v: v > 0), default=d.temperature,
                   help="student sampling temperature")
    p.add_argument("--top-p", type=_float_where("a number in (0, 1]", lambda v: 0 < v <= 1), default=d.top_p,
                   help="nucleus sampling threshold")
    p.add_argument("--top-k", type=_int_any, default=d.top_k, help="top-k sampling (-1: off)")
    p.add_argument("--seed", type=_int_in(0), default=d.seed, help="seed of the data shuffle, adapter and requests")
    p.add_argument("--enable-thinking", action="store_true", help="render prompts with thinking switched on")
    p.add_argument("--async", dest="use_async", action="store_true",
                   help="prompts concurrent, each prompt's teacher scoring concurrent")
    p.add_argument("--max-concurrency", type=pos, default=d.max_concurrency, help="requests in flight with --async")
    p.add_argument("--swanlab-mode", choices=SWANLAB_MODES, default="disabled",
                   help="SwanLab logging: online (needs `swanlab login`), offline (sync later) or disabled")
    p.add_argument("--weights-name", default=d.weights_name, help="name of the final sampler weights")
    p.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help="directory for metrics.jsonl")
    p.add_argument("--backend", choices=("offline", "remote", "auto"), default=None,
                   help="service backend (default: $TRIO_BACKEND, else auto)")
    return p


def config_from_args(args: argparse.Namespace) -> OPDConfig:
    """The :class:`~trio_helpers.distillation.OPDConfig` that parsed arguments describe.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    return OPDConfig(
        base_model=args.base_model, teacher_base_model=args.teacher_base_model,
        teacher_model_path=args.teacher_model_path, lora_rank=args.lora_rank, steps=args.steps,
        batch_size=args.batch_size, group_size=args.group_size, max_tokens=args.max_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        learning_rate=args.learning_rate, kl_penalty_coef=args.kl_penalty_coef,
        sampler_refresh_steps=args.sampler_refresh_steps, enable_thinking=args.enable_thinking,
        rollout="async" if args.use_async else "sync", max_concurrency=args.max_concurrency,
        weights_name=args.weights_name or None,
    )


def main(argv: list[str] | None = None) -> int:
    """Parse flags, load prompts, run OPD, print a line per step and the final weights path.

    Flag errors exit with status 2 and a message naming the flag; a step without datums raises ``RuntimeError``.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(args)
    try:
        config.validate()
    except ValueError as err:
        parser.error(str(err))

    from trio_helpers import connect
    from trio_helpers.data import load_deepmath
    from trio_helpers.tracking import MetricsLogger

    start = time.perf_counter()
    service = connect(args.backend)
    source = "offline" if getattr(service, "backend", None) == "offline" else "auto"
    records = load_deepmath(source=source, sample_size=args.sample_size, seed=args.seed,
                            num_shards=args.num_shards, local_dir=args.data_dir)
    if not records:
        parser.error(f"no prompts loaded (--sample-size {args.sample_size}, --num-shards {args.num_shards})")
    settings = {**config_dict(config), "sample_size": args.sample_size, "num_shards": args.num_shards}
    with MetricsLogger(args.run_dir, swanlab=args.swanlab_mode, project="trio-book-opd", config=settings) as logger:
        result = run_opd(service, records, config, logger=logger,
                         on_step=lambda out: print(format_step(out.metrics, timing=True), flush=True))
    kl = result.series("reverse_kl_mean")
    print(f"reverse KL (sampled, per token): first step {kl[0]:.4f}, last step {kl[-1]:.4f}")
    if result.final_path:
        print(f"final sampler weights: {result.final_path}")
    print(f"metrics: {args.run_dir}/metrics.jsonl; total time {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

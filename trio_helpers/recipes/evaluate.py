"""Evaluate a model on GSM8K from the command line: chapter 07's protocol behind the *GSM8K* example's ``--eval`` flags.

Examples::

    python -m trio_helpers.recipes.evaluate --backend offline --eval-samples 64 --max-tokens 256 --out base.jsonl
    python -m trio_helpers.recipes.evaluate --model-path trio://.../final --eval-samples 256 --compare-to base.jsonl
    python -m trio_helpers.recipes.evaluate --eval-samples 30 --samples-per-problem 8 --temperature 1   # pass@k

It evaluates the first ``--eval-samples`` problems of ``--split`` (the *GSM8K* example's meaning), greedy by default, with
chapter 07's :func:`trio_helpers.evaluation.evaluate`, and prints the accuracy with a bootstrap confidence interval
and the failure counts; with several samples per problem also pass@k; with ``--compare-to`` (records saved earlier
with ``--out``) a paired comparison on the same problems (McNemar's exact test and a paired bootstrap).

Introduced in: chapter 07 (notebooks/07_evaluation).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from trio_helpers.evaluation import (
    accuracy_with_ci,
    format_paired,
    format_summary,
    load_records,
    pass_at_k_curve,
    save_records,
    summary_rows,
)
from trio_helpers.recipes import (DefaultsOnceFormatter, add_backend_flags, check_settings, connect_from_args, load_data,
                                   report_usage)
from trio_helpers.loop import MAX_SEQ_LEN
from trio_helpers.recipes import int_at_least as _int_at_least


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0 = greedy), got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0 = greedy), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The recipe's argument parser.

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    p = argparse.ArgumentParser(
        prog="python -m trio_helpers.recipes.evaluate",
        description="Evaluate a base model or a saved checkpoint on GSM8K (chapter 07 of the book).",
        formatter_class=DefaultsOnceFormatter,
    )
    pos = _int_at_least(1)
    p.add_argument("--base-model", default="Qwen/Qwen3.5-4B", help="the base model (of the checkpoint)")
    p.add_argument("--model-path", default=None,
                   help="a save_weights_for_sampler path to evaluate instead of the base model")
    p.add_argument("--split", choices=("train", "test"), default="test", help="GSM8K split")
    p.add_argument("--data-source", default="auto", choices=("auto", "hf", "modelscope", "local", "offline"),
                   help="where GSM8K comes from (trio_helpers.data.load_gsm8k)")
    p.add_argument("--data-path", default=None, help="local GSM8K folder for --data-source local/modelscope")
    p.add_argument("--eval-samples", type=pos, default=256, help="number of problems: the first N of the split")
    p.add_argument("--samples-per-problem", type=pos, default=1, help="answers per problem (> 1 reports pass@k)")
    p.add_argument("--temperature", type=_temperature, default=None,
                   help="sampling temperature (default: 0, greedy, for one sample; 1 for several)")
    p.add_argument("--max-tokens", type=pos, default=512, help="sampling budget per answer")
    p.add_argument("--max-concurrency", type=pos, default=16, help="requests in flight at once")
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="base of the per-problem sampling seeds")
    p.add_argument("--n-boot", type=_int_at_least(100), default=10_000, help="bootstrap resamples")
    p.add_argument("--compare-to", default=None, help="records (JSONL) of an earlier run on the same problems")
    p.add_argument("--out", default=None, help="write this run's records here (JSONL), and the usage ledger next to it "
                   "(<out stem>.usage.json)")
    p.add_argument("--label", default=None, help="name of this run in the table (default: base or checkpoint)")
    add_backend_flags(p)
    return p


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Cross-flag checks; calls ``parser.error`` (exit status 2) with a message naming the flags.

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    if args.temperature is None:
        args.temperature = 0.0 if args.samples_per_problem == 1 else 1.0
    if args.samples_per_problem > 1 and args.temperature == 0:
        parser.error("--samples-per-problem > 1 with --temperature 0 gives identical greedy answers; "
                     "use --temperature 1 for pass@k")
    if args.compare_to is not None:
        if args.samples_per_problem != 1:
            parser.error("--compare-to compares greedy accuracies: use it with --samples-per-problem 1")
        if not Path(args.compare_to).is_file():
            parser.error(f"--compare-to: no such file {args.compare_to!r} (write one with --out)")
    if args.out is not None and args.compare_to is not None and Path(args.out).resolve() == Path(args.compare_to).resolve():
        parser.error("--out and --compare-to name the same file; the comparison would overwrite its own baseline")
    if args.model_path is not None and not args.model_path.strip():
        parser.error("--model-path is empty; pass the path printed by save_weights_for_sampler, or omit it")
    if args.max_tokens >= MAX_SEQ_LEN:
        parser.error(f"argument --max-tokens: must be < {MAX_SEQ_LEN} (the models' sequence limit, prompt + "
                     f"completion), got {args.max_tokens}")
    if args.out is not None:
        from trio_helpers.tracking import check_writable_dir

        out = Path(args.out)
        if out.is_dir():
            parser.error(f"--out {args.out!r} is a directory; pass a file name for the records, e.g. "
                         f"{str(out / 'records.jsonl')!r}")
        try:
            check_writable_dir(out.parent, "--out folder")
        except ValueError as err:
            parser.error(f"--out {args.out!r}: {err}")


def main(argv: list[str] | None = None) -> int:
    """Run the recipe; returns the exit status (0 ok; argparse exits with 2 on bad flags).

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    validate(parser, args)
    check_settings(parser, args)
    baseline = None
    if args.compare_to is not None:
        try:
            baseline = load_records(args.compare_to)
        except ValueError as err:
            parser.error(f"--compare-to: {err}")

    from trio_helpers.data import load_gsm8k
    from trio_helpers.evaluation import evaluate

    service = connect_from_args(parser, args, argv)
    flags = f"--data-source {args.data_source}" + (f" --data-path {args.data_path}" if args.data_path else "")
    records = load_data(parser, lambda: load_gsm8k(args.split, source=args.data_source, path=args.data_path),
                        flags)[: args.eval_samples]
    if len(records) < args.eval_samples:
        print(f"note: the {args.split} split has only {len(records)} problems; evaluating all of them")
    try:
        sampler = service.create_sampling_client(args.base_model, model_path=args.model_path)
    except Exception as err:  # a bad model name or path: pytrio's ValidationError, one line
        from pytrio.errors.base import PyTrioError

        if not isinstance(err, PyTrioError):
            raise
        print(f"{parser.prog}: error: {(getattr(err, 'message', None) or str(err)).splitlines()[0]}",
              file=sys.stderr)
        return 2
    tokenizer = sampler.get_tokenizer()
    try:
        results = evaluate(sampler, records, tokenizer, max_tokens=args.max_tokens,
                           samples_per_problem=args.samples_per_problem, temperature=args.temperature,
                           max_concurrency=args.max_concurrency, seed=args.seed,
                           progress=args.progress if args.progress is not None else sys.stderr.isatty())
    except Exception as err:  # sampling failed for good (after pytrio's retries and ours): one line
        from pytrio.errors.base import PyTrioError

        from trio_helpers.rollouts import RetriesExhausted

        if not isinstance(err, (PyTrioError, RetriesExhausted)):
            raise
        print(f"{parser.prog}: error: {str(err).splitlines()[0]}; nothing was written, rerun it later",
              file=sys.stderr)
        return 1
    if args.out is not None:
        try:
            save_records(results, args.out)
            print(f"records: {args.out}")
        except OSError as err:
            from trio_helpers.tracking import os_fix

            print(f"{parser.prog}: error: --out {args.out!r}: cannot write it: {err.strerror}; "
                  f"{os_fix(err, '--out')}", file=sys.stderr)
            return 1
    label = args.label or ("checkpoint" if args.model_path else "base")
    print(f"model: {args.base_model}" + (f" @ {args.model_path}" if args.model_path else "")
          + f" | {args.split} problems: {len(records)} | max_tokens {args.max_tokens} | "
          f"temperature {args.temperature:g} | samples/problem {args.samples_per_problem}")
    if args.samples_per_problem == 1:
        runs = {label: results}
        if baseline is not None:
            runs = {"baseline": baseline, **runs}
        print(format_summary(summary_rows(runs, n_boot=args.n_boot, seed=args.seed, interval="auto")))
        if baseline is not None:
            try:
                print(format_paired("baseline", baseline, label, results, n_boot=args.n_boot, seed=args.seed))
            except ValueError as err:
                print(f"error: {err}", file=sys.stderr)
                return 1
    else:
        curve = pass_at_k_curve(results)
        per_problem = accuracy_with_ci(per_problem_accuracy(results), n_boot=args.n_boot, seed=args.seed)
        print(f"pass@1 (mean over problems of the share of correct samples): {per_problem}")
        print("pass@k: " + "  ".join(f"k={k}: {v:.1%}" for k, v in curve.items()))
    usage = Path(args.out).with_name(Path(args.out).stem + ".usage.json") if args.out is not None else None
    try:
        report_usage(service, None, usage)
    except OSError as err:
        print(f"{parser.prog}: error: cannot write {usage}: {err.strerror}", file=sys.stderr)
        return 1
    return 0


def per_problem_accuracy(records) -> list[float]:
    """Share of correct samples of each problem, in problem order: the unit the bootstrap resamples.

    Samples of one problem are not independent (an easy problem makes all of them right), so the interval is
    computed over problems, not over samples.

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    per: dict[int, list[bool]] = {}
    for r in records:
        per.setdefault(r["problem_id"], []).append(bool(r["correct"]))
    return [sum(v) / len(v) for _, v in sorted(per.items())]


if __name__ == "__main__":
    sys.exit(main())

"""Command-line recipes: the book's loops as scripts (``python -m trio_helpers.recipes.<name>``).

Each recipe parses the PyTRIO examples' flags into the same config the chapters use and calls the same function,
so a recipe and its chapter cannot drift apart. This module holds what they share: one argument parser for the
loop's settings (:func:`loop_parser`), the backend flags (:func:`add_backend_flags`), the mapping of flags onto
a config (:func:`config_from_args`) and the run wrapper that turns failures into one line and an exit status
(:func:`run_and_report`).

Exit statuses: 0 done; 1 the run stopped (a service call failed for good, the disk filled, the network or the
service is unreachable, or a run that cannot start); 2 bad flags, settings, paths or data folders, including a
run directory that belongs to another run or is in use (nothing was created or written); 130 interrupted (Ctrl-C).
Every error a user can cause is one line on stderr naming the flag or path, the value and the fix; never a
traceback.

Introduced in: chapter 04 (notebooks/04_grpo_sync).
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from dataclasses import fields

BACKEND_CHOICES = ("offline", "remote", "auto")
OFFLINE_FLAGS = {"latency": "--latency", "fault_rate": "--fault-rate", "outage_after": "--outage-after"}


def int_at_least(low: int, high: int | None = None):
    """An argparse ``type`` accepting integers >= ``low`` (and <= ``high``), with a message naming the bounds.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    want = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

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


def number_where(want: str, ok):
    """An argparse ``type`` accepting finite numbers for which ``ok(value)`` holds; ``want`` describes them.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

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


def key_value(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--loss-config``; the value is read as an int, a float, true/false, or kept as text.

    Introduced in: chapter 08 (notebooks/08_losses).
    """
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE (e.g. clip_low_threshold=0.8), got {text!r}")
    value: object = raw
    for convert in (int, float):
        try:
            value = convert(raw)
            break
        except ValueError:
            continue
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    return key.strip(), value


def add_backend_flags(p: argparse.ArgumentParser) -> None:
    """``--backend`` and the offline backend's ``--latency``, ``--fault-rate``, ``--outage-after`` (refused
    with the real service), ``--progress/--no-progress``.

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    g = p.add_argument_group("backend")
    g.add_argument("--backend", choices=BACKEND_CHOICES, default=None,
                   help="service backend (default: $TRIO_BACKEND, else auto: remote when logged in)")
    g.add_argument("--latency", type=number_where("a number of seconds >= 0", lambda v: v >= 0), default=None,
                   help="offline only: seconds each request (a run created, a training event, a sample) waits "
                        "on the offline server")
    g.add_argument("--fault-rate", type=number_where("a probability in [0, 1)", lambda v: 0 <= v < 1),
                   default=None, help="offline only: share of attempts the offline server answers HTTP 503 "
                   "(pytrio's client retries them)")
    g.add_argument("--outage-after", type=int_at_least(0), default=None,
                   help="offline only: every request from the N-th on is answered 503, outlasting pytrio's retry "
                   "window")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar (default: only when stderr is a terminal)")


# A run on the service that fails after hours should resume from a recent state: recipes save one every 20 steps
# unless told otherwise (tinker-cookbook's default; a state costs one save_state, about the adapter's size on disk).
RECIPE_SAVE_EVERY = 20


class DefaultsOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default stated once: ``(default: X)`` is appended only when the help text
    does not already speak of a default and there is one to state (not None, not a flag's False).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


def loop_parser(prog: str, description: str, defaults, run_dir: str) -> argparse.ArgumentParser:
    """The parser of the loop's settings, shared by the GRPO and OPD recipes (defaults from ``defaults``, a
    :class:`trio_helpers.loop.LoopConfig`). Flag names follow the PyTRIO examples.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    from trio_helpers.loop import LOSSES, LR_SCHEDULES, SWANLAB_MODES

    d = defaults
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=DefaultsOnceFormatter)
    pos = int_at_least(1)
    p.add_argument("--steps", type=pos, default=d.steps, help="training steps (ignored with --all-data)")
    p.add_argument("--batch-size", type=pos, default=d.batch_size, help="prompts per step")
    p.add_argument("--group-size", type=pos, default=d.group_size, help="completions per prompt")
    p.add_argument("--max-tokens", type=pos, default=d.max_tokens, help="sampling budget per completion")
    p.add_argument("--base-model", default=d.base_model, help="model to fine-tune with LoRA")
    p.add_argument("--lora-rank", type=int_at_least(4, 64), default=d.lora_rank, help="LoRA rank")
    p.add_argument("--learning-rate", type=number_where("a number > 0", lambda v: v > 0),
                   default=d.learning_rate, help="Adam learning rate (peak, with --lr-schedule cosine)")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=d.lr_schedule, help="learning-rate schedule")
    p.add_argument("--temperature", type=number_where("a number >= 0", lambda v: v >= 0),
                   default=d.temperature, help="sampling temperature")
    p.add_argument("--top-p", type=number_where("a number in (0, 1]", lambda v: 0 < v <= 1), default=d.top_p,
                   help="nucleus sampling threshold")
    p.add_argument("--top-k", type=int, default=d.top_k, help="top-k sampling (-1: off)")
    p.add_argument("--seed", type=int_at_least(0), default=d.seed, help="seed of the adapter and of every request")
    p.add_argument("--all-data", action="store_true", help="one pass over the data, no wrap-around")
    p.add_argument("--save-every", type=int_at_least(0), default=RECIPE_SAVE_EVERY,
                   help=f"save the training state every N steps (0: never; default {RECIPE_SAVE_EVERY}, as "
                        "tinker-cookbook); needed for --resume")
    p.add_argument("--run-dir", default=run_dir, help="directory for metrics.jsonl, checkpoints.json, config.json")
    p.add_argument("--resume", action="store_true", help="continue from the last saved state in --run-dir")
    p.add_argument("--weights-name", default=d.weights_name, help="name of the final sampler weights")
    p.add_argument("--async", dest="use_async", action="store_true",
                   help="send a step's requests concurrently (chapter 05)")
    p.add_argument("--pipeline", action="store_true",
                   help="also sample the next batches while this one trains (chapter 05)")
    p.add_argument("--max-staleness", type=pos, default=d.max_staleness,
                   help="with --pipeline: most updates a batch's sampler may lag behind")
    p.add_argument("--max-concurrency", type=pos, default=d.max_concurrency,
                   help="requests in flight with --async/--pipeline")
    p.add_argument("--sampler-refresh-steps", type=pos, default=d.sampler_refresh_steps,
                   help="take a new sampler of the current weights every N steps")
    p.add_argument("--loss-fn", choices=LOSSES, default=d.loss_fn, help="forward_backward's loss")
    p.add_argument("--loss-config", type=key_value, action="append", default=None, metavar="KEY=VALUE",
                   help="a loss_fn_config entry (repeat for several)")
    p.add_argument("--ref-kl-coef", type=number_where("a number >= 0", lambda v: v >= 0), default=d.ref_kl_coef,
                   help="weight of the per-token KL penalty to the reference (base) model; 0: off (chapter 09)")
    p.add_argument("--ref-model-path", default=None,
                   help="sampler weights of the reference instead of the base model (with --ref-kl-coef)")
    from trio_helpers.rl import LOSS_AGGREGATIONS

    v = p.add_argument_group("GRPO variants (chapter 10; all off by default)")
    v.add_argument("--loss-aggregation", choices=LOSS_AGGREGATIONS, default=d.loss_aggregation,
                   help="token: the service's total_active_tokens; sequence: per-completion mean; constant: "
                        "Dr. GRPO's datums x max_tokens")
    v.add_argument("--num-substeps", type=pos, default=d.num_substeps,
                   help="minibatches per sampled batch, each with forward_backward + optim_step")
    v.add_argument("--clip-higher", type=number_where("a number >= 1", lambda x: x >= 1), default=None,
                   help="DAPO clip-higher: upper ratio bound of ppo/cispo (e.g. 1.28)")
    v.add_argument("--dynamic-sampling", type=int_at_least(0), default=d.dynamic_sampling,
                   help="DAPO dynamic sampling: at most N extra prompts per step to replace degenerate groups")
    v.add_argument("--tis-cap", type=number_where("a number >= 1", lambda x: x >= 1), default=None,
                   help="truncated importance sampling: cap C on exp(lp_train - lp_sampler) (default off)")
    p.add_argument("--swanlab", nargs="?", const="online", default="disabled", choices=SWANLAB_MODES,
                   help="log to SwanLab: online (needs `swanlab login`), offline (sync later) or disabled")
    p.add_argument("--no-swanlab", dest="swanlab", action="store_const", const="disabled",
                   help="no SwanLab logging (the default)")
    add_backend_flags(p)
    add_dry_run_flag(p)
    return p


def config_from_args(args: argparse.Namespace, cls, **extra):
    """The config of class ``cls`` that parsed arguments describe (every field with a flag of the same name).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    values["rollout"] = "pipeline" if args.pipeline else "async" if args.use_async else "sync"
    values["loss_fn_config"] = dict(args.loss_config) if args.loss_config else None
    if not values.get("weights_name"):
        values["weights_name"] = None
    values.update(extra)
    return cls(**values)


def check_settings(parser: argparse.ArgumentParser, args: argparse.Namespace, config=None,
                   algorithm: str | None = None) -> None:
    """Everything that can be checked before contacting a service; ``parser.error`` (exit 2) otherwise.

    With ``algorithm`` (``"grpo"``, ``"opd"``) also the run directory (:func:`trio_helpers.loop.check_run_dir`):
    a path that cannot be written, a directory another live run holds, or (with ``--resume``) one that belongs to
    another run is refused here, before any client exists.

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    if config is not None:
        try:
            config.validate()
        except ValueError as err:
            parser.error(str(err))
    if getattr(args, "resume", False) and not args.run_dir:
        parser.error("--resume needs --run-dir: the run directory holds the saved states and metrics.jsonl")
    used = [flag for name, flag in OFFLINE_FLAGS.items() if getattr(args, name, None) is not None]
    if used:
        from trio_helpers.backend import resolve_backend

        try:
            backend = resolve_backend(args.backend)
        except ValueError as err:
            parser.error(str(err))
        if backend == "remote":
            parser.error(f"{', '.join(used)} simulate the offline backend and cannot apply to the real service; "
                         "drop them or use --backend offline")
    mode = getattr(args, "swanlab", "disabled")
    try:
        from trio_helpers import tracking

        if hasattr(tracking, "check_swanlab"):
            tracking.check_swanlab(mode)
    except ValueError as err:
        parser.error(str(err))
    if algorithm is not None and config is not None and config.run_dir and not getattr(args, "dry_run", False):
        from trio_helpers.loop import check_run_dir

        try:
            check_run_dir(config.run_dir, config, algorithm, resume=getattr(args, "resume", False))
        except ValueError as err:
            parser.error(str(err))


def load_data(parser: argparse.ArgumentParser, load, flags: str):
    """``load()`` (a data loader), with every failure as one line: exit 2 for a path or folder the user gave
    (missing, empty, unreadable, not a dataset), exit 1 for the network or anything else.

    Args:
        parser: the recipe's parser (its ``prog`` starts the line).
        load: a function of no arguments returning the records.
        flags: the flags that chose the data, as the user would type them (named in the message).

    Introduced in: chapter 07 (notebooks/07_evaluation).
    """
    try:
        return load()
    except Exception as err:  # noqa: BLE001 - files, folders, the network, the data: one line each
        usage = isinstance(err, (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                                 PermissionError))
        first = (str(err).splitlines() or [""])[0].strip() or type(err).__name__
        fix = ("check the folder or pick another one" if usage else
               "check the network, or download the data once and pass its folder")
        print(f"{parser.prog}: error: cannot load the data ({flags}): {type(err).__name__}: {first}; {fix}",
              file=sys.stderr)
        raise SystemExit(2 if usage else 1) from None


def connect_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None = None):
    """``trio_helpers.connect`` with the backend flags; a missing login or a bad backend is one line, exit 2; a
    service that fails while pytrio's client opens its session (the offline server, down from the start) is one
    line, exit 1. Offline, the client is pytrio's own, for the offline server (what ``connect("offline")`` returns).

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    from trio_helpers import connect

    options = {name: getattr(args, name) for name in OFFLINE_FLAGS if getattr(args, name, None) is not None}
    try:
        # offline, the recipes run pytrio's own client against the offline server on 127.0.0.1
        return connect(args.backend, **options)
    except (ValueError, TypeError) as err:
        parser.error(str(err))
    except Exception as err:  # pytrio's AuthError, an unreachable service: one line, no traceback
        from pytrio.errors.auth import AuthError
        from pytrio.errors.base import PyTrioError

        if not isinstance(err, (PyTrioError, ConnectionError)):
            raise
        if isinstance(err, PyTrioError) and not isinstance(err, AuthError):
            # pytrio's client opens its session when it is created: the offline server down from the start
            _could_not_start(parser.prog, err, _outage_note(sys.argv[1:] if argv is None else argv))
            raise SystemExit(1) from None
        message = getattr(err, "message", None) or str(err)
        print(f"{parser.prog}: error: {message.splitlines()[0] if message else type(err).__name__}",
              file=sys.stderr)
        raise SystemExit(2) from None


def _could_not_start(prog: str, err: BaseException, outage: str) -> None:
    """The one line for a pytrio error before a run's first step (its clients could not be created)."""
    message = (getattr(err, "message", None) or str(err) or type(err).__name__).splitlines()[0]
    print(f"{prog}: error: the run could not start: {type(err).__name__}: {message}{outage}", file=sys.stderr)


def resume_command(prog: str, argv: list[str]) -> str:
    """The command that resumes an interrupted run: the same flags, without ``--outage-after``, plus ``--resume``.

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--outage-after":
            skip = True
            continue
        if arg.startswith("--outage-after="):
            continue
        out.append(arg)
    if "--resume" not in out:
        out.append("--resume")
    return " ".join([prog, *map(shlex.quote, out)])


def run_and_report(parser: argparse.ArgumentParser, argv: list[str], run):
    """Call ``run()`` and turn what the user should see into one line and an exit status.

    Returns:
        ``(result, 0)`` on success, ``(None, status)`` otherwise, after printing one line to stderr: a
        :class:`trio_helpers.loop.RunStopped` (status 1, with the resume command when a state was saved), a
        ``ValueError`` (status 1: e.g. nothing to resume), a pytrio error before the first step (status 1:
        e.g. the service is down while the run's clients are created), Ctrl-C (status 130, with the resume
        command).

    Introduced in: chapter 05 (notebooks/05_grpo_async).
    """
    from trio_helpers.loop import RunStopped, read_checkpoints
    from trio_helpers.tracking import os_fix

    prog = parser.prog
    args = argv if argv is not None else sys.argv[1:]
    outage = _outage_note(args)
    run_dir = getattr(parser, "_run_dir", None)

    def saved() -> bool:
        try:
            return bool(run_dir) and bool(read_checkpoints(run_dir))
        except (OSError, ValueError):
            return False

    try:
        return run(), 0
    except RunStopped as stopped:
        print(f"{prog}: error: {stopped}{outage}", file=sys.stderr)
        if stopped.checkpoint is not None:
            print(f"{prog}: resume with: {resume_command(prog, args)}", file=sys.stderr)
        return None, 1
    except ValueError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return None, 2
    except OSError as err:  # a full disk, a read-only or vanished run directory, outside the steps
        where = f" {err.filename}" if err.filename else ""
        how = (f"; then resume with: {resume_command(prog, args)}" if saved() else "")
        print(f"{prog}: error: cannot write{where}: {err.strerror or type(err).__name__}; "
              f"{os_fix(err, '--run-dir')}{how}", file=sys.stderr)
        return None, 1
    except Exception as err:  # a service call that failed before the first step (creating the run's clients)
        from pytrio.errors.base import PyTrioError

        if not isinstance(err, PyTrioError):
            raise
        _could_not_start(prog, err, outage)
        return None, 1
    except KeyboardInterrupt:
        if not getattr(parser, "_resumable", True):
            how = "no state was saved (--save-every 0): rerun it"
        elif saved():
            how = f"resume from the last saved state with: {resume_command(prog, args)}"
        else:
            how = ("no state was saved yet (the first save comes after --save-every steps), so it cannot "
                   "resume: rerun it without --resume")
        print(f"{prog}: interrupted; finished steps are in metrics.jsonl; {how}", file=sys.stderr)
        return None, 130


def _outage_note(argv: list[str]) -> str:
    """`` (the simulated outage of --outage-after N ...)`` when the command simulated one, else ``""``."""
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--outage-after=") else (
            argv[i + 1] if arg == "--outage-after" and i + 1 < len(argv) else None)
        if value is not None:
            return (f" (the offline backend's simulated outage: --outage-after {value} fails every request from "
                    f"request {value} on; drop --outage-after to run normally)")
    return ""


def add_dry_run_flag(p: argparse.ArgumentParser) -> None:
    """``--dry-run``: print the bill the settings imply and send nothing (see :func:`print_dry_run`).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    p.add_argument("--dry-run", action="store_true",
                   help="print what the run would send and cost (upper bounds, and an estimate from a 3-step "
                        "offline run), then exit without contacting any service")


def print_dry_run(config, records: list, run, prompt_of, probe_steps: int = 3) -> None:
    """The bill of a configuration, without a service: upper bounds and an offline estimate, in Qwen tokens.

    Args:
        config: the validated run config (``steps`` may be large).
        records: the offline corpus records the estimate runs on.
        run: ``run(service, records, config)`` runs the loop (``run_grpo`` or ``run_opd``).
        prompt_of: ``prompt_of(tokenizer, record)`` renders a prompt (the scorer's).
        probe_steps: steps of the offline run that the estimate scales up.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    from dataclasses import replace

    import numpy as np

    from trio_helpers.backend import connect, usage_of
    from trio_helpers.costs import TOKEN_RATIO, bill_line, config_bill, short_count
    from trio_helpers.offline import catalog
    from trio_helpers.offline.ledger import Usage
    from trio_helpers.offline.tokenizer import get_offline_tokenizer

    tok = get_offline_tokenizer()
    offline_prompt = float(np.mean([len(prompt_of(tok, r)) for r in records[:64]]))
    prompt = offline_prompt * TOKEN_RATIO["prompt"]
    bound = config_bill(config, prompt)
    print(f"dry run, nothing is sent: {config.steps} steps x {config.batch_size} prompts x "
          f"{config.group_size} completions, max_tokens {config.max_tokens}")
    print(f"  prompts: about {prompt:.0f} Qwen tokens each")
    tokens = ", ".join(f"{name} {short_count(bound[name])}" for name in ("prompt", "sampled", "training", "teacher",
                                                                "reference") if name in bound)
    print("upper bounds (every completion at max_tokens, every datum sent), in Qwen tokens:")
    print(f"  {tokens}")
    print(f"  {bound['optimizer_steps']:.0f} optimizer steps, {bound['sampler_snapshots']:.0f} sampler "
          f"snapshots, {bound['states_saved']:.0f} saved states, 1 training run")
    if "requests" in bound:  # episodes (chapter 12)
        print(f"  episodes: up to {config.max_turns} turns of {config.max_tokens} tokens, one sampling request "
              f"each ({short_count(bound['requests'])} requests);\n  every turn re-sends the episode so far "
              f"(replies counted at 64 tokens)")
    probe = replace(config, steps=min(probe_steps, config.steps), all_data=False, save_every=0, run_dir=None,
                    swanlab="disabled", weights_name=None)
    served = catalog.model_names()
    note = ""
    tool_model = catalog.spec("offline/tool").name
    episodes = getattr(probe, "env", None) is not None
    if episodes and (probe.base_model not in served or catalog.spec(probe.base_model).name != tool_model):
        # episodes need a model that calls tools: the offline stand-ins of other names never do (chapter 12)
        note = f" (offline stand-in {tool_model!r}, which calls tools, for {probe.base_model!r})"
        probe = replace(probe, base_model=tool_model)
    elif probe.base_model not in served:
        note = f" (offline stand-in {served[0]!r} for {probe.base_model!r})"
        probe = replace(probe, base_model=served[0])
    if hasattr(probe, "teacher_base_model") and probe.teacher_base_model not in served:
        probe = replace(probe, teacher_base_model=served[-1], teacher_model_path=None)
    service = connect("offline", latency=0.0)
    before = usage_of(service)
    run(service, records, probe)
    used = usage_of(service) - before
    scale = config.steps / probe.steps
    once = {"training_runs", "sampling_runs", "states_saved", "sampler_weights_saved"}  # not per step
    scaled = Usage(**{name: value if name in once else type(value)(value * scale)
                      for name, value in vars(used).items()})
    print(f"estimate from a {probe.steps}-step offline run{note}, scaled x{scale:.4g}:")
    print(f"  {bill_line(scaled)}")
    print("  (the offline model's text in Qwen tokens; a real model writes other, often longer, text)")


def report_usage(service, run_dir, path=None) -> None:
    """After a run: print the service's ledger (offline) and write it to ``run_dir/usage.json`` (or ``path``):
    the offline counts (``retries``, the attempts the offline server answered 503, among them) and the real-token
    estimate, through :func:`trio_helpers.tracking.write_atomic`.

    The real service's client reports no usage, so there it prints one line saying so.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    import json
    from dataclasses import asdict
    from pathlib import Path

    from trio_helpers.costs import chapter_bill, real_tokens
    from trio_helpers.tracking import write_atomic

    from trio_helpers.backend import usage_of

    used = usage_of(service)
    if used is None:
        print("usage: the real service's client reports none; see your account's usage page")
        return
    print(chapter_bill(used))
    if run_dir or path is not None:
        bill = real_tokens(used)
        record = {"offline": asdict(used), "qwen_tokens_estimate": {
            "inference": bill.inference[0], "inference_range": list(bill.inference[1:]),
            "training": bill.training[0]}}
        path = Path(path) if path is not None else Path(run_dir) / "usage.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record, indent=1) + "\n")
        print(f"usage: {path}")


def print_run_end(result, config, service, start: float) -> None:
    """What both training recipes print after a run: where metrics and the last saved state are, the ledger
    (:func:`report_usage`), the total time and the final weights.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    import time

    print(f"metrics: {config.run_dir}/metrics.jsonl")
    if result.checkpoints:
        print(f"last saved state (resume with --resume --run-dir {config.run_dir}): "
              f"{result.checkpoints[-1]['path']}")
    report_usage(service, config.run_dir)
    print(f"total time {time.perf_counter() - start:.1f}s")
    if result.final_path:
        print(f"final weights: {result.final_path}")

"""Metrics logging: one JSON line per training step on disk, and optionally the same numbers in SwanLab.

A training run's metrics are its memory. ``MetricsLogger`` appends each step's metrics to ``metrics.jsonl`` in the
run directory (plain text, one JSON object per line, readable with ``json`` or ``pandas.read_json(lines=True)``),
keeps them in memory when there is no run directory, and mirrors them to SwanLab when asked. SwanLab is imported
only when its mode is not ``"disabled"``, so a disabled logger neither needs the package nor writes anything.

Introduced in: chapter 04 (notebooks/04_grpo_sync).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

SWANLAB_MODES = ("online", "offline", "disabled")
METRICS_FILE = "metrics.jsonl"


def _jsonable(value):
    """Numbers as plain floats/ints (non-finite ones as ``None``, which JSON can represent); other values as is."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if hasattr(value, "item"):  # numpy scalars
        value = value.item()
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return value


class MetricsLogger:
    """Append-only per-step metrics: ``metrics.jsonl`` in ``run_dir`` (or memory), optionally mirrored to SwanLab.

    Args:
        run_dir: directory of the run (created if missing); ``None`` keeps the history in memory only.
        swanlab: ``"disabled"`` (default: nothing imported, nothing written), ``"offline"`` (SwanLab writes its run
            files under ``run_dir/swanlog``, upload later with ``swanlab sync``) or ``"online"`` (needs
            ``swanlab login``).
        project: SwanLab project name.
        config: the run's settings, stored with the SwanLab run.
        experiment_name: SwanLab's name for this run (default: SwanLab picks one).
        resume: keep an existing ``metrics.jsonl`` and append to it (see :meth:`truncate`); otherwise an existing
            file is replaced, so a fresh run never mixes with an old one.

    Raises:
        ValueError: an unknown ``swanlab`` mode, or one that cannot work here (:func:`check_swanlab`: ``"online"``
            without a login, SwanLab not installed); raised before anything is written. Also: ``resume`` with a
            ``metrics.jsonl`` whose middle is corrupt (the message names the file and line).
        RuntimeError: SwanLab could not start for another reason; the message says what to do.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike | None = None,
        swanlab: str = "disabled",
        project: str = "trio-book",
        config: dict | None = None,
        experiment_name: str | None = None,
        resume: bool = False,
    ) -> None:
        check_swanlab(swanlab)  # before any file is touched: a bad mode never costs a reset metrics.jsonl
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.path = self.run_dir / METRICS_FILE if self.run_dir is not None else None
        self.swanlab_mode = swanlab
        self._rows: list[dict] = []
        self._run = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        if swanlab != "disabled":
            self._run = _start_swanlab(swanlab, project, config, experiment_name, self.run_dir)
        try:
            if self.path is not None:
                if resume and self.path.exists():
                    self._rows = _read_jsonl(self.path, repair=True)
                else:
                    self.path.write_text("", encoding="utf-8")
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        where = str(self.path) if self.path is not None else "memory"
        return f"MetricsLogger({where}, swanlab={self.swanlab_mode!r}, steps={len(self._rows)})"

    def log(self, step: int, metrics: dict) -> dict:
        """Record one step's metrics; returns the row written (``{"step": step, **metrics}``).

        Non-finite numbers are stored as ``null``; SwanLab receives only the finite numeric values.

        Raises:
            ValueError: ``step`` is negative.
        """
        if int(step) < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        row = {"step": int(step), **{str(k): _jsonable(v) for k, v in metrics.items() if k != "step"}}
        self._rows.append(row)
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")
        if self._run is not None:
            numeric = {k: v for k, v in row.items()
                       if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
            self._run.log(numeric, step=int(step))
        return row

    def history(self) -> list[dict]:
        """Every logged row, in the order logged (a copy)."""
        return [dict(r) for r in self._rows]

    def truncate(self, step: int) -> int:
        """Forget the rows of steps ``>= step`` (in memory and on disk): used when a run resumes from a checkpoint
        taken after ``step`` steps, so the steps it redoes are not logged twice. Returns how many rows were dropped.
        """
        keep = [r for r in self._rows if r["step"] < step]
        dropped = len(self._rows) - len(keep)
        self._rows = keep
        if self.path is not None:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")
            os.replace(tmp, self.path)
        return dropped

    def close(self) -> None:
        """Finish the SwanLab run (if any). Safe to call twice; the JSONL file needs no closing."""
        if self._run is not None:
            self._run.finish()
            self._run = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_jsonl(path: Path, repair: bool = False) -> list[dict]:
    """The rows of a metrics file. A torn last line (a hard kill mid-write) is dropped with a one-line message on
    stderr, and with ``repair`` also cut from the file, so that the next row is not glued onto it; a corrupt line
    before the last is an error naming the file and the line."""
    raw = path.read_text(encoding="utf-8", errors="replace")
    lines = raw.split("\n")
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    rows: list[dict] = []
    for k, (number, line) in enumerate(numbered):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            if k < len(numbered) - 1:
                raise ValueError(f"{path}: line {number} is not a JSON row ({err}); the file is corrupt before its "
                                 "last line, so it cannot be resumed safely: fix or delete that line") from None
            print(f"{path}: dropped the partial last row (line {number}, {len(line)} characters), left by a run "
                  "stopped while writing it", file=sys.stderr)
            if repair:
                keep = "".join(f"{good}\n" for _, good in numbered[:k])
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(keep, encoding="utf-8")
                os.replace(tmp, path)
            break
        rows.append(row)
    return rows


def check_swanlab(mode: str) -> None:
    """Raise ``ValueError`` (one line, with the fix) unless SwanLab can run in ``mode`` here; cheap, creates nothing.

    Call it before any model is created or any run file is reset (``MetricsLogger`` calls it first thing):
    ``"disabled"`` always works; ``"offline"`` needs the ``swanlab`` package; ``"online"`` also needs a login
    (``SWANLAB_API_KEY``, or the ``.netrc`` that ``swanlab login`` writes under ``~/.swanlab``), because without one
    SwanLab asks for a key on the terminal, and raises when there is none (a notebook kernel, CI, ``nohup``).

    Raises:
        ValueError: an unknown mode, SwanLab missing, or ``"online"`` without a login.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if mode not in SWANLAB_MODES:
        raise ValueError(f"swanlab mode must be one of {', '.join(map(repr, SWANLAB_MODES))}, got {mode!r}")
    if mode == "disabled":
        return
    try:
        import swanlab  # noqa: F401 - lazy: only when SwanLab is enabled
    except ImportError:
        raise ValueError(f"SwanLab mode {mode!r} needs the swanlab package (pip install swanlab); or use "
                         "--no-swanlab (swanlab='disabled')") from None
    if mode == "online" and not _swanlab_logged_in():
        raise ValueError("SwanLab mode 'online' needs a login and none was found (SWANLAB_API_KEY or `swanlab "
                         "login`); use --no-swanlab or --swanlab offline (swanlab='offline'), or log in first")


def _swanlab_logged_in() -> bool:
    """Whether SwanLab would find an API key, read the way SwanLab 0.10 reads it (environment, then .netrc files)."""
    if os.environ.get("SWANLAB_API_KEY", "").strip():
        return True
    try:
        from swanlab.sdk.internal.settings import Settings

        return bool(Settings().api_key)
    except Exception:  # noqa: BLE001 - another SwanLab version: look for the files `swanlab login` writes
        root = Path(os.environ.get("SWANLAB_ROOT") or os.environ.get("SWANLAB_SAVE_DIR") or Path.home() / ".swanlab")
        return (root / ".netrc").is_file() or (Path.cwd() / ".swanlab" / ".netrc").is_file()


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl``, in file order.

    A torn last line (a run killed while writing it) is skipped with a one-line message on stderr.

    Raises:
        FileNotFoundError: the run directory has no metrics file.
        ValueError: a corrupt line before the last (the message names the file and line).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{METRICS_FILE} not found in run directory {str(run_dir)!r}; was the run started "
                                "with this run_dir?")
    return _read_jsonl(path)


def _start_swanlab(mode: str, project: str, config: dict | None, name: str | None, run_dir: Path | None):
    import swanlab  # lazy: only when SwanLab is enabled

    kwargs = {"mode": mode, "project": project, "config": config or {}}
    if name:
        kwargs["name"] = name
    if run_dir is not None:
        kwargs["log_dir"] = str(run_dir / "swanlog")
    try:
        return swanlab.init(**kwargs)
    except Exception as err:  # noqa: BLE001 - re-raised with the fix in the message
        raise RuntimeError(
            f"SwanLab failed to start in mode {mode!r}: {type(err).__name__}: {err}. For 'online' run "
            "`swanlab login` first; or use swanlab='offline' (sync later) or 'disabled'."
        ) from err

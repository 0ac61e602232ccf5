"""Metrics logging: one JSON line per training step on disk, and optionally the same numbers in SwanLab.

A training run's metrics are its memory. ``MetricsLogger`` appends each step's metrics to ``metrics.jsonl`` in the
run directory (plain text, one JSON object per line, readable with ``json`` or ``pandas.read_json(lines=True)``),
keeps them in memory when there is no run directory, and mirrors them to SwanLab when asked. SwanLab is imported
only when its mode is not ``"disabled"``, so a disabled logger neither needs the package nor writes anything.

Introduced in: chapter 04 (notebooks/04_grpo_sync).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
import sys
from pathlib import Path

SWANLAB_MODES = ("online", "offline", "disabled")
METRICS_FILE = "metrics.jsonl"
TMP_SUFFIX = ".tmp"
"""Suffix of :func:`write_atomic`'s temporary files (``.<name>.<random>.tmp`` next to the target)."""


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) so that readers see the old file or the new one, never half of one.

    The one way the loop and the recipes write a whole file (``config.json``, ``checkpoints.json``, a rewritten
    ``metrics.jsonl``, ``usage.json``, evaluation records): write a temporary file next to ``path``, flush and
    ``fsync`` it, rename it over ``path``, then ``fsync`` the directory. If anything fails (a full disk, a
    read-only directory, ``path`` is a directory, Ctrl-C), the temporary file is removed and the previous
    ``path`` is left as it was; the error is raised.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: the file could not be written (``ENOSPC``, ``EROFS``, ``EISDIR``, ...).

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.errno is not None:  # name the file meant, not the temporary one
            raise OSError(err.errno, err.strerror, str(path)) from None
        raise
    with contextlib.suppress(OSError):  # make the rename durable; not every file system allows it
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def check_writable_dir(directory: str | os.PathLike, what: str = "run_dir") -> Path:
    """Check that a file can be written in ``directory``, or (if it does not exist yet) that it can be created.

    A probe file (a few bytes, flushed and fsynced) is written and removed in ``directory``, or in its nearest
    existing ancestor, so that a full disk, a read-only mount or a file where a directory should be are found
    before any client is created or any sample drawn. Nothing is left behind.

    Raises:
        ValueError: one line naming ``what``, the path, the reason and the fix.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    directory = Path(directory)
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == directory else f" (its parent {str(existing)!r} is a file)"
        raise ValueError(f"{what} {str(directory)!r} is a file, not a directory{where}; pass a directory path "
                         "(it is created if missing)")
    try:
        probe = write_atomic(existing / f".write-probe-{secrets.token_hex(4)}{TMP_SUFFIX}", "probe\n")
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"{what} {str(directory)!r} is not writable: {os_reason(err)}; "
                         f"{os_fix(err, what)}") from None
    return directory


def os_reason(err: OSError) -> str:
    """The short reason of an ``OSError`` (``"No space left on device"``), without the path.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    return err.strerror or type(err).__name__


def os_fix(err: OSError, what: str = "run_dir") -> str:
    """What to do about an ``OSError`` that writing ``what`` raised, in a few words.

    Introduced in: chapter 04 (notebooks/04_grpo_sync).
    """
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"free some space on that disk, or choose a {what} on another disk"
    if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"choose a {what} you can write to"
    if err.errno in (errno.EISDIR, errno.ENOTDIR, errno.EEXIST):
        return f"choose another {what}: something of the wrong kind is in the way"
    return f"check the path, or choose another {what}"


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

    Each step appends one line (a run killed mid-line leaves a torn last row, which resuming detects and cuts);
    every whole-file write (reset, :meth:`truncate`, the repair) goes through :func:`write_atomic`.

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
                    write_atomic(self.path, "")
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
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))
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
                write_atomic(path, "".join(f"{good}\n" for _, good in numbered[:k]))
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

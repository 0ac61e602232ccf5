"""Datasets of the book: GSM8K (chapters 01-05) and DeepMath-103K (chapter 06), real or offline.

Real sources need the network or a local download; the ``"offline"`` source reads the small corpus
shipped in ``trio_helpers/offline/data`` (written by ``python -m trio_helpers.offline.corpus``), the
only data the offline models know.

Data follows the backend. With the default ``source="auto"`` the loaders read the offline corpus whenever the
service in use is the offline backend, and real data only when it is the real service, whatever
``TRIO_BACKEND``, a ``./gsm8k`` folder or the network say: the backend is the one the last ``connect()``
returned, or, before any ``connect()``, the one it would choose (:func:`trio_helpers.backend.backend_in_use`).
An explicit source that contradicts the backend is loaded, with a one-line warning on stderr naming both.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

OFFLINE_DIR = Path(__file__).resolve().parent / "offline" / "data"
GSM8K_SPLITS = ("train", "test")
GSM8K_SOURCES = ("auto", "hf", "modelscope", "local", "offline")
DEEPMATH_SOURCES = ("auto", "modelscope", "local", "offline")
DEEPMATH_DATASET = "zwhe99/DeepMath-103K"
DEEPMATH_NUM_SHARDS = 10
DEEPMATH_COLUMNS = ("question", "final_answer", "difficulty", "r1_solution_1")
PROBE_TIMEOUT_S = 2.0

_ANNOTATION_RE = re.compile(r"<<([^<>=]*)=([^<>]*)>>")

# A downloader writes the repository file ``remote_path`` of the DeepMath dataset to ``dest``.
Downloader = Callable[[str, Path], None]


# --------------------------------------------------------------------------------------------------
# Small helpers


def _backend() -> str:
    """``"offline"`` or ``"remote"``: the backend in use, or the one ``connect()`` would choose."""
    from trio_helpers.backend import backend_in_use  # lazy: imports pytrio

    return backend_in_use()


def _warn_if_mismatched(loader: str, source: str, real_fix: str) -> None:
    """One line on stderr when an explicit source contradicts the backend (the data is still loaded)."""
    try:
        backend = _backend()
    except ValueError:  # a bad TRIO_BACKEND is reported by connect(); an explicit source does not need it
        return
    if source != "offline" and backend == "offline":
        print(f"{loader}: warning: source={source!r} is real data, but the backend in use is offline, whose "
              f"models know only the offline corpus; use source='offline' (or the default 'auto'), or connect "
              f"to the real service", file=sys.stderr)
    elif source == "offline" and backend == "remote":
        print(f"{loader}: warning: source='offline' is the book's synthetic corpus, but the backend in use is "
              f"the real service; use source='auto' for {real_fix}, or connect('offline')", file=sys.stderr)


def _reachable(host: str, port: int = 443, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """One TCP connect with a short timeout: cheap, and it cannot hang like an HTTP client with retries."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _hf_host() -> str:
    """The Hub host, honouring a mirror set in HF_ENDPOINT."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    return urlparse(endpoint).hostname or "huggingface.co"


def _hf_offline_mode() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _say(message: str) -> None:
    print(message)


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _gsm8k_record(row: dict) -> dict:
    return {"question": str(row["question"]), "answer": str(row["answer"])}


def _check_choice(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}")


# --------------------------------------------------------------------------------------------------
# GSM8K


def _find_local_gsm8k(root: Path, split: str) -> list[Path]:
    """Files of ``split`` in a downloaded GSM8K folder: parquet shards first, else jsonl.

    Looks for ``main/{split}-*.parquet`` (the HF / ModelScope layout), then ``{split}-*.parquet``
    anywhere except under ``socratic/``, then ``{split}.jsonl`` (the layout of OpenAI's repository).
    """
    def usable(paths):
        return sorted(p for p in paths if "socratic" not in p.relative_to(root).parts)

    for pattern in (f"main/{split}-*.parquet", f"**/{split}-*.parquet", f"main/{split}.jsonl", f"**/{split}.jsonl"):
        found = usable(root.glob(pattern))
        if found:
            return found
    return []


def _load_gsm8k_local(root: Path, split: str) -> list[dict]:
    if not root.is_dir():
        raise FileNotFoundError(f"GSM8K folder {str(root)!r} does not exist; download it with "
                                f"`modelscope download --dataset AI-ModelScope/gsm8k --local_dir ./gsm8k`")
    files = _find_local_gsm8k(root, split)
    if not files:
        import datasets  # lazy: only for unusual layouts

        return [_gsm8k_record(row) for row in datasets.load_dataset(str(root), "main", split=split)]
    rows: list[dict] = []
    for file in files:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq  # lazy: installed with datasets

            rows += pq.read_table(file, columns=["question", "answer"]).to_pylist()
        else:
            rows += _read_jsonl(file)
    return [_gsm8k_record(row) for row in rows]


def _load_gsm8k_offline(split: str) -> list[dict]:
    return [_gsm8k_record(row) for row in _read_jsonl(OFFLINE_DIR / f"gsm8k_{split}.jsonl")]


def _load_gsm8k_hf(split: str) -> list[dict]:
    if not _hf_offline_mode() and not _reachable(_hf_host()):
        raise ConnectionError(f"cannot reach {_hf_host()}:443 within {PROBE_TIMEOUT_S:.0f} s; use "
                              f"source='local' with a downloaded folder, source='offline', or set "
                              f"HF_HUB_OFFLINE=1 to read the Hugging Face cache")
    import datasets  # lazy: heavy

    return [_gsm8k_record(row) for row in datasets.load_dataset("openai/gsm8k", "main", split=split)]


def load_gsm8k(split: str = "train", source: str = "auto", path: str | None = None) -> list[dict]:
    """Load GSM8K as a list of ``{"question", "answer"}`` records, in file order.

    Args:
        split: ``"train"`` or ``"test"``.
        source: where to read from:
            ``"hf"``: ``datasets.load_dataset("openai/gsm8k", "main")`` (network or HF cache);
            ``"modelscope"`` / ``"local"``: a downloaded folder (``path``, default ``./gsm8k``), e.g. from
            ``modelscope download --dataset AI-ModelScope/gsm8k --local_dir ./gsm8k``; reads
            ``main/{split}-*.parquet`` or ``{split}.jsonl`` directly, else ``datasets.load_dataset(path, "main")``;
            ``"offline"``: the generated corpus shipped with the package (600 train / 300 test problems);
            ``"auto"``: follows the backend (:func:`trio_helpers.backend.backend_in_use`): the offline corpus
            on the offline backend, whatever folders or network exist; on the real service the local folder if
            ``path`` or ``./gsm8k`` exists, else HF if huggingface.co answers a 2 s TCP probe (or
            ``HF_HUB_OFFLINE=1`` asks for the cache), else an error: never synthetic data for a real model.
            An explicit source that contradicts the backend is loaded with a one-line warning on stderr.
        path: the local folder for ``"local"`` / ``"modelscope"`` (and ``"auto"``).
    Returns:
        A list of dicts with exactly the keys ``question`` and ``answer`` (the answer ends with ``#### N``).
        Prints one line naming the source used.
    Raises:
        ValueError: for an unknown split or source, or an unknown ``TRIO_BACKEND`` (with ``"auto"``).
        FileNotFoundError: if a local folder is missing or holds no GSM8K files.
        ConnectionError: on the real service when no real source is reachable, or for ``source="hf"`` when the
            Hub cannot be reached (fails in about 2 s, never hangs); one line with the fix.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    _check_choice("split", split, GSM8K_SPLITS)
    _check_choice("source", source, GSM8K_SOURCES)
    local = path or "gsm8k"
    reason = ""
    if source == "auto":
        if _backend() == "offline":
            source, reason = "offline", "offline backend"
        elif Path(local).is_dir():
            source, reason = "local", f"real service; found folder {local}"
        elif _hf_offline_mode() or _reachable(_hf_host()):
            source, reason = "hf", "real service; Hugging Face Hub"
        else:
            raise ConnectionError(
                f"load_gsm8k: the real service is in use, but there is no folder {local!r} and {_hf_host()}:443 "
                f"did not answer within {PROBE_TIMEOUT_S:.0f} s; download GSM8K once with `modelscope download "
                f"--dataset AI-ModelScope/gsm8k --local_dir ./gsm8k`, or set HF_HUB_OFFLINE=1 to read the cache")
    else:
        _warn_if_mismatched("load_gsm8k", source, "real GSM8K")
    if source == "offline":
        records = _load_gsm8k_offline(split)
    elif source in ("local", "modelscope"):
        records = _load_gsm8k_local(Path(local), split)
    elif reason:  # "auto" chose the Hub for the real service: a failure is reported, never replaced by offline data
        try:
            records = _load_gsm8k_hf(split)
        except Exception as err:  # noqa: BLE001 - re-raised as one line with the fix
            first = (str(err).splitlines() or [""])[0][:120]
            raise ConnectionError(
                f"load_gsm8k: reading openai/gsm8k from the Hugging Face Hub failed ({type(err).__name__}: "
                f"{first}); download it once with `modelscope download --dataset AI-ModelScope/gsm8k "
                f"--local_dir ./gsm8k` and it is read from there") from err
    else:
        records = _load_gsm8k_hf(split)
    _say(f"load_gsm8k: source={source} split={split} records={len(records)}" + (f" ({reason})" if reason else ""))
    return records


def calculator_annotations(answer_text: str) -> list[tuple[str, str]]:
    """The calculator annotations ``<<expression=result>>`` of a GSM8K answer, in order.

    Args:
        answer_text: a GSM8K worked solution, e.g. ``"She sold 48/2 = <<48/2=24>>24 clips."``.
    Returns:
        ``(expression, result)`` string pairs, e.g. ``[("48/2", "24")]``; the split is at the first ``=``.
    Raises:
        TypeError: if answer_text is not a string.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    if not isinstance(answer_text, str):
        raise TypeError(f"answer_text must be a str, got {type(answer_text).__name__}")
    return [(expr.strip(), result.strip()) for expr, result in _ANNOTATION_RE.findall(answer_text)]


def count_steps(answer_text: str) -> int:
    """Number of reasoning steps of a GSM8K answer: its non-empty lines before the ``#### N`` line.

    GSM8K writes one step per line; most, but not all, lines carry a calculator annotation, so
    ``len(calculator_annotations(...))`` can be smaller. In the offline corpus the two are equal.

    Args:
        answer_text: a GSM8K worked solution.
    Returns:
        The step count (0 for an empty answer).
    Raises:
        TypeError: if answer_text is not a string.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    if not isinstance(answer_text, str):
        raise TypeError(f"answer_text must be a str, got {type(answer_text).__name__}")
    lines = [line for line in answer_text.splitlines() if line.strip()]
    return sum(1 for line in lines if not line.lstrip().startswith("####"))


# --------------------------------------------------------------------------------------------------
# DeepMath-103K


def deepmath_shard_name(index: int, num_shards: int = DEEPMATH_NUM_SHARDS) -> str:
    """Repository path of one DeepMath-103K parquet shard.

    Args:
        index: the shard number, from 0.
        num_shards: how many shards the dataset has (10 for DeepMath-103K).
    Returns:
        e.g. ``data/train-00000-of-00010.parquet`` for index 0.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    return f"data/train-{index:05d}-of-{num_shards:05d}.parquet"


def modelscope_downloader(remote_path: str, dest: Path) -> None:
    """Download one file of the DeepMath-103K dataset from ModelScope to ``dest``.

    Uses ``modelscope.hub.file_download.dataset_file_download`` into a scratch folder next to
    ``dest``, then moves the file to ``dest`` (the caller renames ``dest`` into place).

    Args:
        remote_path: the file inside the dataset repository, see :func:`deepmath_shard_name`.
        dest: where to write it (usually a ``.tmp`` name).
    Raises:
        Whatever modelscope raises when the file cannot be fetched (network errors, unknown file).

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    from modelscope.hub.file_download import dataset_file_download  # lazy: heavy

    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as scratch:
        got = dataset_file_download(DEEPMATH_DATASET, remote_path, local_dir=scratch)
        os.replace(got, dest)


def download_deepmath_shards(num_shards: int = 1, local_dir: str | Path = "deepmath",
                             downloader: Downloader | None = None) -> list[Path]:
    """Make sure the first ``num_shards`` DeepMath-103K shards are in ``local_dir``; download the missing ones.

    Each missing shard is written to ``<name>.tmp`` first and renamed when complete, so an interrupted
    download never leaves a truncated parquet file behind; shards already present are skipped.

    Args:
        num_shards: how many of the 10 shards (1..10).
        local_dir: the dataset folder; shards land in ``local_dir/data/``.
        downloader: ``f(remote_path, dest)`` that writes one file; default :func:`modelscope_downloader`.
    Returns:
        The shard paths, in order.
    Raises:
        ValueError: if num_shards is not an int in 1..10.
        RuntimeError: if the downloader returns without writing the file.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or not 1 <= num_shards <= DEEPMATH_NUM_SHARDS:
        raise ValueError(f"num_shards must be an int from 1 to {DEEPMATH_NUM_SHARDS}; got {num_shards!r}")
    downloader = downloader or modelscope_downloader
    paths = []
    for index in range(num_shards):
        remote = deepmath_shard_name(index)
        final = Path(local_dir) / remote
        paths.append(final)
        if final.exists():
            continue
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(final.name + ".tmp")
        tmp.unlink(missing_ok=True)
        try:
            downloader(remote, tmp)
            if not tmp.is_file():
                raise RuntimeError(f"the downloader did not write {remote} to {tmp.name}")
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
    return paths


def _shard_problem(path: Path) -> str | None:
    """None if ``path`` opens as a parquet file with a ``question`` column, else what is wrong (one line).

    Reads only the footer (the schema and row-group index), so it is cheap even for large shards; a download cut
    off part-way has no footer and is caught here.
    """
    import pyarrow.parquet as pq  # lazy: installed with datasets

    try:
        names = pq.ParquetFile(path).schema_arrow.names
    except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        return (str(err).splitlines() or [type(err).__name__])[0][:120]
    return None if "question" in names else f"no 'question' column (columns: {names})"


def _check_shards(paths: list[Path], get_repair: Callable[[], Downloader | None]) -> None:
    """Every shard must open; a broken one is downloaded again with ``get_repair()``, or named with the fix.

    ``get_repair`` is called only when a shard is broken, so healthy shards never cost a network probe.
    """
    for path in paths:
        problem = _shard_problem(path)
        if problem is None:
            continue
        repair = get_repair()
        if repair is not None:
            _say(f"load_deepmath: {path} is truncated or corrupt ({problem}); downloading it again")
            path.unlink()
            download_deepmath_shards(len(paths), path.parent.parent, repair)
            problem = _shard_problem(path)
            if problem is None:
                continue
            raise ValueError(f"DeepMath shard {path} is still unreadable after a fresh download ({problem}); "
                             "check the mirror, or delete the folder and try again later")
        raise ValueError(f"DeepMath shard {path} is truncated or corrupt ({problem}); delete it and load with "
                         "source='modelscope' to download it again")


def _read_deepmath_parquet(paths: list[Path], cache_dir: Path, sample_size: int, seed: int) -> list[dict]:
    """Read shards with datasets' parquet loader, shuffle with the seed and keep ``sample_size`` rows."""
    import datasets  # lazy: heavy

    try:
        ds = datasets.load_dataset("parquet", data_files=[str(p) for p in paths], split="train",
                                   cache_dir=str(cache_dir))
    except Exception as err:  # noqa: BLE001 - a data page damaged inside a shard whose footer is intact
        first = (str(err).splitlines() or [""])[0][:120]
        raise ValueError(f"reading the DeepMath shards {[p.name for p in paths]} failed ({type(err).__name__}: "
                         f"{first}); delete the damaged shard and load with source='modelscope' to download it "
                         "again") from err
    keep = [c for c in DEEPMATH_COLUMNS if c in ds.column_names]
    if "question" not in keep:
        raise ValueError(f"the DeepMath shards have no 'question' column (columns: {ds.column_names})")
    ds = ds.select_columns(keep).shuffle(seed=seed)
    if sample_size > 0:
        ds = ds.select(range(min(sample_size, len(ds))))
    return ds.to_list()


def load_deepmath(source: str = "auto", sample_size: int = 1000, seed: int = 42, num_shards: int = 1,
                  local_dir: str | Path = "deepmath", downloader: Downloader | None = None) -> list[dict]:
    """Load a shuffled sample of DeepMath-103K prompts (question, and final_answer / difficulty if present).

    Args:
        source: ``"modelscope"`` (download the missing shards of ``zwhe99/DeepMath-103K``, then read them),
            ``"local"`` (read shards already in ``local_dir``), ``"offline"`` (the generated prompt set
            shipped with the package, 300 problems) or ``"auto"``, which follows the backend
            (:func:`trio_helpers.backend.backend_in_use`): offline on the offline backend; on the real service
            local shards if present, else ModelScope if reachable (or a ``downloader`` is given), else an error.
            An explicit source that contradicts the backend is loaded with a one-line warning on stderr.
        sample_size: how many records to keep after shuffling; ``<= 0`` keeps all.
        seed: the shuffle seed.
        num_shards: how many of the 10 parquet shards to use (1..10; each holds about 10k problems).
        local_dir: the dataset folder.
        downloader: ``f(remote_path, dest)`` used instead of ModelScope (for tests or mirrors).
    Returns:
        A list of dicts with ``question`` and, when the source has them, ``final_answer`` and ``difficulty``.
        Prints one line naming the source used.
    Raises:
        ValueError: for an unknown source, a num_shards outside 1..10, non-int sample_size / seed, or a
            truncated or corrupt shard that cannot be downloaded again (the message names the file and the fix;
            with ``"modelscope"``, or ``"auto"`` when ModelScope is reachable, a broken shard is downloaded again).
        FileNotFoundError: for ``source="local"`` when shards are missing.
        ConnectionError: ``"auto"`` on the real service with no local shards and ModelScope unreachable.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    _check_choice("source", source, DEEPMATH_SOURCES)
    for name, value in (("sample_size", sample_size), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int; got {value!r}")
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or not 1 <= num_shards <= DEEPMATH_NUM_SHARDS:
        raise ValueError(f"num_shards must be an int from 1 to {DEEPMATH_NUM_SHARDS}; got {num_shards!r}")
    root = Path(local_dir)
    wanted = [root / deepmath_shard_name(i) for i in range(num_shards)]
    reason = ""
    repair: Callable[[], Downloader | None] = lambda: None  # noqa: E731 - how to fix a broken shard, if at all
    if source == "auto":
        if _backend() == "offline":
            source, reason = "offline", "offline backend"
        elif all(p.exists() for p in wanted):
            source, reason = "local", f"real service; found {num_shards} shard(s) in {local_dir}"
            repair = lambda: downloader or (modelscope_downloader if _reachable("modelscope.cn") else None)  # noqa: E731
        elif downloader is not None or _reachable("modelscope.cn"):
            source, reason = "modelscope", "real service; downloading missing shards"
        else:
            raise ConnectionError(
                f"load_deepmath: the real service is in use, but {local_dir!r} lacks {num_shards} shard(s) and "
                f"modelscope.cn:443 did not answer within {PROBE_TIMEOUT_S:.0f} s; copy the shards into "
                f"{local_dir!r}/data/ and use source='local'")
    else:
        _warn_if_mismatched("load_deepmath", source, "DeepMath-103K")
    if source == "offline":
        records = _read_jsonl(OFFLINE_DIR / "deepmath.jsonl")
        random.Random(seed).shuffle(records)
        records = records[:sample_size] if sample_size > 0 else records
    else:
        if source == "modelscope":
            download_deepmath_shards(num_shards, root, downloader)
            repair = lambda: downloader or modelscope_downloader  # noqa: E731
        missing = [p.name for p in wanted if not p.exists()]
        if missing:
            raise FileNotFoundError(f"missing DeepMath shards in {str(local_dir)!r}: {missing}; "
                                    f"use source='modelscope' to download them")
        _check_shards(wanted, repair)
        records = _read_deepmath_parquet(wanted, root / ".hf_cache", sample_size, seed)
    _say(f"load_deepmath: source={source} records={len(records)}" + (f" ({reason})" if reason else ""))
    return records

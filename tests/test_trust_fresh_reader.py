"""A reader who opens chapter 01 as it comes: no TRIO_BACKEND, no login, and a real ``./gsm8k`` folder next to it.

That reader used to get the offline model on real GSM8K (``load_gsm8k`` found the folder on its own while
``connect()`` chose the offline backend): none of the book's outputs, rewards near zero. Now the data follows the
backend, so the chapter must print exactly its committed outputs. This test checks that with strict nbval, the
same sanitize rules as ``make test``, in a fresh working directory and an empty ``HOME``:

- ``TRIO_BACKEND``, ``PYTRIO_*`` and the Hugging Face offline switches are removed from the kernel's environment;
- ``HOME`` is an empty directory, so pytrio finds no ``trio login`` profile (it reads ``$HOME/.pytrio``);
- the working directory holds ``gsm8k/main/{train,test}-00000-of-00001.parquet`` in the layout
  ``modelscope download --dataset AI-ModelScope/gsm8k --local_dir ./gsm8k`` writes, which
  ``load_gsm8k(source="local")`` reads (checked below, so the folder is a real temptation);
- the fitted offline models are shared through ``TRIO_OFFLINE_CACHE`` and matplotlib's font cache through
  ``MPLCONFIGDIR`` (both default to paths under ``HOME``; without them the run would refit for minutes).

The one expected difference from the committed outputs is the line ``connect()`` prints when it chooses the backend
itself (``auto``): ``make notebook`` runs with ``TRIO_BACKEND=offline``, which prints nothing. The test adds that
line to the expected outputs of the cell that calls ``connect()``, and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trio_helpers import data
from trio_helpers.offline.fit import cache_dir

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "notebooks" / "01_gsm8k_data.ipynb"
AUTO_LINE = "trio_helpers.connect: using the offline backend (run `trio login` for the real service).\n"
CALLS_CONNECT = re.compile(r"(?<![\w.])connect\(")

# Two records in GSM8K's own format (question; worked solution with calculator annotations; "#### N").
GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
               "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
               "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
]


def _reader_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRIO_BACKEND", "MPLBACKEND", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRIO_OFFLINE_HOME")
           and not k.startswith("PYTRIO_")}
    env.update(HOME=str(home), TRIO_OFFLINE_CACHE=str(cache_dir()), MPLCONFIGDIR=matplotlib.get_configdir(),
               JUPYTER_PREFER_ENV_PATH="1", PYTHONPATH=str(ROOT))
    return env


def _expected_notebook(source: Path) -> tuple[dict, int]:
    """The committed notebook with ``AUTO_LINE`` prepended to the outputs of each cell that calls connect()."""
    notebook = json.loads(source.read_text(encoding="utf-8"))
    changed = 0
    for cell in notebook["cells"]:
        text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "code" and CALLS_CONNECT.search(text):
            cell["outputs"].insert(0, {"name": "stdout", "output_type": "stream", "text": [AUTO_LINE]})
            changed += 1
    return notebook, changed


def test_chapter_01_in_a_fresh_directory_prints_its_committed_outputs(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    for split, rows in (("train", GSM8K_ROWS), ("test", GSM8K_ROWS[:1])):
        path = work / "gsm8k" / "main" / f"{split}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), path)
    # The folder really is GSM8K as the local loader reads it: the old "auto" would have chosen it.
    monkeypatch.setattr("trio_helpers.backend._ACTIVE", "remote")
    assert data.load_gsm8k("train", source="local", path=str(work / "gsm8k")) == GSM8K_ROWS

    notebook, changed = _expected_notebook(CHAPTER)
    assert changed == 1, f"expected one connect() cell in {CHAPTER.name}, found {changed}"
    (work / CHAPTER.name).write_text(json.dumps(notebook, indent=1), encoding="utf-8")

    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", "--nbval-current-env",
         f"--nbval-sanitize-with={ROOT / 'tests' / 'nbval_sanitize.cfg'}", "--nbval-cell-timeout=120",
         CHAPTER.name],
        cwd=work, env=_reader_env(home), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, (
        f"{CHAPTER.name} run as a fresh reader (no TRIO_BACKEND, no login, ./gsm8k present) differs from its "
        f"committed outputs:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}")
    assert not list(home.glob(".pytrio/**/config.toml")), "the run must not have found or written a login"

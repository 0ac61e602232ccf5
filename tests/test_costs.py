"""The cost ledger in Qwen tokens (``trio_helpers.costs``), ``--dry-run``, and the introduction's cost table.

The introduction's table must say exactly what each chapter's own ledger says: every chapter ends with a cell
that prints ``chapter_bill(...)``, whose last two lines (strict nbval re-checks them on every run) are the row.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trio_helpers.costs import TOKEN_RATIO, bill_line, chapter_bill, config_bill, real_tokens
from trio_helpers.offline.ledger import Usage

ROOT = Path(__file__).resolve().parents[1]


def test_real_tokens_applies_the_documented_ratios() -> None:
    u = Usage(prompt_tokens=1000, sampled_tokens=2000, logprob_tokens=100, forward_backward_tokens=3000,
              forward_backward_active_tokens=2000, optim_steps=3, training_runs=1)
    b = real_tokens(u)
    rp, rc = TOKEN_RATIO["prompt"], TOKEN_RATIO["completion"]
    assert b.sampled[0] == pytest.approx(2000 * rc)
    assert b.inference[1] == pytest.approx(1000 * rp + 2000 * rc + 100 * rp)
    assert b.inference[2] == pytest.approx(1000 * rp + 2000 * rc + 100 * rc)
    assert b.inference[1] < b.inference[0] < b.inference[2]
    assert b.training[0] == pytest.approx(1000 * rp + 2000 * rc)
    assert b.counts["optimizer steps"] == 3 and b.counts["training runs"] == 1


def test_bill_line_and_table_fit_the_page() -> None:
    u = Usage(requests=12_345, prompt_tokens=9_876_543, sampled_tokens=8_765_432, logprob_tokens=1_234_567,
              forward_backward_tokens=7_654_321, forward_backward_active_tokens=5_000_000, optim_steps=1000,
              training_runs=12, sampler_snapshots=1000, states_saved=100)
    assert "optimizer steps" in bill_line(u)
    assert all(len(line) <= 92 for line in chapter_bill(u).splitlines())


def test_config_bill_upper_bounds() -> None:
    from trio_helpers.distillation import OPDConfig
    from trio_helpers.grpo import GRPOConfig

    g = config_bill(GRPOConfig(steps=100, batch_size=4, group_size=4, max_tokens=512, save_every=10), 150)
    assert g["sampled"] == 100 * 16 * 512 and g["prompt"] == 100 * 4 * 150
    assert g["training"] == 100 * 16 * (150 + 511) and g["states_saved"] == 10 and "teacher" not in g
    o = config_bill(OPDConfig(steps=10, sampler_refresh_steps=4), 100)
    assert o["teacher"] == 10 * 4 * (100 + 512) and o["sampler_snapshots"] == 3


def test_dry_run_prints_a_bill_without_any_service(tmp_path) -> None:
    """The GRPO example's command, with the real service selected and no credential: nothing can be sent."""
    env = {k: v for k, v in os.environ.items() if k != "PYTRIO_API_KEY"}
    from trio_helpers.offline.fit import cache_dir

    env.update(HOME=str(tmp_path), TRIO_BACKEND="remote", TRIO_OFFLINE_HOME=str(tmp_path / "offline"),
               TRIO_OFFLINE_CACHE=str(cache_dir()))  # the fitted models, not a refit
    done = subprocess.run([sys.executable, "-m", "trio_helpers.recipes.grpo", "--dry-run", "--steps", "100",
                           "--batch-size", "4", "--group-size", "4", "--max-tokens", "512"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "nothing is sent" in done.stdout and "upper bounds" in done.stdout
    assert "sampled 819.2k" in done.stdout  # 100 steps x 16 completions x 512 tokens
    assert "estimate from a 3-step offline run" in done.stdout
    assert not (tmp_path / "runs").exists()


def test_dry_run_refuses_what_a_real_run_refuses(capsys) -> None:
    from trio_helpers.recipes import grpo

    with pytest.raises(SystemExit) as exc:
        grpo.main(["--dry-run", "--group-size", "1"])
    assert exc.value.code == 2
    assert "group_size=1" in capsys.readouterr().err


def _chapter_bills() -> dict[str, str]:
    bills = {}
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            if cell["cell_type"] == "code" and "print(chapter_bill(" in "".join(cell["source"]):
                text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
                lines = [line.strip() for line in text.strip().splitlines()]
                bills[path.name[:2]] = "; ".join(lines[-2:])
    return bills


def test_every_chapter_ends_with_its_bill() -> None:
    chapters = sorted(p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    bills = _chapter_bills()
    assert sorted(bills) == chapters, f"chapters without a chapter_bill cell: {set(chapters) - set(bills)}"


def test_the_introductions_cost_table_equals_the_chapters_ledgers() -> None:
    intro = (ROOT / "book" / "intro.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\|\s*(\d\d)\s*\|[^|]*\|\s*(inference [^|]+?)\s*\|", intro, re.M))
    bills = _chapter_bills()
    assert rows, "book/intro.md has no cost table rows (| NN | chapter | inference ... |)"
    assert rows == bills

"""The cost ledger in Qwen tokens (``trio_helpers.costs``), ``--dry-run``, and the introduction's cost table.

The introduction's tables must say what ``tools/cost_table.py`` computes from each chapter's recorded run:
every chapter ends with a cell that prints ``chapter_bill(...)`` (strict nbval re-checks it on every run), and
the tool's measurement of a chapter must have recorded exactly that output.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trio_helpers.costs import (TOKEN_RATIO, TYPICAL_COMPLETION_TOKENS, bill_line, chapter_bill, config_bill,
                                real_tokens, service_cost)
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


def _cost_table_tool():
    spec = importlib.util.spec_from_file_location("cost_table", ROOT / "tools" / "cost_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_service_cost_bounds_completions_by_max_tokens() -> None:
    u = Usage(requests=10, samples=12, prompt_tokens=1000, sampled_tokens=900, training_runs=2,
              sampler_snapshots=3, sampler_weights_saved=1)
    c = service_cost(u, {256: 8, 1024: 4})
    assert c.completion_bound == 8 * 256 + 4 * 1024
    assert c.completion_typical == 8 * 256 + 4 * TYPICAL_COMPLETION_TOKENS
    assert c.prompt_tokens == pytest.approx(1000 * TOKEN_RATIO["prompt"])
    assert (c.training_runs, c.sampler_saves, c.requests, c.samples) == (2, 4, 10, 12)
    with pytest.raises(ValueError, match="samples"):
        service_cost(u, {256: 11})


def test_offline_only_services_cost_nothing_on_the_service() -> None:
    """A chapter whose every service is connect("offline", ...) sends nothing after `trio login`; a chapter's
    forced-offline side services (fault injection) are billed apart; its `service` counts even when the offline
    run replaced it with a forced-offline twin (chapters 04 and 05)."""
    tool = _cost_table_tool()
    used = {"requests": 5, "samples": 2, "training_runs": 1}

    def svc(is_service, forced, usage):
        return {"is_service": is_service, "forced_offline": forced, "usage": usage, "max_tokens": {"256": 2}}

    only_offline = {"services": [svc(False, True, used), svc(False, True, used)]}
    (on, on_limits), (off, off_limits) = tool.split(only_offline)
    assert on.requests == 0 and on_limits == {} and off.requests == 10 and off_limits == {256: 4}
    replaced = {"services": [svc(False, False, {}), svc(True, True, used), svc(False, True, used)]}
    (on, _), (off, _) = tool.split(replaced)
    assert on.requests == 5 and off.requests == 5


def test_the_cost_measurements_are_the_committed_notebooks() -> None:
    """Each chapter's measurement was taken from the committed notebook: the chapter_bill output it recorded is
    the notebook's. After re-executing a chapter, run `python tools/cost_table.py NN`."""
    problems = [p for p in _cost_table_tool().stale() if "book/intro.md" not in p]
    assert not problems, "\n".join(problems)


def test_the_introductions_cost_table_equals_what_the_tool_computes() -> None:
    tool = _cost_table_tool()
    intro = (ROOT / "book" / "intro.md").read_text(encoding="utf-8")
    assert tool.intro_table(intro) == tool.render(tool.load()), "run: python tools/cost_table.py --write-only"


@pytest.mark.parametrize("recipe", ["grpo", "opd", "evaluate"])
def test_help_states_each_default_once(recipe, capsys) -> None:
    module = importlib.import_module(f"trio_helpers.recipes.{recipe}")
    with pytest.raises(SystemExit):
        module.main(["--help"])
    text = capsys.readouterr().out
    # argparse wraps help text: join each option's lines before counting
    entries = re.split(r"\n  (?=-)", re.sub(r"\n\s{20,}", " ", text))
    twice = [e for e in entries if e.lower().count("default") > 1]
    assert not twice, twice
    assert "(default: None)" not in text and "(default: False)" not in text

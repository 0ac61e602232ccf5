# Build, test and regenerate the PyTRIO RL book. Every target runs inside .venv, created on first use.
#
#   make book                          build the HTML book from the committed notebook outputs (no execution)
#   make book-zh                       build the Simplified Chinese edition into _build/zh_CN/html (locales/)
#   make catalogs                      regenerate the Chinese edition's message catalogs from the English text
#   make test                          unit tests + strict nbval over notebooks/*.ipynb on the offline backend
#   make test-service                  run every chapter on the real service (needs `trio login`) and check it
#   make notebook NB=notebooks/NN_x.md re-execute one chapter offline and rewrite its .ipynb/.md pair
#   make notebooks                     the same for every chapter
#   make venv                          create/update .venv (automatic; re-runs when requirements change)
#   make clean                         remove build and test outputs (keeps .venv; `rm -rf .venv` for that)

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Environment for executing chapters: offline backend, no hub downloads, the kernel's own inline
# matplotlib backend (an inherited MPLBACKEND=Agg would drop every figure), the venv's kernel spec.
# One BLAS thread: for speed only (the offline numbers are the same bits on any thread count; see conftest.py).
RUN_ENV := env -u MPLBACKEND TRIO_BACKEND=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 JUPYTER_PREFER_ENV_PATH=1 \
	OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
CELL_TIMEOUT := 600

.PHONY: help venv test test-service book book-zh catalogs notebook notebooks clean

help:
	@sed -n '3,11p' Makefile | sed 's/^# *//'

venv: $(STAMP)

# Idempotent: the stamp is rebuilt (pip install re-run) only when requirements.txt or pyproject.toml change.
$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "error: the book needs Python >= 3.11; '$(PYTHON)' is $$($(PYTHON) --version 2>&1). Use make PYTHON=python3.11 ..." >&2; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -r requirements.txt
	$(BIN)/python -m pip install --quiet -e . --no-deps
	touch $@

# `make test` runs the suite on three pytest-xdist workers on this 2-core machine: chapter 05 spends about half its
# time waiting (the simulated service latency it teaches with), and a third worker runs another file meanwhile
# (benchmarks/bench_book.py: -n 3 finished the notebooks in less time than -n 2 in each of two paired runs).
# `--dist loadfile` keeps each file on one worker, so a notebook's cells run in order on one kernel; files go out in
# collection order, which conftest.py sorts slowest notebook first. Plain `pytest` runs serially.
# benchmarks/bench_book.py times the notebooks with this target's own command (`make -n test`).
TEST_ARGS := -n 3 --dist loadfile --no-loadscope-reorder

test: venv
	TRIO_BACKEND=offline $(BIN)/python -m pytest $(TEST_ARGS)

# With a PyTRIO credential: run every chapter on the real service (costs real tokens; see the intro's cost table)
# and check each chapter's invariants; without one: say so in one line and exit 0. Not part of .ci/run.
test-service: venv
	env -u MPLBACKEND JUPYTER_PREFER_ENV_PATH=1 $(BIN)/python tools/check_service.py

book: venv
	$(BIN)/jupyter-book build . -W -n --keep-going --all

# The Chinese edition: the same pages and notebooks with language zh_CN, translated through the catalogs in
# locales/zh_CN/LC_MESSAGES/; -W -n --keep-going like `make book`, so any warning fails it (locales/i18n.py).
book-zh: venv
	$(BIN)/python locales/i18n.py html

# .pot files from the English text into _build/gettext, then `sphinx-intl update` of the catalogs: new or
# changed English text becomes untranslated or fuzzy entries to translate (see locales/README.md).
catalogs: venv
	$(BIN)/python locales/i18n.py catalogs

# NB may name either file of a pair (or the pair's stem); the .md is the source you edit.
notebook: venv
	@case "$(NB)" in \
	  notebooks/[0-9][0-9]_*) ;; \
	  *) echo "usage: make notebook NB=notebooks/NN_topic.md" >&2; exit 2 ;; \
	esac
	$(BIN)/jupytext --to ipynb --update $(basename $(NB)).md
	$(RUN_ENV) $(BIN)/jupyter-execute --inplace --timeout=$(CELL_TIMEOUT) $(basename $(NB)).ipynb
	$(BIN)/jupytext --to md:myst $(basename $(NB)).ipynb

notebooks: venv
	for nb in notebooks/[0-9][0-9]_*.md; do \
	  [ -e "$$nb" ] || { echo "no notebooks/NN_*.md yet"; exit 0; }; \
	  $(MAKE) --no-print-directory notebook NB="$$nb"; \
	done

clean:
	rm -rf _build .pytest_cache .hypothesis swanlog notebooks/swanlog notebooks/runs
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

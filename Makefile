# One virtual environment in the repo; torch and triton pinned through constraints.txt.
VENV   := .venv
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

.PHONY: setup browser run test test-fast bench study leaderboard clean

setup: $(STAMP)

$(STAMP): requirements.txt constraints.txt pyproject.toml
	test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(PIP) install -q -c constraints.txt torch triton
	$(PIP) install -q -c constraints.txt -r requirements.txt
	$(PIP) install -q -c constraints.txt --no-deps -e .
	touch $(STAMP)

# The report test drives a real headless Chromium (Debian's chromium + chromium-driver). Installed here
# when missing and apt-get is usable as root; otherwise say why that one test will skip.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium and chromium-driver for the browser test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
		|| echo "could not install chromium with apt-get: the browser test will skip"; \
	else \
		echo "chromium/chromedriver not found and apt-get needs root: the browser test will skip"; \
	fi

run: setup
	$(OFFLINE) $(VENV)/bin/evalkit run --policy h2o_head --budget 0.2

# Every test, on two pytest-xdist workers with one torch thread each (docs/running.md, "Tests").
test: setup browser
	OMP_NUM_THREADS=1 $(OFFLINE) $(VENV)/bin/pytest -q -n 2

# The fast tier (55 s on the idle 2-core machine, docs/running.md): the tests marked neither `model` (they need the
# default model's files, even only its tokenizer) nor `slow` (2 s or more each, Chromium's among them, and the cases
# of the big equivalence tables outside the tier's sample: `fast_tier_keeps_one_in`). Each test carries its marker
# and the reason; tests/conftest.py ("Two tiers") says how. Two pytest-xdist workers, one torch thread each.
test-fast: setup
	OMP_NUM_THREADS=1 $(OFFLINE) $(VENV)/bin/pytest -q -n 2 -m "not model and not slow"

bench: setup
	$(OFFLINE) $(VENV)/bin/evalkit bench

# The study's sweeps, in the order of docs/granularity-notebook.md's plan (a finished one checks itself and stops);
# each resumes where it stopped. `make -j2 study`: two at a time, one torch thread each
# (on the busy 2-core machine one thread a process was 2.9x faster than two, docs/sweeps.md). study-X runs
# configs/study/X.yaml (the sequel's grids), granularity-X configs/granularity/X.yaml (the 2,048-token ones).
STUDY := study-lengths_query_aware granularity-query_aware granularity-query_agnostic \
         study-lengths_query_agnostic study-scorers_4k study-ruler_4k_baseline study-ruler_4k study-ruler_4k_unsolved \
         study-gemma3_4k_baseline study-gemma3_4k study-gemma3_4k_unsolved \
         study-gemma3_8k_baseline study-gemma3_8k study-frontier_2k_agnostic study-frontier_2k_aware \
         study-frontier_4k_agnostic study-frontier_gemma3_4k_agnostic \
         study-multiturn_2k study-multiturn_gemma3_2k study-long_answer_2k study-ppl_token_512 \
         study-long_answer_gemma3_2k_baseline study-ppl_token_gemma3_512

study: $(STUDY)

# glibc: a branch's cache buffers (a few MB each) come from the heap and go back to it, so the next branch's
# reuse them instead of faulting fresh pages in (0.96 of the time, docs/benchmarks.md); elsewhere ignored.
MALLOC := MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=8589934592
SWEEP := OMP_NUM_THREADS=1 $(MALLOC) $(OFFLINE) $(VENV)/bin/evalkit sweep --wandb off --config

study-%: setup
	$(SWEEP) configs/study/$*.yaml

granularity-%: setup
	$(SWEEP) configs/granularity/$*.yaml

# The study's leaderboard (docs/leaderboard/: index.html, PNGs, leaderboard.csv) from its results folders, read
# only; a run still being written is listed as left out, and the next `make leaderboard` adds it.
LEADERBOARD_RUNS := runs/granularity runs/granularity-query-agnostic runs/study

leaderboard: setup
	$(OFFLINE) $(VENV)/bin/evalkit report $(LEADERBOARD_RUNS) -o docs/leaderboard

# Keeps the committed study folders (.gitignore): they hold hours of sweeps.
clean:
	rm -rf $(VENV) wandb report .pytest_cache .hypothesis
	git clean -fdXq runs

# One virtual environment in the repo; torch and triton pinned through constraints.txt.
VENV   := .venv
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

.PHONY: setup run test bench clean

setup: $(STAMP)

$(STAMP): requirements.txt constraints.txt pyproject.toml
	test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(PIP) install -q -c constraints.txt torch triton
	$(PIP) install -q -c constraints.txt -r requirements.txt
	$(PIP) install -q -c constraints.txt --no-deps -e .
	touch $(STAMP)

run: setup
	$(OFFLINE) $(VENV)/bin/evalkit run --policy h2o_head --budget 0.2

test: setup
	$(OFFLINE) $(VENV)/bin/pytest -q

bench: setup
	$(OFFLINE) $(VENV)/bin/python scripts/bench_loop.py

clean:
	rm -rf $(VENV) runs wandb .pytest_cache .hypothesis

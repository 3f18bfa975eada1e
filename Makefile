# Two set-up commands: `make train` and `make test`. Both create .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/tiny_lm
PYTEST_ARGS ?=

.PHONY: train test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

train: $(VENV)/.installed
	$(PY) -m launch.train --config=configs/tiny_lm.py --workdir=$(WORKDIR) --cpu_devices=8

test: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 --dist=loadgroup -q -rfE $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs

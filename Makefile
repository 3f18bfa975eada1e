# Two set-up commands: `make train` and `make test`. Both create .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/tiny_lm
PYTEST_ARGS ?=

.PHONY: train test chaos install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

# torch is a test-only dependency (Hugging Face parity tests). Pinned and installed first so
# the CPU build is used and transformers does not pull a CUDA build.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

train: $(VENV)/.installed
	$(VENV)/bin/jaxscale train --config=tiny_lm --workdir=$(WORKDIR) --cpu_devices=8

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n 2 --dist=loadgroup -q -rfE $(PYTEST_ARGS)

# Fault injection before a release (docs/faults.md): slow, so not part of `make test`.
chaos: $(VENV)/.installed-test
	$(PY) bench/chaos.py $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) runs

# Two set-up commands: `make train` and `make test`. Both create a venv on first use: `.venv` for
# Python 3.11 (the default where it is installed), `.venv312` / `.venv313` for
# `make test PYTHON=python3.12` / `python3.13`, so the two ends of the supported range sit side by
# side (3.11 resolves jax 0.10.2, 3.12 and 3.13 jax 0.12.x).
PYTHON ?=
PYTHON_EXE := $(shell .ci/find-python $(PYTHON))
PYVER := $(shell $(PYTHON_EXE) -c 'import sys; print("%d%d" % sys.version_info[:2])' 2>/dev/null)
VENV ?= $(if $(filter 311,$(PYVER)),.venv,.venv$(PYVER))
PY := $(VENV)/bin/python
WORKDIR ?= runs/tiny_lm
PYTEST_ARGS ?=
# The Hugging Face parity tests need torch, whose fast CPU wheel is on hand for Python 3.11 only
# (elsewhere the registry serves a multi-GB CUDA build): on by default there, off elsewhere, where
# those tests skip with a one-line reason. PARITY=1 / PARITY=0 overrides.
PARITY ?= $(if $(filter 311,$(PYVER)),1,0)

.PHONY: train test test-deps chaos install clean

$(PY):
	@test -n "$(PYTHON_EXE)" || { echo "make: no working Python $(or $(PYTHON),3.11..3.13) \
	found on PATH or in pyenv; pass PYTHON=/path/to/python3.12" >&2; exit 1; }
	$(PYTHON_EXE) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

# torch is a test-only dependency (the `parity` extra). Pinned and installed first so the CPU
# build is used and transformers does not pull a CUDA build.
$(VENV)/.installed-test: $(VENV)/.installed
ifeq ($(PARITY),1)
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test,parity]"
else
	$(PY) -m pip install --quiet -e ".[test]"
endif
	touch $@

install: $(VENV)/.installed

# The test venv alone (`make test` builds it first too): CI installs its two legs' venvs at once.
test-deps: $(VENV)/.installed-test

train: $(VENV)/.installed
	$(VENV)/bin/jaxscale train --config=tiny_lm --workdir=$(WORKDIR) --cpu_devices=8

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(PY) -c 'import jax, sys; print(f"Python {sys.version.split()[0]}, jax {jax.__version__}")'
	$(PY) -m pytest -n 2 --dist=loadgroup -q -rfE $(PYTEST_ARGS)

# Fault injection before a release (docs/faults.md): slow, so not part of `make test`.
chaos: $(VENV)/.installed-test
	$(PY) bench/chaos.py $(CHAOS_ARGS)

clean:
	rm -rf .venv .venv312 .venv313 runs

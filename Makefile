# The README's two commands: `make demo` (install + run on the built-in demo model) and
# `make test` (install + the whole test suite). Both work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
# torch is pinned exactly: a bare `torch` or a range pulls a multi-GB CUDA build on CPU-only
# machines. On a GPU machine this same pin takes PyPI's CUDA build. TORCH= keeps yours.
TORCH ?= torch==2.13.0
PIP := $(VENV)/bin/python -m pip

.PHONY: install install-test demo test

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

install: $(VENV)/bin/python
	$(PIP) install -q $(TORCH) -e .

install-test: $(VENV)/bin/python
	$(PIP) install -q $(TORCH) -e '.[test]'

demo: install
	$(VENV)/bin/omnivox generate --prompt "Hello! Who are you?" --out reply.wav

test: install-test
	$(VENV)/bin/python -m pytest

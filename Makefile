# The README's two commands: `make serve` (install + the OpenAI-compatible server on the built-in
# demo model) and `make test` (install + the whole test suite). Both work on a fresh clone.
# `make demo` answers one prompt offline. PORT=8000 and HOST=127.0.0.1 by default.
PYTHON ?= python3
VENV ?= .venv
# torch is pinned exactly (a bare `torch` or a range could take any release). On Linux, PyPI's
# torch==2.13.0 is the CUDA build; CPU-only machines elsewhere add PyTorch's CPU index (README:
# TORCH="torch==2.13.0 --extra-index-url ..."). TORCH= keeps the torch you have.
TORCH ?= torch==2.13.0
PIP := $(VENV)/bin/python -m pip
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-test serve demo test

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

install: $(VENV)/bin/python
	$(PIP) install -q $(TORCH) -e .

# The reference DFlash (z-lab's `dflash`, the speculative parity tests) goes in without its
# dependencies: it pins a datasets/requests stack its model code never imports (it needs torch and
# transformers, which the test extras pin). Likewise Kyutai's `moshi` (the duplex family's
# reference): it declares torch<2.10 but runs under torch 2.13 with the test extras' einops,
# sentencepiece and huggingface_hub.
install-test: $(VENV)/bin/python
	$(PIP) install -q $(TORCH) -e '.[test]'
	$(PIP) install -q --no-deps dflash==0.1.0 moshi==0.2.13

serve: install
	$(VENV)/bin/omnivox serve --host $(HOST) --port $(PORT)

demo: install
	$(VENV)/bin/omnivox generate --prompt "Hello! Who are you?" --out reply.wav

test: install-test
	$(VENV)/bin/python -m pytest

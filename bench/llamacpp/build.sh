#!/usr/bin/env bash
# Build llama.cpp's benchmark and server tools from the llama.cpp that the llama-cpp-python sdist
# vendors, in a scratch directory outside the repository (not part of CI).
#
#   bench/llamacpp/build.sh SCRATCH_DIR [LLAMA_CPP_PYTHON_VERSION]
#
# Leaves SCRATCH_DIR/llama.cpp (sources, convert_hf_to_gguf.py, gguf-py) and SCRATCH_DIR/llama.cpp/build/bin
# (llama-bench, llama-server, llama-quantize, llama-batched-bench), built with -march=native.
# Idempotent: an existing build is reused; delete SCRATCH_DIR to start again.
set -euo pipefail

scratch=${1:?usage: build.sh SCRATCH_DIR [LLAMA_CPP_PYTHON_VERSION]}
version=${2:-0.3.36}
repo_root=$(cd "$(dirname "$0")/../.." && pwd)
pip=${PIP:-$repo_root/.venv/bin/pip}
jobs=${JOBS:-$(nproc)}

mkdir -p "$scratch"
scratch=$(cd "$scratch" && pwd)
case "$scratch/" in
  "$repo_root"/*) echo "build.sh: SCRATCH_DIR must be outside the repository" >&2; exit 2 ;;
esac
cd "$scratch"

sdist=llama_cpp_python-$version.tar.gz
if [ ! -f "$sdist" ]; then
  "$pip" download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d .
fi
if [ ! -d llama.cpp ]; then
  tar -xzf "$sdist"
  mv "llama_cpp_python-$version/vendor/llama.cpp" llama.cpp
  rm -rf "llama_cpp_python-$version"
fi

# convert_hf_to_gguf.py imports sentencepiece for llama models even when the tokenizer is BPE.
"$pip" install --quiet sentencepiece

cd llama.cpp
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \
  > build-configure.log
cmake --build build -j "$jobs" --target llama-bench llama-server llama-quantize llama-batched-bench \
  > build-compile.log
ls build/bin

#!/usr/bin/env bash
# kvik's GPU check, in one go on a machine with an NVIDIA GPU (nothing here runs in CI):
#   1. the CUDA tests (`pytest -m gpu`): greedy parity with HF, decode steps replayed as CUDA graphs
#      against eager steps, speculative decoding, int8/int4 weights and int8 KV on the GPU;
#   2. bench/decode_graphs.py on a random 1.1B Llama (`kvik make-model --size 1b`): decode tok/s with
#      graphs, eager and HF generate at batch 1, 16 and 64;
#   3. `kvik bench compare` on the same model against HF static batching on the same card.
# Usage: bash bench/gpu_check.sh [OUT_DIR]   (default gpu-check/; PYTHON=python3 by default).
# Needs torch with CUDA, transformers and kvik's engine dependencies importable; run from the repo root.
set -u
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KVIK_CACHE_DIR=${KVIK_CACHE_DIR:-/tmp/kvik-gpu-check-cache}
model=${KVIK_GPU_CHECK_MODEL:-/tmp/kvik-gpu-check-1b}
started=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - started )) s)"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$out/device.txt"
$py -c "import kvik.engine.core, kvik.bench.compare" || { echo "kvik does not import: stopping"; exit 1; }

# The 1.1B model is written on the CPU while the tests use the GPU.
if [ ! -f "$model/config.json" ]; then
    $py -m kvik.cli.main make-model --size 1b --dtype bfloat16 "$model" > "$out/make-model.log" 2>&1 &
    maker=$!
fi

step "CUDA tests"
timeout 170 $py -m pytest -q -p no:cacheprovider -m gpu --timeout 150 \
    tests/engine/test_cuda.py tests/model/test_quant_cuda.py 2>&1 | tee "$out/tests.log"

if [ -n "${maker:-}" ]; then
    step "waiting for the 1b model"
    wait "$maker" || { cat "$out/make-model.log"; exit 1; }
fi

step "decode: graphs vs eager vs HF"
timeout 120 $py bench/decode_graphs.py --model "$model" --dtype bfloat16 --batch-sizes 1,16,64 \
    --tokens 128 --json "$out/decode_graphs.json" 2>&1 | grep -v "Loading weights" | tee "$out/decode_graphs.log"

step "kvik bench compare (offline, single-stream decode) vs HF on the same card"
timeout 150 $py -m kvik.cli.main bench compare --model "$model" --device cuda --dtype bfloat16 \
    --systems kvik,hf-static --skip online,prefix --num-requests 64 --output-len-range 16,256 \
    --kv-cache-memory 16GiB --out "$out/compare" 2>&1 | grep -v "Loading weights\|it/s\]$" | tee "$out/compare.log"
step "done"

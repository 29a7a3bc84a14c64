#!/usr/bin/env bash
# What benchmarks/gpu_check.sh needs on a GPU machine with no network, in .whl/ (git-ignored,
# carried to that machine): the cp312 manylinux x86-64 wheels of what tokenbus imports and the
# image lacks (it has torch, triton, transformers, tokenizers, safetensors, numpy, aiohttp,
# httpx, pytest, ...), installed there with `pip install --no-index --no-deps --target`; and
# SmolLM2's tokenizer, exported from the packaged GGUF (the GGUF itself is too big to carry),
# for the random-weight models of benchmarks/configs/. Run here, where PyPI is reachable.
#
#     make install && bash benchmarks/gpu_wheels.sh     # then carry .whl to the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.whl}
# One version each (two of one package stop the install there). Dependencies are named
# explicitly: --no-deps below, because the GPU image already has most of them.
WHEELS=(
    msgspec==0.23.0 pyzmq==27.3.0 gguf==0.19.0
    xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
    fastapi==0.165.0 annotated-doc==0.0.7 starlette==1.10.0 opentelemetry-api==1.45.2
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0 uvicorn==0.55.0
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
    rpds-py==2026.9.1
)
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${WHEELS[@]}"
PY=${PYTHON:-.venv/bin/python}
"$PY" - "$DEST/smollm2-tokenizer" <<'PYEOF'
import sys
from transformers import AutoTokenizer
from tokenbus.loader.source import packaged_smollm2_gguf
gguf = packaged_smollm2_gguf()
AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(sys.argv[1])
PYEOF
echo "gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels and a tokenizer, $(du -sh "$DEST" | cut -f1) in $DEST"

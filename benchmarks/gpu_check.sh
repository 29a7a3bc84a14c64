#!/usr/bin/env bash
# The CUDA paths in one prepared run, on a GPU machine with torch (CUDA build) and no network.
# Prepare here first: `bash benchmarks/gpu_wheels.sh` fills .whl/ (wheels the GPU image lacks,
# SmolLM2's tokenizer); carry .whl to the GPU machine. There:
#   1. installs the carried wheels with pip --no-index --no-deps --target (never the network);
#   2. runs the CUDA-marked tests and the Triton tests (CUDA graphs against eager, greedy
#      tokens against HF transformers in fp32 and bf16, the kernels against a reference);
#   3. measures (benchmarks/gpu_bench.py): the copy bandwidth; one decode stream of a dummy
#      Llama-3.1-8B in bf16 against weight bytes / bandwidth; offline throughput of 256 prompts
#      (512 in, 256 out) against HF generate at its best batch size; CUDA graphs against eager
#      at batch 1 and 64 on the SmolLM2 shape and the 8B;
#   4. serves the dummy 8B and runs `tokenbus bench serve` at concurrency 1, 64 and 256.
# Each part has its own time limit; the whole run stays under 8 minutes. Logs and one JSON per
# part land in $OUT (default ./gpu_check_out), and figures.json gathers them.
#
#     bash benchmarks/gpu_check.sh          # DRY_RUN=1: stop after the checks, before any work
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
start=$(date +%s)
status=0
note() { echo "gpu_check: $*" | tee -a "$OUT/summary.log"; }

$PY - <<'EOF' || { note "no CUDA device"; exit 2; }
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("torch", torch.__version__, "CUDA", torch.version.cuda, "on", torch.cuda.get_device_name(0))
EOF
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/tokenbus-site .whl/*.whl || note "installing the carried wheels failed"
    export PYTHONPATH="/tmp/tokenbus-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD:$PYTHONPATH"
TOKENIZER=.whl/smollm2-tokenizer
[ -f "$TOKENIZER/tokenizer.json" ] || { note "no $TOKENIZER: run benchmarks/gpu_wheels.sh"; exit 2; }
[ "${DRY_RUN:-0}" = 1 ] && { note "dry run: checks passed"; exit 0; }

run() {  # run NAME SECONDS CMD...: a part under its own limit, its log in $OUT/NAME.log
    local name=$1 limit=$2; shift 2
    note "== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    note "$name rc=$rc after $(( $(date +%s) - start )) s"
    [ $rc -eq 0 ] || status=1
}

run tests 150 $PY -m pytest -q -p no:cacheprovider --timeout=120 -rs \
    tests/worker/test_cuda_graphs.py tests/e2e/test_cuda_greedy.py \
    tests/model/test_triton_attention.py tests/model/test_attention_backend.py \
    tests/e2e/test_triton_and_dummy.py

LLAMA=benchmarks/configs/llama-3.1-8b
SMOL=benchmarks/configs/smollm2-135m
BENCH="$PY benchmarks/gpu_bench.py --tokenizer $TOKENIZER"
run bandwidth 30 $BENCH bandwidth --json "$OUT/bandwidth.json"
BW=$($PY -c "import json; print(json.load(open('$OUT/bandwidth.json'))['bandwidth_bytes_per_s'])" \
    2>/dev/null || echo "")
run decode_8b 75 $BENCH decode --model $LLAMA ${BW:+--bandwidth $BW} --json "$OUT/decode_8b.json"
run throughput_8b 120 $BENCH throughput --model $LLAMA --json "$OUT/throughput_8b.json"
run graphs_smollm2 45 $BENCH graphs --model $SMOL --output-len 128 --json "$OUT/graphs_smollm2.json"
run graphs_8b 75 $BENCH graphs --model $LLAMA --output-len 64 --json "$OUT/graphs_8b.json"

note "== serving the dummy 8B"
PORT=18123
$PY -m tokenbus.cli.main serve $LLAMA --load-format dummy --tokenizer $TOKENIZER \
    --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256 --port $PORT \
    > "$OUT/server.log" 2>&1 &
server=$!
for _ in $(seq 120); do
    curl -fs "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    sleep 1
done
for c in 1 64 256; do
    prompts=$(( c == 1 ? 16 : 2 * c ))
    run serve_c$c 60 $PY -m tokenbus.cli.main bench serve --base-url "http://127.0.0.1:$PORT" \
        --max-concurrency $c --num-prompts $prompts --input-len 256 768 --output-len 128 256 \
        --ignore-eos --tokenizer $TOKENIZER --output-json "$OUT/serve_c$c.json"
done
kill "$server" 2>/dev/null; wait "$server" 2>/dev/null

$PY - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
figures = {}
for path in sorted(out.glob("*.json")):
    if path.name == "figures.json":
        continue
    data = json.loads(path.read_text())
    for heavy in ("input_lens", "output_lens", "ttfts", "itls", "errors"):
        data.pop(heavy, None)  # bench serve's per-request lists
    figures[path.stem] = data
(out / "figures.json").write_text(json.dumps(figures, indent=1))
print(json.dumps(figures, indent=1)[:6000])
EOF
note "done in $(( $(date +%s) - start )) s, status $status; logs in $OUT"
exit $status

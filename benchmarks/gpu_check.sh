#!/usr/bin/env bash
# The CUDA paths in one prepared run, on a GPU machine with torch (CUDA build) and no network.
# Prepare here first: `bash benchmarks/gpu_wheels.sh` fills .whl/ (wheels the GPU image lacks,
# SmolLM2's tokenizer); carry .whl to the GPU machine (it is git-ignored: name it in `carry`).
# There:
#   1. installs the carried wheels with pip --no-index --no-deps --target (never the network);
#   2. preflight: the server's imports, and one Triton kernel compiled and launched (Triton
#      builds its launcher with the machine's C compiler); if that fails, the benchmarks run
#      on the torch attention path and the summary says so;
#   3. runs the CUDA-marked tests (CUDA graphs against eager, a sliding-window model's and
#      draft-verification steps' among them, one synchronizing call a decode step, greedy
#      tokens against HF transformers in fp32 and bf16, the Triton backend through the
#      engine), then the Triton kernel tests against a reference, in parallel;
#   4. measures (benchmarks/gpu_bench.py): the copy bandwidth; one decode stream of a dummy
#      Llama-3.1-8B in bf16 against weight bytes / bandwidth (steps one at a time, then
#      with --async-scheduling); CUDA graphs against eager at
#      batch 1 and 64 on the SmolLM2 shape; offline throughput of 256 prompts (512 in, 256
#      out) against HF generate at its best batch size; then serves the dummy 8B and runs
#      `tokenbus bench serve` at concurrency 1, 64 and 256; last, graphs against eager on the
#      8B.
# Each part has its own time limit, cut to what is left of DEADLINE (seconds from the start,
# default 470: under 8 minutes in all); a part with under 15 s left is skipped and
# named. Logs and one JSON per part go to $LOGS; after every part $OUT (default
# ./gpu_check_out) holds three files, so a run stopped at any point still brings them back:
# summary.log, figures.json (every part's JSON so far) and logs.tar.gz.
#
#     DRY_RUN=1 bash benchmarks/gpu_check.sh    # stop after the checks, before any work
#     REHEARSE=1 bash benchmarks/gpu_check.sh   # every step on CPU, small: the script's own
#                                               # plumbing (no figure from it means anything)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu_check_out}
LOGS=${LOGS:-/tmp/gpu_check_logs}
DEADLINE=${DEADLINE:-470}
mkdir -p "$OUT" "$LOGS"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
start=$(date +%s)
status=0
note() { echo "gpu_check: $*" | tee -a "$OUT/summary.log"; }

REHEARSE=${REHEARSE:-0}
[ "$REHEARSE" = 1 ] || $PY - <<'EOF' || { note "no CUDA device"; exit 2; }
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("torch", torch.__version__, "CUDA", torch.version.cuda, "on", torch.cuda.get_device_name(0))
EOF
if [ "$REHEARSE" != 1 ] && compgen -G ".whl/*.whl" >/dev/null; then  # cp312: the GPU image's
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/tokenbus-site .whl/*.whl || note "installing the carried wheels failed"
    export PYTHONPATH="/tmp/tokenbus-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
TOKENIZER=.whl/smollm2-tokenizer
[ -f "$TOKENIZER/tokenizer.json" ] || { note "no $TOKENIZER: run benchmarks/gpu_wheels.sh"; exit 2; }
export TOKENBUS_TEST_TOKENIZER="$PWD/$TOKENIZER"  # the tiny test models' tokenizer
[ "${DRY_RUN:-0}" = 1 ] && { note "dry run: checks passed"; exit 0; }

$PY - > "$LOGS/preflight.log" 2>&1 <<'EOF' || { note "preflight: an import failed"; cat "$LOGS/preflight.log"; exit 3; }
import shutil, sysconfig
import fastapi, msgspec, triton, xgrammar, zmq  # noqa: F401
import tokenbus.api.openai.server  # noqa: F401  (the server's whole import tree)
print("triton", triton.__version__, "cc", shutil.which("cc") or shutil.which("gcc"),
      "Python.h dir", sysconfig.get_paths()["include"])
EOF
ATTENTION=auto
if [ "$REHEARSE" != 1 ] && ! $PY - >> "$LOGS/preflight.log" 2>&1 <<'EOF'; then
import torch, triton, triton.language as tl

@triton.jit
def _twice(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

x = torch.arange(10, device="cuda", dtype=torch.float32)
_twice[(1,)](x, 10, BLOCK=16)
assert x.tolist() == [2.0 * i for i in range(10)], x
print("a Triton kernel compiled and ran")
EOF
    ATTENTION=torch
    note "preflight: no Triton kernel ran (log: preflight.log); benchmarks use the torch path"
fi
tail -n 3 "$LOGS/preflight.log"

gather() {  # $OUT/figures.json from every part's JSON so far, and the logs in one archive
    $PY - "$LOGS" "$OUT" "$ATTENTION" <<'PYEOF'
import json, pathlib, sys
logs, out, attention = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
figures = {"attention_backend": attention}
for path in sorted(logs.glob("*.json")):
    try:
        data = json.loads(path.read_text())
    except ValueError:
        continue  # a part stopped while writing it
    for heavy in ("input_lens", "output_lens", "ttfts", "itls", "errors", "generated_texts"):
        data.pop(heavy, None)  # bench serve's per-request lists
    figures[path.stem] = data
(out / "figures.json").write_text(json.dumps(figures, indent=1))
PYEOF
    tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null
}

seconds_left() { echo $(( DEADLINE - ($(date +%s) - start) )); }
source benchmarks/lib.sh  # start_server, stop_server

run() {  # run NAME SECONDS CMD...: a part under its own limit (cut to the deadline)
    local name=$1 limit=$2; shift 2
    local left
    left=$(seconds_left)
    (( limit > left )) && limit=$left
    if (( limit < 15 )); then
        note "== $name skipped: ${left}s left of the ${DEADLINE}s deadline"
        status=1
        return
    fi
    note "== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n 15 "$LOGS/$name.log"
    note "$name rc=$rc after $(( $(date +%s) - start )) s"
    [ $rc -eq 0 ] || status=1
    gather
}

PYTEST="$PY -m pytest -q -p no:cacheprovider -rs"
run tests_cuda 180 $PYTEST --timeout=100 \
    tests/worker/test_cuda_graphs.py tests/e2e/test_cuda_greedy.py tests/e2e/test_triton_and_dummy.py \
    tests/e2e/test_lora_e2e.py::test_adapters_on_a_gpu_give_the_cpu_engines_tokens \
    tests/e2e/test_moe.py::test_moe_on_a_gpu_runs_stacked_experts_in_graphs
# Kernel tests compile one Triton kernel per shape: spread over the cores (pytest-xdist).
PARALLEL=()
$PY -c "import xdist" 2>/dev/null && PARALLEL=(-n 8)
run tests_triton 90 $PYTEST --timeout=80 "${PARALLEL[@]}" tests/model/test_triton_attention.py \
    tests/model/test_triton_moe.py

LLAMA=benchmarks/configs/llama-3.1-8b
SMOL=benchmarks/configs/smollm2-135m
DEVICE_ARGS=(--dtype bfloat16)
DECODE=(--output-len 256)
GRAPHS_SMOL=(--output-len 128)
GRAPHS_8B=(--output-len 64)
THROUGHPUT=(--hf-batch-sizes 128 256)
CONCURRENCY=(1 64 256)
SERVE_LENS=(--input-len 256 768 --output-len 128 256)
if [ "$REHEARSE" = 1 ]; then
    LLAMA=$SMOL
    DEVICE_ARGS=(--device cpu --dtype float32)
    DECODE=(--output-len 16)
    GRAPHS_SMOL=(--output-len 16 --batches 1 4)
    GRAPHS_8B=("${GRAPHS_SMOL[@]}")
    THROUGHPUT=(--num-prompts 8 --input-len 64 --output-len 16 --hf-batch-sizes 4 8)
    CONCURRENCY=(1 4 8)
    SERVE_LENS=(--input-len 32 64 --output-len 16 32)
fi
BENCH="$PY benchmarks/gpu_bench.py --tokenizer $TOKENIZER --attention-backend $ATTENTION"
BENCH="$BENCH ${DEVICE_ARGS[*]}"
run bandwidth 20 $BENCH bandwidth --json "$LOGS/bandwidth.json"
BW=$($PY -c "import json; print(json.load(open('$LOGS/bandwidth.json'))['bandwidth_bytes_per_s'])" \
    2>/dev/null || echo "")
run decode_8b 90 $BENCH decode --model $LLAMA "${DECODE[@]}" ${BW:+--bandwidth $BW} \
    --json "$LOGS/decode_8b.json"
run graphs_smollm2 45 $BENCH graphs --model $SMOL "${GRAPHS_SMOL[@]}" \
    --json "$LOGS/graphs_smollm2.json"
run throughput_8b 120 $BENCH throughput --model $LLAMA "${THROUGHPUT[@]}" \
    --json "$LOGS/throughput_8b.json"

PORT=18123
if (( $(seconds_left) < 60 )); then
    note "== serving skipped: under 60s left of the ${DEADLINE}s deadline"
else
    note "== serving the dummy 8B"
    START_TIMEOUT=90 start_server "$LOGS/server.log" $PORT /health \
        $PY -m tokenbus.cli.main serve $LLAMA --load-format dummy --tokenizer $TOKENIZER \
        "${DEVICE_ARGS[@]}" --attention-backend $ATTENTION --max-model-len 2048 \
        --max-num-seqs 256 --port $PORT || note "the server did not start (log: server.log)"
    for c in "${CONCURRENCY[@]}"; do
        prompts=$(( c == 1 ? 8 : 2 * c ))
        run serve_c$c 45 $PY -m tokenbus.cli.main bench serve --base-url "http://127.0.0.1:$PORT" \
            --max-concurrency $c --num-prompts $prompts "${SERVE_LENS[@]}" \
            --ignore-eos --tokenizer $TOKENIZER --output-json "$LOGS/serve_c$c.json"
    done
    stop_server
fi

run graphs_8b 75 $BENCH graphs --model $LLAMA "${GRAPHS_8B[@]}" --json "$LOGS/graphs_8b.json"

gather
$PY -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1])), indent=1)[:6000])" \
    "$OUT/figures.json"
note "done in $(( $(date +%s) - start )) s, status $status; logs in $OUT"
exit $status

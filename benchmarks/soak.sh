#!/usr/bin/env bash
# The memory soak (benchmarks/soak.py) against a fresh `tokenbus serve` of the default model:
# mixed load at concurrency 8 for $DURATION seconds (default 1800), RSS every 30 s. Extra serve
# flags from $SERVE_ARGS (e.g. --quantization none: the oneDNN path), a result name from $TAG.
# Results in bench_out/soak_$TAG.{txt,json}; the exit status is soak.py's verdict.
set -u
cd "$(dirname "$0")/.."
source benchmarks/lib.sh
tag=${TAG:-default} port=${PORT:-8041}
start_server "bench_out/soak_$tag.log" "$port" /health .venv/bin/tokenbus serve --port "$port" ${SERVE_ARGS:-}
.venv/bin/python benchmarks/soak.py --url "http://127.0.0.1:$port" --server-pid "$SERVER_PID" \
  --duration "${DURATION:-1800}" --warmup "${WARMUP:-300}" --sample-interval 30 \
  --out "bench_out/soak_$tag.json" | tee "bench_out/soak_$tag.txt"
status=${PIPESTATUS[0]}
stop_server
exit "$status"

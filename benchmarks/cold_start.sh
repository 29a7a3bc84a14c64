#!/usr/bin/env bash
# Cold start to healthy: `tokenbus serve` (default model) launched, /health polled every 50 ms.
# The first start after install converts the GGUF's tokenizer and builds the native kernels
# (both cached under ~/.cache/tokenbus); later starts load them. Prints the start-up memory line.
set -u
cd "$(dirname "$0")/.."
for run in ${RUNS:-1 2 3}; do
  start=$(date +%s.%N)
  .venv/bin/tokenbus serve --port 8051 > bench_out/cold_start.log 2>&1 &
  pid=$!
  until curl -sf 127.0.0.1:8051/health >/dev/null; do sleep 0.05; done
  echo "run $run: healthy after $(echo "$(date +%s.%N) - $start" | bc) s"
  kill -TERM $pid; wait $pid 2>/dev/null
done
grep -h "memory:" bench_out/cold_start.log

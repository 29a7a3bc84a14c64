#!/usr/bin/env bash
# Cold start to healthy: `tokenbus serve` (default model) launched, /health polled every 50 ms,
# then where the time goes (benchmarks/startup_profile.py). The first start after install
# converts the GGUF's tokenizer and builds the native kernels (both cached under
# ~/.cache/tokenbus); later starts load them. Prints the start-up memory line.
set -u
cd "$(dirname "$0")/.."
source benchmarks/lib.sh
for run in ${RUNS:-1 2 3}; do
  start=$(date +%s.%N)
  start_server bench_out/cold_start.log 8051 /health .venv/bin/tokenbus serve --port 8051
  echo "run $run: healthy after $(echo "$(date +%s.%N) - $start" | bc) s"
  stop_server
done
grep -h "memory:" bench_out/cold_start.log
.venv/bin/python benchmarks/startup_profile.py

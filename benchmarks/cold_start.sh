#!/usr/bin/env bash
# Cold start to healthy: `tokenbus serve` (default model) launched, /health polled every 50 ms,
# then where the time goes (benchmarks/startup_profile.py). The first start after install
# converts the GGUF's tokenizer and builds the native kernels (both cached under
# ~/.cache/tokenbus); later starts load them. Prints the start-up memory line.
# DROP_CACHES=1 (root) empties the page cache before each start, so torch's libraries and the
# model come from disk, as after a reboot; PEER=llama_cpp times llama-server's start alike.
# TOKENBUS_BENCH_RECORD=benchmarks/results also writes the run's record (benchmarks/record_run.py).
set -u
cd "$(dirname "$0")/.."
source benchmarks/lib.sh
[ -n "${PEER:-}" ] && MODEL=$(default_gguf)  # looked up before the clock starts
: > bench_out/cold_start_runs.txt
for run in ${RUNS:-1 2 3}; do
  for server in tokenbus ${PEER:-}; do
    [ "${DROP_CACHES:-0}" = 1 ] && sync && echo 3 > /proc/sys/vm/drop_caches
    start=$(date +%s.%N)
    case $server in
      tokenbus) start_server bench_out/cold_start.log 8051 /health .venv/bin/tokenbus serve --port 8051 ;;
      llama_cpp) start_server bench_out/cold_start_llama_cpp.log 8051 /health \
                   bash benchmarks/peers/llama_cpp.sh server 8051 "$MODEL" -np 16 -c 32768 ;;
    esac
    dropped=$([ "${DROP_CACHES:-0}" = 1 ] && echo " (page cache dropped)")
    echo "run $run, $server$dropped: healthy after $(echo "$(date +%s.%N) - $start" | bc) s" \
      | tee -a bench_out/cold_start_runs.txt
    stop_server
  done
done
grep -h "memory:" bench_out/cold_start.log
if [ -n "${TOKENBUS_BENCH_RECORD:-}" ]; then  # a run record for docs/benchmarks.md's tables
  .venv/bin/python benchmarks/record_run.py cold_start "$TOKENBUS_BENCH_RECORD"
fi
.venv/bin/python benchmarks/startup_profile.py

#!/usr/bin/env bash
# c1 latency with a CPU hog pinned to one core: the default server (EngineCore in its own
# process) vs --engine-in-process, same short workload, loopback only. Extra `tokenbus serve`
# flags (e.g. --num-threads 1) come from $SERVE_ARGS, a result-name prefix from $TAG; an
# environment such as GOMP_SPINCOUNT=1000 reaches the server. Results in bench_out/shared_*.txt.
set -u
cd "$(dirname "$0")/.."
source benchmarks/lib.sh
B=.venv/bin
common="--num-prompts ${NUM_PROMPTS:-8} --input-len 20 60 --output-len 16 32 --max-concurrency 1 --temperature 0 --ignore-eos"

run_layout() {  # name, port, extra serve flags...
  local name=$1 port=$2; shift 2
  start_server "bench_out/shared_${name}.log" "$port" /health $B/tokenbus serve --port "$port" ${SERVE_ARGS:-} "$@"
  bench_serve "$port" "shared_${name}" $common
  stop_server
}

taskset -c 0 $B/python -c "while True: pass" &
hog=$!
trap 'kill $hog 2>/dev/null' EXIT
run_layout ${TAG:-}default 8031
run_layout ${TAG:-}in_process 8032 --engine-in-process
grep -H -E "Median TTFT|Median ITL|Median E2EL|Output token throughput" bench_out/shared_${TAG:-}*.txt

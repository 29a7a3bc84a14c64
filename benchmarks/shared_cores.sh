#!/usr/bin/env bash
# c1 latency with a CPU hog pinned to one core: the default server (EngineCore in its own
# process) vs --engine-in-process, same short workload, loopback only. Extra `tokenbus serve`
# flags (e.g. --num-threads 1) come from $SERVE_ARGS. Results in bench_out/shared_*.txt.
set -u
cd "$(dirname "$0")/.."
B=.venv/bin
mkdir -p bench_out
common="--num-prompts ${NUM_PROMPTS:-8} --input-len 20 60 --output-len 16 32 --max-concurrency 1 --temperature 0 --ignore-eos"

run_layout() {  # name, port, extra serve flags...
  local name=$1 port=$2; shift 2
  $B/tokenbus serve --port "$port" ${SERVE_ARGS:-} "$@" > "bench_out/shared_${name}.log" 2>&1 &
  local pid=$!
  for _ in $(seq 180); do curl -sf "127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  $B/tokenbus bench serve --base-url "http://127.0.0.1:$port" $common \
    --output-json "bench_out/shared_${name}.json" > "bench_out/shared_${name}.txt" 2>&1
  kill -TERM "$pid"; sleep 3; kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
}

taskset -c 0 $B/python -c "while True: pass" &
hog=$!
trap 'kill $hog 2>/dev/null' EXIT
run_layout ${TAG:-}default 8031
run_layout ${TAG:-}in_process 8032 --engine-in-process
grep -H -E "Median TTFT|Median ITL|Median E2E|Output token throughput" bench_out/shared_${TAG:-}*.txt

#!/usr/bin/env bash
# Where the two cores go while `tokenbus serve` runs the c16 serving workload (64 requests,
# prompts 20-600, outputs 16-256, greedy, EOS ignored): a system-wide `perf record -a -e
# cpu-clock` around the benchmark client, then the share of each process and thread (the
# EngineCore's main thread and OpenMP worker, the API server, the client) and of idle. Needs
# perf; the profiler slows the run, so its throughput is not a figure. Results in bench_out/.
# CONCURRENCY=1 NUM_PROMPTS=12 profiles the c1 workload instead.
set -u
cd "$(dirname "$0")/.."
source benchmarks/lib.sh
B=.venv/bin
TOK=${TOK:-/tmp/smollm2-tokenizer}
save_default_tokenizer "$TOK"
workload="--model smollm2 $(serve_workload "$TOK")"
start_server bench_out/serve_profile.log 8061 /health $B/tokenbus serve --port 8061 --served-model-name smollm2
bench_serve 8061 serve_profile_warmup $workload --max-concurrency 16 --num-prompts 16
c=${CONCURRENCY:-16}
perf record -q -a -e cpu-clock -o bench_out/serve_profile.data -- \
  $B/tokenbus bench serve --base-url http://127.0.0.1:8061 $workload --max-concurrency $c --num-prompts ${NUM_PROMPTS:-64} \
  > bench_out/serve_profile_c$c.txt 2>&1
stop_server
echo "by thread (comm: 'python' is the spawned EngineCore, 'tokenbus' the server and the client; swapper: idle):"
perf report -i bench_out/serve_profile.data --sort pid 2>/dev/null | grep -v "^#" | grep . | head -8
echo "by process and library:"
perf report -i bench_out/serve_profile.data --sort comm,dso 2>/dev/null | grep -v "^#" | grep . | head -12

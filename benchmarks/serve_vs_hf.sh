#!/usr/bin/env bash
# `tokenbus serve` vs HF `transformers serve --continuous-batching` on SmolLM2 (same fp32
# weights), `tokenbus bench serve` at concurrency 1, 8 and 32. Loopback only. Results in bench_out/.
set -u
cd "$(dirname "$0")/.."
source benchmarks/lib.sh
B=.venv/bin
HF_DIR=${HF_DIR:-/tmp/smollm2-hf}
[ -f "$HF_DIR/config.json" ] || $B/python benchmarks/make_hf_copy.py "$HF_DIR"
common="--num-prompts 16 --input-len 20 400 --output-len 16 96 --tokenizer $HF_DIR --temperature 0"

run_peer() {  # name, port, model-or-empty, server command...
  local name=$1 port=$2 model=$3; shift 3
  start_server "bench_out/serve_${name}.log" "$port" /v1/models "$@"
  for c in 1 8 32; do
    bench_serve "$port" "serve_${name}_c$c" ${model:+--model "$model"} $common --max-concurrency "$c"
  done
  stop_server
}

run_peer ours 8011 "" $B/tokenbus serve --port 8011
run_peer hf 8012 "$HF_DIR" $B/transformers serve --port 8012 --continuous-batching
grep -H -E "Output token throughput|Median TTFT|Median ITL" bench_out/serve_*_c*.txt

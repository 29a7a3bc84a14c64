#!/usr/bin/env bash
# One `tokenbus bench serve` run per process layout, same workload, concurrency 16, loopback:
#   SmolLM2:                 1 engine x 2 threads   vs   --data-parallel-size 2 (1 thread each)
#   random 125M Llama (8/4): 1 engine x 2 threads   vs   --tensor-parallel-size 2 (1 thread each)
# Results in bench_out/scale_*.{txt,json}.
set -u
cd "$(dirname "$0")/.."
source benchmarks/lib.sh
B=.venv/bin
TP_MODEL=${TP_MODEL:-/tmp/llama-tp2}
[ -f "$TP_MODEL/config.json" ] || $B/python benchmarks/make_random_model.py "$TP_MODEL"
common="--num-prompts ${NUM_PROMPTS:-64} --input-len 20 600 --output-len 16 256 --max-concurrency 16 --temperature 0 --ignore-eos"

run_layout() {  # name, port, model-or-empty, extra serve flags...
  local name=$1 port=$2 model=$3; shift 3
  start_server "bench_out/scale_${name}.log" "$port" /health $B/tokenbus serve ${model:+"$model"} --port "$port" "$@"
  bench_serve "$port" "scale_${name}" $common ${model:+--tokenizer "$model"}
  stop_server
}

run_layout smollm2_1x2 8021 ""
run_layout smollm2_dp2 8022 "" --data-parallel-size 2
run_layout random_1x2 8023 "$TP_MODEL"
run_layout random_tp2 8024 "$TP_MODEL" --tensor-parallel-size 2
grep -H -E "Output token throughput|Total token throughput|Median TTFT|Median ITL" bench_out/scale_*.txt

#!/usr/bin/env bash
# `tokenbus serve` vs `llama-server -np 16` on the same GGUF (the packaged SmolLM2 Q4_1, or
# MODEL=FILE: e.g. benchmarks/make_random_gguf.py's, which carry SmolLM2's tokenizer), the
# same client (`tokenbus bench serve`, text prompts through SmolLM2's tokenizer) and workload:
# concurrency 1 (12 requests) and 16 (64 requests), prompts 20-600, outputs 16-256, EOS
# ignored. Also cold start to healthy for both. Loopback only; results in bench_out/peer_*.
# PEERS="llama_cpp vllm" adds vLLM's CPU build (benchmarks/peers/vllm_cpu.sh: an HF copy of the
# same weights in fp32, since it cannot run GGUF on CPU; minutes of torch.compile at start);
# vllm_bf16 runs it in bf16 (its choice for SmolLM2's bf16 checkpoint; AMX where the CPU has it);
# PEERS=none runs tokenbus alone; SERVE_ARGS adds `tokenbus serve` flags (e.g. --num-threads 1).
# llama_cpp_amx is llama.cpp built with ggml's AMX kernels (LLAMA_CPP_AMX=1 llama_cpp.sh build);
# LLAMA_CPP_ISA=avx2 runs llama_cpp's AVX2-only build (results under the same names).
# TOKENBUS_BENCH_RECORD=benchmarks/results also writes the run's record (benchmarks/record_run.py).
set -u
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh
B=.venv/bin
TOK=${TOK:-/tmp/smollm2-tokenizer}
save_default_tokenizer "$TOK"
MODEL=${MODEL:-$(default_gguf)}
workload=$(serve_workload "$TOK")

run_peer() {  # name, port, server command...
  local name=$1 port=$2; shift 2
  local start=$(date +%s.%N)
  start_server "bench_out/peer_${name}.log" "$port" /health "$@"
  echo "$name cold start to healthy: $(echo "$(date +%s.%N) - $start" | bc) s" | tee "bench_out/peer_${name}_start.txt"
  bench_serve "$port" "peer_${name}_c1" --model smollm2 $workload --max-concurrency 1 --num-prompts 12
  bench_serve "$port" "peer_${name}_c16" --model smollm2 $workload --max-concurrency 16 --num-prompts 64
  stop_server
}

run_peer tokenbus 8041 $B/tokenbus serve "$MODEL" --port 8041 --served-model-name smollm2 ${SERVE_ARGS:-}
for peer in ${PEERS:-llama_cpp}; do
  case $peer in
    llama_cpp) run_peer llama_cpp 8042 bash benchmarks/peers/llama_cpp.sh server 8042 "$MODEL" -np 16 -c 32768 --alias smollm2 ;;
    llama_cpp_amx) LLAMA_CPP_AMX=1 run_peer llama_cpp_amx 8045 bash benchmarks/peers/llama_cpp.sh server 8045 "$MODEL" -np 16 -c 32768 --alias smollm2 ;;
    vllm) START_TIMEOUT=600 run_peer vllm 8043 bash benchmarks/peers/vllm_cpu.sh server 8043 ;;
    vllm_bf16) START_TIMEOUT=600 run_peer vllm_bf16 8044 bash benchmarks/peers/vllm_cpu.sh server 8044 --dtype bfloat16 ;;
    none) ;;
    *) echo "unknown peer: $peer (llama_cpp, llama_cpp_amx, vllm, vllm_bf16, none)" >&2; exit 2 ;;
  esac
done
for name in tokenbus ${PEERS:-llama_cpp}; do  # this run's results only
  [ "$name" = none ] && continue
  grep -H -E "Output token throughput|Total token throughput|Median TTFT|Median ITL" bench_out/peer_${name}_c*.txt
  cat "bench_out/peer_${name}_start.txt"
done
if [ -n "${TOKENBUS_BENCH_RECORD:-}" ]; then  # a run record for docs/benchmarks.md's tables
  # shellcheck disable=SC2086  # PEERS: one word per peer
  $B/python benchmarks/record_run.py serving "$TOKENBUS_BENCH_RECORD" tokenbus ${PEERS:-llama_cpp}
fi

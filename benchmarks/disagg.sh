#!/usr/bin/env bash
# Disaggregated prefill/decode on this 2-core CPU, same workload, one run each:
#   colocated:  one `tokenbus serve` with 2 threads
#   disagg:     a prefiller (1 thread, P2PConnector kv_producer) + a decoder (1 thread,
#               kv_consumer) behind `tokenbus proxy`
# Workload (benchmarks/disagg_workload.py): long prompts (1-2k tokens, 32 tokens out) mixed
# with chat-sized ones (50-200 tokens, 128 out), Poisson arrivals at RATE req/s, streamed.
# Results in bench_out/disagg_{colocated,split}_rRATE.{txt,json}.
set -u
cd "$(dirname "$0")/.."
source benchmarks/lib.sh
B=.venv/bin
RATE=${RATE:-0.5}
$B/python benchmarks/disagg_workload.py bench_out/disagg.jsonl --long "${LONG:-8}" --chat "${CHAT:-24}"
common="--dataset-path bench_out/disagg.jsonl --num-prompts 1000 --request-rate $RATE --temperature 0 --ignore-eos --metric-percentiles 50,99"

start_server bench_out/disagg_colocated.log 8071 /health $B/tokenbus serve --port 8071 --num-threads 2
bench_serve 8071 "disagg_colocated_r$RATE" $common
stop_server

producer='{"kv_connector": "P2PConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"kv_port": 14671}}'
consumer='{"kv_connector": "P2PConnector", "kv_role": "kv_consumer"}'
start_server bench_out/disagg_prefill.log 8072 /health $B/tokenbus serve --port 8072 --num-threads 1 --kv-transfer-config "$producer"
PREFILL_PID=$SERVER_PID
start_server bench_out/disagg_decode.log 8073 /health $B/tokenbus serve --port 8073 --num-threads 1 --kv-transfer-config "$consumer"
DECODE_PID=$SERVER_PID
start_server bench_out/disagg_proxy.log 8074 /health $B/tokenbus proxy --prefill http://127.0.0.1:8072 --decode http://127.0.0.1:8073 --port 8074
bench_serve 8074 "disagg_split_r$RATE" $common
stop_server
SERVER_PID=$DECODE_PID; stop_server
SERVER_PID=$PREFILL_PID; stop_server
grep -H -E "Request throughput|Output token throughput|Median TTFT|P99 TTFT|Median ITL|P99 ITL" "bench_out/disagg_colocated_r$RATE.txt" "bench_out/disagg_split_r$RATE.txt"

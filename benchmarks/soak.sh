#!/usr/bin/env bash
# The memory soak (benchmarks/soak.py) against a fresh `tokenbus serve` of the default model:
# mixed load at concurrency 8 for $DURATION seconds (default 1800), RSS every 30 s. Extra serve
# flags from $SERVE_ARGS (e.g. --quantization none: the oneDNN path), a result name from $TAG.
# HOSTILE=1 (the default) mixes in specs the server must refuse (soak.py --hostile).
# MODE=disagg: a prefiller (P2PConnector kv_producer) and a decoder (kv_consumer), one thread
# each, behind `tokenbus proxy`; the load goes through the proxy, both servers' memory counts,
# and the prefiller's EngineCore is SIGSTOPped for $STOP_FOR s (30) every $STOP_EVERY s (180).
# Results in bench_out/soak_$TAG.{txt,json}, and a run record under $RECORD (a results dir,
# e.g. benchmarks/results) when set; the exit status is soak.py's verdict.
set -u
cd "$(dirname "$0")/.."
source benchmarks/lib.sh
tag=${TAG:-default} port=${PORT:-8041}
serve_args="${SERVE_ARGS:-}"
variant="${MODE:-colocated}${SERVE_ARGS:+, $SERVE_ARGS}"
soak_args=()
[ -n "${RECORD:-}" ] && soak_args+=(--record "$RECORD")
if [ "${HOSTILE:-1}" = 1 ]; then
  serve_args="$serve_args --max-schema-bytes 1000000"  # room for the slow grammar
  soak_args+=(--hostile)
  variant="$variant, hostile specs"
fi
soak_args+=(--variant "$variant" --command "$(env | grep -E '^(MODE|HOSTILE|SERVE_ARGS|DURATION|STOP_EVERY|STOP_FOR)=' | sort | tr '\n' ' ')bash benchmarks/soak.sh")
engine_pid() {  # LOG: the EngineCore's pid, from the server's start-up line
  grep -o 'EngineCore pid=[0-9]*' "$1" | head -1 | cut -d= -f2
}
if [ "${MODE:-colocated}" = disagg ]; then
  producer='{"kv_connector": "P2PConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"kv_port": 14681}}'
  consumer='{"kv_connector": "P2PConnector", "kv_role": "kv_consumer"}'
  start_server "bench_out/soak_${tag}_prefill.log" $((port + 1)) /health .venv/bin/tokenbus serve \
    --port $((port + 1)) --num-threads 1 --kv-transfer-config "$producer" $serve_args
  prefill_pid=$SERVER_PID
  start_server "bench_out/soak_${tag}_decode.log" $((port + 2)) /health .venv/bin/tokenbus serve \
    --port $((port + 2)) --num-threads 1 --kv-transfer-config "$consumer" $serve_args
  decode_pid=$SERVER_PID
  start_server "bench_out/soak_${tag}_proxy.log" "$port" /health .venv/bin/tokenbus proxy \
    --prefill "http://127.0.0.1:$((port + 1))" --decode "http://127.0.0.1:$((port + 2))" --port "$port"
  soak_args+=(--server-pid "$decode_pid" --extra-pid "$prefill_pid"
    --stop-pid "$(engine_pid "bench_out/soak_${tag}_prefill.log")"
    --stop-every "${STOP_EVERY:-180}" --stop-for "${STOP_FOR:-30}")
else
  start_server "bench_out/soak_$tag.log" "$port" /health .venv/bin/tokenbus serve --port "$port" $serve_args
  soak_args+=(--server-pid "$SERVER_PID")
fi
.venv/bin/python benchmarks/soak.py --url "http://127.0.0.1:$port" "${soak_args[@]}" \
  --duration "${DURATION:-1800}" --warmup "${WARMUP:-300}" --sample-interval 30 \
  --out "bench_out/soak_$tag.json" | tee "bench_out/soak_$tag.txt"
status=${PIPESTATUS[0]}
stop_server
if [ "${MODE:-colocated}" = disagg ]; then
  SERVER_PID=$decode_pid; stop_server
  SERVER_PID=$prefill_pid; stop_server
fi
exit "$status"

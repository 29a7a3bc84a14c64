# Shared by the serving benchmark scripts (source it from the repo root): start a server on
# 127.0.0.1, wait until it answers, drive it with `tokenbus bench serve`, stop it by PID.
mkdir -p bench_out

start_server() {  # LOG PORT READY_PATH command... ; sets SERVER_PID; waits up to $START_TIMEOUT s (180)
  local log=$1 port=$2 path=$3; shift 3
  "$@" > "$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq $((${START_TIMEOUT:-180} * 20))); do
    curl -sf "127.0.0.1:$port$path" >/dev/null && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "the server exited; see $log" >&2; return 1; }
    sleep 0.05
  done
  echo "server on port $port never answered $path; see $log" >&2
  return 1
}

stop_server() {
  kill -TERM "$SERVER_PID"; sleep 3; kill -9 "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null
}

bench_serve() {  # PORT NAME bench-serve-args... ; results in bench_out/NAME.{txt,json}
  local port=$1 name=$2; shift 2
  .venv/bin/tokenbus bench serve --base-url "http://127.0.0.1:$port" "$@" \
    --output-json "bench_out/$name.json" > "bench_out/$name.txt" 2>&1
}

serve_workload() {  # TOKENIZER_DIR: the chat-serving workload of every serving comparison
  echo "--input-len 20 600 --output-len 16 256 --temperature 0 --ignore-eos --tokenizer $1"
}

default_gguf() {  # the packaged SmolLM2 GGUF, found as `tokenbus serve` finds it
  .venv/bin/python -c 'from tokenbus.loader.source import packaged_smollm2_gguf; print(packaged_smollm2_gguf())'
}

save_default_tokenizer() {  # DIR: SmolLM2's tokenizer, from the GGUF, saved once for the client
  [ -f "$1/tokenizer.json" ] && return 0
  .venv/bin/python - "$1" "$(default_gguf)" <<'PY'
import pathlib, sys
from transformers import AutoTokenizer
gguf = pathlib.Path(sys.argv[2])
AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(sys.argv[1])
PY
}

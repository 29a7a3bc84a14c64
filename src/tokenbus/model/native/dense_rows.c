/* fp32 y = x W^T whose every output is one FMA chain over k in order (tokenbus, model/native).

   Why: oneDNN's and MKL's GEMMs pick their kernels, and with them the order of each dot
   product's sums, by the number of rows M (torch.mm changed its answer for a row between M 3 and
   4, oneDNN between M 1 and 2 at K 1536), so a token's logits depended on how many other tokens
   shared its step. Here y[m, n] = fma(x[m, K-1], W[n, K-1], ... fma(x[m, 0], W[n, 0], 0)) for
   every M, every row position and every thread split: --batch-invariant's dense linears.

   W is packed once into panels of 16 rows: panel p is [K][16] (lane r = row 16p + r, rows past N
   zero), so one 16-lane vector per k serves 16 outputs. A work item is a group of NP panels, over
   all rows of x, MR rows at a time: MR x NP accumulators in registers, one per 16 outputs, each a
   chain over k (never split: that would reorder the sums). x rows beyond MR, and panels beyond
   NP, go in smaller constant groups with the same chains.

   Built like the other kernels (-O3 -march=<cpu> -ffast-math): the chains are explicit vector
   FMAs (tile_vectors.h), which the compiler does not reassociate; the baseline loop (no AVX2)
   keeps one scalar chain per output as well. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "tile_vectors.h"

#define PR 16  /* rows of W per panel */

#if defined(HAVE_TILES) && defined(__AVX512F__)
#define MR 4  /* 4 x 3 zmm accumulators, 3 W loads and 4 broadcasts per k: FMA-bound */
#define NP 3
#elif defined(HAVE_TILES)
#define MR 4  /* each vf is two ymm: 8 accumulators and 2 W halves of AVX2's 16 registers */
#define NP 1
#endif

int64_t dense_panel_floats(int64_t N, int64_t K) { return (N + PR - 1) / PR * K * PR; }

/* out (dense_panel_floats) <- W [N, K] row-major. */
void dense_pack(const float *w, int64_t N, int64_t K, float *out) {
    const int64_t panels = (N + PR - 1) / PR;
    memset(out, 0, sizeof(float) * (size_t)(panels * K * PR));
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) out[((n / PR) * K + k) * PR + n % PR] = w[n * K + k];
}

#if defined(HAVE_TILES)
/* Rows [0, R) of x against panels [0, P) from `panel` on: y[r][16p + lane] for the outputs below
   n_valid (the last panel of W may be partial). R and P are constants after inlining. */
static inline __attribute__((always_inline)) void block(const float *panel, int64_t K, const float *x,
                                                        int64_t ldx, float *y, int64_t ldy, int64_t n_valid,
                                                        const int R, const int P) {
    vf acc[MR][NP];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = vf_zero();
    for (int64_t k = 0; k < K; k++) {
        vf w[NP];
        for (int p = 0; p < P; p++) w[p] = vf_loadf(panel + (p * K + k) * PR);
        for (int r = 0; r < R; r++) {
            const vf xv = vf_set1(x[r * ldx + k]);
            for (int p = 0; p < P; p++) acc[r][p] = vf_fma(xv, w[p], acc[r][p]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) {
            const int64_t valid = n_valid - p * PR;
            if (valid >= PR) {
                vf_store(y + r * ldy + p * PR, acc[r][p]);
            } else if (valid > 0) {
                float tmp[PR];
                vf_store(tmp, acc[r][p]);
                memcpy(y + r * ldy + p * PR, tmp, sizeof(float) * (size_t)valid);
            }
        }
}

#define ROWS_CASE(R, P) \
    case R: block(panel, K, x + m * ldx, ldx, y + m * ldy, ldy, n_valid, R, P); break;
#define ALL_ROWS(P)                                               \
    switch (M - m < MR ? M - m : MR) { /* constant R: in registers */ \
        ROWS_CASE(4, P)                                           \
        ROWS_CASE(3, P)                                           \
        ROWS_CASE(2, P)                                           \
        default: block(panel, K, x + m * ldx, ldx, y + m * ldy, ldy, n_valid, 1, P); break; \
    }

/* Panel group g (NP panels, fewer at the end) for all M rows. */
static void panel_group(const float *panels, int64_t N, int64_t K, const float *x, int64_t M, int64_t ldx,
                        float *y, int64_t ldy, int64_t g) {
    const int64_t first = g * NP, num_panels = (N + PR - 1) / PR;
    const int P = (int)(num_panels - first < NP ? num_panels - first : NP);
    const float *panel = panels + first * K * PR;
    const int64_t n_valid = N - first * PR;
    y += first * PR;
    for (int64_t m = 0; m < M; m += MR) {
#if NP == 3
        if (P == 3) { ALL_ROWS(3) }
        else if (P == 2) { ALL_ROWS(2) }
        else { ALL_ROWS(1) }
#else
        (void)P;
        ALL_ROWS(1)
#endif
    }
}
#endif

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T, W packed by dense_pack. Each
   output is one thread's one chain: the split over threads does not change it. 0 on success. */
int dense_matmul(const float *panels, int64_t N, int64_t K, const float *x, int64_t M, int64_t ldx, float *y,
                 int64_t ldy, int num_threads) {
#if defined(HAVE_TILES)
    const int64_t groups = ((N + PR - 1) / PR + NP - 1) / NP;
#pragma omp parallel for schedule(guided) num_threads(num_threads) if (groups > 1 && M * N * K >= 65536)
    for (int64_t g = 0; g < groups; g++) panel_group(panels, N, K, x, M, ldx, y, ldy, g);
#else
    const int64_t num_panels = (N + PR - 1) / PR;
#pragma omp parallel for schedule(guided) num_threads(num_threads) if (num_panels > 1 && M * N * K >= 65536)
    for (int64_t p = 0; p < num_panels; p++)
        for (int64_t m = 0; m < M; m++) {
            float acc[PR] = {0};
            for (int64_t k = 0; k < K; k++) {
                const float xv = x[m * ldx + k], *w = panels + (p * K + k) * PR;
                for (int r = 0; r < PR; r++) acc[r] += xv * w[r];  /* per lane: one chain over k */
            }
            for (int r = 0; r < PR && p * PR + r < N; r++) y[m * ldy + p * PR + r] = acc[r];
        }
#endif
    return 0;
}

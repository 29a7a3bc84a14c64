/* quant_tiles.c's bf16-activation engine on AMX tiles (Sapphire Rapids and later, where the
   kernel grants the tile state: amx_granted). Defines HAVE_AMX and amx_matmul where the build has
   the instructions. Included by quant_tiles.c only, after tiles_bf16.h (its packed blocks). */
#ifndef TOKENBUS_TILES_AMX_H
#define TOKENBUS_TILES_AMX_H

#if defined(HAVE_BF16_TILES) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023  /* Linux: ask for the AMX tile state (arch/x86 uapi) */
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Tiles 0-3: C, 4-5: A, 6-7: B; all 16 rows of 64 bytes. Per thread: the config is thread state. */
static void amx_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
    _tile_loadconfig(&cfg);
}

/* C tile `reg` (rows [m0 + 16 rb, +16) of y, weight tile tt's columns) to y, or only the rows
   and columns that exist through a scratch copy. */
#define AMX_STORE(reg, rb, tt)                                                                          \
    do {                                                                                                \
        const int64_t r0 = m0 + 16 * (rb), nr = M - r0 < 16 ? M - r0 : 16, n0 = (tt) * TR;              \
        const int64_t valid = N - n0 < TR ? N - n0 : TR;                                                \
        if (nr == 16 && valid == TR) {                                                                  \
            _tile_stored(reg, y + r0 * ldy + n0, ldy * (int64_t)sizeof(float));                        \
        } else if (nr > 0) {                                                                            \
            _tile_stored(reg, scratch, 16 * sizeof(float));                                             \
            for (int64_t r = 0; r < nr; r++)                                                            \
                memcpy(y + (r0 + r) * ldy + n0, scratch + 16 * r, sizeof(float) * (size_t)valid);      \
        }                                                                                               \
    } while (0)

/* Weight tiles t and t + 1 (only t when `two` is 0) times all Mpad rows of xb into y, in groups
   of 32 rows: C tiles 0/1 take rows 0-15 of the group (weight tile t / t + 1), 2/3 rows 16-31;
   A tiles 4/5, B tiles 6/7. Each loaded A tile serves two B tiles and each B tile two A tiles
   (x is read from L2 once per two weight tiles). The first group packs each B tile one block
   ahead of using it (a decode-sized call reads it back from L1) into bt [2][blocks * 512],
   which the later groups reuse. */
static void amx_tile_pair(int qtype, int qb, const uint8_t *tiles, int64_t blocks, int64_t tbb, uint16_t *bt,
                          const uint16_t *xb, int64_t Mpad, int64_t K, float *y, int64_t ldy, int64_t M,
                          int64_t N, int64_t t, int two) {
    const __m512i interleave = bf16_pair_order();
    const int64_t lda = K * (int64_t)sizeof(uint16_t);
    uint16_t *bt1 = bt + blocks * 512;
    float scratch[256];
    for (int64_t m0 = 0; m0 < Mpad; m0 += 32) {
        const int two_rows = Mpad - m0 > 16;
        const uint16_t *a = xb + m0 * K;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        if (m0 == 0 && blocks > 0) {
            bf16_pack_block(qtype, tiles, t, 0, blocks, tbb, interleave, bt);
            if (two) bf16_pack_block(qtype, tiles, t + 1, 0, blocks, tbb, interleave, bt1);
        }
        for (int64_t b = 0; b < blocks; b++) {
            /* One block ahead: a tile load waits for every store to the bytes it reads to reach
               L1 (no forwarding from the store buffer), so block b's stores drain while b - 1's
               tiles multiply. */
            if (m0 == 0 && b + 1 < blocks) {
                bf16_pack_block(qtype, tiles, t, b + 1, blocks, tbb, interleave, bt + (b + 1) * 512);
                if (two)
                    bf16_pack_block(qtype, tiles, t + 1, b + 1, blocks, tbb, interleave, bt1 + (b + 1) * 512);
            }
            _tile_loadd(6, bt + b * 512, 64);
            _tile_loadd(4, a + b * 32, lda);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                _tile_loadd(7, bt1 + b * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (two_rows) {
                _tile_loadd(5, a + 16 * K + b * 32, lda);
                _tile_dpbf16ps(2, 5, 6);
                if (two) _tile_dpbf16ps(3, 5, 7);
            }
        }
        AMX_STORE(0, 0, t);
        if (two) AMX_STORE(1, 0, t + 1);
        if (two_rows) AMX_STORE(2, 1, t);
        if (two_rows && two) AMX_STORE(3, 1, t + 1);
    }
}

/* 0 on success, 3 out of memory. */
static int amx_matmul(int qtype, int qb, const uint8_t *tiles, int64_t ntiles, int64_t blocks, int64_t tbb,
                      int64_t N, int64_t K, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
                      int num_threads) {
    const int64_t Mpad = (M + 15) / 16 * 16;  /* whole 16-row A tiles */
    uint16_t *xb = bf16_round_rows(x, M, ldx, K, Mpad);
    if (!xb) return 3;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        uint16_t *bt = aligned_alloc(64, (size_t)blocks * 2048);
        if (bt) amx_configure();
        else failed = 1;
#pragma omp for schedule(guided)
        for (int64_t pair = 0; pair < (ntiles + 1) / 2; pair++) {
            if (!bt) continue;
            amx_tile_pair(qtype, qb, tiles, blocks, tbb, bt, xb, Mpad, K, y, ldy, M, N, 2 * pair,
                          2 * pair + 1 < ntiles);
        }
        if (bt) _tile_release();
        free(bt);
    }
    free(xb);
    return failed ? 3 : 0;
}

/* 1 when the kernel grants this process the tile state. The grant is the process's: asked
   once, the answer kept (a race only asks twice). */
static int amx_granted(void) {
    static int granted = -1;  /* -1: not asked yet */
    int answer = __atomic_load_n(&granted, __ATOMIC_ACQUIRE);
    if (answer < 0) {
        answer = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        __atomic_store_n(&granted, answer, __ATOMIC_RELEASE);
    }
    return answer;
}
#endif

#endif

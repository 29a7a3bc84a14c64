/* GGUF block formats as ggml defines them (block_q5_0, block_q4_K, block_iq4_xs, ...): the
   integer fields of one block, unpacked. Shared by the kernels that dequantize blocks
   (quant_matmul.c) and those that repack them into tiles (quant_tiles.c), so each format's bit
   layout is written once. The gguf package's quants.py dequantizes every one of them in numpy:
   the tests' reference. */
#ifndef TOKENBUS_GGUF_BLOCKS_H
#define TOKENBUS_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define QK_K 256  /* values per K-quant super-block */

/* Bytes of one block of each type. */
enum {
    Q8_0_BLOCK = 34, Q4_0_BLOCK = 18, Q4_1_BLOCK = 20, Q5_0_BLOCK = 22, Q5_1_BLOCK = 24, IQ4_NL_BLOCK = 18,
    MXFP4_BLOCK = 17,
    Q2_K_BLOCK = 84, Q3_K_BLOCK = 110, Q4_K_BLOCK = 144, Q5_K_BLOCK = 176, Q6_K_BLOCK = 210, IQ4_XS_BLOCK = 136,
    HALF_BLOCK = 64 /* F16, BF16: no blocks in the file; the kernels take 32 values (64 bytes) as one */
};

/* The 16-bit float types (F16, BF16): plain values, no scales; the kernels run them as blocks of
   32 so that they fit the block types' loops. */
static inline int half_type(int qtype) { return qtype == F16 || qtype == BF16; }

/* A BF16 value (2 little-endian bytes) as fp32: its bits are an fp32's top 16, exactly. */
static inline float bf16_value(const uint8_t *p) {
    const uint32_t bits = (uint32_t)(p[0] | p[1] << 8) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The sixteen values a 4-bit IQ4_NL / IQ4_XS quant stands for (ggml's kvalues_iq4nl):
   non-uniform, denser near zero. */
static const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                         1,    13,   25,  38,  53,  69,  89,  113};

/* The sixteen values a 4-bit MXFP4 quant stands for (ggml's kvalues_mxfp4): FP4 E2M1's values
   doubled, which is why a block's scale is half of its E8M0 exponent's power of two. */
static const int8_t kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* An MXFP4 block's scale from its E8M0 byte e (the block's first): 2^(e - 128), exactly (ggml's
   ggml_e8m0_to_fp32_half). From e = 2 up an fp32 with exponent field e - 1; e = 0 and 1 give the
   subnormals 2^-128 and 2^-127, made from their bits as ggml makes them. */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

static inline uint32_t load_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Q5_0 / Q5_1's 32 values, 0..31: the low four bits are Q4_0's nibbles (byte j: values j and
   j + 16), value j's fifth bit is bit j of qh (a little-endian uint32). */
static inline void q5_values(const uint8_t *qh, const uint8_t *qs, int8_t *q) {
    const uint32_t h = load_u32(qh);
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)((qs[j] & 0xF) | ((h >> j) & 1) << 4);
        q[j + 16] = (int8_t)((qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4);
    }
}

/* Q4_K / Q5_K sub-block j's (of 8) 6-bit scale and min (ggml's get_scale_min_k4); s: the
   block's 12 scale bytes. */
static inline void k4_scale_min(int j, const uint8_t *s, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* A Q4_K (hq NULL) or Q5_K super-block's sub-block j (of 8), 32 values 0..15 or 0..31: 64 values
   per 32 bytes of qs (sub-block 2i the low nibbles, 2i + 1 the high ones), value l's fifth bit
   bit j of qh[l]. */
static inline void k_sub_values(const uint8_t *qs, const uint8_t *qh, int j, int8_t *q) {
    const uint8_t *p = qs + 32 * (j / 2);
    for (int l = 0; l < 32; l++) {
        const int low = j % 2 ? p[l] >> 4 : p[l] & 0xF;
        q[l] = (int8_t)(low | (qh ? ((qh[l] >> j) & 1) << 4 : 0));
    }
}

/* A Q6_K super-block's 256 values, q - 32 in -32..31 (ggml's dequantize_row_q6_K): per 128
   values, ql's low nibbles then high nibbles, two bits each from qh. */
static inline void q6_k_values(const uint8_t *b, int8_t *q) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int n = 0; n < 2; n++)
        for (int l = 0; l < 32; l++) {
            const uint8_t *a = ql + 64 * n, h = qh[32 * n + l];
            q[128 * n + l] = (int8_t)(((a[l] & 0xF) | ((h & 3) << 4)) - 32);
            q[128 * n + l + 32] = (int8_t)(((a[l + 32] & 0xF) | (((h >> 2) & 3) << 4)) - 32);
            q[128 * n + l + 64] = (int8_t)(((a[l] >> 4) | (((h >> 4) & 3) << 4)) - 32);
            q[128 * n + l + 96] = (int8_t)(((a[l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32);
        }
}

/* The 6-bit scale of Q3_K sub-block i (of 16), offset by 32: the low nibbles of bytes 0-7 are
   scales 0-7, their high nibbles 8-15; bytes 8-11 hold two high bits of each, scale i's at
   bits 2 * (i / 4) of byte 8 + i % 4. s: the block's 12 scale bytes. */
static inline int q3_k_scale(const uint8_t *s, int i) {
    const int low = i < 8 ? s[i] & 0xF : s[i - 8] >> 4;
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (low | high << 4) - 32;
}

/* A Q3_K super-block's 256 values in -4..3 (hmask[32], qs[64], scales[12], d): value
   v = 128 h + 32 s + l (l < 32) has 2 low bits at bit 2s of qs[32 h + l], and loses 4 where bit
   4h + s of hmask[l] is clear. */
static inline void q3_k_values(const uint8_t *b, int8_t *q) {
    const uint8_t *hmask = b;
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++)
                q[128 * h + 32 * s + l] =
                    (int8_t)((int)((b[32 + 32 * h + l] >> (2 * s)) & 3) - (((hmask[l] >> (4 * h + s)) & 1) ^ 1) * 4);
}

/* The scale of IQ4_XS sub-block ib (of 8), offset by 32: 4 low bits in scales_l (two per byte),
   2 high bits in the uint16 scales_h (two per sub-block). b: the block (d, scales_h, scales_l). */
static inline int iq4_xs_scale(const uint8_t *b, int ib) {
    const int low = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
    const int high = ((b[2] | b[3] << 8) >> (2 * ib)) & 3;
    return (low | high << 4) - 32;
}

/* 32 values of IQ4_NL (or an IQ4_XS sub-block) from their 16 bytes: byte j's low nibble is
   value j, its high nibble value j + 16, each through the table. */
static inline void iq4_values(const uint8_t *qs, int8_t *q) {
    for (int j = 0; j < 16; j++) {
        q[j] = kvalues_iq4nl[qs[j] & 0xF];
        q[j + 16] = kvalues_iq4nl[qs[j] >> 4];
    }
}

#endif

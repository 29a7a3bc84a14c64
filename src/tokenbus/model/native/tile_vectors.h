/* 16-lane vectors for the tiled kernels (tokenbus, model/native): one __m512 on AVX-512, two
   __m256 halves (rows 0-7, 8-15) on AVX2: quant_tiles.c's kernels and paged_attention.c's
   long-query path are written once against these. Defines HAVE_TILES where the build has either. */
#ifndef TOKENBUS_TILE_VECTORS_H
#define TOKENBUS_TILE_VECTORS_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include "vec_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "vec_avx2.h"
#endif

#endif

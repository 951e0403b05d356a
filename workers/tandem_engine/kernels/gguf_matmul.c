/* tandem's weight-only matmul over a GGUF file's own quantized blocks (see gguf_matmul.py, which builds it
 * with the system C compiler, caches the shared object per source, flags and CPU, and calls it through
 * ctypes; docs/architecture.md, "GGUF weight-only quantization").
 *
 * W [n, k] is stored as the file stores it: row after row, each row k / 32 blocks of 32 weights.
 *   Q8_0 (ggml type 8):  fp16 d, 32 int8 q;               w_j = d * q_j              (34 bytes)
 *   Q4_1 (ggml type 3):  fp16 d, fp16 m, 16 bytes q;      w_j = d * q_j + m          (20 bytes)
 *                        byte i holds q_i in its low nibble and q_(i+16) in its high one.
 * y [m, n] = x [m, k] @ W^T is computed in float32 without ever writing W out: per block,
 * s = sum_j q_j x_j, then y += d * s (+ m * sum_j x_j for Q4_1, whose per-block sums of x are taken
 * once per call). Rows of x go through in tiles of up to TILE, so each block is unpacked once per tile and
 * reused from registers; output rows (of W) are split over OpenMP threads. That is tandem_gguf_matmul,
 * the float32 reference; tandem_gguf_matmul_q8 (the default for a few rows, below) instead quantizes x to
 * int8 per block of 32, as llama.cpp does, and takes integer dot products of the blocks (AVX-512 VNNI or
 * AVX2), which is what makes a decode step memory bound rather than bound by unpacking to float. Its two
 * halves are entry points of their own, tandem_gguf_quantize_x and tandem_gguf_matmul_q8_cols (a range of
 * output columns), which the fused decode step (decode_step.c) calls from its own threads.
 *
 * Built twice from this one file: with -march=native (the AVX2/FMA/F16C path below when the CPU has them,
 * VNNI too where it has AVX-512 VNNI/VL) and without (the portable scalar path), which the tests check
 * against each other and a reference. */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tandem_kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SIMD 1
#else
#define SIMD 0
#endif

/* Bytes ahead of the block being read that the single-row loops (dot_rows_*) request: with one row of x a
 * weight byte is used once, so a token streams every weight from memory, and the hardware prefetcher alone
 * kept the loops waiting on it. In the engine on the AVX2 EPYC (one stream, 200 steps in turn with the
 * build without it): 2048 bytes every block 1.18-1.29x, every second block 1.15x, every fourth 1.08x;
 * 1024 and 4096 bytes 1.17x and 1.23x. Tiles of several rows reuse each block and are not helped (8
 * sequences: 0.98x), so they do not prefetch. */
#ifndef PF_DIST
#define PF_DIST 2048
#endif
#define TILE 8               /* rows of x per register tile: 8 accumulators + 4 unpacked weight vectors */

/* A block's scale d (the first field of both block types) and a Q4_1 block's min m, as floats; the quantized
 * values of each type. */
_Static_assert(offsetof(block_q8_0, d) == 0 && offsetof(block_q4_1, d) == 0, "d leads every block");
static inline float block_d(const uint8_t *blk) { return f16_to_f32(((const block_q8_0 *)blk)->d); }
static inline float block_m(const uint8_t *blk) { return f16_to_f32(((const block_q4_1 *)blk)->m); }
#define Q8_QS(blk) (((const block_q8_0 *)(blk))->qs)
#define Q4_QS(blk) (((const block_q4_1 *)(blk))->qs)

/* The 32 quantized values of one block as floats (Q4_1 without its d and m). */
static inline void unpack(const uint8_t *blk, int qtype, float q[QK]) {
    if (qtype == Q8_0) {
        for (int j = 0; j < QK; j++) q[j] = (float)Q8_QS(blk)[j];
    } else {
        for (int j = 0; j < QK / 2; j++) {
            q[j] = (float)(Q4_QS(blk)[j] & 15);
            q[j + QK / 2] = (float)(Q4_QS(blk)[j] >> 4);
        }
    }
}

#if SIMD
static inline void unpack8(const uint8_t *blk, int qtype, __m256 q[4]) {
    if (qtype == Q8_0) {
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(Q8_QS(blk) + 8 * i))));
        return;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)Q4_QS(blk)), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}


/* out[r] = x[r] . (row without its mins) for r < mr; mr is a constant at every call site, so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_tile(const uint8_t *row, int qtype, int64_t nb,
                                                           const float *x, int64_t ldx, const int mr,
                                                           float *out) {
    const int64_t bb = block_bytes(qtype);
    __m256 acc[TILE];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        __m256 q[4];
        unpack8(blk, qtype, q);
        const __m256 d = _mm256_set1_ps(block_d(blk));
        for (int r = 0; r < mr; r++) {
            const float *xr = x + r * ldx + b * QK;
            __m256 s0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
            __m256 s1 = _mm256_mul_ps(q[1], _mm256_loadu_ps(xr + 8));
            s0 = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xr + 16), s0);
            s1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), s1);
            acc[r] = _mm256_fmadd_ps(d, _mm256_add_ps(s0, s1), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) out[r] = hsum_m256(acc[r]);
}
#else
static inline void dot_tile(const uint8_t *row, int qtype, int64_t nb, const float *x, int64_t ldx,
                            const int mr, float *out) {
    const int64_t bb = block_bytes(qtype);
    float q[QK];
    for (int r = 0; r < mr; r++) out[r] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        unpack(blk, qtype, q);
        const float d = block_d(blk);
        for (int r = 0; r < mr; r++) {
            const float *xr = x + r * ldx + b * QK;
            float s = 0.f;
            for (int j = 0; j < QK; j++) s += q[j] * xr[j];
            out[r] += d * s;
        }
    }
}
#endif

/* One weight row against rows [0, mr) of x (mr <= TILE): a constant mr per case (see dot_tile). */
static void row_tile(const uint8_t *row, int qtype, int64_t nb, const float *x, int64_t ldx, int mr,
                     float *out) {
    switch (mr) {
    case 1: dot_tile(row, qtype, nb, x, ldx, 1, out); break;
    case 2: dot_tile(row, qtype, nb, x, ldx, 2, out); break;
    case 3: dot_tile(row, qtype, nb, x, ldx, 3, out); break;
    case 4: dot_tile(row, qtype, nb, x, ldx, 4, out); break;
    case 5: dot_tile(row, qtype, nb, x, ldx, 5, out); break;
    case 6: dot_tile(row, qtype, nb, x, ldx, 6, out); break;
    case 7: dot_tile(row, qtype, nb, x, ldx, 7, out); break;
    default: dot_tile(row, qtype, nb, x, ldx, TILE, out); break;
    }
}

/* y[r * ldy + i] = sum_k x[r * ldx + k] * W[i, k] for r < m, i < n. Returns 0, or -1 for an unknown
 * qtype or k not a multiple of 32, -2 when out of memory. */
int tandem_gguf_matmul(const float *x, int64_t ldx, int64_t m, const uint8_t *w, int qtype, int64_t n,
                       int64_t k, float *y, int64_t ldy, int threads) {
    const int64_t bb = block_bytes(qtype), nb = k / QK;
    if (!bb || k % QK || m < 0 || n < 0) return -1;
    float *xsum = NULL; /* [m, nb]: each block's sum of x, for the Q4_1 mins */
    if (qtype == Q4_1 && m > 0 && nb > 0) {
        xsum = malloc(sizeof(float) * (size_t)(m * nb));
        if (!xsum) return -2;
        for (int64_t r = 0; r < m; r++)
            for (int64_t b = 0; b < nb; b++) {
                float s = 0.f;
                for (int j = 0; j < QK; j++) s += x[r * ldx + b * QK + j];
                xsum[r * nb + b] = s;
            }
    }
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = w + i * nb * bb;
        for (int64_t r0 = 0; r0 < m; r0 += TILE) {
            const int mr = (int)(m - r0 < TILE ? m - r0 : TILE);
            float out[TILE];
            row_tile(row, qtype, nb, x + r0 * ldx, ldx, mr, out);
            if (xsum)
                for (int r = 0; r < mr; r++) {
                    const float *xs = xsum + (r0 + r) * nb;
                    for (int64_t b = 0; b < nb; b++) out[r] += block_m(row + b * bb) * xs[b];
                }
            for (int r = 0; r < mr; r++) y[(r0 + r) * ldy + i] = out[r];
        }
    }
    free(xsum);
    return 0;
}

/* --- 8-bit activations: integer dot products (tandem_gguf_matmul_q8) ----------------------------------
 *
 * Each row of x is quantized once per call, per block of 32 like the weights: d_x = max|x| / 127,
 * q_x = roundf(x / d_x) (an all-zero block: d_x = 0, q_x = 0; one holding a NaN or infinity: d_x = NaN,
 * which makes the row's outputs NaN), s_x = d_x * sum(q_x). Per weight block
 * the sum of q_w * q_x is an exact integer, so
 *   Q8_0:  y += d_w * d_x * sum(q_w q_x)
 *   Q4_1:  y += d_w * d_x * sum(q_w q_x) + m_w * s_x       (q_w the unsigned nibbles 0..15)
 * The integer sum of a block is taken in 8 lanes of 4 products each (bytes 4l..4l+3 in lane l), each lane
 * converted to float and accumulated as fma(lane, d_w * d_x, acc_l) over the blocks; the 8 lanes are added
 * at the end in one fixed order (hsum8, tandem_kernels.h), Q4_1's m_w * s_x terms in a sum beside them. The SIMD paths and
 * the portable one follow exactly these steps, so every build gives the same floats (and so does any
 * thread count):
 *   AVX-512 VNNI (+VL):  _mm256_dpbusd_epi32, 32 u8 x s8 products summed into 8 int32 lanes at once;
 *   AVX2:                _mm256_maddubs_epi16 (pairs into int16: at most 2 * 128 * 127, no saturation)
 *                        then _mm256_madd_epi16 by ones (pairs of pairs into int32): the same 8 lanes.
 * u8 x s8: Q4_1's nibbles are the unsigned operand as they are; Q8_0's signed weights go in as |q_w|,
 * their signs moved onto q_x (_mm256_sign_epi8; |q_x| <= 127, so negating it cannot overflow). */

#if SIMD && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1
#else
#define VNNI 0
#endif

typedef struct {
    int8_t *q;  /* [m, nb * 32] */
    float *d;   /* [m, nb] d_x */
    float *s;   /* [nb, m] s_x = d_x * sum(q_x): block-major, so a tile's rows lie side by side (+ TILE
                 * floats, so that 8 of them can be loaded from the last tile into lanes that are dropped) */
} xq8;

/* The quantized x of m rows of k lies in one buffer of tandem_gguf_xq8_bytes(m, k) bytes: q, then d, then s. */
int64_t tandem_gguf_xq8_bytes(int64_t m, int64_t k) {
    const int64_t nb = k / QK;
    return m * nb * QK + (int64_t)sizeof(float) * (2 * m * nb + TILE);
}

static xq8 xq8_at(const void *buf, int64_t m, int64_t nb) {
    int8_t *q = (int8_t *)buf;
    float *d = (float *)(q + m * nb * QK); /* m * nb * 32 bytes: d stays float-aligned */
    return (xq8){q, d, d + m * nb};
}

#if SIMD
/* 32 values of x to int8: roundf(v / d) as trunc(q), + sign(q) where |q - trunc(q)| >= 0.5 (exact: the
 * difference is); returns the sum of the q. */
static inline int quantize_block(const float *v, float d, int8_t *q) {
    const __m256 dv = _mm256_set1_ps(d), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f);
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256i i[4];
    for (int j = 0; j < 4; j++) {
        const __m256 f = _mm256_div_ps(_mm256_loadu_ps(v + 8 * j), dv);
        const __m256 t = _mm256_round_ps(f, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(f, t)), half, _CMP_GE_OQ);
        const __m256 step = _mm256_and_ps(up, _mm256_or_ps(_mm256_and_ps(f, sign), one));
        const __m256 r = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(t, step), _mm256_set1_ps(-127.f)),
                                       _mm256_set1_ps(127.f)); /* only a subnormal d gets past 127 */
        i[j] = _mm256_cvttps_epi32(r);
    }
    /* packs interleave 128-bit lanes: 4-byte groups come out as i0[0..3] i1[0..3] i2[0..3] i3[0..3]
     * i0[4..7] ...; the permutation puts them back in order. */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    return _mm_cvtsi128_si32(s4);
}

/* max |v| of a block, NaN when it holds a NaN. */
static inline float block_amax(const float *v) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(v)), nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
    for (int j = 1; j < 4; j++) {
        const __m256 vj = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * j));
        a = _mm256_max_ps(a, vj);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(vj, vj, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
#else
static inline int quantize_block(const float *v, float d, int8_t *q) {
    int sum = 0;
    for (int j = 0; j < QK; j++) sum += q[j] = (int8_t)fminf(fmaxf(roundf(v[j] / d), -127.f), 127.f);
    return sum;
}

static inline float block_amax(const float *v) {
    float amax = 0.f;
    for (int j = 0; j < QK; j++) {
        if (isnan(v[j])) return NAN;
        amax = fmaxf(amax, fabsf(v[j]));
    }
    return amax;
}
#endif

/* Blocks [i0, i1) of x [m, k] (block i: row i / nb, block i % nb of the row) into buf, the quantized x of
 * tandem_gguf_xq8_bytes(m, k) bytes. Blocks are independent: callers may split them over threads. */
void tandem_gguf_quantize_x(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t i0, int64_t i1, void *buf) {
    const int64_t nb = k / QK;
    const xq8 xq = xq8_at(buf, m, nb);
    for (int64_t i = i0; i < i1; i++) {
        const int64_t r = i / nb, b = i % nb;
        const float *v = x + r * ldx + b * QK;
        int8_t *q = xq.q + i * QK;
        const float amax = block_amax(v);
        /* A NaN or infinity in the block: d = s = NaN, so that the row's outputs are NaN, as the
         * float path's would be NaN or infinite (no finite q could stand for it). */
        const float d = amax <= FLT_MAX ? amax / 127.f : NAN;
        int sum = 0;
        if (d > 0.f)
            sum = quantize_block(v, d, q);
        else
            memset(q, 0, QK);
        xq.d[i] = d;
        xq.s[b * m + r] = d * (float)sum;
    }
}


/* Rows r < mr of the quantized x against one weight row: out[r] = the sum over blocks of d_w d_x sum(q_w q_x),
 * mins[r] = the sum of m_w s_x (Q4_1). mr is a constant at every call site. (Splitting a few rows' blocks
 * over two sets of accumulators, against the fma chain's latency, measured no faster: not done.) */

#if SIMD
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* One block b of the weight row into acc[r] and lane r of mins (s + b * ms: the tile's s_x). */
static inline __attribute__((always_inline)) void block_q8(const uint8_t *blk, int qtype, int64_t b, int64_t nb,
                                                           const int8_t *q, const float *d, const float *s,
                                                           int64_t ms, const int mr, __m256 *acc, __m256 *mins) {
    if (qtype == Q4_1) {
        /* the 16 bytes in both halves; the upper half shifted right by 4 (64 bits at a time: what crosses
         * into a byte from its neighbour is masked off), so the vector holds q_0 .. q_31 in order */
        const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)Q4_QS(blk)));
        const __m256i wu = _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(15));
        int32_t dm_bits;
        memcpy(&dm_bits, blk, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits)); /* d_w, m_w */
        const __m256 dw = _mm256_broadcastss_ps(dm);
        const float mw = _mm_cvtss_f32(_mm_movehdup_ps(dm));
        for (int r = 0; r < mr; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(q + (r * nb + b) * QK));
            const __m256 lanes = _mm256_cvtepi32_ps(dot_u8s8(wu, xv));
            acc[r] = _mm256_fmadd_ps(lanes, _mm256_mul_ps(dw, _mm256_broadcast_ss(d + r * nb + b)), acc[r]);
        }
        /* every row's m_w * s_x at once (a separate multiply and add, as the portable path rounds them) */
        *mins = _mm256_add_ps(*mins, _mm256_mul_ps(_mm256_set1_ps(mw), _mm256_loadu_ps(s + b * ms)));
    } else {
        const __m256i w = _mm256_loadu_si256((const __m256i *)Q8_QS(blk)), wu = _mm256_abs_epi8(w);
        const __m256 dw = _mm256_set1_ps(block_d(blk));
        for (int r = 0; r < mr; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(q + (r * nb + b) * QK));
            const __m256 lanes = _mm256_cvtepi32_ps(dot_u8s8(wu, _mm256_sign_epi8(xv, w)));
            acc[r] = _mm256_fmadd_ps(lanes, _mm256_mul_ps(dw, _mm256_broadcast_ss(d + r * nb + b)), acc[r]);
        }
    }
}

static inline __attribute__((always_inline)) void dot_tile_q8(const uint8_t *row, int qtype, int64_t nb,
                                                              const int8_t *q, const float *d, const float *s,
                                                              int64_t ms, const int mr, float *out, float *mins) {
    const int64_t bb = block_bytes(qtype);
    __m256 acc[TILE], mn = _mm256_setzero_ps();
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) block_q8(row + b * bb, qtype, b, nb, q, d, s, ms, mr, acc, &mn);
    float m8[8];
    _mm256_storeu_ps(m8, mn);
    for (int r = 0; r < mr; r++) {
        float a[8];
        _mm256_storeu_ps(a, acc[r]);
        out[r] = hsum8(a);
        mins[r] = m8[r];
    }
}
#else
static inline void dot_tile_q8(const uint8_t *row, int qtype, int64_t nb, const int8_t *q, const float *d,
                               const float *s, int64_t ms, const int mr, float *out, float *mins) {
    const int64_t bb = block_bytes(qtype);
    float acc[TILE][8];
    int qw[QK];
    for (int r = 0; r < mr; r++) {
        mins[r] = 0.f;
        for (int l = 0; l < 8; l++) acc[r][l] = 0.f;
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        if (qtype == Q8_0)
            for (int j = 0; j < QK; j++) qw[j] = Q8_QS(blk)[j];
        else
            for (int j = 0; j < QK / 2; j++) qw[j] = Q4_QS(blk)[j] & 15, qw[j + QK / 2] = Q4_QS(blk)[j] >> 4;
        const float dw = block_d(blk), mw = qtype == Q4_1 ? block_m(blk) : 0.f;
        for (int r = 0; r < mr; r++) {
            const int8_t *xq = q + (r * nb + b) * QK;
            const float dd = dw * d[r * nb + b];
            for (int l = 0; l < 8; l++) {
                int sum = 0;
                for (int j = 4 * l; j < 4 * l + 4; j++) sum += qw[j] * xq[j];
                acc[r][l] = fmaf((float)sum, dd, acc[r][l]);
            }
            if (qtype == Q4_1) mins[r] += mw * s[b * ms + r];
        }
    }
    for (int r = 0; r < mr; r++) out[r] = hsum8(acc[r]);
}
#endif

#if SIMD
/* One row of x against R (2 or 4) consecutive Q4_1 weight rows: R outputs as dot_tile_q8 computes each with
 * mr = 1, the same floats in the same order, but R independent FMA chains over the blocks instead of one,
 * and x's block loaded once for them. With a single row of x (single-stream decode) a block is a few
 * instructions, and one chain kept the loop waiting on the FMA latency (4 rows measured 1.03-1.07x over 2
 * on this AVX2 EPYC). The scalar parts of a block are scalar here: d_w * d_x (the same product in every lane
 * of block_q8's vector multiply) is broadcast once made, and m_w * s_x is added to a float, as lane 0 of
 * block_q8's vector of mins adds it (rounded apart: this file is built with -ffp-contract=off). */
static inline __attribute__((always_inline)) void dot_rows_q4_1(const uint8_t *row0, int64_t row_bytes, int64_t nb,
                                                               const int8_t *q, const float *d, const float *s,
                                                               float *out, const int R) {
    const int64_t bb = block_bytes(Q4_1);
    const __m256i shift = _mm256_setr_epi64x(0, 0, 4, 4), low = _mm256_set1_epi8(15);
    __m256 acc[4];
    float mn[4];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps(), mn[i] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(q + b * QK));
        const float dx = d[b], sx = s[b];
        for (int i = 0; i < R; i++) {
            const uint8_t *blk = row0 + i * row_bytes + b * bb;
            _mm_prefetch((const char *)blk + PF_DIST, _MM_HINT_T0);
            const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)Q4_QS(blk)));
            const __m256i wu = _mm256_and_si256(_mm256_srlv_epi64(raw, shift), low);
            int32_t dm_bits;
            memcpy(&dm_bits, blk, 4);
            const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits)); /* d_w, m_w */
            const __m256 lanes = _mm256_cvtepi32_ps(dot_u8s8(wu, xv));
            acc[i] = _mm256_fmadd_ps(lanes, _mm256_set1_ps(_mm_cvtss_f32(dm) * dx), acc[i]);
            mn[i] = mn[i] + _mm_cvtss_f32(_mm_movehdup_ps(dm)) * sx;
        }
    }
    for (int i = 0; i < R; i++) {
        float a[8];
        _mm256_storeu_ps(a, acc[i]);
        out[i] = hsum8(a) + mn[i];
    }
}

/* One row of x against R Q8_0 weight rows: dot_tile_q8's floats with mr = 1, its scale product d_w * d_x
 * made once as a float and broadcast (the same product in every lane of block_q8's vector multiply). R = 1:
 * two rows at a time measured 0.74x on the head (30 MB a token, two 34-byte-block streams). */
static inline __attribute__((always_inline)) void dot_rows_q8_0(const uint8_t *row0, int64_t row_bytes, int64_t nb,
                                                               const int8_t *q, const float *d, float *out,
                                                               const int R) {
    const int64_t bb = block_bytes(Q8_0);
    __m256 acc[4];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(q + b * QK));
        const float dx = d[b];
        for (int i = 0; i < R; i++) {
            const uint8_t *blk = row0 + i * row_bytes + b * bb;
            _mm_prefetch((const char *)blk + PF_DIST, _MM_HINT_T0);
            const __m256i w = _mm256_loadu_si256((const __m256i *)Q8_QS(blk));
            const __m256 lanes = _mm256_cvtepi32_ps(dot_u8s8(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)));
            acc[i] = _mm256_fmadd_ps(lanes, _mm256_set1_ps(block_d(blk) * dx), acc[i]);
        }
    }
    for (int i = 0; i < R; i++) {
        float a[8];
        _mm256_storeu_ps(a, acc[i]);
        out[i] = hsum8(a);
    }
}
#endif

static void row_tile_q8(const uint8_t *row, int qtype, int64_t nb, const int8_t *q, const float *d,
                        const float *s, int64_t ms, int mr, float *out, float *mins) {
    switch (mr) {
    case 1: dot_tile_q8(row, qtype, nb, q, d, s, ms, 1, out, mins); break;
    case 2: dot_tile_q8(row, qtype, nb, q, d, s, ms, 2, out, mins); break;
    case 3: dot_tile_q8(row, qtype, nb, q, d, s, ms, 3, out, mins); break;
    case 4: dot_tile_q8(row, qtype, nb, q, d, s, ms, 4, out, mins); break;
    case 5: dot_tile_q8(row, qtype, nb, q, d, s, ms, 5, out, mins); break;
    case 6: dot_tile_q8(row, qtype, nb, q, d, s, ms, 6, out, mins); break;
    case 7: dot_tile_q8(row, qtype, nb, q, d, s, ms, 7, out, mins); break;
    default: dot_tile_q8(row, qtype, nb, q, d, s, ms, TILE, out, mins); break;
    }
}

/* Output columns [i0, i1) of y [m, n] (row stride ldy) = x @ W^T, from x quantized into buf by
 * tandem_gguf_quantize_x: what one thread of tandem_gguf_matmul_q8 computes. W is [n, k] (columns i0 and on
 * of y are rows i0 and on of W). */
void tandem_gguf_matmul_q8_cols(const void *buf, int64_t m, const uint8_t *w, int qtype, int64_t k, int64_t i0,
                                int64_t i1, float *y, int64_t ldy) {
    const int64_t bb = block_bytes(qtype), nb = k / QK;
    const xq8 xq = xq8_at(buf, m, nb);
#if SIMD
    if (m == 1 && qtype == Q4_1) {
        for (; i0 + 4 <= i1; i0 += 4) dot_rows_q4_1(w + i0 * nb * bb, nb * bb, nb, xq.q, xq.d, xq.s, y + i0, 4);
        for (; i0 + 2 <= i1; i0 += 2) dot_rows_q4_1(w + i0 * nb * bb, nb * bb, nb, xq.q, xq.d, xq.s, y + i0, 2);
    } else if (m == 1) {
        for (; i0 < i1; i0++) dot_rows_q8_0(w + i0 * nb * bb, nb * bb, nb, xq.q, xq.d, y + i0, 1);
    }
#endif
    for (int64_t i = i0; i < i1; i++) {
        const uint8_t *row = w + i * nb * bb;
        for (int64_t r0 = 0; r0 < m; r0 += TILE) {
            const int mr = (int)(m - r0 < TILE ? m - r0 : TILE);
            float out[TILE], mins[TILE];
            row_tile_q8(row, qtype, nb, xq.q + r0 * nb * QK, xq.d + r0 * nb, xq.s + r0, m, mr, out, mins);
            for (int r = 0; r < mr; r++) y[(r0 + r) * ldy + i] = qtype == Q4_1 ? out[r] + mins[r] : out[r];
        }
    }
}

/* tandem_gguf_matmul with x quantized to 8 bits per block of 32 (above): same arguments and returns. */
int tandem_gguf_matmul_q8(const float *x, int64_t ldx, int64_t m, const uint8_t *w, int qtype, int64_t n,
                          int64_t k, float *y, int64_t ldy, int threads) {
    const int64_t bb = block_bytes(qtype), nb = k / QK;
    if (!bb || k % QK || m < 0 || n < 0) return -1;
    if (m == 0 || n == 0) return 0;
    if (nb == 0) { /* k = 0: empty sums */
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < n; i++) y[r * ldy + i] = 0.f;
        return 0;
    }
    void *buf = calloc(1, (size_t)tandem_gguf_xq8_bytes(m, k));
    if (!buf) return -2;
    tandem_gguf_quantize_x(x, ldx, m, k, 0, m * nb, buf);
    if (threads < 1) threads = 1;
    /* Output rows split as schedule(static) would: one contiguous range per thread. */
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        tandem_gguf_matmul_q8_cols(buf, m, w, qtype, k, n * t / nt, n * (t + 1) / nt, y, ldy);
    }
    free(buf);
    return 0;
}

/* Values below which a dequantization stays on the calling thread: a decode step's embedding lookup (a
 * few rows of 576) is microseconds of work, where forking the thread pool wakes sleeping threads for
 * ~0.2 ms (an engine waits passively, cpu_budget.py). A weight (a prefill's projections) is still split. */
#define MIN_DEQUANTIZE_VALUES 65536

/* out[i * k + j] = W[rows[i], j] as float32 (rows NULL: row i), each value d * q (+ m) rounded as the
 * gguf package's dequantization rounds it (this file is built with -ffp-contract=off). */
int tandem_gguf_dequantize(const uint8_t *w, int qtype, int64_t k, const int64_t *rows, int64_t n, float *out,
                           int threads) {
    const int64_t bb = block_bytes(qtype), nb = k / QK;
    if (!bb || k % QK || n < 0) return -1;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= MIN_DEQUANTIZE_VALUES)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = w + (rows ? rows[i] : i) * nb * bb;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bb;
            float q[QK];
            unpack(blk, qtype, q);
            const float d = block_d(blk), mn = qtype == Q4_1 ? block_m(blk) : 0.f;
            float *o = out + i * k + b * QK;
            if (qtype == Q4_1)
                for (int j = 0; j < QK; j++) o[j] = d * q[j] + mn;
            else
                for (int j = 0; j < QK; j++) o[j] = q[j] * d;
        }
    }
    return 0;
}

/* 1 when this build runs the AVX2/FMA path, 0 for the portable one. */
int tandem_gguf_simd(void) { return SIMD; }

/* 1 when tandem_gguf_matmul_q8 runs on AVX-512 VNNI, 0 for AVX2's maddubs (or the portable path). */
int tandem_gguf_vnni(void) { return VNNI; }

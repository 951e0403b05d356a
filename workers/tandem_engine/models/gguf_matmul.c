/* tandem's weight-only matmul over a GGUF file's own quantized blocks (see gguf_linear.py, which builds it
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
 * reused from registers; output rows (of W) are split over OpenMP threads.
 *
 * Built twice from this one file: with -march=native (the AVX2/FMA/F16C path below when the CPU has them)
 * and without (the portable scalar path), which the tests check against each other and a reference. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SIMD 1
#else
#define SIMD 0
#endif

enum { Q4_1 = 3, Q8_0 = 8 }; /* ggml's type ids */
#define QK 32                /* weights per block */
#define TILE 8               /* rows of x per register tile: 8 accumulators + 4 unpacked weight vectors */

static int64_t block_bytes(int qtype) { return qtype == Q8_0 ? 34 : qtype == Q4_1 ? 20 : 0; }

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if SIMD
    return _cvtsh_ss(h);
#else
    const int e = (h >> 10) & 31, f = h & 1023;
    const float v = e == 0 ? ldexpf((float)f, -24)                  /* zero and subnormals */
                  : e == 31 ? (f ? NAN : INFINITY)
                  : ldexpf((float)(f | 1024), e - 25);              /* 1.f * 2^(e - 15) */
    return (h & 0x8000) ? -v : v;
#endif
}

/* The 32 quantized values of one block as floats (Q4_1 without its d and m). */
static inline void unpack(const uint8_t *blk, int qtype, float q[QK]) {
    if (qtype == Q8_0) {
        for (int j = 0; j < QK; j++) q[j] = (float)(int8_t)blk[2 + j];
    } else {
        for (int j = 0; j < QK / 2; j++) {
            q[j] = (float)(blk[4 + j] & 15);
            q[j + QK / 2] = (float)(blk[4 + j] >> 4);
        }
    }
}

#if SIMD
static inline void unpack8(const uint8_t *blk, int qtype, __m256 q[4]) {
    if (qtype == Q8_0) {
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * i))));
        return;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4)), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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
        const __m256 d = _mm256_set1_ps(fp16(blk));
        for (int r = 0; r < mr; r++) {
            const float *xr = x + r * ldx + b * QK;
            __m256 s0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(xr));
            __m256 s1 = _mm256_mul_ps(q[1], _mm256_loadu_ps(xr + 8));
            s0 = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xr + 16), s0);
            s1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), s1);
            acc[r] = _mm256_fmadd_ps(d, _mm256_add_ps(s0, s1), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) out[r] = hsum(acc[r]);
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
        const float d = fp16(blk);
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
                    for (int64_t b = 0; b < nb; b++) out[r] += fp16(row + b * bb + 2) * xs[b];
                }
            for (int r = 0; r < mr; r++) y[(r0 + r) * ldy + i] = out[r];
        }
    }
    free(xsum);
    return 0;
}

/* out[i * k + j] = W[rows[i], j] as float32 (rows NULL: row i), each value d * q (+ m) rounded as the
 * gguf package's dequantization rounds it (this file is built with -ffp-contract=off). */
int tandem_gguf_dequantize(const uint8_t *w, int qtype, int64_t k, const int64_t *rows, int64_t n, float *out,
                           int threads) {
    const int64_t bb = block_bytes(qtype), nb = k / QK;
    if (!bb || k % QK || n < 0) return -1;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = w + (rows ? rows[i] : i) * nb * bb;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bb;
            float q[QK];
            unpack(blk, qtype, q);
            const float d = fp16(blk), mn = qtype == Q4_1 ? fp16(blk + 2) : 0.f;
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

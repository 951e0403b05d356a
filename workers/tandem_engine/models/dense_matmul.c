/* tandem's float32 matmul for the dense path's decode steps (see dense_matmul.py, which builds this with
 * kernels/build.py and calls it through ctypes; docs/architecture.md, "Dense decode steps in one call").
 *
 * y [m, n] = x [m, k] @ w [n, k]^T with w packed once into panels of NR = 16 output columns,
 * [ceil(n / 16), k, 16] (zeros past n): a panel's k-th 64 bytes are the 16 weights that meet x[:, k], so one
 * pass over a panel is one sequential read. A tile of up to MR = 6 rows by 16 columns keeps its 12 sums of 8
 * in registers across the whole of k; every output is one chain of fused multiply-adds in k order from zero,
 * on every build (the scalar loop of a CPU without AVX2 and FMA computes the same floats).
 *
 * Measured against oneDNN's packed matmul (torch.ops.mkldnn._linear_pointwise) on SmolLM2's projections with
 * the weights streamed from memory, as in a decode step, on 2 threads of an AVX2 EPYC: 1.2-1.3x at 32 rows,
 * 1.1-1.2x at 128, 1.5-3x at 1-4 rows (where torch runs MKL's sgemv), before the prefetch below. */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 1
#else
#include <math.h>
#define VECTOR 0
#endif

#define NR 16 /* output columns of a panel */
#define MR 6  /* rows of a tile: 12 accumulators, two panel loads and a broadcast fill 15 of AVX2's 16 registers */

/* Rows [0, mr) of x (row stride ldx) times the panel wp ([k][NR]); columns [lo, hi) of the panel go to
 * y[r * ldy + c] (y points at the panel's first column). Each step in k also requests the cache line at
 * pf + k * NR, unless pf is NULL. mr is a constant in each copy (tile_rows). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const float *wp, int64_t k,
                                                       float *y, int64_t ldy, const int mr, int lo, int hi,
                                                       const float *pf) {
#if VECTOR
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define DECLARE(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
    ROWS(DECLARE)
    for (int64_t i = 0; i < k; i++) {
        const __m256 b0 = _mm256_loadu_ps(wp + i * NR), b1 = _mm256_loadu_ps(wp + i * NR + 8);
        if (pf) _mm_prefetch((const char *)(pf + i * NR), _MM_HINT_T0);
#define FMA(r)                                                        \
    if (mr > r) {                                                     \
        const __m256 a = _mm256_broadcast_ss(x + r * ldx + i);        \
        c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                    \
        c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                    \
    }
        ROWS(FMA)
    }
    if (lo == 0 && hi == NR) {
#define STORE(r)                                                      \
    if (mr > r) {                                                     \
        _mm256_storeu_ps(y + r * ldy, c##r##0);                       \
        _mm256_storeu_ps(y + r * ldy + 8, c##r##1);                   \
    }
        ROWS(STORE)
    } else {
        float t[NR];
#define STORE_PART(r)                                                 \
    if (mr > r) {                                                     \
        _mm256_storeu_ps(t, c##r##0);                                 \
        _mm256_storeu_ps(t + 8, c##r##1);                             \
        memcpy(y + r * ldy + lo, t + lo, sizeof(float) * (size_t)(hi - lo)); \
    }
        ROWS(STORE_PART)
    }
#else
    (void)pf;
    for (int r = 0; r < mr; r++)
        for (int c = lo; c < hi; c++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++) acc = fmaf(x[r * ldx + i], wp[i * NR + c], acc);
            y[r * ldy + c] = acc;
        }
#endif
}

static void tile_rows(const float *x, int64_t ldx, const float *wp, int64_t k, float *y, int64_t ldy, int mr, int lo,
                      int hi, const float *pf) {
    switch (mr) {
    case 6: tile(x, ldx, wp, k, y, ldy, 6, lo, hi, pf); break;
    case 5: tile(x, ldx, wp, k, y, ldy, 5, lo, hi, pf); break;
    case 4: tile(x, ldx, wp, k, y, ldy, 4, lo, hi, pf); break;
    case 3: tile(x, ldx, wp, k, y, ldy, 3, lo, hi, pf); break;
    case 2: tile(x, ldx, wp, k, y, ldy, 2, lo, hi, pf); break;
    default: tile(x, ldx, wp, k, y, ldy, 1, lo, hi, pf); break;
    }
}

/* Output columns [c0, c1) of y [m, ldy] for the m rows of x (row stride ldx), panel by panel (a panel is
 * read from memory once, then from cache for its other row tiles).
 * Prefetch, measured on SmolLM2's projections and head with the weights streamed from memory (2 threads of
 * the AVX2 EPYC): with several row tiles, the first tile of a panel requests the next panel, which the
 * hardware prefetcher left the first tile waiting for (1.05-1.09x at 32 rows, 1.14-1.35x at 8); with a
 * single tile, that doubled the stream (0.6-0.98x at 1 row), so a tile of 2-6 rows requests its own panel
 * PF_AHEAD floats (2 KB) ahead instead (1.15-1.21x at 4), and a single row nothing (in the engine, one
 * stream ran 0.94x with the 2 KB prefetch). */
#define PF_AHEAD 512
static void cols(const float *x, int64_t ldx, int64_t m, const float *w, int64_t k, int64_t c0, int64_t c1, float *y,
                 int64_t ldy) {
    for (int64_t p = c0 / NR; p * NR < c1; p++) {
        const int lo = (int)(c0 > p * NR ? c0 - p * NR : 0), hi = (int)(c1 < (p + 1) * NR ? c1 - p * NR : NR);
        const float *panel = w + p * k * NR;
        for (int64_t r = 0; r < m; r += MR)
            tile_rows(x + r * ldx, ldx, panel, k, y + r * ldy + p * NR, ldy, (int)(m - r < MR ? m - r : MR), lo, hi,
                      m == 1 ? NULL : m <= MR ? panel + PF_AHEAD : r == 0 ? panel + k * NR : NULL);
    }
}

/* The fused decode step's entry points (models/gguf_decode.c, kernels_t), in the int8 kernel's shape:
 * `quantize` copies blocks [i0, i1) of 32 values of x [m, k] (row stride ldx, k a multiple of 32) into buf as
 * [m, k] floats; `matmul_cols` computes columns [i0, i1) of y from that copy (qtype unused). */
void tandem_dense_copy_x(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t i0, int64_t i1, void *buf) {
    (void)m;
    const int64_t nb = k / 32;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t r = i / nb, c = i % nb * 32;
        memcpy((float *)buf + r * k + c, x + r * ldx + c, 32 * sizeof(float));
    }
}

void tandem_dense_matmul_cols(const void *buf, int64_t m, const uint8_t *w, int qtype, int64_t k, int64_t i0, int64_t i1,
                              float *y, int64_t ldy) {
    (void)qtype;
    cols((const float *)buf, k, m, (const float *)w, k, i0, i1, y, ldy);
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ the panels of w: a whole matmul, its panels shared
 * out over `threads` OpenMP threads (torch's pool). */
void tandem_dense_matmul(const float *x, int64_t ldx, int64_t m, const float *w, int64_t n, int64_t k, float *y,
                         int64_t ldy, int threads) {
    const int64_t panels = (n + NR - 1) / NR;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int64_t p = 0; p < panels; p++)
        cols(x, ldx, m, w, k, p * NR, (p + 1) * NR < n ? (p + 1) * NR : n, y, ldy);
}

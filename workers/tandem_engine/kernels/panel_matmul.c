/* tandem's float32 matmul for the dense path's decode steps (see panel_matmul.py, which builds this with
 * kernels/build.py and calls it through ctypes; docs/architecture.md, "Dense decode steps in one call").
 *
 * y [m, n] = x [m, k] @ w [n, k]^T with w packed once into panels of NR = 16 output columns,
 * [ceil(n / 16), k, 16] (zeros past n): a panel's k-th 64 bytes are the 16 weights that meet x[:, k], so one
 * pass over a panel is one sequential read. With AVX2, a tile of up to MR = 6 rows by one panel keeps its 12
 * sums of 8 in registers across the whole of k; with AVX-512, a tile of up to 12 rows by two adjacent panels
 * (32 columns) keeps 24 sums of 16. Every output is one chain of fused multiply-adds in k order from zero, on
 * every build (the scalar loop of a CPU without AVX2 and FMA computes the same floats). The panels may also
 * keep the GGUF blocks the weights were dequantized from (below: block panels), unpacked to the same floats.
 *
 * Measured against oneDNN's packed matmul (torch.ops.mkldnn._linear_pointwise) on SmolLM2's projections with
 * the weights streamed from memory, as in a decode step, on 2 threads of an AVX2 EPYC: 1.2-1.3x at 32 rows,
 * 1.1-1.2x at 128, 1.5-3x at 1-4 rows (where torch runs MKL's sgemv), before the prefetch below. On 2 threads
 * of an AVX-512 Xeon (in turn, load 0.7-0.9): the AVX2 build 0.85-0.9x oneDNN at 32 rows, 0.63x at 512; the
 * AVX-512 build with one-panel tiles of 12 rows 1.06x at 32 and 0.72x at 512; with two-panel tiles 1.20-1.24x
 * at 32, 1.07x at 128, 1.02x at 256, 0.97x at 512 and 1.4x at 1-4 rows. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "tandem_kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define VECTOR 512
#define MR 12 /* rows of a tile (of two panels: below) */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 256
#define MR 6 /* rows of a tile: 12 accumulators, two panel loads and a broadcast fill 15 of AVX2's 16 registers */
#else
#include <math.h>
#define VECTOR 0
#define MR 6
#endif

#define NR PANEL_NR /* output columns of a panel */

/* Panels of weights kept in a GGUF file's blocks (the qtype argument, ggml's type ids) instead of floats: the
 * same [ceil(n / 16)] panels of 16 output columns, each a run of k / 32 block panels, one per block of 32
 * weights along k, each holding the 16 columns' blocks of that stretch of k (kernels/panel_matmul.py,
 * pack_block_panels):
 *   Q4_1 (320 bytes): 16 fp16 d, 16 fp16 m, then 16 rows of 16 bytes, row i byte c the i-th byte of column c's
 *        block (its low nibble the weight at k = i, its high nibble the one at k = i + 16);  w = d * q + m
 *   Q8_0 (544 bytes): 16 fp16 d, then 32 rows of 16 int8, row i byte c column c's weight at k = i;  w = d * q
 * A pair of panels is unpacked into float panels in a buffer of the thread's, and the tiles run over it as over
 * float panels. d * q is exact in float32 (11 significant bits times at most 8), so unpacking gives the very
 * floats the file's dequantization does (gguf.quants, which the dense model is loaded from: d * q, then + m) and
 * every output is the float the float panels give; the engine checks this of every projection when it packs
 * them (tandem_panel_unpack). Why: a decode step otherwise streams every float32 weight from memory, 4 bytes,
 * where the blocks are 0.625 (Q4_1) and 1.06 (Q8_0). */

int64_t tandem_panel_block_bytes(int qtype) {
    return qtype == Q4_1 ? (int64_t)sizeof(panel_q4_1) : qtype == Q8_0 ? (int64_t)sizeof(panel_q8_0) : 0;
}

/* Where a block panel's fields lie (panel_q4_1, panel_q8_0). */
#define P4(p) ((const panel_q4_1 *)(p))
#define P8(p) ((const panel_q8_0 *)(p))
_Static_assert(offsetof(panel_q8_0, d) == 0 && offsetof(panel_q4_1, d) == 0, "d leads every block panel");

/* One block panel at src as floats, out [QK][NR]. */
static void unpack_block(const uint8_t *src, int qtype, float *out) {
#if VECTOR == 512
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src));
    if (qtype == Q4_1) {
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)P4(src)->m));
        const __m128i low = _mm_set1_epi8(0x0F);
        for (int i = 0; i < QK / 2; i++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)P4(src)->qs[i]);
            const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low)));
            const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low)));
            _mm512_storeu_ps(out + i * NR, _mm512_fmadd_ps(q0, d, mn)); /* d * q exact: one rounding either way */
            _mm512_storeu_ps(out + (i + QK / 2) * NR, _mm512_fmadd_ps(q1, d, mn));
        }
    } else {
        for (int i = 0; i < QK; i++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)P8(src)->qs[i]);
            _mm512_storeu_ps(out + i * NR, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), d));
        }
    }
#elif VECTOR == 256 && defined(__F16C__)
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src)),
                 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(P8(src)->d + 8)));
    if (qtype == Q4_1) {
        const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)P4(src)->m)),
                     m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(P4(src)->m + 8)));
        const __m128i low = _mm_set1_epi8(0x0F);
        for (int i = 0; i < QK / 2; i++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)P4(src)->qs[i]);
            const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
            float *o = out + i * NR, *o2 = out + (i + QK / 2) * NR;
            _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d0, m0));
            _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d1, m1));
            _mm256_storeu_ps(o2, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d0, m0));
            _mm256_storeu_ps(o2 + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d1, m1));
        }
    } else {
        for (int i = 0; i < QK; i++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)P8(src)->qs[i]);
            _mm256_storeu_ps(out + i * NR, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d0));
            _mm256_storeu_ps(out + i * NR + 8,
                             _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), d1));
        }
    }
#else
    for (int c = 0; c < NR; c++) {
        const float d = f16_to_f32(P8(src)->d[c]), mn = qtype == Q4_1 ? f16_to_f32(P4(src)->m[c]) : 0.0f;
        for (int i = 0; i < QK; i++) {
            float w;
            if (qtype == Q4_1) {
                const uint8_t b = P4(src)->qs[i % 16][c];
                w = fmaf((float)(i < 16 ? b & 15 : b >> 4), d, mn);
            } else {
                w = (float)P8(src)->qs[i][c] * d;
            }
            out[i * NR + c] = w;
        }
    }
#endif
}

/* The kn steps in k from k0 (whole blocks) of np adjacent block panels from bp (each of k) as floats, out
 * [np][stride][NR]; each block's bytes `ahead` bytes further on are requested into L2 on the way (unless ahead
 * is 0). */
#define CHUNK 64 /* steps in k unpacked at a time: two panels' are 8 KB, which stay in L1 */
static inline void unpack_chunk(const uint8_t *bp, int qtype, int np, int64_t k, int64_t k0, int64_t kn, float *out,
                                int64_t stride, int64_t ahead) {
    const int64_t bb = tandem_panel_block_bytes(qtype), panel = k / QK * bb;
    for (int j = 0; j < np; j++)
        for (int64_t i = 0; i < kn; i += QK) {
            const uint8_t *blk = bp + j * panel + (k0 + i) / QK * bb;
#if VECTOR
            if (ahead)
                for (int64_t l = 0; l < bb; l += 64) _mm_prefetch((const char *)(blk + ahead + l), _MM_HINT_T1);
#else
            (void)ahead;
#endif
            unpack_block(blk, qtype, out + (j * stride + i) * NR);
        }
}

/* Rows [0, mr) of x (row stride ldx) times np adjacent panels from wp ([np][k][NR]; np is 2 only in the
 * AVX-512 build) or, if bp is not NULL, from the block panels at bp, unpacked CHUNK steps in k at a time into
 * a buffer that stays in L1 (requesting their bytes `ahead` further on: unpack_chunk); columns [lo, hi) of
 * the np * NR go to y[r * ldy + c] (y points at the first panel's first column). Unless prefetch is NULL, every
 * prefetch_every-th step in k also requests a cache line into L2, one after the other from prefetch (and as many from
 * prefetch + k * NR in the AVX-512 build's second panel). The sums start from zero, or with acc_in from what y
 * holds (a tile's earlier steps in k, stored there by a call over them). mr and np are constants in each copy
 * (tile_rows). The floats are the same whichever panels hold the weights, and however k is cut into chunks
 * or calls. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const float *wp,
                                                       const uint8_t *bp, int qtype, int64_t ahead, int64_t k,
                                                       float *y, int64_t ldy, const int mr, const int np, int lo,
                                                       int hi, const float *prefetch, const int prefetch_every, int acc_in) {
    int prefetch_count = 0;
    _Alignas(64) float chunk[2 * CHUNK * NR];
    const int64_t kc = bp ? CHUNK : k; /* steps in k per pass */
#define CHUNK_START                                                                      \
    for (int64_t k0 = 0; k0 < k; k0 += kc) {                                             \
        const int64_t kn = k - k0 < kc ? k - k0 : kc;                                    \
        const float *w0 = chunk, *w1 = chunk + CHUNK * NR;                               \
        if (bp)                                                                          \
            unpack_chunk(bp, qtype, np, k, k0, kn, chunk, CHUNK, ahead);                 \
        else                                                                             \
            w0 = wp + k0 * NR, w1 = wp + (k + k0) * NR;                                  \
        const float *xk = x + k0;
#if VECTOR == 512
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
    /* lanes [lo, hi) of the first panel and of the second */
    const int l1 = lo > NR ? lo - NR : 0, h0 = hi < NR ? hi : NR;
    const __mmask16 keep0 = lo < h0 ? (__mmask16)(((1u << (h0 - lo)) - 1u) << lo) : 0;
    const __mmask16 keep1 = hi > NR ? (__mmask16)(((1u << (hi - NR - l1)) - 1u) << l1) : 0;
#define DECLARE(r)                                                                   \
    __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = _mm512_setzero_ps();             \
    if (acc_in && mr > r) {                                                          \
        c##r##0 = _mm512_maskz_loadu_ps(keep0, y + r * ldy);                         \
        if (np == 2) c##r##1 = _mm512_maskz_loadu_ps(keep1, y + r * ldy + NR);       \
    }
    ROWS(DECLARE)
    CHUNK_START
    for (int64_t i = 0; i < kn; i++) {
        const __m512 b0 = _mm512_loadu_ps(w0 + i * NR), b1 = np == 2 ? _mm512_loadu_ps(w1 + i * NR) : b0;
        if (prefetch && ++prefetch_count == prefetch_every) {
            prefetch_count = 0;
            _mm_prefetch((const char *)prefetch, _MM_HINT_T1);
            if (np == 2) _mm_prefetch((const char *)(prefetch + k * NR), _MM_HINT_T1);
            prefetch += NR;
        }
#define FMA(r)                                                        \
    if (mr > r) {                                                     \
        const __m512 a = _mm512_set1_ps(xk[r * ldx + i]);             \
        c##r##0 = _mm512_fmadd_ps(a, b0, c##r##0);                    \
        if (np == 2) c##r##1 = _mm512_fmadd_ps(a, b1, c##r##1);       \
    }
        ROWS(FMA)
    }
    }
#define STORE(r)                                                      \
    if (mr > r) {                                                     \
        _mm512_mask_storeu_ps(y + r * ldy, keep0, c##r##0);           \
        if (np == 2) _mm512_mask_storeu_ps(y + r * ldy + NR, keep1, c##r##1); \
    }
    ROWS(STORE)
#elif VECTOR == 256
    (void)np;
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define DECLARE(r)                                                                   \
    __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();             \
    if (acc_in && mr > r) {                                                          \
        if (lo == 0 && hi == NR) {                                                   \
            c##r##0 = _mm256_loadu_ps(y + r * ldy), c##r##1 = _mm256_loadu_ps(y + r * ldy + 8); \
        } else {                                                                     \
            float t[NR] = {0};                                                       \
            memcpy(t + lo, y + r * ldy + lo, sizeof(float) * (size_t)(hi - lo));     \
            c##r##0 = _mm256_loadu_ps(t), c##r##1 = _mm256_loadu_ps(t + 8);          \
        }                                                                            \
    }
    ROWS(DECLARE)
    CHUNK_START
    (void)w1;
    for (int64_t i = 0; i < kn; i++) {
        const __m256 b0 = _mm256_loadu_ps(w0 + i * NR), b1 = _mm256_loadu_ps(w0 + i * NR + 8);
        if (prefetch && ++prefetch_count == prefetch_every) {
            prefetch_count = 0;
            _mm_prefetch((const char *)prefetch, _MM_HINT_T1);
            prefetch += NR;
        }
#define FMA(r)                                                        \
    if (mr > r) {                                                     \
        const __m256 a = _mm256_broadcast_ss(xk + r * ldx + i);       \
        c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                    \
        c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                    \
    }
        ROWS(FMA)
    }
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
    (void)prefetch;
    (void)prefetch_every;
    (void)prefetch_count;
    float acc[MR][NR] = {{0}};
    for (int r = 0; acc_in && r < mr; r++)
        for (int c = lo; c < hi; c++) acc[r][c] = y[r * ldy + c];
    CHUNK_START
    (void)w1;
    for (int r = 0; r < mr; r++)
        for (int c = lo; c < hi; c++)
            for (int64_t i = 0; i < kn; i++) acc[r][c] = fmaf(xk[r * ldx + i], w0[i * NR + c], acc[r][c]);
    }
    for (int r = 0; r < mr; r++)
        for (int c = lo; c < hi; c++) y[r * ldy + c] = acc[r][c];
#endif
#undef CHUNK_START
}

#if VECTOR == 512
#define PANELS 2 /* panels a tile reads: 24 sums, two panel loads and a broadcast (of 32 registers) */
#define TILE(mr) np == 2 ? tile(x, ldx, wp, bp, qtype, ahead, k, y, ldy, mr, 2, lo, hi, prefetch, prefetch_every, acc_in) \
                         : tile(x, ldx, wp, bp, qtype, ahead, k, y, ldy, mr, 1, lo, hi, prefetch, prefetch_every, acc_in)
#else
#define PANELS 1
#define TILE(mr) tile(x, ldx, wp, bp, qtype, ahead, k, y, ldy, mr, 1, lo, hi, prefetch, prefetch_every, acc_in)
#endif

static void tile_rows(const float *x, int64_t ldx, const float *wp, const uint8_t *bp, int qtype, int64_t ahead,
                      int64_t k, float *y, int64_t ldy, int mr, int np, int lo, int hi, const float *prefetch, int prefetch_every,
                      int acc_in) {
    (void)np;
    switch (mr) {
#if MR > 6
    case 12: TILE(12); break;
    case 11: TILE(11); break;
    case 10: TILE(10); break;
    case 9: TILE(9); break;
    case 8: TILE(8); break;
    case 7: TILE(7); break;
#endif
    case 6: TILE(6); break;
    case 5: TILE(5); break;
    case 4: TILE(4); break;
    case 3: TILE(3); break;
    case 2: TILE(2); break;
    default: TILE(1); break;
    }
}

/* Output columns [c0, c1) of y [m, ldy] for the m rows of x (row stride ldx), PANELS panels at a time (they
 * are read from memory once, then from cache for their other row tiles).
 * Prefetch, measured on SmolLM2's projections and head with the weights streamed from memory: with several
 * row tiles, the tiles of a panel request the next panels into L2, each tile a share of their lines spread
 * over its steps in k, so that the whole computation of a panel hides the next one's read. (The first
 * version had the first tile request all of the next panel, one line per step into L1: 1.05-1.09x at 32 rows
 * and 1.14-1.35x at 8 over none on 2 threads of the AVX2 EPYC. On 2 threads of the AVX-512 Xeon its burst
 * outran memory: spreading it, into L2, took 30 layers' projections and the head at 32 rows from 184 to 228
 * GFLOP/s, with runs of tiles below, and 1.07-1.16x at 16-96 rows.) With a single tile, requesting the next
 * panel doubled the stream (0.6-0.98x at 1 row), so a lone tile of 2 to MR rows requests its panels PF_AHEAD
 * floats (2 KB) ahead instead (1.15-1.21x at 4), and a single row nothing (in the engine, one stream ran
 * 0.94x with the 2 KB prefetch). Block panels are unpacked CHUNK steps in k at a time into a buffer that
 * stays in L1, requesting the next pair of panels' bytes on the way: a lone tile unpacks its own chunks; with
 * several, each chunk is unpacked once and every tile takes its steps over it, keeping its sums in y between
 * chunks (the same chain of fused multiply-adds, stored and reloaded exactly). Against unpacking a whole
 * pair of panels into a buffer of the thread's (L2) for the tiles to read, 2 threads of the AVX-512 Xeon:
 * see docs/architecture.md, "Panels kept in the file's blocks". */
#define PF_AHEAD 512
/* Steps in k of a chunk that several tiles share (a lone tile's: CHUNK): every tile reloads and stores its
 * sums once per chunk, so longer chunks pay that less often, while two panels of 256 steps (32 KB) still stay
 * in L1 beside the tiles' rows of x. Half of it up to 4 * MR rows (measured: SmolLM2's projections in Q4_1 on
 * 2 threads of the AVX-512 Xeon, in turn; in cache, 512 rows: 64 steps 58.4 ms, 128 54.3, 256 51.1, float
 * panels 50.3; the AVX2 build 96.9, 85.0, 77.3 and 75.0; at 128 rows 256 steps 1.10-1.12x float panels;
 * streamed from memory, 13-16 rows: 64 and 128 steps even, 256 3% behind; 32-64 rows: 128 and 256 even,
 * 64 3-5% behind). */
#ifndef TILES_CHUNK
#define TILES_CHUNK 256
#endif
#ifndef PF_PAIRS
#define PF_PAIRS 1 /* block panels: a lone tile requests the bytes of the pair of panels this many pairs on (1-4 within 6% at 1 row; 1 the best) */
#endif
#if VECTOR == 512
/* One row of x times np (1-4) adjacent block panels from bp, each weight unpacked in registers and used at
 * once (no buffer), into lanes [lo, hi) of the np * NR columns at y. With one row, each output's chain of
 * fused multiply-adds waits on the one before, so four panels give four chains to overlap, and the unpacking
 * fills the wait. Same weights (unpack_block's operations) and the same chain in k order as the tiles, so
 * the same floats. Requests each block's bytes `ahead` further on into L2 (unless 0). */
static inline __attribute__((always_inline)) void row_blocks(const float *x, const uint8_t *bp, int qtype,
                                                             int64_t k, const int np, float *y, int lo, int hi,
                                                             int64_t ahead) {
    const int64_t bb = tandem_panel_block_bytes(qtype), panel = k / QK * bb;
    const __m128i low = _mm_set1_epi8(0x0F);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < k / QK; b++) {
        const uint8_t *blk[4];
        __m512 d[4], mn[4];
        for (int j = 0; j < np; j++) {
            blk[j] = bp + j * panel + b * bb;
            if (ahead)
                for (int64_t l = 0; l < bb; l += 64) _mm_prefetch((const char *)(blk[j] + ahead + l), _MM_HINT_T1);
            d[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk[j]));
            mn[j] = qtype == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)P4(blk[j])->m)) : d[j];
        }
        const float *xb = x + b * QK;
        if (qtype == Q4_1) {
            for (int half = 0; half < 2; half++) /* low nibbles: k = i; high: k = i + 16 */
                for (int i = 0; i < QK / 2; i++) {
                    const __m512 a = _mm512_set1_ps(xb[half * (QK / 2) + i]);
                    for (int j = 0; j < np; j++) {
                        __m128i q = _mm_loadu_si128((const __m128i *)P4(blk[j])->qs[i]);
                        q = _mm_and_si128(half ? _mm_srli_epi16(q, 4) : q, low);
                        const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), d[j], mn[j]);
                        acc[j] = _mm512_fmadd_ps(a, w, acc[j]);
                    }
                }
        } else {
            for (int i = 0; i < QK; i++) {
                const __m512 a = _mm512_set1_ps(xb[i]);
                for (int j = 0; j < np; j++) {
                    const __m128i q = _mm_loadu_si128((const __m128i *)P8(blk[j])->qs[i]);
                    acc[j] = _mm512_fmadd_ps(a, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d[j]), acc[j]);
                }
            }
        }
    }
    for (int j = 0; j < np; j++) {
        const int a = lo > j * NR ? lo - j * NR : 0, e = hi < (j + 1) * NR ? hi - j * NR : NR;
        if (a < e) _mm512_mask_storeu_ps(y + j * NR, (__mmask16)(((1u << (e - a)) - 1u) << a), acc[j]);
    }
}
#define ROW_PANELS 4
#endif

static void cols(const float *x, int64_t ldx, int64_t m, const void *w, int qtype, int64_t k, int64_t c0, int64_t c1,
                 float *y, int64_t ldy) {
    if (m <= 0) return; /* no rows (a step that samples none): nothing to compute, and no tiles to share lines */
    const int64_t tiles = (m + MR - 1) / MR, lines = (k + tiles - 1) / tiles; /* of each next panel, per tile */
    const int blocks = qtype != F32;
    const int64_t panel_bytes = k / QK * tandem_panel_block_bytes(qtype);
    for (int64_t p = c0 / NR, np; p * NR < c1; p += np) {
        np = PANELS == 2 && (p + 1) * NR < c1 ? 2 : 1;
        const int lo = (int)(c0 > p * NR ? c0 - p * NR : 0), hi = (int)(c1 < (p + np) * NR ? c1 - p * NR : np * NR);
        if (!blocks) {
            const float *panel = (const float *)w + p * k * NR;
            for (int64_t r = 0; r < m; r += MR)
                tile_rows(x + r * ldx, ldx, panel, NULL, F32, 0, k, y + r * ldy + p * NR, ldy,
                          (int)(m - r < MR ? m - r : MR), (int)np, lo, hi,
                          m == 1 ? NULL : m <= MR ? panel + PF_AHEAD : panel + (np * k + r / MR * lines) * NR,
                          m <= MR ? 1 : (int)tiles, 0);
            continue;
        }
        const uint8_t *bp = (const uint8_t *)w + p * panel_bytes;
#if VECTOR == 512
        if (m == 1) { /* one row: up to four panels at a time, unpacked in registers */
            np = (c1 - p * NR + NR - 1) / NR < ROW_PANELS ? (c1 - p * NR + NR - 1) / NR : ROW_PANELS;
            const int h1 = (int)(c1 < (p + np) * NR ? c1 - p * NR : np * NR);
            const int64_t ahead = (p + 2 * np) * NR <= c1 ? np * panel_bytes : 0;
            switch (np) {
            case 4: row_blocks(x, bp, qtype, k, 4, y + p * NR, lo, h1, ahead); break;
            case 3: row_blocks(x, bp, qtype, k, 3, y + p * NR, lo, h1, ahead); break;
            case 2: row_blocks(x, bp, qtype, k, 2, y + p * NR, lo, h1, ahead); break;
            default: row_blocks(x, bp, qtype, k, 1, y + p * NR, lo, h1, ahead); break;
            }
            continue;
        }
#endif
        if (m <= MR) { /* one tile: it unpacks its chunks itself, its sums staying in registers */
            const int64_t ahead = (p + (PF_PAIRS + 1) * np) * NR <= c1 ? PF_PAIRS * np * panel_bytes : 0;
            tile_rows(x, ldx, NULL, bp, qtype, ahead, k, y + p * NR, ldy, (int)m, (int)np, lo, hi, NULL, 1, 0);
            continue;
        }
        /* several tiles: each chunk unpacked once, then every tile's steps over it, its sums kept in y between */
        _Alignas(64) float chunk[2 * TILES_CHUNK * NR];
        const int64_t ahead = (p + 2 * np) * NR <= c1 ? np * panel_bytes : 0;
        const int64_t kc = m > 4 * MR ? TILES_CHUNK : TILES_CHUNK / 2;
        for (int64_t k0 = 0; k0 < k; k0 += kc) {
            const int64_t kn = k - k0 < kc ? k - k0 : kc;
            unpack_chunk(bp, qtype, (int)np, k, k0, kn, chunk, kn, ahead);
            for (int64_t r = 0; r < m; r += MR)
                tile_rows(x + r * ldx + k0, ldx, chunk, NULL, F32, 0, kn, y + r * ldy + p * NR, ldy,
                          (int)(m - r < MR ? m - r : MR), (int)np, lo, hi, NULL, 1, k0 > 0);
        }
    }
}

/* Block panels as float panels: `panels` panels of k from w into out [panels][k][NR] (for the engine's check
 * that they are the float weights, and the tests). */
void tandem_panel_unpack(const uint8_t *w, int qtype, int64_t panels, int64_t k, float *out) {
    for (int64_t p = 0; p < panels; p++) unpack_chunk(w + p * (k / QK) * tandem_panel_block_bytes(qtype), qtype, 1, k, 0, k,
                                                      out + p * k * NR, k, 0);
}

/* Output columns a tile covers: runs of columns starting on multiples of this take whole tiles. */
int tandem_panel_tile_cols(void) { return PANELS * NR; }

/* Bits of the vectors this build computes in (512, 256, or 0: the scalar loop). */
int tandem_panel_vector_bits(void) { return VECTOR; }

/* The fused decode step's entry points (kernels/decode_step.c, kernels_t), in the int8 kernel's shape:
 * `quantize` copies blocks [i0, i1) of 32 values of x [m, k] (row stride ldx, k a multiple of 32) into buf as
 * [m, k] floats; `matmul_cols` computes columns [i0, i1) of y from that copy over the panels w (qtype: F32 or block panels). */
void tandem_panel_copy_x(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t i0, int64_t i1, void *buf) {
    (void)m;
    const int64_t nb = k / 32;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t r = i / nb, c = i % nb * 32;
        memcpy((float *)buf + r * k + c, x + r * ldx + c, 32 * sizeof(float));
    }
}

void tandem_panel_matmul_cols(const void *buf, int64_t m, const uint8_t *w, int qtype, int64_t k, int64_t i0, int64_t i1,
                              float *y, int64_t ldy) {
    cols((const float *)buf, k, m, w, qtype, k, i0, i1, y, ldy);
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ the panels of w: a whole matmul over `threads`
 * OpenMP threads (torch's pool), in runs of whole tiles, RUNS_PER_THREAD per thread, handed out share first:
 * each thread takes the runs of its own contiguous share in order, then what is left of the others' (so a
 * descheduled thread's runs are still done). A tile's prefetch of the next panels (cols) only helps when the
 * same thread computes them: handed out tile by tile, the neighbour was mostly the other thread's and the
 * head at 32 rows ran at 172 GFLOP/s in a decode step. The fused step hands out its columns the same way
 * (decode_step.c, take_near). */
#define RUNS_PER_THREAD 8
#define MAX_SHARES 64
void tandem_panel_matmul(const float *x, int64_t ldx, int64_t m, const void *w, int qtype, int64_t n, int64_t k,
                         float *y, int64_t ldy, int threads) {
    if (m <= 0 || n <= 0) return;
    if (threads > MAX_SHARES) threads = MAX_SHARES;
    if (threads < 1) threads = 1;
    const int64_t tiles = (n + PANELS * NR - 1) / (PANELS * NR), spread = (int64_t)threads * RUNS_PER_THREAD;
    const int64_t run = (tiles + spread - 1) / spread * PANELS * NR, runs = (n + run - 1) / run;
    struct { _Alignas(64) int64_t n; } taken[MAX_SHARES] = {{0}};
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        for (int i = 0; i < nt; i++) {
            const int v = (t + i) % nt;
            const int64_t first = runs * v / nt, count = runs * (v + 1) / nt - first;
            for (int64_t j; (j = __atomic_fetch_add(&taken[v].n, 1, __ATOMIC_RELAXED)) < count;) {
                const int64_t c0 = (first + j) * run;
                cols(x, ldx, m, w, qtype, k, c0, c0 + run < n ? c0 + run : n, y, ldy);
            }
        }
    }
}

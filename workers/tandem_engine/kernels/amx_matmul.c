/* bfloat16 matmuls on AMX tiles for a bfloat16 model's decode steps (see amx_matmul.py, which builds this with
 * kernels/build.py on CPUs with amx_bf16 and calls it through ctypes; docs/architecture.md, "bfloat16 decode
 * steps on AMX").
 *
 * y [m, n] (float32) = bf16(x) [m, k] @ w [n, k]^T, w a bfloat16 weight packed once into panels of 16 output
 * columns, [ceil(n / 16)][k / 32][16][16][2]: the k / 32 tiles of a panel, each the 16 x 32 weights of one
 * stretch of 32 in k as AMX's B operand wants them (row i holds, for each of the 16 columns, the pair of
 * weights at k = 2i and 2i + 1), 1 KB apiece and one after another, so that a pass over a panel is one
 * sequential read. x is rounded to bfloat16 first (round to nearest even, as torch's .to(torch.bfloat16))
 * into a buffer [rows][k]; each tile product (TDPBF16PS) multiplies bfloat16 pairs exactly and adds them
 * into float32 sums. A tile of 16 rows by two panels keeps four 16 x 16 sums in tile registers over the
 * whole of k: per 32 steps in k, two 1 KB weight tiles and two row tiles are loaded for four products.
 *
 * Why: oneDNN's bf16 matmul at a decode step's 32 rows ran at 318 GFLOP/s from torch's F.linear (it
 * reorders the weights on every call) and 443 with prepacked weights, on 2 cores of the AVX-512 Xeon, where
 * AMX's arithmetic is ~2.5 TFLOP/s a core: a decode step is bound by reading the weights, 2 bytes each. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "tandem_kernels.h"

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512F__)
#error "amx_matmul.c needs AMX-BF16 and AVX-512 (amx_matmul.py's build_flags)"
#endif

#define NR PANEL_NR  /* output columns of a panel */
#define KT 32        /* steps in k of a tile */
#define TILE_B 1024  /* bytes of a weight tile: 16 rows of 64 */

/* Linux hands a process the AMX tile state only when asked (arch_prctl, since 5.16). Returns 0 when it
 * may use the tiles (oneDNN asks the same for torch's bf16 matmuls; asking again is harmless). */
int tandem_amx_init(void) {
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

/* Every tile the kernel uses is 16 rows of 64 bytes: 0-3 the sums (16 x 16 float32), 4-5 rows of x (16 x
 * 32 bfloat16), 6-7 weight tiles. The configuration is per thread; each call loads it (oneDNN, on the same
 * threads, loads its own) and releases the tiles when done. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* gcc's _tile_loadconfig tells the compiler it reads only the first 8 bytes of the configuration, so one built
 * on the stack may lose the stores to the rest as dead (then ldtilecfg faults on a nonzero reserved byte or
 * loads the wrong shapes). A constant in memory cannot. */
static const _Alignas(64) tilecfg_t CONFIG = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

static void load_config(void) { _tile_loadconfig(&CONFIG); }

/* Buffer bytes for m rows of k: rows padded to a whole tile of 16 (the padding's sums are computed and not
 * stored), and a cache line of slack. */
int64_t tandem_amx_x_bytes(int64_t m, int64_t k) { return ((m + 15) / 16 * 16) * k * 2 + 64; }


/* Blocks [i0, i1) of 32 values of x [m, k] (row stride ldx; block i is row i / (k / 32), values
 * i % (k / 32) * 32 on) into the buffer as bfloat16 row tiles: the tile of rows 16 t.. and values 32 j.. is
 * the buffer's (t * k / 32 + j)-th 1 KB, a row of it 64 bytes, so that a tile load reads 1 KB in order (16
 * rows k * 2 bytes apart were 16 separate streams for the prefetcher). The fused decode step's "quantize"
 * entry (decode_step.c), for k a multiple of 32. */
void tandem_amx_copy_x(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t i0, int64_t i1, void *buf) {
    (void)m;
    const int64_t nb = k / KT;
    uint16_t *out = (uint16_t *)buf;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t r = i / nb, j = i % nb, c = j * KT;
        const float *src = x + r * ldx + c;
        uint16_t *dst = out + ((r / 16 * nb + j) * 16 + r % 16) * KT;
        _mm256_storeu_si256((__m256i *)dst, f32x16_to_bf16(_mm512_loadu_ps(src)));
        _mm256_storeu_si256((__m256i *)(dst + 16), f32x16_to_bf16(_mm512_loadu_ps(src + 16)));
    }
}

/* The sums of tile t (16 x 16) into rows [r, r + rows) and columns [c, c + cols) of y: straight from the tile
 * when it is whole, else through a buffer. */
#define STORE(t, yp, ldy, rows, cols)                                                        \
    do {                                                                                     \
        if ((rows) == 16 && (cols) == NR) {                                                  \
            _tile_stored(t, (yp), (ldy) * 4);                                                \
        } else {                                                                             \
            _Alignas(64) float tmp_[16 * NR];                                                \
            _tile_stored(t, tmp_, NR * 4);                                                   \
            for (int rr_ = 0; rr_ < (rows); rr_++)                                           \
                memcpy((yp) + rr_ * (ldy), tmp_ + rr_ * NR, sizeof(float) * (size_t)(cols)); \
        }                                                                                    \
    } while (0)

/* Output columns [c0, c1) of y [m, ldy] for the m rows of the bf16 buffer xb (row stride k), over the packed
 * panels w; c0 a multiple of 16 (of 32 where the runs are cut: decode_step.c's col_align), n the weight's
 * columns. Tiles of up to 16 rows by two panels; a run's last panel may be alone. */
static void cols(const uint16_t *xb, int64_t m, const uint8_t *w, int64_t k, int64_t c0, int64_t c1, float *y,
                 int64_t ldy) {
    const int64_t kb_n = k / KT, panel_bytes = kb_n * TILE_B, xs = 64;
    load_config();
    for (int64_t c = c0; c < c1; c += 2 * NR) {
        const int two = c + NR < c1;
        const uint8_t *b0 = w + c / NR * panel_bytes, *b1 = b0 + panel_bytes;
        const int w0 = (int)(c1 - c < NR ? c1 - c : NR), w1 = two ? (int)(c1 - c - NR < NR ? c1 - c - NR : NR) : 0;
        for (int64_t r = 0; r < m; r += 32) {
            const int rows0 = (int)(m - r < 16 ? m - r : 16);
            const int rows1 = m - r > 16 ? (int)(m - r - 16 < 16 ? m - r - 16 : 16) : 0;
            const uint16_t *a0 = xb + r * k, *a1 = a0 + 16 * k; /* row tiles r / 16 and r / 16 + 1 */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            if (rows1 && two)
                for (int64_t kb = 0; kb < kb_n; kb++) {
                    _tile_loadd(6, b0 + kb * TILE_B, 64);
                    _tile_loadd(7, b1 + kb * TILE_B, 64);
                    _tile_loadd(4, a0 + kb * 16 * KT, xs);
                    _tile_loadd(5, a1 + kb * 16 * KT, xs);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            else if (two)
                for (int64_t kb = 0; kb < kb_n; kb++) {
                    _tile_loadd(6, b0 + kb * TILE_B, 64);
                    _tile_loadd(7, b1 + kb * TILE_B, 64);
                    _tile_loadd(4, a0 + kb * 16 * KT, xs);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                }
            else if (rows1)
                for (int64_t kb = 0; kb < kb_n; kb++) {
                    _tile_loadd(6, b0 + kb * TILE_B, 64);
                    _tile_loadd(4, a0 + kb * 16 * KT, xs);
                    _tile_loadd(5, a1 + kb * 16 * KT, xs);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(2, 5, 6);
                }
            else
                for (int64_t kb = 0; kb < kb_n; kb++) {
                    _tile_loadd(6, b0 + kb * TILE_B, 64);
                    _tile_loadd(4, a0 + kb * 16 * KT, xs);
                    _tile_dpbf16ps(0, 4, 6);
                }
            float *yr = y + r * ldy + c;
            STORE(0, yr, ldy, rows0, w0);
            if (two) STORE(1, yr + NR, ldy, rows0, w1);
            if (rows1) {
                STORE(2, yr + 16 * ldy, ldy, rows1, w0);
                if (two) STORE(3, yr + 16 * ldy + NR, ldy, rows1, w1);
            }
        }
    }
    _tile_release();
}

/* The fused decode step's "matmul_cols" entry (decode_step.c): columns [i0, i1) of y for the m rows that
 * tandem_amx_copy_x put in buf. qtype is not read (the panels are bfloat16). */
void tandem_amx_matmul_cols(const void *buf, int64_t m, const uint8_t *w, int qtype, int64_t k, int64_t i0, int64_t i1,
                            float *y, int64_t ldy) {
    (void)qtype;
    if (m > 0 && i0 < i1) cols((const uint16_t *)buf, m, w, k, i0, i1, y, ldy);
}

/* Pairs of panels in a run the whole-matmul entries hand out, of `runs` pairs over nt threads: an eighth of a
 * thread's share, so that each call streams its panels in order (and the float32 kernel requests the next
 * pair's blocks as it ends one). One pair an item, the threads took turns at adjacent pairs and each started
 * its pair cold: the LM head of a 32-row decode step took 3.3 -> 2.8 ms (bfloat16), 4.7 -> 4.0 (float32). */
static inline int64_t pairs_per_run(int64_t runs, int nt) { return (runs + 8 * nt - 1) / (8 * nt); }

/* y [m, n] (row stride ldy) = bf16(x) [m, k] @ W^T on `threads` threads: x rounded into buf
 * (tandem_amx_x_bytes(m, k) bytes), then runs of columns handed out from a shared counter. */
void tandem_amx_matmul(const float *x, int64_t ldx, int64_t m, const uint8_t *w, int64_t n, int64_t k, float *y,
                       int64_t ldy, void *buf, int threads) {
    const int64_t blocks = m * (k / KT), runs = (n + 2 * NR - 1) / (2 * NR);
    int64_t next = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        tandem_amx_copy_x(x, ldx, m, k, blocks * t / nt, blocks * (t + 1) / nt, buf);
#pragma omp barrier
        const int64_t per = pairs_per_run(runs, nt), items = (runs + per - 1) / per;
        for (int64_t j; (j = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED)) < items;) {
            const int64_t c = j * per * 2 * NR, c1 = c + per * 2 * NR;
            cols((const uint16_t *)buf, m, w, k, c, c1 < n ? c1 : n, y, ldy);
        }
    }
}

/* ---- float32 matmuls on AMX over a GGUF file's Q4_1 and Q8_0 blocks (amx_matmul.py's AmxBlockKernel) ----
 *
 * y [m, n] (float32) = x [m, k] @ w [n, k]^T, where every weight is one of its block's values, w = d * q + m
 * (Q4_1: q in 0..15) or d * q (Q8_0: q in -128..127), as the loader dequantized them. q is a bfloat16 exactly
 * (at most 8 significant bits), and x is split exactly into three bfloat16 parts, x = hi + mid + lo (hi is x
 * rounded to bfloat16, mid the remainder rounded, lo what is left: 24 bits of significand in three runs of
 * 8). So each tile product multiplies exactly and adds into float32 sums: per block of 32 in k,
 * s = sum over the block of hi * q + mid * q + lo * q (96 exact products, rounded as they add), then
 * acc = fma(d, s, acc) and, for Q4_1, acc = fma(m, sum of x over the block, acc). Float32 arithmetic
 * throughout, the sums in another order than x @ w's; at AMX's rate instead of the FMA units'.
 *
 * Packed weights, per panel of 16 output columns and block of 32 in k (BLK_B bytes, one after another):
 * the 1 KB bfloat16 tile of q as AMX's B operand wants it (as the bfloat16 panels above), then the 16
 * columns' d, then their m (float32; zeros for Q8_0).
 * x's buffer: per tile of 16 rows and block of 32 in k, three 1 KB row tiles (hi, mid, lo); after all of
 * them, the float32 sums of x over each block, [rows padded to 16][k / 32]. */

#define BLK_B (TILE_B + 2 * NR * 4)

int64_t tandem_amx_f32_x_bytes(int64_t m, int64_t k) {
    const int64_t rows = (m + 15) / 16 * 16;
    return rows * k * 2 * 3 + rows * (k / KT) * 4 + 64;
}

static inline __m512 widen(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }

/* 16 values of x into their three bfloat16 parts at p (hi), p + 512 (mid), p + 1024 (lo), in uint16s. */
static inline void split3(__m512 v, uint16_t *p) {
    const __m256i hi = f32x16_to_bf16(v);
    const __m512 r1 = _mm512_sub_ps(v, widen(hi));
    const __m256i mid = f32x16_to_bf16(r1);
    const __m256i lo = f32x16_to_bf16(_mm512_sub_ps(r1, widen(mid)));
    _mm256_storeu_si256((__m256i *)p, hi);
    _mm256_storeu_si256((__m256i *)(p + 512), mid);
    _mm256_storeu_si256((__m256i *)(p + 1024), lo);
}

/* Blocks [i0, i1) of 32 values of x [m, k] (block i is row i / (k / 32), values i % (k / 32) * 32 on) split
 * into the buffer, with their sums. The fused decode step's "quantize" entry (decode_step.c). */
void tandem_amx_f32_copy_x(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t i0, int64_t i1, void *buf) {
    const int64_t nb = k / KT, rows = (m + 15) / 16 * 16;
    uint16_t *out = (uint16_t *)buf;
    float *sums = (float *)((uint8_t *)buf + rows * k * 2 * 3);
    for (int64_t i = i0; i < i1; i++) {
        const int64_t r = i / nb, j = i % nb;
        const float *src = x + r * ldx + j * KT;
        uint16_t *dst = out + ((r / 16 * nb + j) * 3 * 16 + r % 16) * KT;
        const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
        split3(a, dst);
        split3(b, dst + 16);
        sums[r * nb + j] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
}

/* Rows [0, rows) of 16 columns: out = acc + d * s (+ m * the rows' block sums, Q4_1), acc taken as zero for
 * a panel's first block; out is acc itself (row stride 32) or, after its last block, y. */
static inline __attribute__((always_inline)) void scale_rows_n(float *out, int64_t ldo, const float *acc,
                                                               const float *s, int rows, const float *dm,
                                                               const float *sums, int64_t nb, int has_m, int first) {
    const __m512 d = _mm512_loadu_ps(dm), mm = _mm512_loadu_ps(dm + NR);
    for (int r = 0; r < rows; r++) {
        __m512 a = first ? _mm512_mul_ps(d, _mm512_load_ps(s + r * NR))
                         : _mm512_fmadd_ps(d, _mm512_load_ps(s + r * NR), _mm512_load_ps(acc + r * 2 * NR));
        if (has_m) a = _mm512_fmadd_ps(mm, _mm512_set1_ps(sums[r * nb]), a);
        _mm512_storeu_ps(out + r * ldo, a);
    }
}

/* The same, with the loop's count and the flags known to the compiler in the common cases. */
static inline void scale_rows(float *out, int64_t ldo, const float *acc, const float *s, int rows, const float *dm,
                              const float *sums, int64_t nb, int has_m, int first) {
    if (rows == 16 && has_m && !first)
        scale_rows_n(out, ldo, acc, s, 16, dm, sums, nb, 1, 0);
    else if (rows == 16 && !has_m && !first)
        scale_rows_n(out, ldo, acc, s, 16, dm, sums, nb, 0, 0);
    else
        scale_rows_n(out, ldo, acc, s, rows, dm, sums, nb, has_m, first);
}

/* f32_cols' step that stores the sums of one tile of rows (tiles t0 and t1: its two panels) for block kb,
 * then scales them into acc (its rows from `row`); after the last block, into y where a panel is whole. */
#define F32_SCALE(t0, t1, row, kb)                                                                           \
    do {                                                                                                     \
        const int rows_ = (row) ? rows1 : rows0, last_ = (kb) == nb - 1;                                     \
        const float *sk_ = sums + (r + (row)) * nb + (kb);                                                   \
        float *a_ = acc + (row) * 2 * NR;                                                                    \
        float *y_ = y + (r + (row)) * ldy + c;                                                               \
        _tile_stored(t0, s[0], NR * 4);                                                                      \
        scale_rows(last_ && w0 == NR ? y_ : a_, last_ && w0 == NR ? ldy : 2 * NR, a_, s[0], rows_,           \
                   (const float *)(b0 + (kb) * BLK_B + TILE_B), sk_, nb, has_m, (kb) == 0);                  \
        if (two) {                                                                                           \
            _tile_stored(t1, s[1], NR * 4);                                                                  \
            scale_rows(last_ && w1 == NR ? y_ + NR : a_ + NR, last_ && w1 == NR ? ldy : 2 * NR, a_ + NR, s[1], \
                       rows_, (const float *)(b1 + (kb) * BLK_B + TILE_B), sk_, nb, has_m, (kb) == 0);       \
        }                                                                                                    \
    } while (0)

/* Output columns [c0, c1) of y for the m rows split into buf, over the block panels w (qtype Q4_1 or Q8_0);
 * c0 a multiple of 16. Tiles of up to 32 rows by two panels: per block of 32 in k, up to twelve tile
 * products into four tiles, which are then scaled into float32 sums kept in a 4 KB buffer (and, after the
 * last block, stored into y). */
static void f32_cols(const uint8_t *buf, int64_t m, int64_t r0, int64_t r1, const uint8_t *w, int has_m, int64_t k,
                     int64_t c0, int64_t c1, float *y, int64_t ldy) {
    const int64_t nb = k / KT, rows_all = (m + 15) / 16 * 16, panel_bytes = nb * BLK_B;
    const float *sums = (const float *)(buf + rows_all * k * 2 * 3);
    /* A decode step's rows: each panel is read for one pair of row tiles, so the kernel requests its next
     * blocks itself (SmolLM2's 30 layers at 32 rows, weights streamed: 0.95x the time; with more rows, where the
     * panels are read again from cache, 1.03x). */
    const int once = r1 - r0 <= 32;
    _Alignas(64) float acc[32 * 2 * NR];
    _Alignas(64) float s[2][16 * NR];
    load_config();
    for (int64_t c = c0; c < c1; c += 2 * NR) {
        const int two = c + NR < c1;
        const uint8_t *b0 = w + c / NR * panel_bytes, *b1 = b0 + panel_bytes;
        const int w0 = (int)(c1 - c < NR ? c1 - c : NR), w1 = two ? (int)(c1 - c - NR < NR ? c1 - c - NR : NR) : 0;
        for (int64_t r = r0; r < r1; r += 32) {
            const int rows0 = (int)(r1 - r < 16 ? r1 - r : 16);
            const int rows1 = r1 - r > 16 ? (int)(r1 - r - 16 < 16 ? r1 - r - 16 : 16) : 0;
            const uint8_t *a0 = buf + r / 16 * nb * 3 * TILE_B, *a1 = a0 + nb * 3 * TILE_B;
            /* The panels' two sets of sums take turns: one set's products for a block are issued before the
             * other set's sums of the block before are stored and scaled, so the tile unit is never idle
             * waiting for a store. */
            /* Two sets of sums, one per tile of rows (tiles 0-1 and 2-3, each over the two panels), take turns:
             * one set's products for a block are issued before the other set's sums are stored and scaled, so
             * the tile unit computes while the stores and the scaling run. */
            for (int64_t kb = 0; kb < nb; kb++) {
                const uint8_t *p0 = b0 + kb * BLK_B, *p1 = b1 + kb * BLK_B;
                /* panels read for one pair of row tiles only: their lines two blocks on (past the end of the
                 * second panel, the first lines of the call's next pair: the LM head's 4.7 -> 4.0 ms a decode
                 * step of 32 rows, with its runs below) */
                if (once && (kb + 2 < nb || c + 2 * NR < c1))
                    for (int l = 0; l < BLK_B / 64; l++) {
                        _mm_prefetch((const char *)(p0 + 2 * BLK_B + l * 64), _MM_HINT_T0);
                        if (two) _mm_prefetch((const char *)(p1 + 2 * BLK_B + l * 64), _MM_HINT_T0);
                    }
                _tile_loadd(6, p0, 64);
                if (two) _tile_loadd(7, p1, 64);
                _tile_zero(0);
                _tile_zero(1);
                for (int part = 0; part < 3; part++) {
                    _tile_loadd(4, a0 + (kb * 3 + part) * TILE_B, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two) _tile_dpbf16ps(1, 4, 7);
                }
                if (rows1) {
                    if (kb) F32_SCALE(2, 3, 16, kb - 1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int part = 0; part < 3; part++) {
                        _tile_loadd(5, a1 + (kb * 3 + part) * TILE_B, 64);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                F32_SCALE(0, 1, 0, kb);
            }
            if (rows1) F32_SCALE(2, 3, 16, nb - 1);
            if (w0 < NR) /* a partial panel (then alone): its columns from acc */
                for (int rr = 0; rr < rows0 + rows1; rr++)
                    memcpy(y + (r + rr) * ldy + c, acc + rr * 2 * NR, sizeof(float) * (size_t)w0);
            else if (two && w1 < NR)
                for (int rr = 0; rr < rows0 + rows1; rr++)
                    memcpy(y + (r + rr) * ldy + c + NR, acc + rr * 2 * NR + NR, sizeof(float) * (size_t)w1);
        }
    }
    _tile_release();
}

/* The fused decode step's "matmul_cols" entry (decode_step.c): columns [i0, i1) of y for the m rows that
 * tandem_amx_f32_copy_x split into buf; qtype the panels' blocks' (Q4_1 or Q8_0). */
void tandem_amx_f32_matmul_cols(const void *buf, int64_t m, const uint8_t *w, int qtype, int64_t k, int64_t i0,
                                int64_t i1, float *y, int64_t ldy) {
    if (m > 0 && i0 < i1) f32_cols((const uint8_t *)buf, m, 0, m, w, qtype == Q4_1, k, i0, i1, y, ldy);
}

/* The fused step's "matmul_rows" entry: rows [r0, r1) and columns [i0, i1) of y, the rows of a prefill step
 * a block at a time (decode_step.c, project_runs). */
void tandem_amx_f32_matmul_rows(const void *buf, int64_t m, int64_t r0, int64_t r1, const uint8_t *w, int qtype,
                                int64_t k, int64_t i0, int64_t i1, float *y, int64_t ldy) {
    if (r0 < r1 && i0 < i1) f32_cols((const uint8_t *)buf, m, r0, r1, w, qtype == Q4_1, k, i0, i1, y, ldy);
}

/* Rows of x a work item of the whole matmul takes: their split rows (128 x 1536 x 6 bytes at most for SmolLM2)
 * stay in L2 while the item's two panels are read once from memory for all of them. On 30 layers of SmolLM2's
 * projections at 512 rows, weights streamed, 2 threads: items of 256 and 512 rows took 1.04x and 1.14x as
 * long. */
#define ROW_BLOCK 128

/* y [m, n] (row stride ldy) = x [m, k] @ W^T on `threads` threads: x split into buf
 * (tandem_amx_f32_x_bytes(m, k) bytes), then work items of up to ROW_BLOCK rows by 32 columns (with one block of
 * rows, by runs of columns) handed out from a shared counter, a block of rows at a time. */
void tandem_amx_f32_matmul(const float *x, int64_t ldx, int64_t m, const uint8_t *w, int qtype, int64_t n, int64_t k,
                           float *y, int64_t ldy, void *buf, int threads) {
    const int64_t blocks = m * (k / KT), runs = (n + 2 * NR - 1) / (2 * NR), row_blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
    int64_t next = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        tandem_amx_f32_copy_x(x, ldx, m, k, blocks * t / nt, blocks * (t + 1) / nt, buf);
#pragma omp barrier
        /* one block of rows (a decode step's): runs of pairs; more blocks: one pair of a block an item */
        const int64_t per = row_blocks == 1 ? pairs_per_run(runs, nt) : 1, items = (runs + per - 1) / per;
        for (int64_t j; (j = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED)) < items * row_blocks;) {
            const int64_t c = j % items * per * 2 * NR, r = j / items * ROW_BLOCK, c1 = c + per * 2 * NR;
            f32_cols((const uint8_t *)buf, m, r, r + ROW_BLOCK < m ? r + ROW_BLOCK : m, w, qtype == Q4_1, k, c,
                     c1 < n ? c1 : n, y, ldy);
        }
    }
}

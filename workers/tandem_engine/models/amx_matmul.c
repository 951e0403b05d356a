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

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512F__)
#error "amx_matmul.c needs AMX-BF16 and AVX-512 (amx_matmul.py's amx_flags)"
#endif

#define NR 16        /* output columns of a panel */
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

static void load_config(void) {
    _Alignas(64) tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* Buffer bytes for m rows of k: rows padded to a whole tile of 16 (the padding's sums are computed and not
 * stored), and a cache line of slack. */
int64_t tandem_amx_x_bytes(int64_t m, int64_t k) { return ((m + 15) / 16 * 16) * k * 2 + 64; }

/* float32 to bfloat16, rounded to nearest even as torch rounds; NaN as 0x7fc0. 16 at a time. */
static inline __m256i to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

/* Blocks [i0, i1) of 32 values of x [m, k] (row stride ldx; block i is row i / (k / 32), values
 * i % (k / 32) * 32 on) into the buffer as bfloat16 row tiles: the tile of rows 16 t.. and values 32 j.. is
 * the buffer's (t * k / 32 + j)-th 1 KB, a row of it 64 bytes, so that a tile load reads 1 KB in order (16
 * rows k * 2 bytes apart were 16 separate streams for the prefetcher). The fused decode step's "quantize"
 * entry (gguf_decode.c), for k a multiple of 32. */
void tandem_amx_copy_x(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t i0, int64_t i1, void *buf) {
    (void)m;
    const int64_t nb = k / KT;
    uint16_t *out = (uint16_t *)buf;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t r = i / nb, j = i % nb, c = j * KT;
        const float *src = x + r * ldx + c;
        uint16_t *dst = out + ((r / 16 * nb + j) * 16 + r % 16) * KT;
        _mm256_storeu_si256((__m256i *)dst, to_bf16(_mm512_loadu_ps(src)));
        _mm256_storeu_si256((__m256i *)(dst + 16), to_bf16(_mm512_loadu_ps(src + 16)));
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
 * panels w; c0 a multiple of 16 (of 32 where the runs are cut: gguf_decode.c's col_align), n the weight's
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

/* The fused decode step's "matmul_cols" entry (gguf_decode.c): columns [i0, i1) of y for the m rows that
 * tandem_amx_copy_x put in buf. qtype is not read (the panels are bfloat16). */
void tandem_amx_matmul_cols(const void *buf, int64_t m, const uint8_t *w, int qtype, int64_t k, int64_t i0, int64_t i1,
                            float *y, int64_t ldy) {
    (void)qtype;
    if (m > 0 && i0 < i1) cols((const uint16_t *)buf, m, w, k, i0, i1, y, ldy);
}

/* y [m, n] (row stride ldy) = bf16(x) [m, k] @ W^T on `threads` threads: x rounded into buf
 * (tandem_amx_x_bytes(m, k) bytes), then runs of 32 columns handed out from a shared counter. */
void tandem_amx_matmul(const float *x, int64_t ldx, int64_t m, const uint8_t *w, int64_t n, int64_t k, float *y,
                       int64_t ldy, void *buf, int threads) {
    const int64_t blocks = m * (k / KT), runs = (n + 2 * NR - 1) / (2 * NR);
    int64_t next = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        tandem_amx_copy_x(x, ldx, m, k, blocks * t / nt, blocks * (t + 1) / nt, buf);
#pragma omp barrier
        for (int64_t j; (j = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED)) < runs;) {
            const int64_t c = j * 2 * NR;
            cols((const uint16_t *)buf, m, w, k, c, c + 2 * NR < n ? c + 2 * NR : n, y, ldy);
        }
    }
}

/* tandem's tiled causal attention of prefill chunks over a paged KV cache of float32, bfloat16 or float16
 * (see attention/cpu_backend.py, which builds it through kernels/build.py and calls it through ctypes;
 * docs/architecture.md, "CPU kernels"): over torch's OpenMP pool (tandem_prefill_attention_kv), or one work
 * item at a time on the whole-step kernel's threads (tandem_prefill_attention_item, for decode_step.c).
 * Decode rows are paged_attention.c's; the vectors both use are attention_simd.h. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "tandem_kernels.h"
#include "attention_simd.h"

/* Causal attention of prefill chunks (query rows of a sequence's later tokens over all its keys) over a
 * float32 cache, or a 16-bit one whose chunk of keys and values an item widens into its scratch first. A
 * work item is one sequence's KV head and PF_TILE of its query tokens: the group's query
 * heads (g of them) for those tokens are PF_TILE * g rows (48 for SmolLM2), computed together GEMM-style
 * against chunks of up to PF_CHUNK keys. The item's queries are transposed once into a [D][rows] panel, so
 * a key's scores for 16 rows are D fused multiply-adds of a panel vector by one element of the key, read
 * where the cache holds it; PF_SC_ROWS x PF_SC_KEYS scores stay in registers over D. Scores are kept
 * [key][row], so the softmax runs down the rows in vectors: per chunk, one maximum, one pass of e^x
 * (score_exp, a polynomial the compiler vectorises) and one sum, and the accumulators are rescaled once per
 * chunk, not per 16 keys (a prompt of up to PF_CHUNK tokens is one chunk). P x V then adds the chunk's V
 * rows into PF_PV_ROWS rows' accumulators, PF_PV_COLS vectors of D each, kept in registers over the whole
 * chunk. Keys past a row's own position are masked, so only the chunk on the diagonal computes any
 * masked scores. Needs D a multiple of 16. */
#define PF_TILE 16
#define PF_CHUNK 128  /* keys per softmax step: a multiple of PF_SC_KEYS */
#define PF_NEG (-1e30f)  /* a masked score: finite, as -ffast-math assumes */
/* Register blocks: with AVX-512's 32 registers, 3 x 16 rows by 8 keys of scores and 12 rows by 2 x 16 floats
 * of D in P x V (24 accumulators each); AVX2's 16 registers (a v16 is two there) take 16 rows by 4 keys and
 * 6 rows by 16 floats. How the work is cut does not change any float: every score and accumulator lane adds
 * its terms in the same order, so both builds compute the same outputs. */
#if defined(__AVX512F__)
#define PF_SC_ROWS 3
#define PF_SC_KEYS 8
#define PF_PV_ROWS 12
#define PF_PV_COLS 2
#else
#define PF_SC_ROWS 1
#define PF_SC_KEYS 4
#define PF_PV_ROWS 6
#define PF_PV_COLS 1
#endif
_Static_assert(PF_CHUNK % PF_SC_KEYS == 0, "a chunk's keys pad to whole score blocks within it");

typedef struct {
    const float *q; int64_t q_tok_stride;
    const void *kc, *vc; int kv_type;  /* a float32, bfloat16 or float16 cache (KV_F32, ...) */
    const int32_t *table; int64_t table_stride;
    const int64_t *seq_ids, *q_starts, *q_lens, *seq_lens;  /* per prefill: block-table row, first query
                                                               row, query tokens, tokens in all */
    float *out;
    int nq, nkv, d, bs; float scale;
} prefill_job;

/* Work items (tiles of PF_TILE query tokens) of a prefill of ql query tokens, per KV head. */
static inline int64_t prefill_tiles(int64_t ql) { return (ql + PF_TILE - 1) / PF_TILE; }

/* Rows of an item with g query heads per KV head, padded to whole vectors. */
static inline int prefill_rpad(int rows) { return (rows + 15) & ~15; }

/* Scores of RV x 16 rows (from the [D][rpad] panel qt) by PF_SC_KEYS keys (kp), into sc [key][rpad]. */
static inline __attribute__((always_inline)) void prefill_scores(float *sc, int64_t rpad, const float *qt,
                                                            const float *const *kp, int d, const int rv) {
    const float *k[PF_SC_KEYS];
    for (int x = 0; x < PF_SC_KEYS; x++) k[x] = kp[x];
    v16 a[PF_SC_ROWS][PF_SC_KEYS];
    for (int i = 0; i < rv; i++)
        for (int x = 0; x < PF_SC_KEYS; x++) a[i][x] = zero16();
    for (int c = 0; c < d; c++) {
        v16 qv[PF_SC_ROWS];
        for (int i = 0; i < rv; i++) qv[i] = ld16(qt + (int64_t)c * rpad + 16 * i);
        for (int x = 0; x < PF_SC_KEYS; x++) {
            const v16 kv = bcast16(k[x][c]);
            for (int i = 0; i < rv; i++) a[i][x] = fma16(qv[i], kv, a[i][x]);
        }
    }
    for (int x = 0; x < PF_SC_KEYS; x++)
        for (int i = 0; i < rv; i++) st16(sc + (int64_t)x * rpad + 16 * i, a[i][x]);
}

/* acc[rows][cols x 16 floats from column c] = alpha * acc + sum over nk keys of p[key][row] * V. */
static inline __attribute__((always_inline)) void prefill_pv(float *acc, int d, const float *alpha, const float *p,
                                                        int64_t rpad, const float *const *vp, int nk, int c,
                                                        const int rows, const int cols) {
    v16 o[PF_PV_ROWS][PF_PV_COLS];
    for (int i = 0; i < rows; i++)
        for (int y = 0; y < cols; y++) o[i][y] = smul16(alpha[i], ld16(acc + (int64_t)i * d + c + 16 * y));
    for (int x = 0; x < nk; x++) {
        v16 v[PF_PV_COLS];
        for (int y = 0; y < cols; y++) v[y] = ld16(vp[x] + c + 16 * y);
        const float *px = p + (int64_t)x * rpad;
        for (int i = 0; i < rows; i++) {
            const v16 w = bcast16(px[i]);
            for (int y = 0; y < cols; y++) o[i][y] = fma16(w, v[y], o[i][y]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int y = 0; y < cols; y++) st16(acc + (int64_t)i * d + c + 16 * y, o[i][y]);
}

/* P x V for `rows` rows (at most PF_PV_ROWS) over all of D. */
static inline __attribute__((always_inline)) void prefill_pv_rows(float *acc, int d, const float *alpha,
                                                             const float *p, int64_t rpad, const float *const *vp,
                                                             int nk, const int rows) {
    int c = 0;
    for (; c + 16 * PF_PV_COLS <= d; c += 16 * PF_PV_COLS) prefill_pv(acc, d, alpha, p, rpad, vp, nk, c, rows, PF_PV_COLS);
    for (; c < d; c += 16) prefill_pv(acc, d, alpha, p, rpad, vp, nk, c, rows, 1);
}

/* Key or value row `src` (d values of cache type kt, d a multiple of 16) as floats in dst: exact. */
static void widen_row(float *dst, const char *src, int d, int kt) {
    if (kt == KV_BF16)
        for (int c = 0; c < d; c += 16) st16(dst + c, ld16kv(src + 2 * c, KV_BF16));
    else
        for (int c = 0; c < d; c += 16) st16(dst + c, ld16kv(src + 2 * c, KV_F16));
}

/* GCC's cost model vectorises the softmax loops 8 floats wide even with AVX-512 unless told otherwise; 16 wide
 * took two 256-token prompts' 30 layers from 26.6 to 24.4 ms, with the same floats (score_exp is per lane). */
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("prefer-vector-width=512")))
#endif
static void prefill_item(const prefill_job *j, int64_t s, int h, int64_t t, float *buf) {
    const int d = j->d, g = j->nq / j->nkv;
    const int64_t ql = j->q_lens[s], r0 = t * PF_TILE;
    const int ntok = (int)(ql - r0 < PF_TILE ? ql - r0 : PF_TILE);
    const int64_t p0 = j->seq_lens[s] - ql + r0;  /* position of the tile's first query token */
    const int rows = ntok * g, rpad = prefill_rpad(rows), nrv = rpad / 16;
    const int32_t *bt = j->table + j->seq_ids[s] * j->table_stride;
    float *qt = buf, *acc = qt + (int64_t)d * rpad, *sc = acc + (int64_t)rpad * d;
    float *mx = sc + (int64_t)PF_CHUNK * rpad, *sum = mx + rpad, *alpha = sum + rpad, *tmp = alpha + rpad;
    float *zero = tmp + rpad, *wide = zero + d;  /* wide: a 16-bit cache's chunk of K, then of V, as floats */
    const float *kp[PF_CHUNK], *vp[PF_CHUNK];
    const int64_t elem = j->kv_type == KV_F32 ? 4 : 2;
    /* row r = token r / g at position p0 + r / g, head h * g + r % g; qt[c][r] its scaled query */
    for (int r = 0; r < rpad; r++) {
        if (r < rows) {
            const float *src = j->q + (j->q_starts[s] + r0 + r / g) * j->q_tok_stride + (int64_t)(h * g + r % g) * d;
            for (int c = 0; c < d; c++) qt[(int64_t)c * rpad + r] = src[c] * j->scale;
        } else {
            for (int c = 0; c < d; c++) qt[(int64_t)c * rpad + r] = 0.0f;
        }
        mx[r] = PF_NEG; sum[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * rpad * d);
    memset(zero, 0, sizeof(float) * d);
    const int64_t nkeys = p0 + ntok, tok = (int64_t)j->nkv * d;
    int64_t blk = 0, in_blk = 0;  /* where key kb + x lies: block-table entry and slot, stepped, not divided */
    for (int64_t kb = 0; kb < nkeys; kb += PF_CHUNK) {
        const int nk = (int)(nkeys - kb < PF_CHUNK ? nkeys - kb : PF_CHUNK);
        const int nkr = (nk + PF_SC_KEYS - 1) / PF_SC_KEYS * PF_SC_KEYS;
        for (int x = 0; x < nkr; x++) {
            if (x < nk) {
                const int64_t off = ((int64_t)bt[blk] * j->bs + in_blk) * tok + (int64_t)h * d;
                if (j->kv_type == KV_F32) {
                    kp[x] = (const float *)j->kc + off; vp[x] = (const float *)j->vc + off;
                } else {  /* widened once per item and chunk: ~1% of the item's arithmetic */
                    float *kw = wide + (int64_t)x * d, *vw = wide + (int64_t)(PF_CHUNK + x) * d;
                    widen_row(kw, (const char *)j->kc + off * elem, d, j->kv_type);
                    widen_row(vw, (const char *)j->vc + off * elem, d, j->kv_type);
                    kp[x] = kw; vp[x] = vw;
                }
                if (++in_blk == j->bs) { in_blk = 0; blk++; }
            } else {
                kp[x] = vp[x] = zero;
            }
        }
        /* scores [key][row] */
        for (int x = 0; x < nkr; x += PF_SC_KEYS) {
            int i = 0;
            for (; i + PF_SC_ROWS <= nrv; i += PF_SC_ROWS)
                prefill_scores(sc + (int64_t)x * rpad + 16 * i, rpad, qt + 16 * i, kp + x, d, PF_SC_ROWS);
            for (; i < nrv; i++) prefill_scores(sc + (int64_t)x * rpad + 16 * i, rpad, qt + 16 * i, kp + x, d, 1);
        }
        /* Key kb + x is visible to rows r with p0 + r / g >= kb + x, i.e. r >= (kb + x - p0) * g; padding
         * keys to none (padding rows, all zero, are never written out). */
        for (int x = kb + 1 > p0 ? 0 : (int)(p0 + 1 - kb); x < nkr; x++) {
            const float lo = x < nk ? (float)((kb + x - p0) * g) : (float)rpad;
            float *srow = sc + (int64_t)x * rpad;
            for (int r = 0; r < rpad; r++) srow[r] = (float)r >= lo ? srow[r] : PF_NEG;
        }
        /* the softmax's running maximum and sum of each row, over this chunk, down the rows */
        for (int r = 0; r < rpad; r++) tmp[r] = mx[r];
        for (int x = 0; x < nkr; x++) {
            const float *srow = sc + (int64_t)x * rpad;
            for (int r = 0; r < rpad; r++) tmp[r] = srow[r] > tmp[r] ? srow[r] : tmp[r];
        }
        for (int r = 0; r < rpad; r++) {
            alpha[r] = score_exp(mx[r] - tmp[r]);
            mx[r] = tmp[r];
            tmp[r] = 0.0f;
        }
        for (int x = 0; x < nkr; x++) {
            float *srow = sc + (int64_t)x * rpad;
            for (int r = 0; r < rpad; r++) { srow[r] = score_exp(srow[r] - mx[r]); tmp[r] += srow[r]; }
        }
        for (int r = 0; r < rpad; r++) sum[r] = sum[r] * alpha[r] + tmp[r];
        /* acc = acc * alpha + P V */
        int r = 0;
        for (; r + PF_PV_ROWS <= rpad; r += PF_PV_ROWS)
            prefill_pv_rows(acc + (int64_t)r * d, d, alpha + r, sc + r, rpad, vp, nkr, PF_PV_ROWS);
        for (; r + 4 <= rpad; r += 4) prefill_pv_rows(acc + (int64_t)r * d, d, alpha + r, sc + r, rpad, vp, nkr, 4);
        for (; r < rpad; r += 2) prefill_pv_rows(acc + (int64_t)r * d, d, alpha + r, sc + r, rpad, vp, nkr, 2);
    }
    for (int r = 0; r < rows; r++) {
        float *dst = j->out + ((j->q_starts[s] + r0 + r / g) * j->nq + h * g + r % g) * d;
        const float inv = 1.0f / sum[r];
        for (int c = 0; c < d; c++) dst[c] = acc[(int64_t)r * d + c] * inv;
    }
}

/* Items lie in order of sequence, KV head and tile; later tiles attend to more keys, so the n-th item handed
 * out is the (items - 1 - n)-th: the longest go first. */
static void prefill_nth_item(const prefill_job *j, int64_t items, int64_t n, float *buf) {
    int64_t s = 0, rest = items - 1 - n;
    while (rest >= j->nkv * prefill_tiles(j->q_lens[s])) rest -= j->nkv * prefill_tiles(j->q_lens[s++]);
    prefill_item(j, s, (int)(rest / prefill_tiles(j->q_lens[s])), rest % prefill_tiles(j->q_lens[s]), buf);
}

/* The work items of n_seqs prefills of q_lens query tokens each, with nkv KV heads (for
 * tandem_prefill_attention_item). */
int64_t tandem_prefill_items(const int64_t *q_lens, int64_t n_seqs, int nkv) {
    int64_t items = 0;
    for (int64_t s = 0; s < n_seqs; s++) items += nkv * prefill_tiles(q_lens[s]);
    return items;
}

/* Floats of scratch one thread needs for tandem_prefill_attention with g query heads per KV head. */
int64_t tandem_prefill_scratch(int g, int d) {
    const int64_t rpad = prefill_rpad(PF_TILE * g);
    return rpad * (2 * d + PF_CHUNK + 4) + d + 2 * PF_CHUNK * (int64_t)d;
}

/* out [T, nq, D] rows of n_seqs prefills (see prefill_job); scratch: n_threads * tandem_prefill_scratch floats.
 * Returns -1 for a head layout it does not take (D not a multiple of 16, nq not a multiple of nkv). */
int tandem_prefill_attention_kv(const float *q, int64_t q_tok_stride, const void *kc, const void *vc, int kv_type,
                                const int32_t *table, int64_t table_stride, const int64_t *seq_ids,
                                const int64_t *q_starts, const int64_t *q_lens, const int64_t *seq_lens,
                                int64_t n_seqs, float *out, float *scratch, int nq, int nkv, int d, int bs,
                                float scale, int n_threads) {
    if (d % 16 != 0 || nkv <= 0 || nq % nkv != 0) return -1;
    if (kv_type != KV_F32 && kv_type != KV_BF16 && kv_type != KV_F16) return -1;
    const prefill_job j = {q, q_tok_stride, kc, vc, kv_type, table, table_stride, seq_ids, q_starts, q_lens, seq_lens,
                      out, nq, nkv, d, bs, scale};
    const int64_t items = tandem_prefill_items(q_lens, n_seqs, nkv);
    const int64_t per_thread = tandem_prefill_scratch(nq / nkv, d);
    if (n_threads > items) n_threads = (int)items;
    if (n_threads < 1) n_threads = 1;
    #pragma omp parallel num_threads(n_threads)
    {
        float *buf = scratch + (int64_t)omp_get_thread_num() * per_thread;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t n = 0; n < items; n++) prefill_nth_item(&j, items, n, buf);
    }
    return 0;
}

/* The n-th of tandem_prefill_attention_kv's `items` work items on the calling thread, with buf
 * (tandem_prefill_scratch floats): for a caller that shares the items out over threads of its own, as the
 * fused step does (kernels/decode_step.c). The same floats as tandem_prefill_attention_kv's. The layout
 * checks are the caller's (tandem_prefill_attention_kv's). */
void tandem_prefill_attention_item(const float *q, int64_t q_tok_stride, const void *kc, const void *vc,
                                   int kv_type, const int32_t *table, int64_t table_stride, const int64_t *seq_ids,
                                   const int64_t *q_starts, const int64_t *q_lens, const int64_t *seq_lens,
                                   float *out, int nq, int nkv, int d, int bs, float scale, int64_t items,
                                   int64_t n, float *buf) {
    const prefill_job j = {q, q_tok_stride, kc, vc, kv_type, table, table_stride, seq_ids, q_starts, q_lens, seq_lens,
                      out, nq, nkv, d, bs, scale};
    prefill_nth_item(&j, items, n, buf);
}

/* The same over a float32 cache (the entry bench/prefill_attention.py times against earlier revisions). */
int tandem_prefill_attention(const float *q, int64_t q_tok_stride, const float *kc, const float *vc,
                             const int32_t *table, int64_t table_stride, const int64_t *seq_ids,
                             const int64_t *q_starts, const int64_t *q_lens, const int64_t *seq_lens,
                             int64_t n_seqs, float *out, float *scratch, int nq, int nkv, int d, int bs,
                             float scale, int n_threads) {
    return tandem_prefill_attention_kv(q, q_tok_stride, kc, vc, KV_F32, table, table_stride, seq_ids, q_starts,
                                       q_lens, seq_lens, n_seqs, out, scratch, nq, nkv, d, bs, scale, n_threads);
}

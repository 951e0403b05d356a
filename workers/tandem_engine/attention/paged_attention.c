/* tandem's CPU paged attention for decode rows (see torch_backend.py, which builds it with the system C
 * compiler through kernels/build.py, caches the shared object per source, flags and CPU, and calls it
 * through ctypes). Rows are shared out over torch's OpenMP thread pool. The KV cache
 * holds float32, bfloat16 or float16 (kv_type 0, 1, 2); a 16-bit block is widened to float32 in a per-thread
 * buffer before use, so the arithmetic is float32 whatever the cache holds (docs/architecture.md). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

typedef struct {
    const float *q; int64_t q_tok_stride;        /* [T, nq, D], head stride D */
    const void *kc, *vc;                         /* [num_blocks, bs, nkv, D] of kv_type */
    int kv_type;
    const int32_t *table; int64_t table_stride;  /* [num_seqs, max_blocks] */
    const int64_t *rows, *seqs, *klens;          /* per work row: query row, sequence, keys to attend */
    float *out;                                  /* [T, nq, D] contiguous */
    float *scratch; int64_t scratch_per_thread;  /* floats: nq * max_klen scores, nq * D accumulators and,
                                                    for a 16-bit cache, one widened block bs * nkv * D */
    int64_t n_rows; int nq, nkv, d, bs; float scale;
} job_t;

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline float f16_to_f32(uint16_t h) {
    /* Integer arithmetic only (no subnormal float inputs, which -ffast-math may flush): exact for every
     * half, subnormals included. */
    const uint32_t em = h & 0x7fffu;
    union { uint32_t u; float f; } v;
    if (em < 0x0400u) v.f = (float)em * 0x1p-24f;            /* zero and subnormals: em * 2^-24 */
    else if (em < 0x7c00u) v.u = (em << 13) + (112u << 23);  /* rebias the exponent from 15 to 127 */
    else v.u = (em << 13) | 0x7f800000u;                     /* inf and NaN */
    v.u |= (uint32_t)(h & 0x8000u) << 16;
    return v.f;
}

/* The first n floats of the cache block starting at element `off`: the block itself for a float32
 * cache, else the block widened into buf. */
static const float *block_f32(const job_t *j, const void *cache, int64_t off, int64_t n, float *buf) {
    if (j->kv_type == KV_F32) return (const float *)cache + off;
    const uint16_t *src = (const uint16_t *)cache + off;
    if (j->kv_type == KV_BF16)
        for (int64_t i = 0; i < n; i++) buf[i] = bf16_to_f32(src[i]);
    else
        for (int64_t i = 0; i < n; i++) buf[i] = f16_to_f32(src[i]);
    return buf;
}

static void one(const job_t *j, int64_t r, float *sc) {
    const int g = j->nq / j->nkv, d = j->d, bs = j->bs, nkv = j->nkv, nq = j->nq;
    const int64_t row = j->rows[r], klen = j->klens[r];
    const int32_t *bt = j->table + j->seqs[r] * j->table_stride;
    const float *q = j->q + row * j->q_tok_stride;
    float *acc = sc + (int64_t)nq * klen, *wide = acc + (int64_t)nq * d;
    const int64_t tok_stride = (int64_t)nkv * d;
    for (int64_t p0 = 0; p0 < klen; p0 += bs) {
        const int64_t n = klen - p0 < bs ? klen - p0 : bs;
        const float *kb = block_f32(j, j->kc, (int64_t)bt[p0 / bs] * bs * tok_stride, n * tok_stride, wide);
        for (int64_t o = 0; o < n; o++) {
            for (int h = 0; h < nkv; h++) {
                const float *k = kb + o * tok_stride + h * d;
                for (int gi = 0; gi < g; gi++) {
                    const float *qq = q + (h * g + gi) * d; float s = 0.f;
                    for (int x = 0; x < d; x++) s += qq[x] * k[x];
                    sc[(h * g + gi) * klen + p0 + o] = s * j->scale;
                }
            }
        }
    }
    for (int hi = 0; hi < nq; hi++) {
        float *s = sc + hi * klen, m = -INFINITY, sum = 0.f;
        for (int64_t p = 0; p < klen; p++) m = s[p] > m ? s[p] : m;
        for (int64_t p = 0; p < klen; p++) { s[p] = expf(s[p] - m); sum += s[p]; }
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < klen; p++) s[p] *= inv;
    }
    memset(acc, 0, sizeof(float) * nq * d);
    for (int64_t p0 = 0; p0 < klen; p0 += bs) {
        const int64_t n = klen - p0 < bs ? klen - p0 : bs;
        const float *vb = block_f32(j, j->vc, (int64_t)bt[p0 / bs] * bs * tok_stride, n * tok_stride, wide);
        for (int64_t o = 0; o < n; o++) {
            for (int h = 0; h < nkv; h++) {
                const float *v = vb + o * tok_stride + h * d;
                for (int gi = 0; gi < g; gi++) {
                    const int hi = h * g + gi;
                    const float w = sc[hi * klen + p0 + o]; float *a = acc + hi * d;
                    for (int x = 0; x < d; x++) a[x] += w * v[x];
                }
            }
        }
    }
    memcpy(j->out + row * nq * d, acc, sizeof(float) * nq * d);
}

int tandem_paged_attention(const float *q, int64_t q_tok_stride, const void *kc, const void *vc, int kv_type,
                           const int32_t *table, int64_t table_stride, const int64_t *rows,
                           const int64_t *seqs, const int64_t *klens, float *out, float *scratch,
                           int64_t scratch_per_thread, int64_t n_rows, int nq, int nkv, int d, int bs,
                           float scale, int n_threads) {
    if (kv_type != KV_F32 && kv_type != KV_BF16 && kv_type != KV_F16) return -1;
    const job_t j = {q, q_tok_stride, kc, vc, kv_type, table, table_stride, rows, seqs, klens, out, scratch,
                     scratch_per_thread, n_rows, nq, nkv, d, bs, scale};
    if (n_threads > n_rows) n_threads = (int)n_rows;
    if (n_threads < 1) n_threads = 1;
    /* One row per work item, handed out dynamically: rows differ in context length. */
    #pragma omp parallel num_threads(n_threads)
    {
        float *sc = scratch + (int64_t)omp_get_thread_num() * scratch_per_thread;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < n_rows; r++) one(&j, r, sc);
    }
    return 0;
}

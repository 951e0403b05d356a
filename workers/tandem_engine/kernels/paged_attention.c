/* tandem's CPU paged attention for decode rows (see attention/cpu_backend.py, which builds it with the system
 * C compiler through kernels/build.py, caches the shared object per source, flags and CPU, and calls it
 * through ctypes). Rows are shared out over torch's OpenMP thread pool; the whole-step kernel (decode_step.c)
 * takes a row's head range at a time. The KV cache holds float32, bfloat16 or float16 (kv_type 0, 1, 2), and
 * the arithmetic is float32 whatever it holds (docs/architecture.md, "CPU kernels"): with head sizes a
 * multiple of 64 the loops convert 16 values at a time as they load them (ld16kv), for other sizes a block is
 * widened into a per-thread buffer first. At the end: the store of a step's keys and values
 * (tandem_write_kv). Prefill chunks are prefill_attention.c's; the vectors both use are attention_simd.h. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "tandem_kernels.h"
#include "attention_simd.h"

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

/* a . b for d a multiple of 8: four independent partial sums, so the FMAs do not wait on each other. */
static inline float dot_v8(const float *a, const float *b, int d) {
    v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int x = 0;
    for (; x + 32 <= d; x += 32) {
        s0 += V8(a + x) * V8(b + x);
        s1 += V8(a + x + 8) * V8(b + x + 8);
        s2 += V8(a + x + 16) * V8(b + x + 16);
        s3 += V8(a + x + 24) * V8(b + x + 24);
    }
    for (; x < d; x += 8) s0 += V8(a + x) * V8(b + x);
    return hsum8_pairs((s0 + s1) + (s2 + s3));
}

static inline float dot(const float *a, const float *b, int d) {
    if (d % 8 == 0) return dot_v8(a, b, d);
    float s = 0.f;
    for (int x = 0; x < d; x++) s += a[x] * b[x];
    return s;
}

/* acc [d] += sum over the block's n tokens of w[o] * v[o * stride : + d], for d a multiple of 8: each
 * 8-float slice of acc stays in registers for the whole block. */
static inline void axpy_block_v8(float *acc, const float *w, const float *v, int64_t n, int64_t stride, int d) {
    for (int x = 0; x < d; x += 8) {
        v8 r0 = V8(acc + x), r1 = {0};
        int64_t o = 0;
        for (; o + 2 <= n; o += 2) {
            r0 += w[o] * V8(v + o * stride + x);
            r1 += w[o + 1] * V8(v + (o + 1) * stride + x);
        }
        if (o < n) r0 += w[o] * V8(v + o * stride + x);
        *(v8 *)(acc + x) = r0 + r1;
    }
}

/* Blocks lie scattered over the pool, where the hardware prefetcher cannot follow: while one block is
 * computed, the one PREFETCH_AHEAD places on in the row's table is requested, a line at a time. On x86 the
 * request is an asm statement: GCC 12 deleted this file's loops of __builtin_prefetch as dead code from -O1
 * on, unseen until a test read the built object for prefetch instructions (elsewhere the builtin stays,
 * and may be deleted the same way). */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2
#endif
static inline void prefetch_line(const char *p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht1 %0" : : "m"(*p));
#else
    __builtin_prefetch(p, 0, 2);
#endif
}
static inline void prefetch(const char *p, int64_t bytes) {
    for (int64_t c = 0; c < bytes; c += 64) prefetch_line(p + c);  /* into L2: L1 holds the block being read */
}

/* A run of lines to request a few at a time, spread over the computation of the block before it: a
 * whole block requested at once fills the core's miss buffers, and the computation then waits for it. */
typedef struct { const char *p; int64_t left; } prefetch_stream;
static inline void prefetch_step(prefetch_stream *s, int64_t lines) {
    for (; lines > 0 && s->left > 0; lines--, s->p += 64, s->left -= 64) prefetch_line(s->p);
}

/* Query heads of one KV head taken together by the head-group loops below (their accumulators fill the
 * vector registers), and how many of them start at head hi of a range ending at h1, with g per KV head. */
#define GROUP_MAX 3
static inline int group_run(int hi, int h1, int g) {
    const int end = (hi / g + 1) * g < h1 ? (hi / g + 1) * g : h1;
    return end - hi > GROUP_MAX ? GROUP_MAX : end - hi;
}

/* For nh query heads that read the same KV head: acc[k * acc_stride : + 64] += sum over the block's n tokens
 * of w[k * w_stride + o] * v[v0 + o * stride : + 64] (v of cache type kt), in token order, one fused
 * multiply-add per token and lane. All nh * 4 accumulators stay in registers over the block and each V row is loaded once for the nh
 * heads, so the adds do not wait on one another. */
static inline __attribute__((always_inline)) void axpy_heads64(float *acc, int64_t acc_stride, const float *w,
                                                              int64_t w_stride, const void *v, int64_t v0,
                                                              const int kt, int64_t n, int64_t stride,
                                                              prefetch_stream *pf, int64_t per, const int nh) {
    v16 a[GROUP_MAX][4];
    for (int k = 0; k < nh; k++)
        for (int c = 0; c < 4; c++) a[k][c] = ld16(acc + k * acc_stride + 16 * c);
    for (int64_t o = 0; o < n; o++) {
        prefetch_step(pf, per);
        const int64_t es = kt == KV_F32 ? 4 : 2;  /* bytes per value */
        const char *vr = (const char *)v + (v0 + o * stride) * es;
        const v16 x0 = ld16kv(vr, kt), x1 = ld16kv(vr + 16 * es, kt), x2 = ld16kv(vr + 32 * es, kt),
                  x3 = ld16kv(vr + 48 * es, kt);
        for (int k = 0; k < nh; k++) {
            const v16 wk = bcast16(w[k * w_stride + o]);
            a[k][0] = fma16(wk, x0, a[k][0]); a[k][1] = fma16(wk, x1, a[k][1]);
            a[k][2] = fma16(wk, x2, a[k][2]); a[k][3] = fma16(wk, x3, a[k][3]);
        }
    }
    for (int k = 0; k < nh; k++)
        for (int c = 0; c < 4; c++) st16(acc + k * acc_stride + 16 * c, a[k][c]);
}

/* p[k] = the 16 lane sums of q[k * d : + d] * K row kr (of cache type kt) for nh heads, in d order: the FMA
 * chains of one key, whose 16 lanes hsum16 adds up. */
static inline __attribute__((always_inline)) void key_lanes(v16 *p, const float *q, int d, const char *kr,
                                                           const int kt, const int nh) {
    const int64_t es = kt == KV_F32 ? 4 : 2;  /* bytes per value */
    for (int k = 0; k < nh; k++) p[k] = zero16();
    for (int x = 0; x < d; x += 64) {
        const char *kx = kr + x * es;
        const v16 k0 = ld16kv(kx, kt), k1 = ld16kv(kx + 16 * es, kt), k2 = ld16kv(kx + 32 * es, kt),
                  k3 = ld16kv(kx + 48 * es, kt);
        for (int k = 0; k < nh; k++) {
            const float *qk = q + k * d + x;
            p[k] = fma16(ld16(qk), k0, p[k]); p[k] = fma16(ld16(qk + 16), k1, p[k]);
            p[k] = fma16(ld16(qk + 32), k2, p[k]); p[k] = fma16(ld16(qk + 48), k3, p[k]);
        }
    }
}

#if defined(__AVX512F__)
/* The four levels of hsum16's tree (lanes i and i + 8, then i and i + 4 of those, then pairs, then the two
 * halves), each over two vectors at once: 16 keys' lane vectors become their 16 sums with 15 adds and 30
 * shuffles instead of 16 horizontal sums, and every sum is the same floats as hsum16's. */
static inline __m512 tree1(v16 a, v16 b) {  /* [a's 8 | b's 8] */
    return _mm512_add_ps(_mm512_shuffle_f32x4((__m512)a, (__m512)b, 0x44), _mm512_shuffle_f32x4((__m512)a, (__m512)b, 0xEE));
}
static inline __m512 tree2(__m512 a, __m512 b) {  /* [a's first 4 | a's second | b's first | b's second] */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
static inline __m512 tree3(__m512 a, __m512 b) {  /* in each 128-bit lane: [a's 2 | b's 2]; then [a, a, b, b] */
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}
#endif

/* For nh query heads that read the same KV head, the scores of the block's n tokens:
 * s[k * s_stride + o] = scale * q[k * d : + d] . kb[k0_at + o * stride : + d] (kb of cache type kt), for d
 * a multiple of 64. Each K row is loaded once for the nh heads; with AVX-512, 16 keys' sums are made
 * together (tree1..3; as one horizontal sum per key, they were 30% of the loop's time with the cache in L2).
 * A head's arithmetic is the same whatever nh is, so its scores do not depend on which heads share the
 * call. */
static inline __attribute__((always_inline)) void scores_heads64(float *s, int64_t s_stride, const float *q, int d,
                                                                const void *kb, int64_t k0_at, const int kt,
                                                                int64_t n, int64_t stride, float scale,
                                                                prefetch_stream *pf, int64_t per, const int nh) {
    const int64_t es = kt == KV_F32 ? 4 : 2;  /* bytes per value */
    const char *k0 = (const char *)kb + k0_at * es;
    int64_t o = 0;
#if defined(__AVX512F__)
    /* key r + 4 j of 16 lands in lane r + 4 j: pairs (r, r + 4) and (r + 8, r + 12), then r's two pairs */
    for (; o + 16 <= n; o += 16) {
        __m512 y[GROUP_MAX][4];
        for (int r = 0; r < 4; r++) {
            __m512 x[GROUP_MAX][2];
            for (int h = 0; h < 2; h++) {
                v16 pa[GROUP_MAX], pb[GROUP_MAX];
                prefetch_step(pf, per);
                key_lanes(pa, q, d, k0 + (o + r + 8 * h) * stride * es, kt, nh);
                prefetch_step(pf, per);
                key_lanes(pb, q, d, k0 + (o + r + 8 * h + 4) * stride * es, kt, nh);
                for (int k = 0; k < nh; k++) x[k][h] = tree1(pa[k], pb[k]);
            }
            for (int k = 0; k < nh; k++) y[k][r] = tree2(x[k][0], x[k][1]);
        }
        for (int k = 0; k < nh; k++) {
            const __m512 sums = tree3(tree3(y[k][0], y[k][1]), tree3(y[k][2], y[k][3]));
            _mm512_storeu_ps(s + k * s_stride + o, _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
        }
    }
#endif
    for (; o < n; o++) {
        prefetch_step(pf, per);
        v16 p[GROUP_MAX];
        key_lanes(p, q, d, k0 + o * stride * es, kt, nh);
        for (int k = 0; k < nh; k++) s[k * s_stride + o] = hsum16(p[k]) * scale;
    }
}

/* s[0, n) = softmax(s[0, n)), in place. The max and the sum run over 16 lanes (p % 16) and then across
 * them in a fixed order: as one serial chain over the keys, each head's max and sum waited a compare or an
 * add latency per key, which was most of a decode step's attention time with the cache in L2. */
static inline void softmax(float *s, int64_t n) {
    float lane[16];
    for (int l = 0; l < 16; l++) lane[l] = -INFINITY;
    int64_t p = 0;
    for (; p + 16 <= n; p += 16)
        for (int l = 0; l < 16; l++) lane[l] = s[p + l] > lane[l] ? s[p + l] : lane[l];
    float m = -INFINITY;
    for (int l = 0; l < 16; l++) m = lane[l] > m ? lane[l] : m;
    for (; p < n; p++) m = s[p] > m ? s[p] : m;
    for (p = 0; p < n; p++) s[p] = score_exp(s[p] - m);
    for (int l = 0; l < 16; l++) lane[l] = 0.f;
    for (p = 0; p + 16 <= n; p += 16)
        for (int l = 0; l < 16; l++) lane[l] += s[p + l];
    float sum = hsum16(ld16(lane));
    for (; p < n; p++) sum += s[p];
    const float inv = 1.f / sum;
    for (p = 0; p < n; p++) s[p] *= inv;
}

/* The slices [off, off + bytes) of n tokens of tok_bytes each from p: a row's KV heads of one block, the
 * whole block when they are all of them. */
static inline void prefetch_heads(const char *p, int64_t n, int64_t tok_bytes, int64_t off, int64_t bytes) {
    if (bytes == tok_bytes) {
        prefetch(p, n * tok_bytes);
        return;
    }
    for (int64_t o = 0; o < n; o++) {
        const char *s = p + o * tok_bytes + off, *line = (const char *)((uintptr_t)s & ~(uintptr_t)63);
        prefetch(line, s + bytes - line);
    }
}

/* Where block `i` of a row's table starts in `cache`, as bytes (NULL past the row's last block). */
static const char *block_at(const job_t *j, const void *cache, const int32_t *bt, int64_t i, int64_t klen) {
    if (i * j->bs >= klen) return NULL;
    const int64_t elem = j->kv_type == KV_F32 ? 4 : 2;
    return (const char *)cache + (int64_t)bt[i] * j->bs * j->nkv * j->d * elem;
}

/* The prefetch stream for block `i` of a row's table: all of it when the row reads every KV head of a
 * token and `spread` (requested a few lines at a time by the loops over the block before), else its
 * slices requested now, and an empty stream. */
static prefetch_stream next_block(const job_t *j, const void *cache, const int32_t *bt, int64_t i, int64_t klen,
                            int64_t tok_bytes, int64_t head_off, int64_t head_bytes, int spread) {
    const char *p = block_at(j, cache, bt, i, klen);
    prefetch_stream s = {p, 0};
    if (!p) return s;
    if (spread && head_bytes == tok_bytes) s.left = j->bs * tok_bytes;
    else prefetch_heads(p, j->bs, tok_bytes, head_off, head_bytes);
    return s;
}

/* Query heads [h0, h1) of work row r, with one thread's scratch sc: scores and accumulators at every head's
 * own place whatever the range, so a head's floats do not depend on which heads share its call. kt: the
 * cache type, a constant in each copy below (one_f32 ...), which the whole-row kernel and the head-range
 * entry both run. */
static inline __attribute__((always_inline)) void one_t(const job_t *j, int64_t r, int h0, int h1, float *sc,
                                                          const int kt) {
    const int g = j->nq / j->nkv, d = j->d, bs = j->bs, nkv = j->nkv, nq = j->nq;
    const int64_t row = j->rows[r], klen = j->klens[r];
    const int32_t *bt = j->table + j->seqs[r] * j->table_stride;
    const float *q = j->q + row * j->q_tok_stride;
    float *acc = sc + (int64_t)nq * klen, *wide = acc + (int64_t)nq * d;
    const int64_t elem = j->kv_type == KV_F32 ? 4 : 2, tok_stride = (int64_t)nkv * d, tok_bytes = tok_stride * elem;
    /* the bytes of a token that the range reads: its KV heads h0 / g .. (h1 - 1) / g */
    const int64_t head_off = (int64_t)(h0 / g) * d * elem;
    const int64_t head_bytes = (int64_t)((h1 - 1) / g + 1 - h0 / g) * d * elem;
    /* Lines of the next block to request per token step of the loops over a block (d a multiple of 64: one
     * step per token and group of up to three heads, as many groups as KV heads when the row is whole). */
    const int spread = d % 64 == 0;
    const int64_t groups = (int64_t)nkv * ((g + GROUP_MAX - 1) / GROUP_MAX), per = (bs * tok_bytes / 64 + groups * bs - 1) / (groups * bs);
    for (int64_t i = 0; i < PREFETCH_AHEAD; i++) {  /* the first blocks of K, and of V for after the softmax */
        const char *kp = block_at(j, j->kc, bt, i, klen), *vp = block_at(j, j->vc, bt, i, klen);
        if (kp) prefetch_heads(kp, bs, tok_bytes, head_off, head_bytes);
        if (vp) prefetch_heads(vp, bs, tok_bytes, head_off, head_bytes);
    }
    for (int64_t p0 = 0; p0 < klen; p0 += bs) {
        const int64_t n = klen - p0 < bs ? klen - p0 : bs;
        const int64_t at = (int64_t)bt[p0 / bs] * bs * tok_stride;  /* the block's first element */
        prefetch_stream pf = next_block(j, j->kc, bt, p0 / bs + PREFETCH_AHEAD, klen, tok_bytes, head_off, head_bytes, spread);
        if (d % 64 != 0) {
            const float *kb = block_f32(j, j->kc, at, n * tok_stride, wide);
            for (int64_t o = 0; o < n; o++)
                for (int hi = h0; hi < h1; hi++)  /* query head hi reads kv head hi / g */
                    sc[hi * klen + p0 + o] = dot(q + hi * d, kb + o * tok_stride + (hi / g) * d, d) * j->scale;
        } else
            for (int hi = h0; hi < h1;) {  /* up to three heads of kv head h at once, the cache read in place */
                const int h = hi / g, nh = group_run(hi, h1, g);
                float *s = sc + hi * klen + p0;
                const float *qh = q + hi * d;
                const int64_t kh = at + h * d;
                if (nh == 3) scores_heads64(s, klen, qh, d, j->kc, kh, kt, n, tok_stride, j->scale, &pf, per, 3);
                else if (nh == 2) scores_heads64(s, klen, qh, d, j->kc, kh, kt, n, tok_stride, j->scale, &pf, per, 2);
                else scores_heads64(s, klen, qh, d, j->kc, kh, kt, n, tok_stride, j->scale, &pf, per, 1);
                hi += nh;
            }
        prefetch_step(&pf, INT64_MAX);  /* what the loops did not request */
    }
    for (int hi = h0; hi < h1; hi++) softmax(sc + hi * klen, klen);
    memset(acc + h0 * d, 0, sizeof(float) * (h1 - h0) * d);
    for (int64_t p0 = 0; p0 < klen; p0 += bs) {
        const int64_t n = klen - p0 < bs ? klen - p0 : bs;
        const int64_t at = (int64_t)bt[p0 / bs] * bs * tok_stride;
        prefetch_stream pf = next_block(j, j->vc, bt, p0 / bs + PREFETCH_AHEAD, klen, tok_bytes, head_off, head_bytes, spread);
        const float *vb = d % 64 == 0 ? NULL : block_f32(j, j->vc, at, n * tok_stride, wide);
        for (int hi = h0; hi < h1;) {  /* query head hi = h * g + gi reads kv head h */
            const int h = hi / g;
            const float *w = sc + hi * klen + p0;
            float *a = acc + hi * d;
            if (d % 64 == 0) {  /* up to three heads of kv head h at once, the cache read in place */
                const int nh = group_run(hi, h1, g);
                for (int x = 0; x < d; x += 64) {
                    const int64_t vh = at + h * d + x;
                    if (nh == 3) axpy_heads64(a + x, d, w, klen, j->vc, vh, kt, n, tok_stride, &pf, per, 3);
                    else if (nh == 2) axpy_heads64(a + x, d, w, klen, j->vc, vh, kt, n, tok_stride, &pf, per, 2);
                    else axpy_heads64(a + x, d, w, klen, j->vc, vh, kt, n, tok_stride, &pf, per, 1);
                }
                hi += nh;
                continue;
            }
            if (d % 8 == 0) axpy_block_v8(a, w, vb + h * d, n, tok_stride, d);
            else
                for (int64_t o = 0; o < n; o++)
                    for (int x = 0; x < d; x++) a[x] += w[o] * vb[o * tok_stride + h * d + x];
            hi++;
        }
        prefetch_step(&pf, INT64_MAX);
    }
    memcpy(j->out + (row * nq + h0) * d, acc + h0 * d, sizeof(float) * (h1 - h0) * d);
}

/* One copy of `one` per cache type, each built like a kernel of its own: in a single copy holding every
 * type's loops, GCC 12 made the float32 loops 1.45x slower (bench/attention_kernel.py). */
static __attribute__((noinline)) void one_f32(const job_t *j, int64_t r, int h0, int h1, float *sc) {
    one_t(j, r, h0, h1, sc, KV_F32);
}
static __attribute__((noinline)) void one_bf16(const job_t *j, int64_t r, int h0, int h1, float *sc) {
    one_t(j, r, h0, h1, sc, KV_BF16);
}
static __attribute__((noinline)) void one_f16(const job_t *j, int64_t r, int h0, int h1, float *sc) {
    one_t(j, r, h0, h1, sc, KV_F16);
}
static void one(const job_t *j, int64_t r, int h0, int h1, float *sc) {
    if (j->kv_type == KV_F32) one_f32(j, r, h0, h1, sc);
    else if (j->kv_type == KV_BF16) one_bf16(j, r, h0, h1, sc);
    else one_f16(j, r, h0, h1, sc);
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
        for (int64_t r = 0; r < n_rows; r++) one(&j, r, 0, nq, sc);
    }
    return 0;
}

/* Query heads [h0, h1) of one decode row (q [nq, D], out [nq, D]: the row's own; table: the row's blocks;
 * klen: the keys it attends; scratch: one thread's scratch_per_thread floats), exactly as
 * tandem_paged_attention computes them: the fused decode step (kernels/decode_step.c) splits rows and their
 * heads over its threads itself. */
void tandem_paged_attention_heads(const float *q, const void *kc, const void *vc, int kv_type, const int32_t *table,
                                  int64_t klen, float *out, float *scratch, int nq, int nkv, int d, int bs,
                                  float scale, int h0, int h1) {
    const int64_t zero = 0;
    const job_t j = {q, 0, kc, vc, kv_type, table, 0, &zero, &zero, &klen, out, scratch, 0, 1, nq, nkv, d, bs, scale};
    one(&j, 0, h0, h1, scratch);
}

/* Stores t tokens' keys and values in a float32 cache, what two index_copy_ calls do in one pass: token i's
 * row (row floats: nkv * D) at k + i * k_stride and v + i * v_stride (strides in floats: views into the
 * QKV projection) goes to slot slots[i] of kc and vc (slot rows of row floats). Every slot is checked
 * before anything is written: returns the first token whose slot is outside [0, n_slots), or -1 once all
 * are written. One thread: a decode step's rows are a few KB, a 2048-token chunk's a few MB per layer. */
int64_t tandem_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *kc, float *vc,
                        const int64_t *slots, int64_t t, int64_t row, int64_t n_slots) {
    for (int64_t i = 0; i < t; i++)
        if (slots[i] < 0 || slots[i] >= n_slots) return i;
    for (int64_t i = 0; i < t; i++) {
        memcpy(kc + slots[i] * row, k + i * k_stride, sizeof(float) * row);
        memcpy(vc + slots[i] * row, v + i * v_stride, sizeof(float) * row);
    }
    return -1;
}

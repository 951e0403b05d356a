/* A whole step of a Llama-family model, under --quantization gguf or on the dense float32 path, in one
 * OpenMP parallel region (see decode_step.py, which builds it with kernels/build.py and calls it through
 * ctypes; docs/architecture.md, "One C call per step" and "Dense decode steps in one call"). Its rows are
 * decode rows (one new token of a sequence) and the rows of prefill chunks (several new tokens of one).
 *
 * For every layer and every row: q|k|v of the normed residual stream, RoPE, K and V into the paged cache
 * (float32, bfloat16 or float16, rounded as torch rounds), attention, o + residual, the post-attention norm,
 * gate|up, SiLU * up, down + residual and the next norm (the next layer's input norm, or the final norm after
 * the last layer). Every row's K and V are in the cache before any row attends, so a prefill row sees the
 * chunk's earlier tokens.
 * The work itself is the other kernels' code, reached through function pointers (kernels_t): a matmul in
 * two halves (quantize x, then a range of output columns: gguf_matmul.c's int8 kernel, or
 * panel_matmul.c's float32 panels, whose "quantize" copies x), the row kernels of kernels/fused.c,
 * kernels/paged_attention.c's head-range attention of a decode row and kernels/prefill_attention.c's work
 * items of the tiled prefill attention, each built with its own flags; so under gguf the step computes the
 * op-by-op path's floats. What this file adds is the threading, RoPE and the cache writes.
 *
 * Why: run op by op, a decode step is ~150 parallel regions and a prefill chunk ~300, and under
 * OMP_WAIT_POLICY=PASSIVE (cpu_budget.py: an idle engine must not spin) each one wakes sleeping threads. Here
 * the threads are woken once per step and meet between phases at a barrier of their own that spins a bounded
 * while, then yields the CPU (a peer may be descheduled where engines share cores). Matmuls hand out their
 * output columns in runs (take_near), the attention its decode rows' (row, query head) items weighted by the
 * row's context and then the prefill tiles one by one, the norms their rows. */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "tandem_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

/* Pauses a thread spins at a barrier before it yields: a few tens of microseconds, longer than a balanced
 * phase's stragglers take, short next to a time slice lost to a descheduled peer. */
#define SPINS 2000
/* The cost of an attention item beyond its keys, in keys: dividing items by context alone would hand a
 * thread many short rows' worth of fixed work. */
#define ITEM_KEYS 16

typedef struct { const uint8_t *data; int64_t rows, qtype; } part_t;  /* rows of a weight in GGUF blocks */
typedef struct { const part_t *parts; int64_t n_parts, cols; } proj_t; /* parts' outputs side by side */

typedef struct {
    proj_t qkv, o, gate_up, down;
    const float *post_attn_norm, *next_norm; /* [hidden]; next: the next layer's input norm, or the final norm */
} layer_t;

typedef struct { /* entry points of the other kernels (see the file comment; their types: tandem_kernels.h) */
    tandem_split_x_fn *quantize;
    tandem_matmul_cols_fn *matmul_cols;
    tandem_add_rms_norm_row_fn *add_rms_norm_row;
    tandem_silu_mul_row_fn *silu_mul_row;
    tandem_attention_heads_fn *attention_heads;
    /* the n-th of `items` work items of the tiled causal attention of prefill chunks */
    tandem_prefill_attention_item_fn *prefill_attention_item;
    /* NULL, or matmul_cols for rows [r0, r1) only (r0 a multiple of 16): then a step of many rows runs its
     * projections a block of rows at a time (row_block) */
    tandem_matmul_rows_fn *matmul_rows;
} kernels_t;

typedef struct tandem_step_model {
    kernels_t k;
    const layer_t *layers;
    int64_t n_layers, hidden, inter, nq, nkv, d;
    const float *first_norm;         /* [hidden] layer 0's input norm */
    const float *rope_cos, *rope_sin; /* [max_positions, D]: (cos, cos) and (-sin, sin) */
    float eps, scale;
    int64_t col_align; /* projection runs start on multiples of this many columns (the matmul's group) */
    int64_t row_block_bytes; /* cut rows into blocks whose split x is at most this (row_block; q|k|v: twice) */
} model_t;

typedef struct tandem_step {
    int64_t m;                                 /* rows: one per new token */
    float *x, *h;                              /* [m, hidden]: the residual stream (updated in place), and
                                                  x through the final norm (written) */
    const int64_t *positions, *slots, *klens;  /* [m]: position, cache slot, keys to attend (itself included);
                                                  klens 0: a row of a prefill chunk (below) */
    const int32_t *table;                      /* [m, table_stride] each row's block table */
    int64_t table_stride, bs;
    int64_t kv_type;                           /* what the caches hold: 0 float32, 1 bfloat16, 2 float16 (the
                                                  attention kernel's kv_type) */
    void *const *kv;                           /* [n_layers * 2]: layer i's K cache, then its V cache, each
                                                  [num_blocks, bs, nkv, D] of kv_type */
    float *qkv, *attn, *o, *gu, *act, *down;   /* work: [m, (nq + 2 nkv) D], [m, nq D], [m, hidden],
                                                  [m, 2 inter], [m, inter], [m, hidden] */
    void *xq;                                  /* the quantized x of m rows of the widest input (zeroed) */
    float *scratch;                            /* attention: scratch_per_thread floats per thread */
    int64_t scratch_per_thread;
    int64_t *phase_ns;                         /* NULL, or [N_PHASES] nanoseconds to add each phase's wall
                                                  time to (as thread 0 sees it, its wait at the barrier
                                                  included): bench/profile_step.py */
    /* Prefill chunks (sequences of more than one new token), whose rows attend through the tiled prefill
     * kernel: per chunk, its row of the block table prefill_table, its first row, its rows and its tokens in all
     * (cached ones and these); prefill_items: that kernel's work items for them all (0: none). */
    int64_t prefill_items;
    const int64_t *prefill_seq_ids, *prefill_q_starts, *prefill_q_lens, *prefill_seq_lens;
    const int32_t *prefill_table;
    int64_t prefill_table_stride;
} step_t;

/* The phases of a layer, as step_t.phase_ns counts them: q|k|v with RoPE and the cache writes, attention,
 * the copy or quantization of its output, o, the norms (with their residual adds), gate|up, SiLU * up, down. */
enum { PH_QKV, PH_ATTENTION, PH_ATTENTION_OUT, PH_O, PH_NORM, PH_GATE_UP, PH_SILU, PH_DOWN, N_PHASES };

/* next: the first item of the current phase that no thread has taken yet (phases hand out their items
 * dynamically, below); taken[t]: runs taken so far from thread t's own share of a matmul's columns (take_near),
 * each on a cache line of its own. MAX_SHARES: threads that have shares; more share one counter (take). */
#define MAX_SHARES 64
typedef struct { _Alignas(64) atomic_llong n; } counter_t;
typedef struct { atomic_int arrived, phase; atomic_llong next; counter_t taken[MAX_SHARES]; } barrier_t;

static void reset_items(barrier_t *b, int nt) {
    atomic_store_explicit(&b->next, 0, memory_order_relaxed);
    for (int t = 0; t < nt && t < MAX_SHARES; t++) atomic_store_explicit(&b->taken[t].n, 0, memory_order_relaxed);
}

/* Every thread of nt waits here until all have arrived; what each wrote before is visible to all after,
 * and the next phase hands out its items from the first. */
static void barrier_wait(barrier_t *b, int nt) {
    if (nt == 1) {
        reset_items(b, nt);
        return;
    }
    const int phase = atomic_load_explicit(&b->phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == nt - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        reset_items(b, nt); /* every thread is done taking items */
        atomic_store_explicit(&b->phase, phase + 1, memory_order_release);
        return;
    }
    for (int i = 0; atomic_load_explicit(&b->phase, memory_order_acquire) == phase; i++) {
        if (i < SPINS)
            PAUSE();
        else
            sched_yield();
    }
}

/* Thread t's share [share(n, t, nt), share(n, t + 1, nt)) of n items. */
static inline int64_t share(int64_t n, int t, int nt) { return n * t / nt; }

/* Items of a phase handed out dynamically: the threads take runs of `chunk` from a shared counter until
 * none are left, so a thread that loses its core for a while (the API server answering a token, another
 * engine) leaves its share to the others instead of holding them all at the next barrier. Static shares
 * cost a whole step what one descheduled thread lost. Returns the start of the run taken, or n. */
static inline int64_t take(barrier_t *b, int64_t n, int64_t chunk) {
    const int64_t i = atomic_fetch_add_explicit(&b->next, chunk, memory_order_relaxed);
    return i < n ? i : n;
}

/* Runs per thread a matmul's columns are cut into: more even out a descheduled thread, each costs an atomic
 * add (on the thread's own counter's cache line while it takes from its own share, take_near). */
#define RUNS_PER_THREAD 8

/* Runs of a matmul's columns handed out share first: thread t takes the runs of its own contiguous share in
 * order, then the runs left in the other threads' shares (t + 1, t + 2, ...), from their fronts. So a thread
 * mostly computes one contiguous range, and each run's last panels prefetch the first of its next run
 * (panel_matmul.c, cols); from a single counter the next run was as often the other thread's. A
 * descheduled thread's runs are still taken by the others. Measured on 30 layers' projections and the head
 * at 32 rows with weights streamed from memory, 2 threads of the AVX-512 Xeon: contiguous halves 246
 * GFLOP/s, 4 runs per thread from one counter 230, 16 runs 207. Returns the start of the run taken, or n. */
static inline int64_t take_near(barrier_t *b, int t, int nt, int64_t n, int64_t chunk) {
    if (n <= 0 || chunk <= 0) return n;
    if (nt > MAX_SHARES) return take(b, n, chunk);
    const int64_t runs = (n + chunk - 1) / chunk;
    for (int i = 0; i < nt; i++) {
        const int v = (t + i) % nt;
        const int64_t first = share(runs, v, nt), count = share(runs, v + 1, nt) - first;
        if (atomic_load_explicit(&b->taken[v].n, memory_order_relaxed) >= count) continue;
        const int64_t j = atomic_fetch_add_explicit(&b->taken[v].n, 1, memory_order_relaxed);
        if (j < count) return (first + j) * chunk;
    }
    return n;
}

/* The run length for n items over nt threads, a multiple of `align` (whole groups of the matmul's rows). */
static inline int64_t run_length(int64_t n, int nt, int64_t align) {
    const int64_t c = (n + (int64_t)nt * RUNS_PER_THREAD - 1) / ((int64_t)nt * RUNS_PER_THREAD);
    return (c + align - 1) / align * align;
}

/* Output columns [c0, c1) of projection p, for rows [r0, r1) of the m rows quantized in xq, into y [m, p->cols]
 * (rows other than all of them only with matmul_rows). */
static void project(const kernels_t *k, const proj_t *p, const void *xq, int64_t m, int64_t r0, int64_t r1,
                    int64_t kdim, int64_t c0, int64_t c1, float *y) {
    int64_t start = 0;
    for (int64_t i = 0; i < p->n_parts; i++) {
        const part_t *pt = &p->parts[i];
        const int64_t a = c0 > start ? c0 : start, b = c1 < start + pt->rows ? c1 : start + pt->rows;
        if (a < b && r0 == 0 && r1 == m)
            k->matmul_cols(xq, m, pt->data, (int)pt->qtype, kdim, a - start, b - start, y + start, p->cols);
        else if (a < b)
            k->matmul_rows(xq, m, r0, r1, pt->data, (int)pt->qtype, kdim, a - start, b - start, y + start, p->cols);
        start += pt->rows;
    }
}

/* The rows of the blocks a step's rows are cut into for a projection of kdim inputs (m: one block): when the
 * kernel takes row ranges (matmul_rows) and the rows' split x (6 bytes a value: the float32 AMX kernel's
 * three bfloat16 parts) is over `limit` bytes (0: never cut), blocks of equal rows, a multiple of 16, that
 * each fit. Each block is run against every column of the projection in turn, its x read from L2 while the
 * weights pass (model_t.row_block_bytes: decode_step.py's ROW_BLOCK_BYTES). */
static inline int64_t row_block(const kernels_t *k, int64_t m, int64_t kdim, int64_t limit) {
    const int64_t bytes = m * kdim * 6;
    if (!k->matmul_rows || limit <= 0 || bytes <= limit) return m;
    const int64_t nrb = (bytes + limit - 1) / limit, rows = (m + nrb - 1) / nrb;
    return (rows + 15) / 16 * 16;
}

/* Thread t's whole-row share: x[r] += delta[r] (none: NULL), h[r] = its norm times w, and, given xq, h[r]
 * quantized into it. */
static void norm_rows(const model_t *md, const step_t *s, const float *delta, const float *w, void *xq, int t,
                      int nt) {
    const int64_t hd = md->hidden, nb = hd / QK;
    for (int64_t r = share(s->m, t, nt); r < share(s->m, t + 1, nt); r++) {
        md->k.add_rms_norm_row(s->x + r * hd, delta ? delta + r * hd : NULL, w, s->h + r * hd, hd, md->eps);
        if (xq) md->k.quantize(s->h, hd, s->m, hd, r * nb, (r + 1) * nb, xq);
    }
}

/* x [D] rotated in place as models/llama.py's apply_rope: x cos + roll(x, D / 2) sin, the product with sin
 * fused into the add (torch's addcmul contracts it to one fma). */
static void rope(float *x, const float *cos, const float *sin, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t j = 0; j < half; j++) {
        const float a = x[j], b = x[j + half];
        x[j] = fmaf(b, sin[j], a * cos[j]);
        x[j + half] = fmaf(a, sin[j + half], b * cos[j + half]);
    }
}

/* d floats of x into element `at` of a cache of kv_type (an entry point of its own for the tests). */
void tandem_decode_step_store_kv(void *cache, int64_t at, const float *x, int64_t d, int64_t kv_type) {
    if (kv_type == KV_F32) {
        memcpy((float *)cache + at, x, sizeof(float) * d);
        return;
    }
    uint16_t *out = (uint16_t *)cache + at;
    int64_t j = 0;
    if (kv_type == KV_F16) {
#if defined(__F16C__)
        for (; j + 8 <= d; j += 8)
            _mm_storeu_si128((__m128i *)(out + j), _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; j < d; j++) out[j] = f32_to_f16(x[j]);
    } else
        for (; j < d; j++) out[j] = f32_to_bf16(x[j]);
}

/* q|k|v a head at a time (whole heads, so a thread can finish them; share first, take_near), or a head of a
 * block of rows at a time from one counter: RoPE on q and k, then K and V into their slots (rounded to the
 * cache's type). */
static void qkv_phase(const model_t *md, const step_t *s, const layer_t *L, void *kc, void *vc, barrier_t *bar,
                      int t, int nt) {
    const int64_t d = md->d, nq = md->nq, nkv = md->nkv, heads = nq + 2 * nkv, ld = heads * d;
    const int64_t rb = row_block(&md->k, s->m, md->hidden, 2 * md->row_block_bytes), nrb = (s->m + rb - 1) / rb;
    const int64_t items = nrb * heads;
    for (int64_t j; (j = nrb > 1 ? take(bar, items, 1) : take_near(bar, t, nt, heads, 1)) < items;) {
        const int64_t u = j % heads, r0 = j / heads * rb, r1 = r0 + rb < s->m ? r0 + rb : s->m;
        project(&md->k, &L->qkv, s->xq, s->m, r0, r1, md->hidden, u * d, (u + 1) * d, s->qkv);
        for (int64_t r = r0; r < r1; r++) {
            float *x = s->qkv + r * ld + u * d;
            if (u < nq + nkv) rope(x, md->rope_cos + s->positions[r] * d, md->rope_sin + s->positions[r] * d, d);
            if (u >= nq) /* kv head u - nq (K) or u - nq - nkv (V) */
                tandem_decode_step_store_kv(u < nq + nkv ? kc : vc, (s->slots[r] * nkv + (u - nq) % nkv) * d, x, d, s->kv_type);
        }
    }
}

/* Output columns of projection p handed out in runs (take_near), for the m rows quantized in xq, into y; or,
 * with the rows cut into blocks, runs of a block's columns from one counter, a block at a time. */
static void project_runs(const model_t *md, const proj_t *p, const void *xq, int64_t m, int64_t kdim, float *y,
                         barrier_t *bar, int t, int nt) {
    const int64_t n = p->cols, rb = row_block(&md->k, m, kdim, md->row_block_bytes), nrb = (m + rb - 1) / rb;
    if (nrb > 1) { /* a block of rows (in L2 as the kernel splits it) against every column in turn */
        const int64_t per = (n + 4 * nt - 1) / (4 * nt) / md->col_align * md->col_align;
        const int64_t chunk = per > md->col_align ? per : md->col_align, runs = (n + chunk - 1) / chunk;
        for (int64_t j; (j = take(bar, nrb * runs, 1)) < nrb * runs;) {
            const int64_t c = j % runs * chunk, r0 = j / runs * rb;
            project(&md->k, p, xq, m, r0, r0 + rb < m ? r0 + rb : m, kdim, c, c + chunk < n ? c + chunk : n, y);
        }
        return;
    }
    const int64_t chunk = run_length(n, nt, md->col_align);
    for (int64_t c; (c = take_near(bar, t, nt, n, chunk)) < n;)
        project(&md->k, p, xq, m, 0, m, kdim, c, c + chunk < n ? c + chunk : n, y);
}

/* Decode rows: thread t's (row, query head) items, a contiguous run of them, cut by cost (the row's keys +
 * ITEM_KEYS), so a row's heads mostly stay together. Then the prefill chunks' tiles, handed out one at a
 * time, the longest first (they even out what the static shares left uneven). */
static void attention_phase(const model_t *md, const step_t *s, const void *kc, const void *vc, barrier_t *bar,
                            int t, int nt) {
    const int64_t nq = md->nq, d = md->d, ld = (nq + 2 * md->nkv) * d;
    int64_t total = 0;
    for (int64_t r = 0; r < s->m; r++) total += s->klens[r] ? nq * (s->klens[r] + ITEM_KEYS) : 0;
    const int64_t lo = share(total, t, nt), hi = share(total, t + 1, nt);
    float *sc = s->scratch + t * s->scratch_per_thread;
    int64_t base = 0; /* the cost of the rows before r */
    for (int64_t r = 0; r < s->m && base < hi; r++) {
        if (!s->klens[r]) continue;
        const int64_t w = s->klens[r] + ITEM_KEYS;
        /* items h with lo <= base + h w < hi */
        const int64_t h0 = lo > base ? (lo - base + w - 1) / w : 0;
        const int64_t h1 = hi - base < nq * w ? (hi - base + w - 1) / w : nq;
        if (h0 < h1)
            md->k.attention_heads(s->qkv + r * ld, kc, vc, (int)s->kv_type, s->table + r * s->table_stride, s->klens[r],
                                  s->attn + r * nq * d, sc, (int)nq, (int)md->nkv, (int)d, (int)s->bs, md->scale,
                                  (int)h0, (int)h1);
        base += nq * w;
    }
    for (int64_t n; (n = take(bar, s->prefill_items, 1)) < s->prefill_items;)
        md->k.prefill_attention_item(s->qkv, ld, kc, vc, (int)s->kv_type, s->prefill_table, s->prefill_table_stride,
                                     s->prefill_seq_ids, s->prefill_q_starts, s->prefill_q_lens, s->prefill_seq_lens, s->attn, (int)nq,
                                     (int)md->nkv, (int)d, (int)s->bs, md->scale, s->prefill_items, n, sc);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The barrier that ends phase `ph`; thread 0 charges the time since the last one to it (when timing). */
static void end_phase(const step_t *s, barrier_t *bar, int t, int nt, int ph, int64_t *since) {
    barrier_wait(bar, nt);
    if (s->phase_ns && t == 0) {
        const int64_t now = now_ns();
        s->phase_ns[ph] += now - *since;
        *since = now;
    }
}

static void run(const model_t *md, const step_t *s, barrier_t *bar, int t, int nt) {
    const kernels_t *k = &md->k;
    const int64_t m = s->m, hd = md->hidden, inter = md->inter, nqd = md->nq * md->d;
    int64_t since = s->phase_ns && t == 0 ? now_ns() : 0;
    norm_rows(md, s, NULL, md->first_norm, s->xq, t, nt);
    end_phase(s, bar, t, nt, PH_NORM, &since);
    for (int64_t l = 0; l < md->n_layers; l++) {
        const layer_t *L = &md->layers[l];
        void *kc = s->kv[2 * l], *vc = s->kv[2 * l + 1];
        qkv_phase(md, s, L, kc, vc, bar, t, nt);
        end_phase(s, bar, t, nt, PH_QKV, &since);
        attention_phase(md, s, kc, vc, bar, t, nt);
        end_phase(s, bar, t, nt, PH_ATTENTION, &since);
        k->quantize(s->attn, nqd, m, nqd, share(m * nqd / QK, t, nt), share(m * nqd / QK, t + 1, nt), s->xq);
        end_phase(s, bar, t, nt, PH_ATTENTION_OUT, &since);
        project_runs(md, &L->o, s->xq, m, nqd, s->o, bar, t, nt);
        end_phase(s, bar, t, nt, PH_O, &since);
        norm_rows(md, s, s->o, L->post_attn_norm, s->xq, t, nt);
        end_phase(s, bar, t, nt, PH_NORM, &since);
        project_runs(md, &L->gate_up, s->xq, m, hd, s->gu, bar, t, nt);
        end_phase(s, bar, t, nt, PH_GATE_UP, &since);
        /* SiLU * up over the thread's share of blocks of 32 columns, a row's run of them at a time (one call
         * each, not one per block), each run quantized as soon as it is made (in L1: at most a row) */
        const int64_t nb = inter / QK;
        for (int64_t i = share(m * nb, t, nt), end = share(m * nb, t + 1, nt); i < end;) {
            const int64_t r = i / nb, run_end = (r + 1) * nb < end ? (r + 1) * nb : end, c = i % nb * QK;
            const float *g = s->gu + r * 2 * inter + c;
            k->silu_mul_row(g, g + inter, s->act + r * inter + c, (run_end - i) * QK);
            k->quantize(s->act, inter, m, inter, i, run_end, s->xq);
            i = run_end;
        }
        end_phase(s, bar, t, nt, PH_SILU, &since);
        project_runs(md, &L->down, s->xq, m, inter, s->down, bar, t, nt);
        end_phase(s, bar, t, nt, PH_DOWN, &since);
        const int last = l == md->n_layers - 1;
        norm_rows(md, s, s->down, L->next_norm, last ? NULL : s->xq, t, nt);
        if (!last || s->phase_ns) end_phase(s, bar, t, nt, PH_NORM, &since);
    }
}

/* One step (see the file comment) on up to `threads` threads. Returns 0, or -1 for shapes the step does not
 * take (an odd head size, or with prefill chunks one not a multiple of 16; nq not a multiple of nkv, a
 * projection input not a multiple of 32) or an unknown kv_type. */
int tandem_decode_step(const model_t *md, const step_t *s, int threads) {
    if (md->d % 2 || md->nq % md->nkv || md->hidden % QK || md->inter % QK || md->nq * md->d % QK) return -1;
    if (s->prefill_items && md->d % 16) return -1;
    if (s->kv_type != KV_F32 && s->kv_type != KV_BF16 && s->kv_type != KV_F16) return -1;
    barrier_t bar;
    atomic_init(&bar.arrived, 0);
    atomic_init(&bar.phase, 0);
    atomic_init(&bar.next, 0);
    for (int t = 0; t < MAX_SHARES; t++) atomic_init(&bar.taken[t].n, 0);
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    run(md, s, &bar, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}

/* What tandem's two attention kernels share: paged_attention.c (decode rows) and prefill_attention.c
 * (prefill chunks), each its own library. Here: 8- and 16-float vectors and their arithmetic, the load of 16
 * KV-cache values of any type as floats (ld16kv) and the softmax's e^x (score_exp), all static inline, so
 * that each kernel compiles them into its own code with its own flags (docs/architecture.md, "CPU kernels").
 * Include it after tandem_kernels.h (the KV types, conversions and exp_small): it includes no header of
 * this folder itself, since kernels/build.py writes beside a source only the headers that source names. */
#ifndef TANDEM_ATTENTION_SIMD_H
#define TANDEM_ATTENTION_SIMD_H
#ifndef TANDEM_KERNELS_H
#error "include tandem_kernels.h before attention_simd.h"
#endif

/* 8 floats in a vector register (GCC/Clang vector extension; aligned(4): loads need no alignment). */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
#define V8(p) (*(const v8 *)(p))

static inline float hsum8_pairs(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* 16 floats: one vector register with AVX-512. Elsewhere a pair of 8-float vectors, written out: GCC lowers
 * a 64-byte vector type on AVX2 through the stack (scalar broadcasts and lane extracts as 16-byte moves),
 * and perf on an AVX2-only EPYC showed the decode loops spending their time there, 5x slower than the
 * Intel with AVX-512 against a 1.5x slower memory. fma16 is one rounding per lane through the FMA
 * instruction itself: -ffast-math may reorder plain adds and fuse plain multiplies differently in each
 * inlined copy of a loop, and a head's floats must not depend on which copy (how many heads) ran it. */
#if defined(__AVX512F__)
#include <immintrin.h>
typedef float v16 __attribute__((vector_size(64), aligned(4)));
static inline v16 ld16(const float *p) { return *(const v16 *)p; }
static inline void st16(float *p, v16 v) { *(v16 *)p = v; }
static inline v16 zero16(void) { return (v16){0}; }
static inline v16 bcast16(float s) { return (v16){0} + s; }
static inline v16 smul16(float s, v16 a) { return s * a; }
static inline v16 fma16(v16 a, v16 b, v16 acc) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc); }
static inline float hsum16(v16 v) {
    const v8 lo = {v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]};
    const v8 hi = {v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15]};
    return hsum8_pairs(lo + hi);
}
#else
#if defined(__FMA__)
#include <immintrin.h>
static inline v8 fma8(v8 a, v8 b, v8 acc) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc); }
#else
static inline v8 fma8(v8 a, v8 b, v8 acc) { return acc + a * b; }
#endif
typedef struct { v8 lo, hi; } v16;
static inline v16 ld16(const float *p) { return (v16){V8(p), V8(p + 8)}; }
static inline void st16(float *p, v16 v) { *(v8 *)p = v.lo; *(v8 *)(p + 8) = v.hi; }
static inline v16 zero16(void) { return (v16){{0}, {0}}; }
static inline v16 bcast16(float s) { const v8 b = (v8){0} + s; return (v16){b, b}; }
static inline v16 smul16(float s, v16 a) { return (v16){s * a.lo, s * a.hi}; }
static inline v16 fma16(v16 a, v16 b, v16 acc) { return (v16){fma8(a.lo, b.lo, acc.lo), fma8(a.hi, b.hi, acc.hi)}; }
static inline float hsum16(v16 v) { return hsum8_pairs(v.lo + v.hi); }
#endif

/* The 16 cache values at `at` of a cache of type kt (a constant at every call site), as floats: exact,
 * since every bfloat16 and float16 is a float. The decode loops (paged_attention.c) read a 16-bit cache this
 * way, in place, rather than widening each block into a buffer first: a decode row reads half the bytes of a
 * float32 cache, and no buffer is written and read back. Prefill widens a chunk's rows with it. */
static inline __attribute__((always_inline)) v16 ld16kv(const char *at, const int kt) {
    if (kt == KV_F32) return ld16((const float *)at);
    const uint16_t *p = (const uint16_t *)at;
#if defined(__AVX512F__)
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (kt == KV_F16) return (v16)_mm512_cvtph_ps(h);
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif defined(__AVX2__) && defined(__F16C__)
    const __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)(p + 8));
    if (kt == KV_F16) return (v16){(v8)_mm256_cvtph_ps(a), (v8)_mm256_cvtph_ps(b)};
    return (v16){(v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16),
                 (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)};
#else
    float t[16];
    for (int k = 0; k < 16; k++) t[k] = kt == KV_F16 ? f16_to_f32(p[k]) : bf16_to_f32(p[k]);
    return ld16(t);
#endif
}

/* e^x for a score minus its row's maximum (x <= 0): below -87, where e^x is under 2^-125, it is taken
 * at -87 (a masked score weighs 1.6e-38 of its row's largest). Branch-free arithmetic of our own
 * (kernels/tandem_kernels.h), so GCC vectorises the loops that call it at any width and every lane computes
 * the same float whatever the width. libm's expf is not that: under -ffast-math GCC calls libmvec's
 * variant of the loop's width (SSE, AVX2 or AVX-512, where the tuning prefers 512-bit vectors: AMD's
 * Zen 4, a Xeon GCC does not know by name) for the body and scalar expf for the tail, and those differ
 * in the last bit, so the builds of each ISA level disagreed. */
static inline float score_exp(float x) { return exp_small(__builtin_fmaxf(x, -87.0f)); }

#endif

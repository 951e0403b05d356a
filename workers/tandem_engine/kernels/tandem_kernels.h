/* What tandem's C kernels share: ggml's type ids and block layouts, the KV cache's types, the number
 * conversions (one algorithm each), the horizontal sums, e^x, and the prototype of every entry point, so
 * that each kernel's definitions and the whole-step kernel's table of them are checked by the compiler
 * against one declaration (docs/architecture.md, "CPU kernels"). kernels/build.py resolves a quoted
 * #include against this folder and keys each build on the header's text too. (The two attention kernels
 * also share attention_simd.h, their vector code.) */
#ifndef TANDEM_KERNELS_H
#define TANDEM_KERNELS_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* --- ggml's tensor types and their blocks ---------------------------------------------------------------
 * The type ids are ggml's (the gguf package's GGMLQuantizationType; tests/engine/kernels/test_kernel_build.py
 * holds them equal). A block is 32 weights along k. */
enum ggml_type { F32 = 0, F16 = 1, Q4_1 = 3, Q8_0 = 8 };
#define QK 32 /* weights of a block */

typedef struct { uint16_t d; int8_t qs[QK]; } block_q8_0;               /* w_j = d * qs_j */
typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } block_q4_1;       /* w_j = d * q_j + m; byte i holds
                                                                           q_i (low nibble), q_(i+16) (high) */
_Static_assert(sizeof(block_q8_0) == 34, "ggml's Q8_0 block is 34 bytes");
_Static_assert(sizeof(block_q4_1) == 20, "ggml's Q4_1 block is 20 bytes");

/* Bytes of a block of `type` as a GGUF file stores it (0: not a block type the kernels read). */
static inline int64_t block_bytes(int type) {
    return type == Q8_0 ? (int64_t)sizeof(block_q8_0) : type == Q4_1 ? (int64_t)sizeof(block_q4_1) : 0;
}

/* The panel kernel's block panels (panel_matmul.c): the blocks of PANEL_NR output columns over one stretch of
 * 32 along k, interleaved so that row i holds every column's i-th byte. */
#define PANEL_NR 16 /* output columns of a panel */
typedef struct { uint16_t d[PANEL_NR]; int8_t qs[QK][PANEL_NR]; } panel_q8_0;
typedef struct { uint16_t d[PANEL_NR], m[PANEL_NR]; uint8_t qs[QK / 2][PANEL_NR]; } panel_q4_1;
_Static_assert(sizeof(panel_q8_0) == 544, "a Q8_0 block panel is 16 d then 32 rows of 16 bytes");
_Static_assert(sizeof(panel_q4_1) == 320, "a Q4_1 block panel is 16 d, 16 m, then 16 rows of 16 bytes");

/* --- the KV cache ------------------------------------------------------------------------------------- */
enum kv_type { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 }; /* kernels/paged_attention.py's KERNEL_KV_TYPES */

/* --- conversions -------------------------------------------------------------------------------------- */

/* float16 to float, exact for every half (subnormals too): F16C's instruction, or in integers only (no
 * subnormal float input, which -ffast-math may flush); the same floats either way. */
static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t em = h & 0x7fffu;
    union { uint32_t u; float f; } v;
    if (em < 0x0400u) v.f = (float)em * 0x1p-24f;            /* zero and subnormals: em * 2^-24 */
    else if (em < 0x7c00u) v.u = (em << 13) + (112u << 23);  /* rebias the exponent from 15 to 127 */
    else v.u = (em << 13) | 0x7f800000u;                     /* inf and NaN */
    v.u |= (uint32_t)(h & 0x8000u) << 16;
    return v.f;
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* float to float16, rounded to nearest even as torch's .to(torch.float16) rounds: subnormal halves below
 * 2^-14, infinity from 65520 on, NaN as 0x7e00. */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (x < 0x33000000u) return (uint16_t)sign; /* at most 2^-25: zero (2^-25 itself ties to even) */
    uint32_t h, rem, half;
    if (x < 0x38800000u) { /* a subnormal half: x's significand over 2^24 units of 2^-24 */
        const uint32_t shift = 126u - (x >> 23), m = (x & 0x7fffffu) | 0x800000u;
        h = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    } else { /* rebias the exponent from 127 to 15; a carry out of the significand moves into it */
        h = (x - 0x38000000u) >> 13, rem = x & 0x1fffu, half = 0x1000u;
    }
    if (rem > half || (rem == half && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

/* float to bfloat16, rounded to nearest even as torch's .to(torch.bfloat16) rounds; NaN as 0x7fc0. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
/* f32_to_bf16 of 16 floats at once. */
static inline __m256i f32x16_to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}
#endif

/* --- horizontal sums ------------------------------------------------------------------------------------
 * Eight lanes in one fixed order, (l0+l4 + l2+l6) + (l1+l5 + l3+l7): what a 256-bit register's halves added,
 * then its 64-bit halves, then its pairs give, so that a vector path and a scalar one sum alike. (The
 * attention kernels sum their own vectors in their own fixed tree: attention_simd.h, hsum16.) */
static inline float hsum8(const float a[8]) {
    const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
    return (s0 + s2) + (s1 + s3);
}

#if defined(__AVX__)
static inline float hsum_m256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* --- e^x ----------------------------------------------------------------------------------------------
 * e^x for x in [-87, 88] (callers clamp): x = k ln2 + r with |r| <= ln2 / 2 (ln2 split in two so that
 * k * hi is exact), e^r by its Taylor series to degree 7 (truncation below 1e-8 relative), times 2^k
 * built in the exponent bits. Branch-free, so the compiler vectorises the loops that call it (given
 * -fno-trapping-math: kernels/fused.py; with trapping math GCC 12 left silu_mul's loop scalar). */
static inline float exp_small(float x) {
    const float k = rintf(x * 1.44269504088896341f);
    const float r = (x - k * 0.693145751953125f) - k * 1.42860682030941723e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale = {(uint32_t)((int32_t)k + 127) << 23};
    return p * scale.f;
}

/* --- entry points ---------------------------------------------------------------------------------------
 * Every function a kernel exports, declared once. The kinds the whole-step kernel calls through its table
 * (decode_step.c's kernels_t) are function types, so a definition that drifts from its kind does not compile. */

/* A matmul in two halves: blocks [i0, i1) of x [m, k] (row stride ldx) into the kernel's buffer... */
typedef void tandem_split_x_fn(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t i0, int64_t i1, void *buf);
/* ...then output columns [i0, i1) of y [m, ldy] from it, over the weight w of type qtype... */
typedef void tandem_matmul_cols_fn(const void *buf, int64_t m, const uint8_t *w, int qtype, int64_t k, int64_t i0,
                                   int64_t i1, float *y, int64_t ldy);
/* ...or the same for rows [r0, r1) only. */
typedef void tandem_matmul_rows_fn(const void *buf, int64_t m, int64_t r0, int64_t r1, const uint8_t *w, int qtype,
                                   int64_t k, int64_t i0, int64_t i1, float *y, int64_t ldy);
typedef void tandem_add_rms_norm_row_fn(float *x, const float *delta, const float *w, float *out, int64_t n,
                                        float eps);
typedef void tandem_silu_mul_row_fn(const float *g, const float *u, float *out, int64_t n);
typedef void tandem_attention_heads_fn(const float *q, const void *kc, const void *vc, int kv_type,
                                       const int32_t *table, int64_t klen, float *out, float *scratch, int nq,
                                       int nkv, int d, int bs, float scale, int h0, int h1);
typedef void tandem_prefill_attention_item_fn(const float *q, int64_t q_tok_stride, const void *kc, const void *vc,
                                              int kv_type, const int32_t *table, int64_t table_stride,
                                              const int64_t *seq_ids, const int64_t *q_starts,
                                              const int64_t *q_lens, const int64_t *seq_lens, float *out, int nq,
                                              int nkv, int d, int bs, float scale, int64_t items, int64_t n,
                                              float *buf);

/* fused.c: the decoder's elementwise work */
tandem_add_rms_norm_row_fn tandem_add_rms_norm_row;
void tandem_add_rms_norm(float *x, int64_t x_stride, const float *delta, int64_t delta_stride, const float *w,
                         float *out, int64_t rows, int64_t n, float eps, int n_threads);
tandem_silu_mul_row_fn tandem_silu_mul_row;
void tandem_silu_mul(const float *gu, int64_t gu_stride, float *out, int64_t rows, int64_t n, int n_threads);
void tandem_rope(const float *x, int64_t x_stride, const float *cos, const float *sin, int64_t cs_stride,
                 float *out, int64_t rows, int64_t nh, int64_t d, int n_threads);
void tandem_argmax(const float *x, int64_t x_stride, int64_t *out, int64_t rows, int64_t n, int n_threads);

/* paged_attention.c: decode rows, a row's head range and the KV store */
int tandem_paged_attention(const float *q, int64_t q_tok_stride, const void *kc, const void *vc, int kv_type,
                           const int32_t *table, int64_t table_stride, const int64_t *rows, const int64_t *seqs,
                           const int64_t *klens, float *out, float *scratch, int64_t scratch_per_thread,
                           int64_t n_rows, int nq, int nkv, int d, int bs, float scale, int n_threads);
tandem_attention_heads_fn tandem_paged_attention_heads;
int64_t tandem_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *kc, float *vc,
                        const int64_t *slots, int64_t t, int64_t row, int64_t n_slots);

/* prefill_attention.c: the tiled causal attention of prefill chunks, over threads or one work item at a time */
int64_t tandem_prefill_items(const int64_t *q_lens, int64_t n_seqs, int nkv);
int64_t tandem_prefill_scratch(int g, int d);
int tandem_prefill_attention_kv(const float *q, int64_t q_tok_stride, const void *kc, const void *vc, int kv_type,
                                const int32_t *table, int64_t table_stride, const int64_t *seq_ids,
                                const int64_t *q_starts, const int64_t *q_lens, const int64_t *seq_lens,
                                int64_t n_seqs, float *out, float *scratch, int nq, int nkv, int d, int bs,
                                float scale, int n_threads);
tandem_prefill_attention_item_fn tandem_prefill_attention_item;
int tandem_prefill_attention(const float *q, int64_t q_tok_stride, const float *kc, const float *vc,
                             const int32_t *table, int64_t table_stride, const int64_t *seq_ids,
                             const int64_t *q_starts, const int64_t *q_lens, const int64_t *seq_lens,
                             int64_t n_seqs, float *out, float *scratch, int nq, int nkv, int d, int bs,
                             float scale, int n_threads);

/* gguf_matmul.c: weight-only matmuls over a GGUF file's blocks */
int tandem_gguf_matmul(const float *x, int64_t ldx, int64_t m, const uint8_t *w, int qtype, int64_t n, int64_t k,
                       float *y, int64_t ldy, int threads);
int64_t tandem_gguf_xq8_bytes(int64_t m, int64_t k);
tandem_split_x_fn tandem_gguf_quantize_x;
tandem_matmul_cols_fn tandem_gguf_matmul_q8_cols;
int tandem_gguf_matmul_q8(const float *x, int64_t ldx, int64_t m, const uint8_t *w, int qtype, int64_t n,
                          int64_t k, float *y, int64_t ldy, int threads);
int tandem_gguf_dequantize(const uint8_t *w, int qtype, int64_t k, const int64_t *rows, int64_t n, float *out,
                           int threads);
int tandem_gguf_simd(void);
int tandem_gguf_vnni(void);

/* panel_matmul.c: float32 matmuls over weights packed in panels of PANEL_NR columns */
int64_t tandem_panel_block_bytes(int qtype);
void tandem_panel_unpack(const uint8_t *w, int qtype, int64_t panels, int64_t k, float *out);
int tandem_panel_tile_cols(void);
int tandem_panel_vector_bits(void);
tandem_split_x_fn tandem_panel_copy_x;
tandem_matmul_cols_fn tandem_panel_matmul_cols;
void tandem_panel_matmul(const float *x, int64_t ldx, int64_t m, const void *w, int qtype, int64_t n, int64_t k,
                         float *y, int64_t ldy, int threads);

/* amx_matmul.c: bfloat16 and split-float32 matmuls on AMX tiles */
int tandem_amx_init(void);
int64_t tandem_amx_x_bytes(int64_t m, int64_t k);
tandem_split_x_fn tandem_amx_copy_x;
tandem_matmul_cols_fn tandem_amx_matmul_cols;
void tandem_amx_matmul(const float *x, int64_t ldx, int64_t m, const uint8_t *w, int64_t n, int64_t k, float *y,
                       int64_t ldy, void *buf, int threads);
int64_t tandem_amx_f32_x_bytes(int64_t m, int64_t k);
tandem_split_x_fn tandem_amx_f32_copy_x;
tandem_matmul_cols_fn tandem_amx_f32_matmul_cols;
tandem_matmul_rows_fn tandem_amx_f32_matmul_rows;
void tandem_amx_f32_matmul(const float *x, int64_t ldx, int64_t m, const uint8_t *w, int qtype, int64_t n, int64_t k,
                           float *y, int64_t ldy, void *buf, int threads);

/* decode_step.c: a whole step of a model in one OpenMP region (its structures are its own) */
struct tandem_step_model;
struct tandem_step;
int tandem_decode_step(const struct tandem_step_model *md, const struct tandem_step *s, int threads);
void tandem_decode_step_store_kv(void *cache, int64_t at, const float *x, int64_t d, int64_t kv_type);

#endif

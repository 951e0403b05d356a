/* tandem's fused CPU kernels for the decoder's elementwise work (see kernels/fused.py, which builds this
 * with kernels/build.py and calls it through ctypes). float32 only; rows are shared out over torch's
 * OpenMP thread pool. Each function does in one pass over a row what torch does in several, with torch's
 * own order of float operations wherever it is observable (docs/architecture.md, "CPU kernels"):
 *   add_rms_norm: x += delta (float adds, as x.add_(delta)); out = (x * rsqrt(mean(x^2) + eps)) * w, the
 *     mean of squares summed in double (exact products, a sum far more accurate than float's), rounded once;
 *   silu_mul: out = (g / (1 + exp(-g))) * u, with an exp within about one ulp of torch's;
 *   rope: out = x * cos + rotate_half(x) * sin as torch's addcmul(x * cos, x.roll(D / 2), sin) computes it
 *     on a CPU with FMA: the product x * cos rounded, then one fused multiply-add. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tandem_kernels.h"

/* Elements per thread below which a row loop stays on the calling thread. A batch-32 decode step's rows
 * (32 x 576 for a norm, 32 x 1536 for SiLU) take 30-40 us on one core; a second thread saves ~half of that
 * on a quiet machine, but where engines share cores a fork and join can wait milliseconds for a
 * descheduled thread. Prefill chunks (thousands of rows) are still split. */
#define MIN_ELEMS_PER_THREAD 65536

static int threads_for(int64_t rows, int64_t n, int n_threads) {
    int64_t useful = rows * n / MIN_ELEMS_PER_THREAD;
    if (useful > rows) useful = rows;
    if (useful < n_threads) n_threads = (int)useful;
    return n_threads < 1 ? 1 : n_threads;
}

/* One row of tandem_add_rms_norm (delta NULL: no add); an entry point of its own for the fused decode step
 * (kernels/decode_step.c), which shares rows out over its threads itself. */
void tandem_add_rms_norm_row(float *x, const float *delta, const float *w, float *out, int64_t n, float eps) {
    if (delta)
        for (int64_t i = 0; i < n; i++) x[i] += delta[i];
    /* Eight independent partial sums in a fixed order: vectorisable without reassociating anything. */
    double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) part[k] += (double)x[i + k] * (double)x[i + k];
    double sum = 0;
    for (int k = 0; k < 8; k++) sum += part[k];
    for (; i < n; i++) sum += (double)x[i] * (double)x[i];
    const float inv = 1.0f / sqrtf((float)(sum / (double)n) + eps);
    for (int64_t j = 0; j < n; j++) out[j] = (x[j] * inv) * w[j];
}

/* x [rows, n] (row stride x_stride) is updated in place with delta [rows, n] (row stride delta_stride;
 * NULL: no add); out [rows, n] contiguous gets the normalised rows times w [n]. */
void tandem_add_rms_norm(float *x, int64_t x_stride, const float *delta, int64_t delta_stride, const float *w,
                         float *out, int64_t rows, int64_t n, float eps, int n_threads) {
    const int nt = threads_for(rows, n, n_threads);
    #pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < rows; r++)
        tandem_add_rms_norm_row(x + r * x_stride, delta ? delta + r * delta_stride : NULL, w, out + r * n, n, eps);
}

/* out [n] = silu(g [n]) * u [n]: one row of tandem_silu_mul, or any run of its columns (the fused decode
 * step's threads take 32 columns at a time). */
void tandem_silu_mul_row(const float *g, const float *u, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        /* Below -88, exp(-g) overflows as torch's does (silu = -0); above 87 it is below float's
         * resolution next to 1. */
        const float m = -g[i] < -87.0f ? -87.0f : -g[i];
        const float e = m > 88.0f ? INFINITY : exp_small(m > 88.0f ? 88.0f : m);
        out[i] = (g[i] / (1.0f + e)) * u[i];
    }
}

/* gu [rows, 2n] (row stride gu_stride) holds gate | up; out [rows, n] contiguous gets silu(gate) * up. */
void tandem_silu_mul(const float *gu, int64_t gu_stride, float *out, int64_t rows, int64_t n, int n_threads) {
    const int nt = threads_for(rows, n, n_threads);
    #pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < rows; r++)
        tandem_silu_mul_row(gu + r * gu_stride, gu + r * gu_stride + n, out + r * n, n);
}

/* One row of tandem_rope: nh heads of x (head stride d) rotated by cos [d] = (cos, cos) and sin [d] =
 * (-sin, sin) into out [nh, d]. */
static void rope_row(const float *x, const float *c, const float *s, float *out, int64_t nh, int64_t d) {
    const int64_t h = d / 2;
    for (int64_t k = 0; k < nh; k++, x += d, out += d) {
        for (int64_t i = 0; i < h; i++) out[i] = fmaf(x[i + h], s[i], x[i] * c[i]);
        for (int64_t i = h; i < d; i++) out[i] = fmaf(x[i - h], s[i], x[i] * c[i]);
    }
}

/* x [rows, nh, d] (row stride x_stride, heads contiguous), cos and sin [rows, d] (row stride cs_stride);
 * out [rows, nh, d] contiguous. */
void tandem_rope(const float *x, int64_t x_stride, const float *cos, const float *sin, int64_t cs_stride,
                 float *out, int64_t rows, int64_t nh, int64_t d, int n_threads) {
    const int nt = threads_for(rows, nh * d, n_threads);
    #pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < rows; r++)
        rope_row(x + r * x_stride, cos + r * cs_stride, sin + r * cs_stride, out + r * nh * d, nh, d);
}

/* Index of a row's largest value as torch.argmax gives it: the first of equal maxima, and the first NaN if
 * there is one (NaN is the largest there). One pass in vectors of ARGMAX_LANES: each lane keeps its largest
 * value and where it first saw it (a strictly larger value replaces them, so a lane keeps the earliest of its
 * equal maxima); then the lanes' best, the earliest place on ties, and the tail past the last whole vector. A
 * NaN anywhere sends the row to a scalar scan for the first one. The vectors are one register wide: without
 * AVX-512, GCC lowers 16-float vectors' compares and selects lane by lane (a batch-32 step's argmax took
 * 8.9 ms on one AVX2 core against 0.27 in vectors of 8). */
#ifdef __AVX512F__
#define ARGMAX_LANES 16
#else
#define ARGMAX_LANES 8
#endif
typedef float vfa __attribute__((vector_size(4 * ARGMAX_LANES)));
typedef int32_t via __attribute__((vector_size(4 * ARGMAX_LANES)));

static int64_t argmax_row(const float *x, int64_t n) {
    const int64_t whole = n / ARGMAX_LANES * ARGMAX_LANES;
    float m = x[0];
    int64_t at = 0;
    int nan = 0;
    if (whole > 0) {
        vfa vm;
        memcpy(&vm, x, sizeof vm);
        via vat, vnan = vm != vm;
        for (int l = 0; l < ARGMAX_LANES; l++) vat[l] = l;
        via idx = vat;
        for (int64_t i = ARGMAX_LANES; i < whole; i += ARGMAX_LANES) {
            vfa v;
            memcpy(&v, x + i, sizeof v);
            idx += ARGMAX_LANES;
            const via gt = v > vm;
            vm = (vfa)(((via)v & gt) | ((via)vm & ~gt));
            vat = (idx & gt) | (vat & ~gt);
            vnan |= v != v;
        }
        m = vm[0];
        at = vat[0];
        for (int l = 0; l < ARGMAX_LANES; l++) {
            nan |= vnan[l] != 0;
            if (vm[l] > m || (vm[l] == m && vat[l] < at)) { m = vm[l]; at = vat[l]; }
        }
    }
    for (int64_t i = whole; i < n; i++) {
        nan |= x[i] != x[i];
        if (x[i] > m) { m = x[i]; at = i; }
    }
    if (nan)
        for (int64_t i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    return at;
}

/* out[r] = argmax of row r of x [rows, n] (row stride x_stride): a greedy step's tokens from its logits. */
void tandem_argmax(const float *x, int64_t x_stride, int64_t *out, int64_t rows, int64_t n, int n_threads) {
    const int nt = threads_for(rows, n, n_threads);
    #pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * x_stride, n);
}

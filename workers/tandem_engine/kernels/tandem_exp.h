/* e^x as a branch-free polynomial, shared by the C kernels that include it (kernels/build.py resolves a
 * quoted #include against this folder and keys each build on the header's text too). */
#ifndef TANDEM_EXP_H
#define TANDEM_EXP_H
#include <math.h>
#include <stdint.h>

/* e^x for x in [-87, 88] (callers clamp): x = k ln2 + r with |r| <= ln2 / 2 (ln2 split in two so that
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

#endif

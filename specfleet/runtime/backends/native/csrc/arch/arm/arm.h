/* AArch64 helpers of specfleet's kernels (csrc/arch/arm/): NEON and the ARMv8.2 dot product (vdotq_s32,
 * -march=armv8.2-a+dotprod; /proc/cpuinfo `asimddp`). Included by the ARM bodies only; the arch-free
 * contract they implement is ../../q_common.h.
 *
 * The contract's eight fp32 lanes are two 128-bit registers here (lanes 0-3, 4-7); every lane takes the
 * generic body's operations in its order (vfmaq_f32 where the generic body calls fmaf, plain vector
 * multiplies and adds elsewhere), so every ARM body gives the generic path's bits. */
#ifndef SPECFLEET_ARM_H
#define SPECFLEET_ARM_H
#include <arm_neon.h>

#include "../../q_common.h"

#ifndef __ARM_FEATURE_DOTPROD
#error "the ARM bodies need the dot product extension: build with -march=armv8.2-a+dotprod"
#endif

/* sf_hsum8 of lanes lo (0-3) and hi (4-7): ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)) */
ALWAYS_INLINE float hsum8(float32x4_t lo, float32x4_t hi) {
    const float32x4_t s = vaddq_f32(lo, hi);
    const float32x2_t t = vadd_f32(vget_low_f32(s), vget_high_f32(s));
    return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}

/* sf_hsum8_pairs: ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)) */
ALWAYS_INLINE float hsum8_pairs(float32x4_t lo, float32x4_t hi) {
    const float32x4_t p = vpaddq_f32(lo, hi);   /* v0+v1, v2+v3, v4+v5, v6+v7 */
    const float32x4_t q = vpaddq_f32(p, p);     /* (v0+v1)+(v2+v3), (v4+v5)+(v6+v7), ... */
    return vgetq_lane_f32(q, 0) + vgetq_lane_f32(q, 1);
}

ALWAYS_INLINE float h2f(uint16_t h) {
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}

/* sf_exp on four lanes: the same clamp (maxnm/minnm give the bound for a NaN, as sf_exp does), rounding
 * and fused multiply-adds */
ALWAYS_INLINE float32x4_t exp4(float32x4_t x) {
    x = vminnmq_f32(vmaxnmq_f32(x, vdupq_n_f32(-87.3f)), vdupq_n_f32(88.3f));
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

/* weights stream from memory: ask for the lines 4 KiB ahead (changes no result) */
ALWAYS_INLINE void stream_ahead(const void *block, int64_t bytes) {
    const char *p = (const char *)block + 4096;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
}

#endif

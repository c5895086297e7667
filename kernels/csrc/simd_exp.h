/* What entropy.c and sample.c both compute with: exp of y <= 0 (y = x - max x), 0 below EXP_LO so that
 * masked tokens (-inf) weigh nothing, as a Cephes-style polynomial on [-ln2/2, ln2/2] times 2^n (relative
 * error about 2e-7), and a lane max. kernels/cbuild.py keys each library by its source and this header. */
#ifndef ENTROPIC_SIMD_EXP_H
#define ENTROPIC_SIMD_EXP_H
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define EXP_LO (-87.0f)
#define EXP_HI (88.0f)

static inline float exp_scalar(float y) {
    if (!(y > EXP_LO)) return 0.0f; /* also -inf and nan-free: masked tokens weigh nothing */
    return expf(y < EXP_HI ? y : EXP_HI);
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* exp(y) for y <= 0 (y = z - max z), 0 below EXP_LO. */
static inline __m256 exp256(__m256 y) {
    const __m256 lo = _mm256_set1_ps(EXP_LO);
    __m256 live = _mm256_cmp_ps(y, lo, _CMP_GT_OQ);
    __m256 x = _mm256_max_ps(y, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), live);
}
#endif
#endif

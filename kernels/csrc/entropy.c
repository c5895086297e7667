/* Exact entropy and log-normalizer of each row of logits, in two passes and no allocation
 * (see kernels/cpu_entropy.py; the torch reference is kernels.entropy.exact_entropy_and_log_norm).
 *
 * For row r, with z = scale[r] * x[r, :], m = max z, y = z - m, e = exp(y), A = sum e, B = sum e y:
 *   H = log A - B / A,   log sum exp z = m + log A.
 * Pass one finds m; pass two accumulates A and B without writing anything. The torch path makes six
 * passes and three row-sized temporaries (shift, clamp, exp, sum, dot product); those temporaries are
 * megabytes per step at a decode batch's vocabulary size.
 *
 * exp is a Cephes-style polynomial on [-ln2/2, ln2/2] times 2^n (relative error about 2e-7, the same
 * as the scalar expf's at float precision); below -87 it gives 0, so masked tokens (-inf) weigh 0 and
 * their 0 * y is taken as 0, as in the reference. Single-threaded: unlike the pruning kernels, which spread
 * over the engine's OpenMP threads (decode_attention.c), it has not been measured to gain from them.
 * AVX2/FMA when the build machine has them (kernels/cbuild.py picks the flags), else scalar C.
 */
#include "simd_exp.h"

#if defined(__AVX2__) && defined(__FMA__)
static inline double hsum256d(__m256 v) {
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    __m256d s = _mm256_add_pd(lo, hi);
    __m128d t = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
    return _mm_cvtsd_f64(t) + _mm_cvtsd_f64(_mm_unpackhi_pd(t, t));
}
#endif

static float row_max(const float *x, int64_t vocab, float s) {
    float m = -INFINITY;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 a = _mm256_set1_ps(-INFINITY), b = a;
    for (; i + 16 <= vocab; i += 16) {
        a = _mm256_max_ps(a, _mm256_loadu_ps(x + i));
        b = _mm256_max_ps(b, _mm256_loadu_ps(x + i + 8));
    }
    m = hmax256(_mm256_max_ps(a, b));
#endif
    for (; i < vocab; i++) m = x[i] > m ? x[i] : m;
    return s * m; /* scale > 0, so the max of the scaled row is the scaled max */
}

/* Returns 0, or -1 when some scale is not positive (the caller then uses the torch path). */
int entropic_row_entropy(const float *logits, int64_t rows, int64_t vocab, int64_t stride, const float *scale,
                         float *entropy, float *log_norm) {
    for (int64_t r = 0; r < rows; r++)
        if (!(scale[r] > 0.0f)) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * stride;
        const float s = scale[r];
        const float m = row_max(x, vocab, s);
        if (!(m > -INFINITY) || m == INFINITY) { /* all masked, or an overflow: no distribution to measure */
            entropy[r] = NAN;
            log_norm[r] = m;
            continue;
        }
        double a = 0.0, b = 0.0;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m), lo = _mm256_set1_ps(EXP_LO);
        /* float lanes over blocks of 4096, summed into doubles per block: float error stays ~1e-6 */
        while (i + 32 <= vocab) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
            int64_t end = i + 4096 < vocab ? i + 4096 : vocab;
            for (; i + 16 <= end; i += 16) {
                __m256 y0 = _mm256_fmsub_ps(_mm256_loadu_ps(x + i), vs, vm);
                __m256 y1 = _mm256_fmsub_ps(_mm256_loadu_ps(x + i + 8), vs, vm);
                __m256 e0 = exp256(y0), e1 = exp256(y1);
                a0 = _mm256_add_ps(a0, e0);
                a1 = _mm256_add_ps(a1, e1);
                b0 = _mm256_fmadd_ps(e0, _mm256_max_ps(y0, lo), b0); /* e = 0 where y is -inf: 0, not nan */
                b1 = _mm256_fmadd_ps(e1, _mm256_max_ps(y1, lo), b1);
            }
            a += hsum256d(_mm256_add_ps(a0, a1));
            b += hsum256d(_mm256_add_ps(b0, b1));
        }
#endif
        for (; i < vocab; i++) {
            float y = s * x[i] - m;
            float e = exp_scalar(y);
            a += e;
            b += e > 0.0f ? (double)e * y : 0.0;
        }
        entropy[r] = (float)(log(a) - b / a);
        log_norm[r] = (float)(m + log(a));
    }
    return 0;
}

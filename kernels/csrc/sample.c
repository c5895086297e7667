/* One categorical draw from each row's softmax, by inverse CDF (see kernels/cpu_sample.py).
 *
 * For row r with m = max x, e_i = exp(x_i - m) and A = sum e: the token is the first i whose running sum of
 * e passes u * A, for one uniform u in [0, 1) made from seeds[r] by SplitMix64. That is an exact draw from
 * softmax(x) up to float rounding, as vLLM's Gumbel-max is; it takes one exp per token where Gumbel-max
 * takes a random number and two logs per token.
 *
 * Two passes and one exp per token: pass one finds m; pass two sums e over blocks of BLOCK tokens and keeps
 * each block's sum (in ``block_sums``, vocab / BLOCK floats per call, given by the caller); then the block
 * sums are walked in double up to u * A, and only the block where the running sum passes it has its
 * weights computed again (by the same code) and added one by one. The running sum over blocks adds the very block sums A was added from, in
 * the same order, so it reaches A at the last block: with u < 1 the walk always ends in a block. Inside
 * it, float rounding between the block's sum and its terms added one by one can leave u * A unpassed; the
 * block's last token with a nonzero weight is then taken. Tokens whose weight is 0 (-inf logits: masked,
 * and everything below exp's range under the max) are never taken.
 *
 * exp is the polynomial of simd_exp.h, as in entropy.c. Single-threaded, like entropy.c: the engine's OpenMP pool owns the
 * cores. AVX2/FMA when the build machine has them (kernels/cbuild.py picks the flags), else scalar C.
 */
#include "simd_exp.h"

#define BLOCK 16

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

static uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static float row_max(const float *x, int64_t vocab) {
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
    return m;
}

/* The weights exp(x_i - m) of tokens [start, end), end - start <= BLOCK, into e; returns their sum, added
 * in a fixed order. Pass two and the walk both call it, so a block's weights are the same in each. */
static inline float block_weights(const float *x, int64_t start, int64_t end, float m, float *e) {
#if defined(__AVX2__) && defined(__FMA__)
    if (end - start == BLOCK) {
        const __m256 vm = _mm256_set1_ps(m);
        __m256 e0 = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + start), vm));
        __m256 e1 = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + start + 8), vm));
        _mm256_storeu_ps(e, e0);
        _mm256_storeu_ps(e + 8, e1);
        return hsum256(_mm256_add_ps(e0, e1));
    }
#endif
    float s = 0.0f;
    for (int64_t i = start; i < end; i++) s += (e[i - start] = exp_scalar(x[i] - m));
    return s;
}

/* Returns 0, or -1 when some row has no distribution to draw from (every logit -inf, a +inf or a nan):
 * the caller then leaves the batch to vLLM's sampler. */
int entropic_sample_rows(const float *logits, int64_t rows, int64_t vocab, int64_t stride, const uint64_t *seeds,
                         float *block_sums, int64_t *out) {
    const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * stride;
        const float m = row_max(x, vocab);
        if (!(m > -INFINITY) || m == INFINITY) return -1;
        float e[BLOCK];
        double total = 0.0;
        for (int64_t b = 0; b < blocks; b++) {
            int64_t start = b * BLOCK, end = start + BLOCK < vocab ? start + BLOCK : vocab;
            block_sums[b] = block_weights(x, start, end, m, e);
            total += block_sums[b];
        }
        if (!(total > 0.0) || !isfinite(total)) return -1; /* a nan logit poisons the sum */
        const double u = (double)(splitmix64(seeds[r]) >> 11) * 0x1.0p-53; /* [0, 1) */
        const double target = u * total;
        double run = 0.0;
        int64_t b = 0;
        while (b < blocks - 1 && run + block_sums[b] <= target) run += block_sums[b++];
        int64_t start = b * BLOCK, end = start + BLOCK < vocab ? start + BLOCK : vocab, pick = -1;
        block_weights(x, start, end, m, e);
        for (int64_t i = start; i < end; i++) {
            if (e[i - start] > 0.0f) {
                pick = i;
                run += e[i - start];
                if (run > target) break;
            }
        }
        if (pick < 0) return -1; /* cannot happen: this block's sum was positive */
        out[r] = pick;
    }
    return 0;
}

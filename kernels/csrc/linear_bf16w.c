// A float32 linear layer whose weights are stored as bfloat16: y[m, n] = sum_k x[m, k] * w[n, k] + bias[n].
//
// For the few rows of a decode step a linear layer is a pass over its weights, and its time is the bytes it
// reads: float32 weights that a bfloat16 checkpoint widened hold the same values in twice the bytes. Each
// weight is widened back to float32 as it is read (bf16 is the high half of an IEEE float32) and every product
// and sum is float32, as in a float32 GEMM; only the order of the sums differs.
//
// The weights are packed once (entropic_pack_bf16w) in panels of NP output columns: panel p holds, for each k,
// the NP weights w[p NP .. p NP + NP - 1, k] side by side, so a pass streams memory in order and each k costs one
// load of NP weights, one broadcast of x[m, k] per row and NP / 8 multiply-adds per row, with no reduction
// across lanes at the end. Columns past N in the last panel are zero.
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define NP 16  // output columns per panel: two AVX2 vectors
#define MR 6   // rows per pass: MR x 2 accumulators, 2 weight vectors and one broadcast (15 of AVX2's 16)

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// w [N, K] bf16 bits, row-major, into packed [ceil(N / NP), K, NP].
void entropic_pack_bf16w(const uint16_t *w, int64_t N, int64_t K, uint16_t *packed) {
    int64_t panels = (N + NP - 1) / NP;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NP; j++) {
                int64_t n = p * NP + j;
                packed[(p * K + k) * NP + j] = n < N ? w[n * K + k] : 0;
            }
}

#ifdef __AVX2__
#define PREFETCH_AHEAD 32  // k steps (1 KiB) ahead along the panel, beside the hardware prefetcher

// One pass of R rows (a constant in each instance, so the accumulators stay in registers) over a panel.
#define PANEL_ROWS(R)                                                                                           \
    static void panel_rows_##R(const float *x, int64_t ldx, int64_t K, const uint16_t *panel,                 \
                               float acc[MR][NP]) {                                                             \
        __m256 a0[R], a1[R];                                                                                    \
        for (int i = 0; i < R; i++) a0[i] = a1[i] = _mm256_setzero_ps();                                        \
        for (int64_t k = 0; k < K; k++) {                                                                       \
            _mm_prefetch((const char *)(panel + (k + PREFETCH_AHEAD) * NP), _MM_HINT_T0);                       \
            __m256i h = _mm256_loadu_si256((const __m256i *)(panel + k * NP));                                  \
            __m256 w0 = _mm256_castsi256_ps(                                                                    \
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));                       \
            __m256 w1 = _mm256_castsi256_ps(                                                                    \
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));                  \
            for (int i = 0; i < R; i++) {                                                                       \
                __m256 v = _mm256_broadcast_ss(x + i * ldx + k);                                                \
                a0[i] = _mm256_fmadd_ps(v, w0, a0[i]);                                                          \
                a1[i] = _mm256_fmadd_ps(v, w1, a1[i]);                                                          \
            }                                                                                                   \
        }                                                                                                       \
        for (int i = 0; i < R; i++) {                                                                           \
            _mm256_storeu_ps(acc[i], a0[i]);                                                                    \
            _mm256_storeu_ps(acc[i] + 8, a1[i]);                                                                \
        }                                                                                                       \
    }
PANEL_ROWS(1)
PANEL_ROWS(2)
PANEL_ROWS(3)
PANEL_ROWS(4)
PANEL_ROWS(5)
PANEL_ROWS(6)
#endif

// Rows m0 .. m0 + mb - 1 (mb <= MR) of one panel's NP columns, into acc[mb][NP].
static void panel_rows(const float *x, int64_t ldx, int64_t m0, int64_t mb, int64_t K, const uint16_t *panel,
                       float acc[MR][NP]) {
    const float *x0 = x + m0 * ldx;
#ifdef __AVX2__
    switch (mb) {
        case 1: panel_rows_1(x0, ldx, K, panel, acc); return;
        case 2: panel_rows_2(x0, ldx, K, panel, acc); return;
        case 3: panel_rows_3(x0, ldx, K, panel, acc); return;
        case 4: panel_rows_4(x0, ldx, K, panel, acc); return;
        case 5: panel_rows_5(x0, ldx, K, panel, acc); return;
        default: panel_rows_6(x0, ldx, K, panel, acc); return;
    }
#else
    for (int i = 0; i < mb; i++) {
        for (int j = 0; j < NP; j++) acc[i][j] = 0.0f;
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < NP; j++) acc[i][j] += x0[i * ldx + k] * bf16_to_f32(panel[k * NP + j]);
    }
#endif
}

// x [M, K] float32 rows ldx apart; packed from entropic_pack_bf16w; bias [N] or NULL; y [M, N] rows ldy apart.
// threads: the engine's OpenMP threads, split over panels.
void entropic_linear_bf16w(const float *x, int64_t ldx, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
                           const float *bias, float *y, int64_t ldy, int threads) {
    int64_t panels = (N + NP - 1) / NP;
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        const uint16_t *panel = packed + p * K * NP;
        int64_t n0 = p * NP, nb = N - n0 < NP ? N - n0 : NP;
        // passes of equal size (8 rows: 4 + 4, not 6 + 2): a pass of few rows is bound by its multiply-adds'
        // latency, not their count
        int64_t passes = (M + MR - 1) / MR, per = (M + passes - 1) / passes;
        for (int64_t m0 = 0; m0 < M; m0 += per) {
            int64_t mb = M - m0 < per ? M - m0 : per;
            float acc[MR][NP];
            panel_rows(x, ldx, m0, mb, K, panel, acc);
            for (int64_t i = 0; i < mb; i++) {
                float *yi = y + (m0 + i) * ldy + n0;
                for (int64_t j = 0; j < nb; j++) yi[j] = acc[i][j] + (bias ? bias[n0 + j] : 0.0f);
            }
        }
    }
}

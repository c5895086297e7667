// A float32 linear layer whose weights are stored as bfloat16: y[m, n] = sum_k x[m, k] * w[n, k] + bias[n].
//
// For the few rows of a decode step a linear layer is a pass over its weights, and its time is the bytes it
// reads: float32 weights that a bfloat16 checkpoint widened hold the same values in twice the bytes. Each
// weight is widened back to float32 as it is read (bf16 is the high half of an IEEE float32) and every product
// and sum is float32, as in a float32 GEMM; only the order of the sums differs.
//
// The weights are packed once (entropic_pack_bf16w) in panels of NP output columns, NP = two vectors of float32
// lanes (16 with AVX2, 32 with AVX-512): for each k a panel holds its NP weights as NP / 2 pairs, pair j being
// the weights of columns j and j + NP / 2. A vector load of a panel's k step then widens to float32 in two
// operations, a shift of each pair's low half into the high half (columns 0 .. NP / 2 - 1) and a mask of its
// low half (the others), so a pass streams memory in order and each k costs one load, those two operations, and
// one broadcast and two multiply-adds per row, with no reduction across lanes at the end. Columns past N in the
// last panel are zero.
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define NP 32  // output columns per panel: two AVX-512 vectors
#define MR 12  // rows per pass: MR x 2 accumulators and 2 weight vectors of the 32 registers (broadcasts from memory)
#else
#define NP 16  // two AVX2 vectors
#define MR 6   // MR x 2 accumulators, 2 weight vectors and one broadcast (15 of AVX2's 16 registers)
#endif
#define HALF (NP / 2)

// The panel width the library was built with (the caller sizes the packed weights by it).
int entropic_bf16w_panel(void) { return NP; }

// Rows per step up to which this build runs a float32 engine's linear layers faster than vLLM's oneDNN float32
// GEMM, with a margin (docs/results/README.md, bf16 decode weights): past them a pass of MR rows over a panel
// is bound by its multiply-adds, which a GEMM that reuses each weight across more rows does with fewer loads.
int entropic_bf16w_rows(void) {
#if defined(__AVX512F__)
    return 64;
#elif defined(__AVX2__)
    return 12;
#else
    return 0;
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// w [N, K] bf16 bits, row-major, into packed [ceil(N / NP), K, NP] (pairs as above).
void entropic_pack_bf16w(const uint16_t *w, int64_t N, int64_t K, uint16_t *packed) {
    int64_t panels = (N + NP - 1) / NP;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NP; j++) {
                int64_t n = p * NP + (j % 2 ? HALF : 0) + j / 2;
                packed[(p * K + k) * NP + j] = n < N ? w[n * K + k] : 0;
            }
}

#if defined(__AVX512F__) || defined(__AVX2__)
#define PREFETCH_AHEAD (1024 / (NP * 2))  // k steps 1 KiB ahead along the panel, beside the hardware prefetcher

#if defined(__AVX512F__)
typedef __m512 vec;
typedef __m512i ivec;
#define LOADI(p) _mm512_loadu_si512((const void *)(p))
#define LOW_HALVES(h) _mm512_castsi512_ps(_mm512_slli_epi32(h, 16))
#define HIGH_HALVES(h) _mm512_castsi512_ps(_mm512_and_si512(h, _mm512_set1_epi32((int)0xFFFF0000u)))
#define BROADCAST(p) _mm512_set1_ps(*(p))
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define ZERO() _mm512_setzero_ps()
#define STORE(p, v) _mm512_storeu_ps(p, v)
#else
typedef __m256 vec;
typedef __m256i ivec;
#define LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define LOW_HALVES(h) _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
#define HIGH_HALVES(h) _mm256_castsi256_ps(_mm256_and_si256(h, _mm256_set1_epi32((int)0xFFFF0000u)))
#define BROADCAST(p) _mm256_broadcast_ss(p)
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define ZERO() _mm256_setzero_ps()
#define STORE(p, v) _mm256_storeu_ps(p, v)
#endif

// One pass of R rows (a constant in each instance, so the accumulators stay in registers) over a panel.
#define PANEL_ROWS(R)                                                                                           \
    static void panel_rows_##R(const float *x, int64_t ldx, int64_t K, const uint16_t *panel,                 \
                               float acc[MR][NP]) {                                                             \
        vec a0[R], a1[R];                                                                                       \
        for (int i = 0; i < R; i++) a0[i] = a1[i] = ZERO();                                                     \
        for (int64_t k = 0; k < K; k++) {                                                                       \
            _mm_prefetch((const char *)(panel + (k + PREFETCH_AHEAD) * NP), _MM_HINT_T0);                       \
            ivec h = LOADI(panel + k * NP);                                                                     \
            vec w0 = LOW_HALVES(h), w1 = HIGH_HALVES(h);                                                        \
            for (int i = 0; i < R; i++) {                                                                       \
                vec v = BROADCAST(x + i * ldx + k);                                                             \
                a0[i] = FMA(v, w0, a0[i]);                                                                      \
                a1[i] = FMA(v, w1, a1[i]);                                                                      \
            }                                                                                                   \
        }                                                                                                       \
        for (int i = 0; i < R; i++) {                                                                           \
            STORE(acc[i], a0[i]);                                                                               \
            STORE(acc[i] + HALF, a1[i]);                                                                        \
        }                                                                                                       \
    }
PANEL_ROWS(1)
PANEL_ROWS(2)
PANEL_ROWS(3)
PANEL_ROWS(4)
PANEL_ROWS(5)
PANEL_ROWS(6)
#if MR > 6
PANEL_ROWS(7)
PANEL_ROWS(8)
PANEL_ROWS(9)
PANEL_ROWS(10)
PANEL_ROWS(11)
PANEL_ROWS(12)
#endif
#endif

// Rows m0 .. m0 + mb - 1 (mb <= MR) of one panel's NP columns, into acc[mb][NP] in column order.
static void panel_rows(const float *x, int64_t ldx, int64_t m0, int64_t mb, int64_t K, const uint16_t *panel,
                       float acc[MR][NP]) {
    const float *x0 = x + m0 * ldx;
#if defined(__AVX512F__) || defined(__AVX2__)
    switch (mb) {
        case 1: panel_rows_1(x0, ldx, K, panel, acc); return;
        case 2: panel_rows_2(x0, ldx, K, panel, acc); return;
        case 3: panel_rows_3(x0, ldx, K, panel, acc); return;
        case 4: panel_rows_4(x0, ldx, K, panel, acc); return;
        case 5: panel_rows_5(x0, ldx, K, panel, acc); return;
#if MR > 6
        case 6: panel_rows_6(x0, ldx, K, panel, acc); return;
        case 7: panel_rows_7(x0, ldx, K, panel, acc); return;
        case 8: panel_rows_8(x0, ldx, K, panel, acc); return;
        case 9: panel_rows_9(x0, ldx, K, panel, acc); return;
        case 10: panel_rows_10(x0, ldx, K, panel, acc); return;
        case 11: panel_rows_11(x0, ldx, K, panel, acc); return;
        default: panel_rows_12(x0, ldx, K, panel, acc); return;
#else
        default: panel_rows_6(x0, ldx, K, panel, acc); return;
#endif
    }
#else
    for (int i = 0; i < mb; i++) {
        for (int j = 0; j < NP; j++) acc[i][j] = 0.0f;
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < NP; j++)
                acc[i][(j % 2 ? HALF : 0) + j / 2] += x0[i * ldx + k] * bf16_to_f32(panel[k * NP + j]);
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

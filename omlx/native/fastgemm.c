/* Small-batch float32 matmul for MLX's CPU backend, bit-identical to OpenBLAS.
 *
 * MLX calls cblas_sgemm for every float32 matmul. A decode step multiplies a few
 * rows (one per sequence) by each weight: C (M x N) = A (M x K) . B^T, B the
 * weight (N x K, row-major). OpenBLAS handles that like a big GEMM: it copies
 * (packs) the whole weight on every call, so at M = 8 it moves the weights about
 * three times and reaches ~10 GB/s here. This kernel streams each weight once.
 *
 * Results are identical to OpenBLAS's, bit for bit: OpenBLAS sums each output
 * element as one fused multiply-add chain per K block (blocks of its GEMM_Q,
 * halved when less than two are left) and adds the blocks in order. Each vector
 * lane here is one output element running that same chain. The block rule is not
 * assumed: on first use the library compares itself with OpenBLAS on probe
 * problems and only takes over calls when one rule reproduces every bit.
 *
 * Small problems (M * N <= 1200, M * N * K <= 1e6, K >= 32: at one or two rows,
 * most of a layer's projections) OpenBLAS gives to its small-matrix kernel, which
 * sums differently: each output is a dot product in 16 lanes (lane l takes
 * k = l, l + 16, ..., one fused multiply-add chain; the last partial block's
 * missing lanes get 0 * 0), then the lanes are added in a fixed tree. That
 * kernel runs on one thread; here the same sums run on every core. It too is
 * proven on probe problems before it takes a call, separately from the rule
 * above.
 *
 * Everything else (other shapes, layouts, types) goes to OpenBLAS unchanged.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_KERNEL 1
#else
#define HAVE_KERNEL 0
#endif

#ifndef OPENBLAS_PATH
#define OPENBLAS_PATH "libopenblas.so.0"
#endif

enum { RowMajor = 101 };
enum { NoTrans = 111, Trans = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float*, int, const float*,
                         int, float, float*, int);

#define MAX_ROWS 16   /* two 8-lane groups */
#define MAX_BLOCKS 64

static sgemm_fn real_sgemm;
static int block_q, block_u; /* calibrated K-block rule; 0 = fast path off */
static int small_on;         /* the small-matrix order reproduced */
static char status[200] = "not initialised";
static pthread_once_t once = PTHREAD_ONCE_INIT;
static unsigned long long num_fast, num_small, num_forwarded;

/* OpenBLAS's K split: GEMM_Q while at least two are left, else the rest halved
 * (rounded up to u) when it exceeds GEMM_Q. */
static int k_blocks(int k, int q, int u, int* out) {
    int n = 0;
    for (int ls = 0; ls < k;) {
        int ml = k - ls;
        if (ml >= 2 * q)
            ml = q;
        else if (ml > q)
            ml = ((ml / 2 + u - 1) / u) * u;
        if (n == MAX_BLOCKS) return -1;
        out[n++] = ml;
        ls += ml;
    }
    return n;
}

#if HAVE_KERNEL
/* One output element per lane: lane m of a chain is C[m, n + j], a fused
 * multiply-add chain over one K block, in order, as OpenBLAS runs it. */
static void block_chains(const float* at, const float* const* w, int k0, int k1, __m256* sum) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    for (int k = k0; k < k1; k++) {
        __m256 x = _mm256_loadu_ps(at + (size_t)k * 8);
        a0 = _mm256_fmadd_ps(x, _mm256_broadcast_ss(w[0] + k), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_broadcast_ss(w[1] + k), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_broadcast_ss(w[2] + k), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_broadcast_ss(w[3] + k), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_broadcast_ss(w[4] + k), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_broadcast_ss(w[5] + k), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_broadcast_ss(w[6] + k), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_broadcast_ss(w[7] + k), a7);
    }
    sum[0] = _mm256_add_ps(sum[0], a0);
    sum[1] = _mm256_add_ps(sum[1], a1);
    sum[2] = _mm256_add_ps(sum[2], a2);
    sum[3] = _mm256_add_ps(sum[3], a3);
    sum[4] = _mm256_add_ps(sum[4], a4);
    sum[5] = _mm256_add_ps(sum[5], a5);
    sum[6] = _mm256_add_ps(sum[6], a6);
    sum[7] = _mm256_add_ps(sum[7], a7);
}

/* Columns [n0, n1) of C, eight weight rows at a time; every group of eight rows
 * of A (packed by pack_rows) reuses them while they are in L1. */
static void columns(const float* at, int M, const float* b, int ldb, float* c, int ldc,
                    float beta, int n0, int n1, const int* blocks, int nblocks, int K) {
    for (int n = n0; n < n1; n += 8) {
        int width = n1 - n < 8 ? n1 - n : 8;
        const float* w[8];
        for (int j = 0; j < 8; j++) w[j] = b + (size_t)(n + (j < width ? j : 0)) * ldb;
        for (int g = 0; g * 8 < M; g++) {
            int rows = M - g * 8 < 8 ? M - g * 8 : 8;
            float* cg = c + (size_t)g * 8 * ldc;
            float out[8][8];
            __m256 sum[8];
            for (int j = 0; j < 8; j++) {
                for (int m = 0; m < 8; m++)
                    out[j][m] = beta != 0.0f && m < rows && j < width ? cg[(size_t)m * ldc + n + j]
                                                                       : 0.0f;
                sum[j] = _mm256_loadu_ps(out[j]);
            }
            const float* ag = at + (size_t)g * K * 8;
            for (int bi = 0, k0 = 0; bi < nblocks; k0 += blocks[bi++])
                block_chains(ag, w, k0, k0 + blocks[bi], sum);
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(out[j], sum[j]);
            for (int m = 0; m < rows; m++)
                for (int j = 0; j < width; j++) cg[(size_t)m * ldc + n + j] = out[j][m];
        }
    }
}

/* A's rows packed per group of 8 as at[k * 8 + lane] (zeros past M). */
static float* pack_rows(int M, int K, const float* a, int lda) {
    static __thread float* buf;
    static __thread size_t cap;
    size_t need = (size_t)2 * K * 8;
    if (need > cap) {
        free(buf);
        buf = malloc(need * sizeof(float));
        cap = buf ? need : 0;
        if (!buf) return NULL;
    }
    for (int g = 0; g * 8 < M; g++) {
        float* pack = buf + (size_t)g * K * 8;
        int rows = M - g * 8 < 8 ? M - g * 8 : 8;
        for (int k = 0; k < K; k++)
            for (int m = 0; m < 8; m++)
                pack[(size_t)k * 8 + m] = m < rows ? a[(size_t)(g * 8 + m) * lda + k] : 0.0f;
    }
    return buf;
}

static int fast_sgemm(int M, int N, int K, const float* a, int lda, const float* b, int ldb,
                      float beta, float* c, int ldc, int q, int u) {
    int blocks[MAX_BLOCKS];
    int nblocks = k_blocks(K, q, u, blocks);
    const float* at = nblocks > 0 ? pack_rows(M, K, a, lda) : NULL;
    if (!at) return 0;
    int big = (size_t)N * K >= 65536;
#pragma omp parallel if (big)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int per = ((N + nt - 1) / nt + 7) / 8 * 8;
        int n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        if (n0 < n1) columns(at, M, b, ldb, c, ldc, beta, n0, n1, blocks, nblocks, K);
    }
    return 1;
}

/* ---- OpenBLAS's small-matrix kernel order -------------------------------- */

/* Its sum of 16 lane totals when it reduces four outputs at once (groups of four
 * lanes, then the four group sums pairwise). */
static inline float sum_by_fours(const float* p) {
    float g0 = (p[0] + p[1]) + (p[2] + p[3]);
    float g1 = (p[4] + p[5]) + (p[6] + p[7]);
    float g2 = (p[8] + p[9]) + (p[10] + p[11]);
    float g3 = (p[12] + p[13]) + (p[14] + p[15]);
    return (g0 + g1) + (g2 + g3);
}

/* Its sum for a lone output (_mm512_reduce_add_ps: halves folded onto each other). */
static inline float sum_by_halves(const float* p) {
    float h[8], q[4];
    for (int i = 0; i < 8; i++) h[i] = p[i] + p[i + 8];
    for (int i = 0; i < 4; i++) q[i] = h[i] + h[i + 4];
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* Outputs C[m, n] for n in [n0, n1), every m: 16 lane chains each, four rows of A
 * against one weight row at a time. The kernel reduces by fours every output
 * except those in both the last N % 4 weight rows and the last M % 4 rows. */
static void small_columns(int M, int N, int K, const float* a, int lda, const float* b,
                          int ldb, float beta, float* c, int ldc, int n0, int n1) {
    int k16 = K & ~15, rem = K - k16;
    int n4 = N & ~3, m4 = M & ~3;
    for (int n = n0; n < n1; n++) {
        const float* w = b + (size_t)n * ldb;
        float wt[16] = {0};
        for (int i = 0; i < rem; i++) wt[i] = w[k16 + i];
        for (int m0 = 0; m0 < M; m0 += 4) {
            int rows = M - m0 < 4 ? M - m0 : 4;
            __m256 lo[4], hi[4];
            for (int r = 0; r < 4; r++) lo[r] = hi[r] = _mm256_setzero_ps();
            for (int k = 0; k < k16; k += 16) {
                __m256 wl = _mm256_loadu_ps(w + k), wh = _mm256_loadu_ps(w + k + 8);
                for (int r = 0; r < rows; r++) {
                    const float* x = a + (size_t)(m0 + r) * lda + k;
                    lo[r] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x), lo[r]);
                    hi[r] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x + 8), hi[r]);
                }
            }
            for (int r = 0; r < rows; r++) {
                int m = m0 + r;
                if (rem) {
                    float xt[16] = {0};
                    const float* x = a + (size_t)m * lda + k16;
                    for (int i = 0; i < rem; i++) xt[i] = x[i];
                    __m256 wl = _mm256_loadu_ps(wt), wh = _mm256_loadu_ps(wt + 8);
                    lo[r] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xt), lo[r]);
                    hi[r] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xt + 8), hi[r]);
                }
                float p[16];
                _mm256_storeu_ps(p, lo[r]);
                _mm256_storeu_ps(p + 8, hi[r]);
                float sum = n < n4 || m < m4 ? sum_by_fours(p) : sum_by_halves(p);
                float* out = c + (size_t)m * ldc + n;
                *out = beta != 0.0f ? sum + *out : sum;
            }
        }
    }
}

static void small_sgemm(int M, int N, int K, const float* a, int lda, const float* b, int ldb,
                        float beta, float* c, int ldc) {
    int big = (size_t)N * K >= 65536;
#pragma omp parallel if (big)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int per = (N + nt - 1) / nt;
        int n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        if (n0 < n1) small_columns(M, N, K, a, lda, b, ldb, beta, c, ldc, n0, n1);
    }
}
#endif

/* ---- calibration: which K-block rule reproduces OpenBLAS here ---------- */

static float probe_value(unsigned* state) {
    *state = *state * 1664525u + 1013904223u;
    return (float)((int)(*state >> 9) - (1 << 22)) / (float)(1 << 20);
}

#if HAVE_KERNEL
/* Probe problems (rows, K, N) whose K values tell the block rules apart, each
 * with beta 0 and 1; OpenBLAS's answers are computed once. */
static const int probes[][3] = {{8, 2000, 152}, {2, 330, 608}, {5, 1536, 256}, {16, 700, 80},
                                {1, 1536, 1240}, {1, 1536, 1024}, {3, 24, 100}};
#define NUM_PROBES 7

/* Inside the small-matrix range: N or M not multiples of 4 (both sum trees),
 * K with and without a partial last block of 16, one and many rows. */
static const int small_probes[][3] = {{1, 576, 576}, {2, 1536, 192}, {3, 64, 77}, {5, 40, 203},
                                      {7, 100, 150}, {16, 33, 75}, {1, 1536, 651}};
#define NUM_SMALL 7

static void probe_c(int p, int beta, float* c) {
    unsigned st = 7u + 2u * p + beta;
    for (int i = 0; i < probes[p][0] * probes[p][2]; i++) c[i] = probe_value(&st);
}

/* Does the (q, u) rule give OpenBLAS's bits on every probe? The first probe
 * alone rules out almost every wrong rule, cheaply. */
static int rule_matches(int q, int u, const float* a, const float* b, float* const* want,
                        float* got) {
    for (int p = 0; p < NUM_PROBES; p++) {
        int M = probes[p][0], K = probes[p][1], N = probes[p][2];
        for (int beta = 0; beta < 2; beta++) {
            probe_c(p, beta, got);
            if (!fast_sgemm(M, N, K, a, K, b, K, (float)beta, got, N, q, u)) return 0;
            if (memcmp(want[2 * p + beta], got, sizeof(float) * M * N) != 0) return 0;
        }
    }
    return 1;
}

/* Does the small-matrix path give OpenBLAS's bits on every small probe? */
static int small_matches(const float* a, const float* b, float* want, float* got) {
    for (int p = 0; p < NUM_SMALL; p++) {
        int M = small_probes[p][0], K = small_probes[p][1], N = small_probes[p][2];
        for (int beta = 0; beta < 2; beta++) {
            unsigned st = 101u + 2u * p + beta, st2 = st;
            for (int i = 0; i < M * N; i++) want[i] = probe_value(&st);
            for (int i = 0; i < M * N; i++) got[i] = probe_value(&st2);
            real_sgemm(RowMajor, NoTrans, Trans, M, N, K, 1.0f, a, K, b, K, (float)beta, want, N);
            small_sgemm(M, N, K, a, K, b, K, (float)beta, got, N);
            if (memcmp(want, got, sizeof(float) * M * N) != 0) return 0;
        }
    }
    return 1;
}

static void calibrate(void) {
    int max_k = 0, max_n = 0, num_out = 0;
    for (int p = 0; p < NUM_PROBES; p++) {
        max_k = probes[p][1] > max_k ? probes[p][1] : max_k;
        max_n = probes[p][2] > max_n ? probes[p][2] : max_n;
        num_out += 2 * probes[p][0] * probes[p][2];
    }
    float* a = malloc(sizeof(float) * MAX_ROWS * max_k);
    float* b = malloc(sizeof(float) * max_n * max_k);
    float* got = malloc(sizeof(float) * MAX_ROWS * max_n);
    float* wants = malloc(sizeof(float) * num_out);
    float* want[2 * NUM_PROBES];
    if (!a || !b || !got || !wants) {
        free(a), free(b), free(got), free(wants);
        return;
    }
    unsigned st = 1u;
    for (int i = 0; i < MAX_ROWS * max_k; i++) a[i] = probe_value(&st);
    for (int i = 0; i < max_n * max_k; i++) b[i] = probe_value(&st);
    for (int p = 0; p < NUM_PROBES; p++)
        for (int beta = 0; beta < 2; beta++) {
            int M = probes[p][0], K = probes[p][1], N = probes[p][2];
            float* w = want[2 * p + beta] = wants;
            wants += M * N;
            probe_c(p, beta, w);
            real_sgemm(RowMajor, NoTrans, Trans, M, N, K, 1.0f, a, K, b, K, (float)beta, w, N);
        }
    /* Common GEMM_Q values first, then every other. */
    static const int usual[] = {320, 256, 384, 512, 128, 192, 224, 240, 288, 352, 448, 640, 768};
    static const int us[] = {1, 2, 4, 8, 16, 32};
    int num_usual = sizeof usual / sizeof usual[0];
    for (int i = 0; i < num_usual + 1024 && !block_q; i++) {
        int q = i < num_usual ? usual[i] : i - num_usual;
        if (q < 16) continue;
        for (int j = 0; j < 6 && !block_q; j++)
            if (rule_matches(q, us[j], a, b, want, got)) block_q = q, block_u = us[j];
    }
    small_on = small_matches(a, b, want[0], got);
    free(want[0]), free(a), free(b), free(got);
}
#endif

static void init(void) {
    void* lib = dlopen(OPENBLAS_PATH, RTLD_NOW | RTLD_LOCAL);
    real_sgemm = lib ? (sgemm_fn)dlsym(lib, "cblas_sgemm") : NULL;
    if (!real_sgemm) real_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    if (!real_sgemm) {
        /* Nothing to forward to: every matmul would be wrong, so stop loudly. */
        fprintf(stderr, "omlx fastgemm: no cblas_sgemm in %s: %s\n", OPENBLAS_PATH, dlerror());
        abort();
    }
    const char* env = getenv("OMLX_FASTGEMM");
    if (env && strcmp(env, "0") == 0) {
        snprintf(status, sizeof status, "off (OMLX_FASTGEMM=0)");
        return;
    }
#if HAVE_KERNEL
    calibrate();
    const char* small = small_on ? "its small-matrix sums too" : "small-matrix calls forwarded";
    if (block_q)
        snprintf(status, sizeof status, "on (OpenBLAS K blocks of %d, halves rounded to %d; %s)",
                 block_q, block_u, small);
    else if (small_on)
        snprintf(status, sizeof status,
                 "on (its small-matrix sums only: no K-block rule reproduces this OpenBLAS)");
    else
        snprintf(status, sizeof status, "off (no K-block rule reproduces this OpenBLAS)");
#else
    snprintf(status, sizeof status, "off (built without AVX2/FMA)");
#endif
}

/* Where OpenBLAS uses its small-matrix kernel for this layout (its own summation
 * order): M * N <= 1200, M * N * K <= 1e6 and K >= 32. */
static int small_range(int M, int N, int K) {
    long long mn = (long long)M * N;
    return mn <= 1200 && mn * K <= 1000000 && K >= 32;
}

void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float* a,
                 int lda, const float* b, int ldb, float beta, float* c, int ldc) {
    pthread_once(&once, init);
#if HAVE_KERNEL
    if (order == RowMajor && ta == NoTrans && tb == Trans && alpha == 1.0f &&
        (beta == 0.0f || beta == 1.0f) && M >= 1 && M <= MAX_ROWS && N >= 1) {
        if (small_range(M, N, K)) {
            if (small_on) {
                small_sgemm(M, N, K, a, lda, b, ldb, beta, c, ldc);
                __atomic_add_fetch(&num_small, 1, __ATOMIC_RELAXED);
                return;
            }
        } else if (block_q && K >= 16 &&
                   fast_sgemm(M, N, K, a, lda, b, ldb, beta, c, ldc, block_q, block_u)) {
            __atomic_add_fetch(&num_fast, 1, __ATOMIC_RELAXED);
            return;
        }
    }
#endif
    __atomic_add_fetch(&num_forwarded, 1, __ATOMIC_RELAXED);
    real_sgemm(order, ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* For omlx.blas: what the library decided, and how many calls took each way. */
const char* omlx_fastgemm_status(void) {
    pthread_once(&once, init);
    return status;
}

void omlx_fastgemm_counts(unsigned long long* fast, unsigned long long* forwarded) {
    *fast = __atomic_load_n(&num_fast, __ATOMIC_RELAXED);
    *forwarded = __atomic_load_n(&num_forwarded, __ATOMIC_RELAXED);
}

/* Calls that ran the small-matrix sums (not included in the fast count). */
unsigned long long omlx_fastgemm_small_count(void) {
    return __atomic_load_n(&num_small, __ATOMIC_RELAXED);
}

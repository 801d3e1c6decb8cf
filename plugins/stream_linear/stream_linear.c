/* y = x @ W^T (+ bias) for the CPU target forward, streaming each weight once per call for all of x's rows
 * (plugins/stream_linear/native.py says why).
 *
 * The kernel reads weights packed in panels of PW = 2 * LANES outputs (spectree_stream_pack makes them from the
 * row-major [out, in] weights; outputs past `out` are zero). Per panel and input k:
 *   FMT_F32   float32: the panel's PW values, output j at j
 *   FMT_BF16  bfloat16: output j at slot 2 j, output LANES + j at slot 2 j + 1, so that one load widens to the
 *             panel's two vectors by a shift and a mask (exact, on any x86 vector unit)
 *   FMT_Q8    int8 in blocks of Q_BLOCK inputs, one float32 scale per output and block: w = d * q (GGUF Q8_0's layout
 *             with its float16 scale widened): the panel's PW values, output j at j; scales [panel, block, PW]
 *   FMT_Q4    4-bit in blocks of Q_BLOCK inputs, a float32 scale and minimum per output and block: w = d * q + m,
 *             q in 0..15 (GGUF's Q4_1): LANES bytes, byte j holding output j in its low nibble and output LANES + j in
 *             its high one; scales and minimums [panel, block, PW]
 * The packer's source layouts (native.py's BlockWeight): [out, in] float32 / bfloat16 / int8; Q4 [out, in / 2]
 * bytes, a block's byte j holding input j in its low nibble and input j + 16 in its high one; scales [out, blocks].
 * Activations are float32 in the sums (bfloat16 inputs widened; a bfloat16 output rounded to nearest even once).
 *
 * Batch invariance by construction: y[r, o] is one fixed sequence of float32 operations on x[r] and W[o] alone. A
 * (row, output) pair is one vector lane whose sum takes the inputs k = 0, 1, 2, ... in order, one multiply-add each
 * (quantised formats: a block's products summed in order into a block sum that starts at zero, then added to the
 * row's sum as one multiply-add by the block scale, for Q4 one more by the block minimum times the sum of the
 * block's inputs), then the bias. No lane sums and no tails: tiles of several rows and panels only share loads
 * between accumulators. So one row alone, a tree of 16 and a prompt chunk of 500 give a row the same bits, and the
 * AVX-512 and AVX2 routes agree with each other (a lane's operations do not depend on the vector width); the portable
 * route, for CPUs without FMA, rounds each product before adding it. Built with -ffp-contract=off so that the compiler
 * keeps that split where it is written. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../bf16.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define FMT_F32 0
#define FMT_BF16 1
#define FMT_Q8 2
#define FMT_Q4 3
#define Q_BLOCK 32

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
#define MAX_ROWS 8 /* rows per tile: 2 * MAX_ROWS accumulators of the 32 vector registers */
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vbroadcast(const float *p) { return _mm512_set1_ps(*p); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline void vload_bf16_pair(const uint16_t *p, vf *lo, vf *hi) {
    __m512i w = _mm512_loadu_si512((const void *)p);
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    *hi = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
}
static inline void vload_i8_pair(const int8_t *p, vf *lo, vf *hi) {
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + LANES))));
}
static inline void vload_u4_pair(const uint8_t *p, vf *lo, vf *hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
#define MAX_ROWS 6 /* 12 accumulators, two weight vectors and a broadcast of the 16 registers */
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vbroadcast(const float *p) { return _mm256_broadcast_ss(p); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline void vload_bf16_pair(const uint16_t *p, vf *lo, vf *hi) {
    __m256i w = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline void vload_i8_pair(const int8_t *p, vf *lo, vf *hi) {
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + LANES))));
}
static inline void vload_u4_pair(const uint8_t *p, vf *lo, vf *hi) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#else
/* portable: GCC vector extensions, multiply then add (two roundings; -ffp-contract=off keeps them apart) */
#define LANES 8
#define MAX_ROWS 4
typedef float vf __attribute__((vector_size(32)));
static inline vf vzero(void) { return (vf){0}; }
static inline vf vbroadcast(const float *p) { return (vf){0} + *p; }
static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf a) { memcpy(p, &a, sizeof a); }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline void vload_bf16_pair(const uint16_t *p, vf *lo, vf *hi) {
    for (int i = 0; i < LANES; i++) {
        (*lo)[i] = bf16_to_f32(p[2 * i]);
        (*hi)[i] = bf16_to_f32(p[2 * i + 1]);
    }
}
static inline void vload_i8_pair(const int8_t *p, vf *lo, vf *hi) {
    for (int i = 0; i < LANES; i++) {
        (*lo)[i] = (float)p[i];
        (*hi)[i] = (float)p[LANES + i];
    }
}
static inline void vload_u4_pair(const uint8_t *p, vf *lo, vf *hi) {
    for (int i = 0; i < LANES; i++) {
        (*lo)[i] = (float)(p[i] & 15);
        (*hi)[i] = (float)(p[i] >> 4);
    }
}
#endif

#define PW (2 * LANES)  /* outputs per panel */
#define GROUP 4         /* panels a thread takes at a time: their weights stay in cache for all of a call's row tiles */
#define ROW_BLOCK 64    /* rows whose inputs stay in cache while the weights stream past them */

/* A weight as packed, and where its panels start. */
typedef struct {
    int fmt;
    const void *data;
    const float *scale;    /* Q8 / Q4: [panels, blocks, PW] */
    const float *minimum;  /* Q4 */
    int64_t in;
} weights_t;

static inline int64_t panel_bytes(int fmt, int64_t in) {
    switch (fmt) {
    case FMT_F32: return in * PW * 4;
    case FMT_BF16: return in * PW * 2;
    case FMT_Q8: return in * PW;
    }
    return in * PW / 2;
}

/* The rows' inputs: `xs` float32, row r at xs + r * stride; Q4: `xsum` the sums of each block's inputs, in order,
 * [rows, blocks]. */
typedef struct {
    const float *xs;
    int64_t stride;
    const float *xsum;
} inputs_t;

/* acc[p][r][h] += the panels p0.. p0+NP-1 of w times rows r0.. r0+R-1, h the panel's half (outputs j, LANES + j).
 * One function per (format, R, NP), the loops over the tile fully unrolled so the accumulators live in registers. */
#define UNROLL _Pragma("GCC unroll 16")

/* The panel's two vectors at input k (outputs j and LANES + j), whatever the format (quantised: before the scale). */
static inline __attribute__((always_inline)) void weights_at(const char *panel, int64_t k, const int fmt, vf *lo,
                                                             vf *hi) {
    switch (fmt) {
    case FMT_F32:
        *lo = vload((const float *)panel + k * PW);
        *hi = vload((const float *)panel + k * PW + LANES);
        break;
    case FMT_BF16: vload_bf16_pair((const uint16_t *)panel + k * PW, lo, hi); break;
    case FMT_Q8: vload_i8_pair((const int8_t *)panel + k * PW, lo, hi); break;
    default: vload_u4_pair((const uint8_t *)panel + k * LANES, lo, hi);
    }
}

/* acc[p][r][h] += x[r][xk] * the panels' weights at input k. One row: the input broadcast once, then each panel's
 * weights loaded and used at once; several rows: the panels' weights loaded once, then each row's input broadcast and
 * used at once (so that no more vectors are live than registers hold). */
static inline __attribute__((always_inline)) void step(const char *base, int64_t pstride, int64_t k, const float *xs,
                                                       int64_t xstride, int64_t xk, const int R, const int NP,
                                                       const int fmt, vf acc[GROUP][MAX_ROWS][2]) {
    if (R == 1) {
        const vf xb = vbroadcast(xs + xk);
        UNROLL for (int p = 0; p < NP; p++) {
            vf lo, hi;
            weights_at(base + p * pstride, k, fmt, &lo, &hi);
            acc[p][0][0] = vfma(xb, lo, acc[p][0][0]);
            acc[p][0][1] = vfma(xb, hi, acc[p][0][1]);
        }
        return;
    }
    vf lo[GROUP], hi[GROUP];
    UNROLL for (int p = 0; p < NP; p++) weights_at(base + p * pstride, k, fmt, &lo[p], &hi[p]);
    UNROLL for (int r = 0; r < R; r++) {
        const vf xb = vbroadcast(xs + r * xstride + xk);
        UNROLL for (int p = 0; p < NP; p++) {
            acc[p][r][0] = vfma(xb, lo[p], acc[p][r][0]);
            acc[p][r][1] = vfma(xb, hi[p], acc[p][r][1]);
        }
    }
}

static inline __attribute__((always_inline)) void tile(const weights_t *w, int64_t p0, const inputs_t *x, int64_t r0,
                                                       const int R, const int NP, const int fmt,
                                                       float *out /* [NP][R][PW] */) {
    vf acc[GROUP][MAX_ROWS][2];
    UNROLL for (int p = 0; p < NP; p++) UNROLL for (int r = 0; r < R; r++) acc[p][r][0] = acc[p][r][1] = vzero();
    const int64_t in = w->in, blocks = in / Q_BLOCK;
    const float *xs = x->xs + r0 * x->stride;
    const int64_t pstride = panel_bytes(fmt, in), xstride = x->stride;
    const char *base = (const char *)w->data + p0 * pstride;
    if (fmt == FMT_F32 || fmt == FMT_BF16) {
        for (int64_t k = 0; k < in; k++) step(base, pstride, k, xs, xstride, k, R, NP, fmt, acc);
    } else {
        for (int64_t b = 0; b < blocks; b++) {
            vf s[GROUP][MAX_ROWS][2];
            UNROLL for (int p = 0; p < NP; p++) UNROLL for (int r = 0; r < R; r++) s[p][r][0] = s[p][r][1] = vzero();
            for (int64_t k = b * Q_BLOCK; k < (b + 1) * Q_BLOCK; k++) step(base, pstride, k, xs, xstride, k, R, NP, fmt, s);
            UNROLL for (int p = 0; p < NP; p++) {
                const float *d = w->scale + ((p0 + p) * blocks + b) * PW;
                const vf d0 = vload(d), d1 = vload(d + LANES);
                UNROLL for (int r = 0; r < R; r++) {
                    acc[p][r][0] = vfma(s[p][r][0], d0, acc[p][r][0]);
                    acc[p][r][1] = vfma(s[p][r][1], d1, acc[p][r][1]);
                }
                if (fmt == FMT_Q4) {
                    const float *m = w->minimum + ((p0 + p) * blocks + b) * PW;
                    const vf m0 = vload(m), m1 = vload(m + LANES);
                    UNROLL for (int r = 0; r < R; r++) {
                        const vf xsum = vbroadcast(x->xsum + (r0 + r) * blocks + b);
                        acc[p][r][0] = vfma(m0, xsum, acc[p][r][0]);
                        acc[p][r][1] = vfma(m1, xsum, acc[p][r][1]);
                    }
                }
            }
        }
    }
    UNROLL for (int p = 0; p < NP; p++) UNROLL for (int r = 0; r < R; r++) {
        vstore(out + (p * R + r) * PW, acc[p][r][0]);
        vstore(out + (p * R + r) * PW + LANES, acc[p][r][1]);
    }
}

typedef void (*tile_fn)(const weights_t *, int64_t, const inputs_t *, int64_t, float *);
#define TILE_FN(R, NP)                                                                                               \
    static void tile_##R##_##NP(const weights_t *w, int64_t p0, const inputs_t *x, int64_t r0, float *out) {        \
        switch (w->fmt) {                                                                                            \
        case FMT_F32: tile(w, p0, x, r0, R, NP, FMT_F32, out); break;                                                \
        case FMT_BF16: tile(w, p0, x, r0, R, NP, FMT_BF16, out); break;                                              \
        case FMT_Q8: tile(w, p0, x, r0, R, NP, FMT_Q8, out); break;                                                  \
        default: tile(w, p0, x, r0, R, NP, FMT_Q4, out);                                                             \
        }                                                                                                            \
    }
TILE_FN(1, 4)
TILE_FN(1, 2)
TILE_FN(1, 1)
TILE_FN(2, 2)
TILE_FN(2, 1)
TILE_FN(3, 1)
TILE_FN(4, 1)
#if MAX_ROWS >= 6
TILE_FN(5, 1)
TILE_FN(6, 1)
#endif
#if MAX_ROWS >= 8
TILE_FN(7, 1)
TILE_FN(8, 1)
#endif

/* The tile for R rows and at most `avail` panels, and (in *np) how many panels it takes: enough accumulators to hide
 * the multiply-add latency (one row: four panels, two rows: two), few enough to stay in registers. */
static tile_fn pick(int R, int avail, int *np) {
    if (R == 1) {
        *np = avail >= 4 ? 4 : avail >= 2 ? 2 : 1;
        return *np == 4 ? tile_1_4 : *np == 2 ? tile_1_2 : tile_1_1;
    }
    if (R == 2) {
        *np = avail >= 2 ? 2 : 1;
        return *np == 2 ? tile_2_2 : tile_2_1;
    }
    *np = 1;
    switch (R) {
    case 3: return tile_3_1;
    case 4: return tile_4_1;
#if MAX_ROWS >= 6
    case 5: return tile_5_1;
    case 6: return tile_6_1;
#endif
#if MAX_ROWS >= 8
    case 7: return tile_7_1;
    case 8: return tile_8_1;
#endif
    }
    return 0;
}

int spectree_stream_lanes(void) { return LANES; }
int spectree_stream_panel(void) { return PW; }

/* Packs the row-major weight `src` ([out, in], the layouts of the header; Q8 / Q4 with scale / minimum [out, blocks])
 * into `dst` (panel_bytes per panel) and, for Q8 / Q4, `dscale` / `dmin` ([panels, blocks, PW] float32). */
void spectree_stream_pack(int fmt, const void *src, const float *scale, const float *minimum, int64_t out, int64_t in,
                          void *dst, float *dscale, float *dmin) {
    const int64_t panels = (out + PW - 1) / PW, blocks = in / Q_BLOCK;
    memset(dst, 0, (size_t)(panels * panel_bytes(fmt, in)));
    for (int64_t o = 0; o < out; o++) {
        const int64_t p = o / PW, j = o % PW;
        char *panel = (char *)dst + p * panel_bytes(fmt, in);
        for (int64_t k = 0; k < in; k++) {
            switch (fmt) {
            case FMT_F32: ((float *)panel)[k * PW + j] = ((const float *)src)[o * in + k]; break;
            case FMT_BF16:
                ((uint16_t *)panel)[k * PW + (j < LANES ? 2 * j : 2 * (j - LANES) + 1)] =
                    ((const uint16_t *)src)[o * in + k];
                break;
            case FMT_Q8: ((int8_t *)panel)[k * PW + j] = ((const int8_t *)src)[o * in + k]; break;
            default: {
                const uint8_t byte = ((const uint8_t *)src)[(o * in + k - k % Q_BLOCK) / 2 + k % (Q_BLOCK / 2)];
                const uint8_t q = k % Q_BLOCK < Q_BLOCK / 2 ? byte & 15 : byte >> 4;
                ((uint8_t *)panel)[k * LANES + j % LANES] |= (uint8_t)(j < LANES ? q : q << 4);
            }
            }
        }
        if (fmt == FMT_Q8 || fmt == FMT_Q4)
            for (int64_t b = 0; b < blocks; b++) {
                dscale[(p * blocks + b) * PW + j] = scale[o * blocks + b];
                if (fmt == FMT_Q4) dmin[(p * blocks + b) * PW + j] = minimum[o * blocks + b];
            }
    }
    if (fmt == FMT_Q8 || fmt == FMT_Q4)
        for (int64_t o = out; o < panels * PW; o++)
            for (int64_t b = 0; b < blocks; b++) {
                dscale[((o / PW) * blocks + b) * PW + o % PW] = 0.0f;
                if (fmt == FMT_Q4) dmin[((o / PW) * blocks + b) * PW + o % PW] = 0.0f;
            }
}

/* y[r, o] for r < rows, o < out. x: `rows` rows of `in` float32 (x_bf16 = 0) or bfloat16 inputs, row r at
 * x + r * x_stride elements; w: packed (spectree_stream_pack); y: [rows, out] contiguous, float32 or bfloat16
 * (y_bf16); bias: [out] float32 or NULL. Returns 0, or -1 when the float32 copy of a bfloat16 x cannot be
 * allocated. */
int spectree_stream_linear(const void *x, int x_bf16, int64_t rows, int64_t in, int64_t x_stride, int fmt,
                           const void *wdata, const float *scale, const float *minimum, int64_t out,
                           const float *bias, void *y, int y_bf16) {
    const float *xs = (const float *)x;
    float *copy = NULL;
    int64_t xs_stride = x_stride;
    if (x_bf16) {
        copy = (float *)malloc((size_t)(rows * in) * sizeof(float));
        if (!copy) return -1;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < in; i++) copy[r * in + i] = bf16_to_f32(((const uint16_t *)x)[r * x_stride + i]);
        xs = copy;
        xs_stride = in;
    }
    const int64_t blocks = in / Q_BLOCK;
    float *xsum = NULL;
    if (fmt == FMT_Q4) {
        xsum = (float *)malloc((size_t)(rows * blocks) * sizeof(float));
        if (!xsum) {
            free(copy);
            return -1;
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t b = 0; b < blocks; b++) {
                float t = 0.0f;
                for (int i = 0; i < Q_BLOCK; i++) t += xs[r * xs_stride + b * Q_BLOCK + i];
                xsum[r * blocks + b] = t;
            }
    }
    const inputs_t inputs = {xs, xs_stride, xsum};
    const weights_t w = {fmt, wdata, scale, minimum, in};
    const int64_t panels = (out + PW - 1) / PW;
    for (int64_t rb = 0; rb < rows; rb += ROW_BLOCK) {
        const int64_t n = rows - rb < ROW_BLOCK ? rows - rb : ROW_BLOCK;
        const int64_t tiles = (n + MAX_ROWS - 1) / MAX_ROWS; /* balanced: sizes differ by at most one row */
#pragma omp parallel if (out * in * (n < 8 ? n : 8) >= 65536)
        {
            /* each thread one contiguous range of panels, so that a one-row call splits evenly */
            int64_t t = 0, nt = 1;
#ifdef _OPENMP
            t = omp_get_thread_num();
            nt = omp_get_num_threads();
#endif
            const int64_t q0 = panels * t / nt, q1 = panels * (t + 1) / nt;
            float sums[GROUP * MAX_ROWS * PW];
            for (int64_t g0 = q0; g0 < q1; g0 += GROUP) {
                const int64_t g1 = g0 + GROUP < q1 ? g0 + GROUP : q1;
                int64_t r0 = rb;
                for (int64_t ti = 0; ti < tiles; ti++) {
                    const int R = (int)(n / tiles + (ti < n % tiles));
                    for (int64_t p0 = g0; p0 < g1;) {
                        int np;
                        pick(R, (int)(g1 - p0), &np)(&w, p0, &inputs, r0, sums);
                        for (int p = 0; p < np; p++)
                            for (int r = 0; r < R; r++)
                                for (int j = 0; j < PW && (p0 + p) * PW + j < out; j++) {
                                    const int64_t o = (p0 + p) * PW + j;
                                    float v = sums[(p * R + r) * PW + j];
                                    if (bias) v += bias[o];
                                    elem_store(y, (r0 + r) * out + o, v, y_bf16);
                                }
                        p0 += np;
                    }
                    r0 += R;
                }
            }
        }
    }
    free(copy);
    free(xsum);
    return 0;
}

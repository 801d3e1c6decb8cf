/* y = x @ W^T (+ bias) for the CPU target forward, streaming each weight row once per call for all of x's rows
 * (plugins/stream_linear/native.py says why).
 *
 * Weights, row-major [out, in]:
 *   FMT_F32   float32
 *   FMT_BF16  bfloat16 (widened to float32 by a shift: exact, and cheap on any x86 vector unit)
 *   FMT_Q8    int8 in blocks of Q_BLOCK inputs, one float32 scale per block: w[o, i] = d[o, i / Q_BLOCK] * q[o, i]
 *             (the layout of GGUF's Q8_0 with its float16 scale widened)
 *   FMT_Q4    4-bit in blocks of Q_BLOCK inputs, a float32 scale and minimum per block: w = d * q + m, q in 0..15;
 *             a block's 16 bytes hold input j in the low nibble of byte j and input j + 16 in the high nibble
 *             (GGUF's Q4_1 with its float16 scale and minimum widened)
 * Activations are float32 in the sums (bfloat16 inputs widened; a bfloat16 output rounded to nearest even once).
 *
 * Batch invariance by construction: the value of y[r, o] is a function of x[r] and W[o] alone. Every (row, output)
 * pair has one vector accumulator whose lanes take the inputs i = lane (mod LANES) in increasing i, one fused
 * multiply-add per chunk of LANES inputs (quantised formats: a block's products summed in a block accumulator, then
 * added to the row's as one fused multiply-add by the block scale); the lanes are then summed in one fixed order, the
 * inputs past the last whole chunk added one by one, then the bias. Tiles of several rows and outputs only share
 * loads between accumulators, they never change one's sequence of operations: one row alone, a tree of 16 and a
 * prompt chunk of 500 give each row the same bits. Build with -ffp-contract=off: the compiler must not fuse (or not
 * fuse) differently in different tile shapes. Results differ between instruction sets (LANES), not between calls. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../bf16.h"

#define FMT_F32 0
#define FMT_BF16 1
#define FMT_Q8 2
#define FMT_Q4 3
#define Q_BLOCK 32


#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
#define TILE_ROWS 4
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float s) { return _mm512_set1_ps(s); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vload_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 32 4-bit values of a Q4 block as two vectors: inputs 0..15 (low nibbles), 16..31 (high nibbles) */
static inline void vload_q4(const uint8_t *p, vf *lo, vf *hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline float vsum(vf a) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); /* AVX512F only */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), hi);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
#define TILE_ROWS 4
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float s) { return _mm256_set1_ps(s); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vload_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline float vsum(vf a) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}
#else
/* portable: GCC vector extensions, multiply then add (two roundings; -ffp-contract=off keeps them apart) */
#define LANES 8
#define TILE_ROWS 2
typedef float vf __attribute__((vector_size(32)));
static inline vf vzero(void) { return (vf){0}; }
static inline vf vset1(float s) { return (vf){s, s, s, s, s, s, s, s}; }
static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf vload_bf16(const uint16_t *p) {
    vf v;
    for (int i = 0; i < LANES; i++) v[i] = bf16_to_f32(p[i]);
    return v;
}
static inline vf vload_i8(const int8_t *p) {
    vf v;
    for (int i = 0; i < LANES; i++) v[i] = (float)p[i];
    return v;
}
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline float vsum(vf a) {
    float h0 = (a[0] + a[4]) + (a[2] + a[6]), h1 = (a[1] + a[5]) + (a[3] + a[7]);
    return h0 + h1;
}
#endif

#if LANES == 8 /* a Q4 block's 16 bytes as four 8-input vectors: inputs 0-7, 8-15 (low nibbles), 16-23, 24-31 */
static inline void vload_q4_8(const uint8_t *p, vf out[4]) {
    for (int half = 0; half < 2; half++) {
#if defined(__AVX2__)
        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * half)));
        out[half] = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
        out[2 + half] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
#else
        for (int i = 0; i < 8; i++) {
            out[half][i] = (float)(p[8 * half + i] & 15);
            out[2 + half][i] = (float)(p[8 * half + i] >> 4);
        }
#endif
    }
}
#endif

/* The weights' row `o` as the kernel reads it (bytes per row, block arrays per row). */
typedef struct {
    int fmt;
    const void *data;      /* [out, in] f32 / bf16 / int8; Q4: [out, in / 2] bytes */
    const float *scale;    /* Q8 / Q4: [out, in / Q_BLOCK] */
    const float *minimum;  /* Q4: [out, in / Q_BLOCK] */
    int64_t in;
} weights_t;

/* Sums for a tile of TO outputs x TR rows: acc[o][r] = x[r] . W[o0 + o] over the whole chunks; `xs` the rows'
 * float32 inputs, `xstride` between them; results into sums[o * TR + r] (before the tail and bias). One function per
 * format and tile shape (TILE_FN below), the loops over the tile fully unrolled, so the accumulators live in
 * registers. */
#define UNROLL _Pragma("GCC unroll 16")

static inline __attribute__((always_inline)) void tile_dense(const weights_t *w, int64_t o0, const float *xs,
                                                             int64_t xstride, const int TO, const int TR,
                                                             const int bf16, float *sums) {
    vf acc[8][TILE_ROWS];
    UNROLL for (int o = 0; o < TO; o++) UNROLL for (int r = 0; r < TR; r++) acc[o][r] = vzero();
    const int64_t in = w->in, whole = in - in % LANES;
    const float *wf = (const float *)w->data + o0 * in;
    const uint16_t *wh = (const uint16_t *)w->data + o0 * in;
    const char *ahead = (const char *)w->data + (o0 + 2 * TO) * in * (bf16 ? 2 : 4);
    const int64_t step = TO * LANES * (bf16 ? 2 : 4);
    for (int64_t i = 0; i < whole; i += LANES) {
        vf xv[TILE_ROWS];
        for (int64_t off = 0; off < step; off += 64) __builtin_prefetch(ahead + i / LANES * step + off, 0, 3);
        UNROLL for (int r = 0; r < TR; r++) xv[r] = vload(xs + r * xstride + i);
        UNROLL for (int o = 0; o < TO; o++) {
            vf wv = bf16 ? vload_bf16(wh + o * in + i) : vload(wf + o * in + i);
            UNROLL for (int r = 0; r < TR; r++) acc[o][r] = vfma(xv[r], wv, acc[o][r]);
        }
    }
    UNROLL for (int o = 0; o < TO; o++) UNROLL for (int r = 0; r < TR; r++) sums[o * TR + r] = vsum(acc[o][r]);
}

static inline __attribute__((always_inline)) void tile_q8(const weights_t *w, int64_t o0, const float *xs,
                                                          int64_t xstride, const int TO, const int TR, float *sums) {
    vf acc[8][TILE_ROWS];
    UNROLL for (int o = 0; o < TO; o++) UNROLL for (int r = 0; r < TR; r++) acc[o][r] = vzero();
    const int64_t in = w->in, blocks = in / Q_BLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        UNROLL for (int o = 0; o < TO; o++) {
            const int8_t *q = (const int8_t *)w->data + (o0 + o) * in + b * Q_BLOCK;
            vf qv[Q_BLOCK / LANES];
            UNROLL for (int c = 0; c < Q_BLOCK / LANES; c++) qv[c] = vload_i8(q + c * LANES);
            const vf d = vset1(w->scale[(o0 + o) * blocks + b]);
            UNROLL for (int r = 0; r < TR; r++) {
                const float *x = xs + r * xstride + b * Q_BLOCK;
                vf s = vmul(vload(x), qv[0]);
                UNROLL for (int c = 1; c < Q_BLOCK / LANES; c++) s = vfma(vload(x + c * LANES), qv[c], s);
                acc[o][r] = vfma(s, d, acc[o][r]);
            }
        }
    }
    UNROLL for (int o = 0; o < TO; o++) UNROLL for (int r = 0; r < TR; r++) sums[o * TR + r] = vsum(acc[o][r]);
}

/* FMT_Q4: sum(w * x) = d * sum(q * x) + m * sum(x) per block; sum(x) over a block's inputs (`xsum`, per row and
 * block, computed once per call) enters as a scalar fused multiply-add after the vector sum, blocks in order. */
static inline __attribute__((always_inline)) void tile_q4(const weights_t *w, int64_t o0, const float *xs,
                                                          int64_t xstride, const float *xsum, int64_t xsum_stride,
                                                          const int TO, const int TR, float *sums) {
    vf acc[8][TILE_ROWS];
    float macc[8][TILE_ROWS];
    UNROLL for (int o = 0; o < TO; o++) UNROLL for (int r = 0; r < TR; r++) {
        acc[o][r] = vzero();
        macc[o][r] = 0.0f;
    }
    const int64_t in = w->in, blocks = in / Q_BLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        UNROLL for (int o = 0; o < TO; o++) {
            const uint8_t *q = (const uint8_t *)w->data + ((o0 + o) * in + b * Q_BLOCK) / 2;
            vf qv[Q_BLOCK / LANES];
#if LANES == 16
            vload_q4(q, &qv[0], &qv[1]);
#else
            vload_q4_8(q, qv);
#endif
            const float dm = w->scale[(o0 + o) * blocks + b], mm = w->minimum[(o0 + o) * blocks + b];
            const vf d = vset1(dm);
            UNROLL for (int r = 0; r < TR; r++) {
                const float *x = xs + r * xstride + b * Q_BLOCK;
                vf s = vmul(vload(x), qv[0]);
                UNROLL for (int c = 1; c < Q_BLOCK / LANES; c++) s = vfma(vload(x + c * LANES), qv[c], s);
                acc[o][r] = vfma(s, d, acc[o][r]);
                macc[o][r] = fmaf(mm, xsum[r * xsum_stride + b], macc[o][r]);
            }
        }
    }
    UNROLL for (int o = 0; o < TO; o++) UNROLL for (int r = 0; r < TR; r++)
        sums[o * TR + r] = vsum(acc[o][r]) + macc[o][r];
}

/* Outputs per tile for a tile of `tr` rows: enough accumulators to hide the fused multiply-add latency, few enough
 * to stay in registers. */
#if LANES == 16
#define TO_FOR(tr) ((tr) == 1 ? 8 : 4)
#else
#define TO_FOR(tr) ((tr) == 1 ? 8 : (tr) == 2 ? 4 : 3)
#endif

typedef struct {
    const float *xs;      /* the rows' float32 inputs */
    int64_t xs_stride;
    const float *xsum;    /* Q4: per row and block, the sum of the block's inputs */
    int64_t xsum_stride;
} inputs_t;

typedef void (*tile_fn)(const weights_t *, int64_t, const inputs_t *, int64_t, float *);

#define TILE_FN(TO, TR)                                                                                              \
    static void tile_##TO##_##TR(const weights_t *w, int64_t o0, const inputs_t *x, int64_t r0, float *s) {          \
        const float *xs = x->xs + r0 * x->xs_stride;                                                                \
        switch (w->fmt) {                                                                                            \
        case FMT_F32: tile_dense(w, o0, xs, x->xs_stride, TO, TR, 0, s); break;                                      \
        case FMT_BF16: tile_dense(w, o0, xs, x->xs_stride, TO, TR, 1, s); break;                                     \
        case FMT_Q8: tile_q8(w, o0, xs, x->xs_stride, TO, TR, s); break;                                             \
        default: tile_q4(w, o0, xs, x->xs_stride, x->xsum + r0 * x->xsum_stride, x->xsum_stride, TO, TR, s);         \
        }                                                                                                            \
    }
TILE_FN(8, 1)
TILE_FN(1, 1)
TILE_FN(4, 2)
TILE_FN(1, 2)
#if TILE_ROWS >= 3
TILE_FN(1, 3)
#if LANES == 16
TILE_FN(4, 3)
TILE_FN(4, 4)
TILE_FN(1, 4)
#else
TILE_FN(3, 3)
TILE_FN(3, 4)
TILE_FN(1, 4)
#endif
#endif

static tile_fn pick(int to, int tr) {
    if (to == 1) {
        switch (tr) {
        case 1: return tile_1_1;
        case 2: return tile_1_2;
#if TILE_ROWS >= 3
        case 3: return tile_1_3;
#endif
#if TILE_ROWS >= 4
        case 4: return tile_1_4;
#endif
        }
    }
    switch (tr) {
    case 1: return tile_8_1;
    case 2: return tile_4_2;
#if TILE_ROWS >= 3
#if LANES == 16
    case 3: return tile_4_3;
    case 4: return tile_4_4;
#else
    case 3: return tile_3_3;
    case 4: return tile_3_4;
#endif
#endif
    }
    return 0;
}

static inline float weight_at(const weights_t *w, int64_t o, int64_t i) {
    switch (w->fmt) {
    case FMT_F32: return ((const float *)w->data)[o * w->in + i];
    case FMT_BF16: return bf16_to_f32(((const uint16_t *)w->data)[o * w->in + i]);
    }
    return 0.0f; /* quantised rows are whole blocks (no tail) */
}

#define ROW_BLOCK 64   /* rows whose inputs stay in cache while a group of outputs' weights is read */
#define OUT_GROUP 48   /* outputs a thread takes at a time: their weights stream once per row block */
#define WIDE_OUTPUTS 24 /* outputs a multi-row block takes at a time: a multiple of every tile width (TO_FOR) */

int spectree_stream_lanes(void) { return LANES; }

/* y[r, o] for r < rows, o < out. x: `rows` rows of `in` float32 (x_bf16 = 0) or bfloat16 inputs, row r at
 * x + r * x_stride elements; y: [rows, out] contiguous, float32 or bfloat16 (y_bf16); bias: [out] float32 or NULL.
 * Returns 0, or -1 when the float32 copy of a bfloat16 x cannot be allocated. */
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
    float *xsum = NULL;
    if (fmt == FMT_Q4) {
        xsum = (float *)malloc((size_t)(rows * (in / Q_BLOCK)) * sizeof(float));
        if (!xsum) {
            free(copy);
            return -1;
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t b = 0; b < in / Q_BLOCK; b++) {
                float t = 0.0f;
                for (int i = 0; i < Q_BLOCK; i++) t += xs[r * xs_stride + b * Q_BLOCK + i];
                xsum[r * (in / Q_BLOCK) + b] = t;
            }
    }
    const inputs_t inputs = {xs, xs_stride, xsum, in / Q_BLOCK};
    const weights_t w = {fmt, wdata, scale, minimum, in};
    const int64_t whole = (fmt == FMT_F32 || fmt == FMT_BF16) ? in - in % LANES : in;
    const int64_t groups = (out + OUT_GROUP - 1) / OUT_GROUP;
#pragma omp parallel for schedule(static) if (out * in * (rows < 8 ? rows : 8) >= 65536)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t g0 = g * OUT_GROUP, g1 = g0 + OUT_GROUP < out ? g0 + OUT_GROUP : out;
        float sums[WIDE_OUTPUTS * TILE_ROWS];
        for (int64_t rb = 0; rb < rows; rb += ROW_BLOCK) {
            const int64_t rb1 = rb + ROW_BLOCK < rows ? rb + ROW_BLOCK : rows;
            /* one row: output tiles as wide as the one-row tile; several: WIDE_OUTPUTS outputs at a time, their
             * weights read from memory for the first row tile and from cache for the others */
            const int ot = rb1 - rb == 1 ? TO_FOR(1) : WIDE_OUTPUTS;
            for (int64_t o0 = g0; o0 < g1; o0 += ot) {
                const int to = g1 - o0 < ot ? (int)(g1 - o0) : ot;
                for (int64_t r0 = rb; r0 < rb1; r0 += TILE_ROWS) {
                    const int tr = (int)(rb1 - r0 < TILE_ROWS ? rb1 - r0 : TILE_ROWS);
                    for (int s0 = 0; s0 < to;) { /* sub-tiles of this row tile's width, then single outputs */
                        const int sub = to - s0 >= TO_FOR(tr) ? TO_FOR(tr) : 1;
                        pick(sub, tr)(&w, o0 + s0, &inputs, r0, sums + s0 * tr);
                        s0 += sub;
                    }
                    for (int o = 0; o < to; o++) {
                        for (int r = 0; r < tr; r++) {
                            float v = sums[o * tr + r];
                            const float *xr = xs + (r0 + r) * xs_stride;
                            for (int64_t i = whole; i < in; i++) v = fmaf(xr[i], weight_at(&w, o0 + o, i), v);
                            if (bias) v += bias[o0 + o];
                            const int64_t at = (r0 + r) * out + o0 + o;
                            if (y_bf16) ((uint16_t *)y)[at] = f32_to_bf16(v);
                            else ((float *)y)[at] = v;
                        }
                    }
                }
            }
        }
    }
    free(copy);
    free(xsum);
    return 0;
}

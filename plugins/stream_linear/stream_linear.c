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
 *             q in 0..15 (GGUF's Q4_1), multiplied by int8 activations (below); panels of QW = 8 outputs whatever
 *             the vector width, Q4_STRIDE bytes per block: for each quarter h (the block's inputs 8 h .. 8 h + 7)
 *             32 bytes, byte 4 j + t holding output j's input 8 h + t in its low nibble and 8 h + 4 + t in its high
 *             one, then the QW scales and the QW minimums (float32): one stream per panel
 * The packer's source layouts (native.py's BlockWeight): [out, in] float32 / bfloat16 / int8; Q4 [out, in / 2]
 * bytes, a block's byte j holding input j in its low nibble and input j + 16 in its high one; scales [out, blocks].
 * Activations are float32 in the sums (bfloat16 inputs widened; a bfloat16 output rounded to nearest even once),
 * except for Q4, whose activations are quantised per row and block as GGUF's Q8 activations are (llama.cpp's Q4_1 x
 * Q8_1 arithmetic): dx = amax / 127, xq = x / dx rounded to nearest even (int8), sx = dx * sum(xq). A Q4 output sums,
 * per block in order, the exact integer sum(q * xq) (AVX2: pair products by VPMADDUBSW, whose 16-bit sums cannot
 * overflow: 8 x 2 x 15 x 127 < 2^15) as y += float(isum) * (d * dx), then y += m * sx. Converting 4-bit weights to
 * float32 costs more than reading them on AVX2; these integer products do not.
 *
 * Batch invariance by construction: y[r, o] is one fixed sequence of float32 operations on x[r] and W[o] alone. A
 * (row, output) pair is one vector lane whose sum takes the inputs k = 0, 1, 2, ... in order, one multiply-add each
 * (quantised formats: a block's products summed in order into a block sum that starts at zero, then added to the
 * row's sum as one multiply-add by the block scale, for Q4 one more by the block minimum times the sum of the
 * block's inputs), then the bias. No lane sums and no tails: tiles of several rows and panels only share loads
 * between accumulators. So one row alone, a tree of 16 and a prompt chunk of 500 give a row the same bits, and the
 * AVX-512 and AVX2 routes agree with each other (a lane's operations do not depend on the vector width; Q4 runs the
 * same AVX2 code on both); the portable route, for CPUs without FMA, rounds each product before adding it. Built with
 * -ffp-contract=off so that the compiler keeps that split where it is written. */

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
#endif

#define PW (2 * LANES)  /* outputs per panel */
#define GROUP 4         /* panels a thread takes at a time: their weights stay in cache for all of a call's row tiles */
#define ROW_BLOCK 64    /* rows whose inputs stay in cache while the weights stream past them */

/* A weight as packed, and where its panels start. */
typedef struct {
    int fmt;
    const void *data;
    const float *scale;    /* Q8: [panels, blocks, PW] (Q4's are in its panels) */
    int64_t in;
} weights_t;

#define QW 8          /* outputs per Q4 panel: one vector of 8 int32 sums */
#define Q4_MAX_ROWS 4 /* rows per Q4 tile: its 16-bit and float sums, a panel's weights and two broadcasts in 16 registers */
#define Q4_STRIDE (Q_BLOCK / 2 * QW + 2 * QW * 4) /* bytes per block of a Q4 panel: 4-bit values, scales, minimums */

/* outputs per panel */
static inline int panel_width(int fmt) { return fmt == FMT_Q4 ? QW : PW; }

static inline int64_t panel_bytes(int fmt, int64_t in) {
    switch (fmt) {
    case FMT_F32: return in * PW * 4;
    case FMT_BF16: return in * PW * 2;
    case FMT_Q8: return in * PW;
    }
    return in / Q_BLOCK * Q4_STRIDE;
}

/* The rows' inputs: `xs` float32, row r at xs + r * stride; Q4: `xq` the quantised rows [rows, in] int8, `dx` and `sx`
 * their block scales and scaled sums [rows, blocks]. */
typedef struct {
    const float *xs;
    int64_t stride;
    const int8_t *xq;
    const float *dx;
    const float *sx;
} inputs_t;

/* acc[p][r][h] += the panels p0.. p0+NP-1 of w times rows r0.. r0+R-1, h the panel's half (outputs j, LANES + j).
 * One function per (format, R, NP), the loops over the tile fully unrolled so the accumulators live in registers. */
#define UNROLL _Pragma("GCC unroll 16")

/* The panel's two vectors at input k (outputs j and LANES + j), whatever the format (Q8: before the scale). */
static inline __attribute__((always_inline)) void weights_at(const char *panel, int64_t k, const int fmt, vf *lo,
                                                             vf *hi) {
    switch (fmt) {
    case FMT_F32:
        *lo = vload((const float *)panel + k * PW);
        *hi = vload((const float *)panel + k * PW + LANES);
        break;
    case FMT_BF16: vload_bf16_pair((const uint16_t *)panel + k * PW, lo, hi); break;
    default: vload_i8_pair((const int8_t *)panel + k * PW, lo, hi);
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
            }
        }
    }
    UNROLL for (int p = 0; p < NP; p++) UNROLL for (int r = 0; r < R; r++) {
        vstore(out + (p * R + r) * PW, acc[p][r][0]);
        vstore(out + (p * R + r) * PW + LANES, acc[p][r][1]);
    }
}

/* Q4 x int8 activations: out[p][r][j] for the QW outputs j of panels p0.. p0+NP-1 and rows r0.. r0+R-1. */
#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void q4_tile(const weights_t *w, int64_t p0, const inputs_t *x,
                                                          int64_t r0, const int R, const int NP,
                                                          float *out /* [NP][R][QW] */) {
    const int64_t in = w->in, blocks = in / Q_BLOCK, pstride = panel_bytes(FMT_Q4, in);
    const uint8_t *base = (const uint8_t *)w->data + p0 * pstride;
    const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc[4][Q4_MAX_ROWS];
    UNROLL for (int p = 0; p < NP; p++) UNROLL for (int r = 0; r < R; r++) acc[p][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i s[4][Q4_MAX_ROWS];
        UNROLL for (int p = 0; p < NP; p++) UNROLL for (int r = 0; r < R; r++) s[p][r] = _mm256_setzero_si256();
        /* not unrolled: unrolled, GCC hoists all 4 x R x NP products of a block ahead of their sums and spills them
         * (measured on Zen 3: 13-20% slower at 4-16 rows) */
        _Pragma("GCC unroll 1") for (int h = 0; h < 4; h++) {
            __m256i lo[4], hi[4];
            UNROLL for (int p = 0; p < NP; p++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(base + p * pstride + b * Q4_STRIDE + h * 32));
                lo[p] = _mm256_and_si256(v, nibble);
                hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            }
            UNROLL for (int r = 0; r < R; r++) {
                const int8_t *xr = x->xq + (r0 + r) * in + b * Q_BLOCK + 8 * h;
                int32_t a, c;
                memcpy(&a, xr, 4);
                memcpy(&c, xr + 4, 4);
                const __m256i xa = _mm256_set1_epi32(a), xc = _mm256_set1_epi32(c);
                UNROLL for (int p = 0; p < NP; p++)
                    s[p][r] = _mm256_add_epi16(s[p][r], _mm256_add_epi16(_mm256_maddubs_epi16(lo[p], xa),
                                                                         _mm256_maddubs_epi16(hi[p], xc)));
            }
        }
        UNROLL for (int p = 0; p < NP; p++) {
            const float *dm = (const float *)(base + p * pstride + b * Q4_STRIDE + Q_BLOCK / 2 * QW);
            const __m256 d = _mm256_loadu_ps(dm), m = _mm256_loadu_ps(dm + QW);
            UNROLL for (int r = 0; r < R; r++) {
                const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[p][r], ones));
                const __m256 ddx = _mm256_mul_ps(d, _mm256_broadcast_ss(x->dx + (r0 + r) * blocks + b));
                acc[p][r] = _mm256_fmadd_ps(isum, ddx, acc[p][r]);
                acc[p][r] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(x->sx + (r0 + r) * blocks + b), acc[p][r]);
            }
        }
    }
    UNROLL for (int p = 0; p < NP; p++) UNROLL for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (p * R + r) * QW,
                                                                                              acc[p][r]);
}
#else
/* portable: the same integer sums; the scale and minimum terms multiplied, then added */
static inline void q4_tile(const weights_t *w, int64_t p0, const inputs_t *x, int64_t r0, const int R, const int NP,
                           float *out /* [NP][R][QW] */) {
    const int64_t in = w->in, blocks = in / Q_BLOCK, pstride = panel_bytes(FMT_Q4, in);
    for (int p = 0; p < NP; p++)
        for (int r = 0; r < R; r++) {
            const uint8_t *panel = (const uint8_t *)w->data + (p0 + p) * pstride;
            float acc[QW] = {0};
            for (int64_t b = 0; b < blocks; b++) {
                const int8_t *xr = x->xq + (r0 + r) * in + b * Q_BLOCK;
                const float dx = x->dx[(r0 + r) * blocks + b], sx = x->sx[(r0 + r) * blocks + b];
                for (int j = 0; j < QW; j++) {
                    int32_t isum = 0;
                    for (int h = 0; h < 4; h++)
                        for (int t = 0; t < 4; t++) {
                            const uint8_t byte = panel[b * Q4_STRIDE + h * 32 + 4 * j + t];
                            isum += (byte & 15) * xr[8 * h + t] + (byte >> 4) * xr[8 * h + 4 + t];
                        }
                    const float *dm = (const float *)(panel + b * Q4_STRIDE + Q_BLOCK / 2 * QW);
                    const float d = dm[j], m = dm[QW + j];
                    const float ddx = d * dx;
                    float t1 = (float)isum * ddx;
                    acc[j] = acc[j] + t1;
                    t1 = m * sx;
                    acc[j] = acc[j] + t1;
                }
            }
            memcpy(out + (p * R + r) * QW, acc, sizeof acc);
        }
}
#endif

typedef void (*tile_fn)(const weights_t *, int64_t, const inputs_t *, int64_t, float *);
#define TILE_FN(R, NP)                                                                                               \
    static void tile_##R##_##NP(const weights_t *w, int64_t p0, const inputs_t *x, int64_t r0, float *out) {        \
        switch (w->fmt) {                                                                                            \
        case FMT_F32: tile(w, p0, x, r0, R, NP, FMT_F32, out); break;                                                \
        case FMT_BF16: tile(w, p0, x, r0, R, NP, FMT_BF16, out); break;                                              \
        default: tile(w, p0, x, r0, R, NP, FMT_Q8, out);                                                             \
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
#define Q4_TILE_FN(R, NP)                                                                                            \
    static void q4_tile_##R##_##NP(const weights_t *w, int64_t p0, const inputs_t *x, int64_t r0, float *out) {     \
        q4_tile(w, p0, x, r0, R, NP, out);                                                                           \
    }
Q4_TILE_FN(1, 4)
Q4_TILE_FN(1, 2)
Q4_TILE_FN(1, 1)
Q4_TILE_FN(2, 1)
Q4_TILE_FN(3, 1)
Q4_TILE_FN(4, 1)

/* The tile for R rows and at most `avail` panels, and (in *np) how many panels it takes: enough accumulators to hide
 * the multiply-add latency (one row: four panels, two rows: two), few enough to stay in registers. */
static tile_fn pick(int fmt, int R, int avail, int *np) {
    if (fmt == FMT_Q4) {
        /* several rows: one panel (two rows x two panels spill: measured ~15% slower) */
        *np = R > 1 ? 1 : avail >= 4 ? 4 : avail >= 2 ? 2 : 1;
        switch (R * 4 + *np) {
        case 8: return q4_tile_1_4;
        case 6: return q4_tile_1_2;
        case 5: return q4_tile_1_1;
        case 9: return q4_tile_2_1;
        case 13: return q4_tile_3_1;
        case 17: return q4_tile_4_1;
        }
        return 0;
    }
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

/* The packed sizes of an [out, in] weight of `fmt`: *data_bytes, and *scale_floats of Q8's scales (0 otherwise). */
void spectree_stream_packed_size(int fmt, int64_t out, int64_t in, int64_t *data_bytes, int64_t *scale_floats) {
    const int64_t pw = panel_width(fmt), panels = (out + pw - 1) / pw;
    *data_bytes = panels * panel_bytes(fmt, in);
    *scale_floats = fmt == FMT_Q8 ? panels * (in / Q_BLOCK) * pw : 0;
}

/* Packs the row-major weight `src` ([out, in], the layouts of the header; Q8 / Q4 with scale / minimum [out, blocks])
 * into `dst` and, for Q8, `dscale` ([panels, blocks, PW] float32), sized as spectree_stream_packed_size says; outputs
 * past `out` are zero. */
void spectree_stream_pack(int fmt, const void *src, const float *scale, const float *minimum, int64_t out, int64_t in,
                          void *dst, float *dscale) {
    const int64_t pw = panel_width(fmt), blocks = in / Q_BLOCK;
    int64_t bytes, floats;
    spectree_stream_packed_size(fmt, out, in, &bytes, &floats);
    memset(dst, 0, (size_t)bytes);
    if (dscale) memset(dscale, 0, (size_t)floats * sizeof(float));
    for (int64_t o = 0; o < out; o++) {
        const int64_t p = o / pw, j = o % pw;
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
                const int64_t kk = k % Q_BLOCK, h = kk / 8, t = kk % 4;
                const uint8_t byte = ((const uint8_t *)src)[(o * in + k - kk) / 2 + kk % (Q_BLOCK / 2)];
                const uint8_t q = kk < Q_BLOCK / 2 ? byte & 15 : byte >> 4;
                ((uint8_t *)panel)[(k / Q_BLOCK) * Q4_STRIDE + h * 32 + 4 * j + t] |= (uint8_t)(kk % 8 < 4 ? q : q << 4);
            }
            }
        }
        for (int64_t b = 0; b < blocks && fmt == FMT_Q8; b++) dscale[(p * blocks + b) * pw + j] = scale[o * blocks + b];
        for (int64_t b = 0; b < blocks && fmt == FMT_Q4; b++) {
            float *dm = (float *)(panel + b * Q4_STRIDE + Q_BLOCK / 2 * QW);
            dm[j] = scale[o * blocks + b];
            dm[QW + j] = minimum[o * blocks + b];
        }
    }
}

/* Q4's activations (the header's rule): xq [rows, in], dx and sx [rows, blocks]. */
static void quantize_rows(const float *xs, int64_t stride, int64_t rows, int64_t in, int8_t *xq, float *dx,
                          float *sx) {
    const int64_t blocks = in / Q_BLOCK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *x = xs + r * stride + b * Q_BLOCK;
            float amax = 0.0f;
            for (int i = 0; i < Q_BLOCK; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
            const float d = amax / 127.0f;
            int32_t sum = 0;
            for (int i = 0; i < Q_BLOCK; i++) {
                const float q = d > 0.0f ? rintf(x[i] / d) : 0.0f; /* nearest even: the default rounding mode */
                xq[r * in + b * Q_BLOCK + i] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
                sum += xq[r * in + b * Q_BLOCK + i];
            }
            dx[r * blocks + b] = d;
            sx[r * blocks + b] = d * (float)sum;
        }
}

/* y[r, o] for r < rows, o < out. x: `rows` rows of `in` float32 (x_bf16 = 0) or bfloat16 inputs, row r at
 * x + r * x_stride elements; w: packed (spectree_stream_pack), with Q8's scales; y: [rows, out] contiguous, float32 or bfloat16
 * (y_bf16); bias: [out] float32 or NULL. Returns 0, or -1 when the float32 copy of a bfloat16 x (or Q4's quantised
 * rows) cannot be allocated. */
int spectree_stream_linear(const void *x, int x_bf16, int64_t rows, int64_t in, int64_t x_stride, int fmt,
                           const void *wdata, const float *scale, int64_t out, const float *bias, void *y,
                           int y_bf16) {
    const float *xs = (const float *)x;
    float *copy = NULL, *xscale = NULL;
    int8_t *xq = NULL;
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
    if (fmt == FMT_Q4) {
        xq = (int8_t *)malloc((size_t)(rows * in));
        xscale = (float *)malloc((size_t)(2 * rows * blocks) * sizeof(float));
        if (!xq || !xscale) {
            free(copy);
            free(xq);
            free(xscale);
            return -1;
        }
        quantize_rows(xs, xs_stride, rows, in, xq, xscale, xscale + rows * blocks);
    }
    const inputs_t inputs = {xs, xs_stride, xq, xscale, xscale ? xscale + rows * blocks : NULL};
    const weights_t w = {fmt, wdata, scale, in};
    const int64_t pw = panel_width(fmt), panels = (out + pw - 1) / pw, group = GROUP * PW / pw;
    const int64_t max_rows = fmt == FMT_Q4 ? Q4_MAX_ROWS : MAX_ROWS;
    for (int64_t rb = 0; rb < rows; rb += ROW_BLOCK) {
        const int64_t n = rows - rb < ROW_BLOCK ? rows - rb : ROW_BLOCK;
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
            for (int64_t g0 = q0; g0 < q1; g0 += group) {
                const int64_t g1 = g0 + group < q1 ? g0 + group : q1;
                int64_t r0 = rb;
                /* the widest tiles first (8 rows on AVX2: 6 + 2, not 4 + 4): each keeps the most multiply-add
                 * chains in flight (measured: 8-15% faster at 7-8 rows) */
                while (r0 < rb + n) {
                    const int R = (int)(rb + n - r0 < max_rows ? rb + n - r0 : max_rows);
                    for (int64_t p0 = g0; p0 < g1;) {
                        int np;
                        pick(fmt, R, (int)(g1 - p0), &np)(&w, p0, &inputs, r0, sums);
                        for (int p = 0; p < np; p++)
                            for (int r = 0; r < R; r++)
                                for (int j = 0; j < pw && (p0 + p) * pw + j < out; j++) {
                                    const int64_t o = (p0 + p) * pw + j;
                                    float v = sums[(p * R + r) * pw + j];
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
    free(xq);
    free(xscale);
    return 0;
}

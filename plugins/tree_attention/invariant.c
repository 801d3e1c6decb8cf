/* Row-invariant tree attention for the CPU, in float32 (see plugins/tree_attention/native.py).
 *
 * A query row's output is a function of its logical key sequence alone: the prefix slots [0, L) in order, then the
 * tree slots its mask row shows, in slot order (a node's ancestors, root first). Plain decoding attends that same
 * sequence as slots [0, L + depth], contiguous. Every reduction runs in that logical order, in a shape that does not
 * depend on N, on where the tree slots sit, or on the other rows. Two routes, each invariant on its own (a model on
 * a machine always takes the same one: it depends on the dtype, the head size and the CPU alone):
 *
 * bf16 where the CPU has AVX512-BF16 and the head size is a multiple of 32 (`attend_group_bf16`): 16 (row, head)
 * pairs are the 16 lanes of a vector and everything is lane-wise, so no lane sees another:
 *   score_t = scale * sum_j q[2j..2j+1] . k_t[2j..2j+1]  bf16 pair dot products, j = 0 .. D/2 - 1 in order;
 *   m = max_t score_t; e_t = bf16(exp(score_t - m))      rounded to nearest even; z = sum_t e_t, t in order;
 *   out = sum_u (e_2u v_2u + e_2u+1 v_2u+1) / z          bf16 pair dot products over logical keys (2u, 2u + 1), u in
 *                                                        order (past the row's end: weight 0, value 0).
 * Rounding the weights to bf16 for the second product is what GPU flash attention does; z sums the rounded weights,
 * so each output is a convex combination of the values. A key that every lane takes in slot order (`pairs_of`: the
 * prefix, a causal chunk's rows, a tree's trunk) is loaded once for all lanes, each lane masking those past its end.
 *
 * float32, or a CPU without AVX512-BF16, or another head size (`attend_tile`):
 *   score_t = scale * dot(q, k_t)       the dot's association depends on D alone (LANES-lane partial sums over D of
 *                                       float32 multiply-adds, then a fixed pairwise lane sum);
 *   m       = max_t score_t              exact, any order;
 *   e_t     = exp(score_t - m)           one elementwise vector routine (`vexp`) for every t: no scalar tail that
 *                                       could round otherwise than the vector body;
 *   z       = sum_t e_t                  lane t mod LANES accumulates t, blocks in order, then the fixed lane sum;
 *   out     = (sum_t e_t v_t) / z        sequential over t, LANES lanes of D at a time.
 * Rows are worked in tiles of (row, head) pairs that share loads of keys in slot order, never arithmetic: each pair
 * runs the same statements in every tile size.
 *
 * So a tree step's row equals, bit for bit, the one-token step that later decodes the same path (tests/plugins/
 * test_native.py checks it across tile sizes and lane counts). Built with -ffp-contract=off (native.py): whether GCC
 * fuses a * b + c may differ between the inlined instantiations (it did with 8-lane vectors at a head size of 80), and
 * a fused and an unfused multiply-add round differently. No -ffast-math: it would let the compiler reassociate the
 * sums.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../bf16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_DPBF16 1 /* AVX512-BF16: a bf16 pair dot product per lane in one instruction */
#else
#define HAVE_DPBF16 0
#endif

/* Lanes of a vector: 16 (one AVX-512 register) where the CPU has AVX-512; 8 (one AVX2 register) elsewhere, where
 * 16-lane vectors compile to register pairs that GCC spills (measured: ~3x slower on AMD EPYC Zen 3). A model on a
 * machine always takes the same width, so every row of it sums in the same shape. */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t))));

/* one broadcast (a loop over the lanes compiles to a chain of inserts) */
#if LANES == 16
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }
#endif

static inline vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* The sum of the LANES lanes as one fixed pairwise tree. */
static inline float lane_sum(vf v) {
    float a[LANES];
    memcpy(a, &v, sizeof a);
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) a[i] = a[i] + a[i + w];
    return a[0];
}

/* exp(x) for x <= 0: Cephes' single-precision polynomial (~1 ulp); exactly 0 below -87 (and for -inf). */
static inline vf vexp(vf x) {
    const vf lo = splat(-87.0f);
    vi under = x < lo;
    x = pick(under, lo, x);
    vf t = x * splat(1.44269504088896341f) + splat(0.5f);
    vi n = __builtin_convertvector(t, vi);
    n = n + (__builtin_convertvector(n, vf) > t); /* truncation toward zero -> floor */
    vf fn = __builtin_convertvector(n, vf);
    vf r = x - fn * splat(0.693359375f);
    r = r - fn * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    vf out = p * (vf)((n + 127) << 23);
    return (vf)((vi)out & ~under);
}

typedef float vf_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float))));
typedef uint16_t vh_unaligned __attribute__((vector_size(LANES * sizeof(uint16_t)), aligned(sizeof(uint16_t))));

/* Elements [c * 16, c * 16 + 16) of a row of `d` values (float32, or bfloat16 as uint16), zero past its end, as
 * float32. Inlined with constant d and bf16, it is one load (and a widening shift). */
static inline __attribute__((always_inline)) vf load(const void *base, int64_t offset, int64_t c, int64_t d,
                                                     int bf16) {
    const int64_t left = d - c * LANES;
    if (bf16) {
        const uint16_t *row = (const uint16_t *)base + offset + c * LANES;
        vh x = {0};
        if (left >= LANES)
            x = *(const vh_unaligned *)row;
        else
            memcpy(&x, row, (size_t)left * sizeof(uint16_t));
        return (vf)(__builtin_convertvector(x, vi) << 16);
    }
    const float *row = (const float *)base + offset + c * LANES;
    if (left >= LANES) return *(const vf_unaligned *)row;
    vf x = {0};
    memcpy(&x, row, (size_t)left * sizeof(float));
    return x;
}

/* LANES vectors' lane sums as one vector (lane j: the sum of p[j]'s lanes), each by the same pairwise tree as
 * lane_sum, whichever lane its vector lands in. */
#if LANES == 16
static inline vf lane_sums(const vf p[LANES]) {
    const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vi lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vi lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], lo8) + __builtin_shuffle(p[2 * i], p[2 * i + 1], hi8);
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo4) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi4);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
    return __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
}

#else
static inline vf lane_sums(const vf p[LANES]) {
    const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    const vi lo2 = {0, 1, 4, 5, 8, 9, 12, 13}, hi2 = {2, 3, 6, 7, 10, 11, 14, 15};
    const vi lo1 = {0, 2, 4, 6, 8, 10, 12, 14}, hi1 = {1, 3, 5, 7, 9, 11, 13, 15};
    vf a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], lo4) + __builtin_shuffle(p[2 * i], p[2 * i + 1], hi4);
    for (int i = 0; i < 2; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo2) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi2);
    return __builtin_shuffle(b[0], b[1], lo1) + __builtin_shuffle(b[0], b[1], hi1);
}
#endif

/* Accumulator vectors a tile keeps (its pairs x the head's LANES-lane chunks): within AVX-512's 32 vector registers.
 * Without AVX-512 there are 16 registers (AVX2) or fewer, so no tile of several pairs fits:
 * every tile is one pair there (the same arithmetic, see attend_tile). That also bounds the build: GCC's vectoriser
 * took over a minute on the 24 wide-tile instantiations at -march=znver3 / x86-64-v3, under a second without them. */
#if defined(__AVX512F__)
#define TILE_VECTORS 24
#define WIDE_TILES 1
#else
#define TILE_VECTORS 4
#define WIDE_TILES 0
#endif
#define MAX_TILE 6 /* 24 / 4: the widest tile (head size 64, AVX-512) */
#define MAX_HEAD 512 /* the largest head size taken (spectree_tree_attention refuses larger ones) */
#define MAX_CHUNKS (MAX_HEAD / LANES)

/* One tile: up to MAX_TILE (query row, head) pairs of one kv head, which share the run of keys [0, shared): each of
 * those keys and values is loaded once for all of them. Pair i's logical keys: slots [0, min(shared, total[i])), then
 * path[i][0 .. total[i] - shared). Every pair's arithmetic is the same sequence of operations whatever the tile holds
 * (tiles only share loads; a pair that stops inside the shared run masks the keys past its end, as the per-pair
 * route leaves them out), so its result depends on its own row alone. `tile` and `chunks` are constants where this
 * is inlined. */
static inline __attribute__((always_inline)) void attend_tile(
    const void *q, const int64_t *qo, const void *k, int64_t ko, int64_t ks, const void *v, int64_t vo, int64_t vs,
    int64_t shared, const int64_t *const *path, const int64_t *total, float *w, int64_t padded, float *const *o,
    int64_t d, int64_t chunks, int64_t tile, float scale, int bf16) {
    /* fixed bounds, not [tile][chunks]: variable-length arrays stay stack allocations in the inlined loops (measured:
     * ~3x slower at a head size of 64 on AVX2) */
    vf qv[MAX_TILE][MAX_CHUNKS], acc[MAX_TILE][MAX_CHUNKS], part[MAX_TILE][LANES], top[MAX_TILE];
    float z[MAX_TILE];
    int64_t most = 0;
    for (int64_t i = 0; i < tile; i++) {
        for (int64_t c = 0; c < chunks; c++) qv[i][c] = load(q, qo[i], c, d, bf16);
        most = total[i] > most ? total[i] : most;
        top[i] = splat(-INFINITY); /* lane-wise running max; the max is exact in any order */
    }
    vf lane;
    for (int j = 0; j < LANES; j++) lane[j] = (float)j;

    /* scores, LANES logical keys at a time: each key's dot as LANES-lane partial sums over D, then its lane sum */
    for (int64_t blk = 0; blk * LANES < most; blk++) {
        if (tile == 1 && (blk + 1) * LANES <= shared) {
            /* a whole block of shared keys: the same sums, the LANES keys' chains interleaved (each key's own sum
             * still runs over D in order), so that they overlap rather than wait on one another */
            for (int64_t j = 0; j < LANES; j++) part[0][j] = (vf){0};
            for (int64_t c = 0; c < chunks; c++)
                for (int64_t j = 0; j < LANES; j++)
                    part[0][j] = qv[0][c] * load(k, ko + (blk * LANES + j) * ks, c, d, bf16) + part[0][j];
        } else
        for (int64_t j = 0; j < LANES; j++) {
            const int64_t t = blk * LANES + j;
            if (t < shared) { /* past a pair's end: a score that the mask below drops */
                vf kc[MAX_CHUNKS];
                for (int64_t c = 0; c < chunks; c++) kc[c] = load(k, ko + t * ks, c, d, bf16);
                for (int64_t i = 0; i < tile; i++) {
                    vf p = {0};
                    for (int64_t c = 0; c < chunks; c++) p = qv[i][c] * kc[c] + p;
                    part[i][j] = p;
                }
            } else {
                for (int64_t i = 0; i < tile; i++) {
                    vf p = {0};
                    if (t < total[i]) {
                        const int64_t off = ko + path[i][t - shared] * ks;
                        for (int64_t c = 0; c < chunks; c++) p = qv[i][c] * load(k, off, c, d, bf16) + p;
                    }
                    part[i][j] = p;
                }
            }
        }
        for (int64_t i = 0; i < tile; i++) {
            if (blk * LANES >= total[i]) continue;
            vf sc = lane_sums(part[i]) * splat(scale);
            sc = pick(lane + splat((float)(blk * LANES)) < splat((float)total[i]), sc, splat(-INFINITY));
            memcpy(w + i * padded + blk * LANES, &sc, sizeof sc);
            top[i] = pick(sc > top[i], sc, top[i]);
        }
    }
    /* weights: exp(score - max), summed lane t mod LANES over the blocks in order, then the fixed lane sum */
    for (int64_t i = 0; i < tile; i++) {
        float m = -INFINITY;
        for (int64_t j = 0; j < LANES; j++) m = top[i][j] > m ? top[i][j] : m;
        const vf mv = splat(m);
        vf zl = {0};
        for (int64_t blk = 0; blk * LANES < total[i]; blk++) {
            vf e;
            memcpy(&e, w + i * padded + blk * LANES, sizeof e);
            e = vexp(e - mv);
            memcpy(w + i * padded + blk * LANES, &e, sizeof e);
            zl = zl + e;
        }
        z[i] = lane_sum(zl);
        for (int64_t c = 0; c < chunks; c++) acc[i][c] = (vf){0};
    }
    /* the weighted sum of values in logical order, 16 lanes of D at a time; divided by z at the end */
    for (int64_t t = 0; t < most; t++) {
        if (t < shared) {
            vf vc[MAX_CHUNKS];
            for (int64_t c = 0; c < chunks; c++) vc[c] = load(v, vo + t * vs, c, d, bf16);
            for (int64_t i = 0; i < tile; i++) {
                if (t >= total[i]) continue;
                const vf p = splat(w[i * padded + t]);
                for (int64_t c = 0; c < chunks; c++) acc[i][c] = p * vc[c] + acc[i][c];
            }
        } else {
            for (int64_t i = 0; i < tile; i++) {
                if (t >= total[i]) continue;
                const int64_t off = vo + path[i][t - shared] * vs;
                const vf p = splat(w[i * padded + t]);
                for (int64_t c = 0; c < chunks; c++) acc[i][c] = p * load(v, off, c, d, bf16) + acc[i][c];
            }
        }
    }
    for (int64_t i = 0; i < tile; i++)
        for (int64_t c = 0; c < chunks; c++) {
            const vf r = z[i] > 0.0f ? acc[i][c] / splat(z[i]) : (vf){0}; /* a row that sees nothing: zeros */
            const int64_t left = d - c * LANES;
            memcpy(o[i] + c * LANES, &r, (size_t)(left < LANES ? left : LANES) * sizeof(float));
        }
}

/* attend_tile with the tile size a constant (1 .. TILE_VECTORS / chunks) */
#if WIDE_TILES
#define TILES(D, CHUNKS, BF16)                                                                                      \
    switch (tile) {                                                                                                \
    case 1: attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, shared, path, total, w, padded, o, D, CHUNKS, 1, scale,    \
                        BF16); break;                                                                              \
    case 2: attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, shared, path, total, w, padded, o, D, CHUNKS, 2, scale,    \
                        BF16); break;                                                                              \
    case 3: attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, shared, path, total, w, padded, o, D, CHUNKS, 3, scale,    \
                        BF16); break;                                                                              \
    case 4: attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, shared, path, total, w, padded, o, D, CHUNKS, 4, scale,    \
                        BF16); break;                                                                              \
    case 5: attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, shared, path, total, w, padded, o, D, CHUNKS, 5, scale,    \
                        BF16); break;                                                                              \
    default: attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, shared, path, total, w, padded, o, D, CHUNKS, 6, scale,   \
                         BF16); break;                                                                             \
    }
#else
#define TILES(D, CHUNKS, BF16)                                                                                      \
    attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, shared, path, total, w, padded, o, D, CHUNKS, 1, scale, BF16);
#endif

#define GROUP LANES /* (row, head) pairs per work item on the bf16 route: a vector's lanes */
#define KEY_BATCH 8 /* keys whose scores the bf16 route accumulates together (independent chains) */

#if HAVE_DPBF16
/* The bf16 route (the header says what it computes): a shared key's dwords are broadcast to all 16 lanes; the values
 * are summed in register tiles of pairs that share each key pair's interleaved values. A lane past its last key
 * computes scores that are masked to -inf, so its weights there are exactly 0 and the shared value loads add
 * 0 * (a finite value) to its sums: the bits of the route that leaves those keys out. */

static inline __m512 dp(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

/* Elements [c * 16, c * 16 + 16) of a bf16 row. */
static inline __m256i half_row(const uint16_t *row, int64_t c) {
    return _mm256_loadu_si256((const __m256i *)(row + c * LANES));
}

/* Two keys' 16 elements as 16 bf16 pairs (a[i], b[i]), the layout of a pair dot product's operand. */
static inline __m512i interleave(__m256i a, __m256i b, __m512i inter) {
    return _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), inter, _mm512_castsi256_si512(b));
}

/* The weighted values of a tile of pairs: eh, z, path, total and o start at the tile's first pair (eh strided by
 * GROUP per key pair); each output is divided by its pair's z. */
static inline __attribute__((always_inline)) void values_tile(
    const uint16_t *v, int64_t vo, int64_t vs, int64_t shared, const int64_t *const *path, const int64_t *total,
    const uint32_t *eh, float *const *o, const float *z, int64_t chunks, int64_t tile) {
    const __m512i inter = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    __m512 acc[tile][chunks];
    int64_t most = 0;
    for (int64_t i = 0; i < tile; i++) {
        most = total[i] > most ? total[i] : most;
        for (int64_t c = 0; c < chunks; c++) acc[i][c] = _mm512_setzero_ps();
    }
    for (int64_t t = 0; t < most; t += 2) {
        const uint32_t *pairs = eh + (t / 2) * GROUP;
        if (t + 1 < shared) {
            __m512i vc[chunks];
            const uint16_t *r0 = v + vo + t * vs, *r1 = r0 + vs;
            for (int64_t c = 0; c < chunks; c++)
                vc[c] = interleave(half_row(r0, c), half_row(r1, c), inter);
            for (int64_t i = 0; i < tile; i++) {
                const __m512i p = _mm512_set1_epi32((int)pairs[i]);
                for (int64_t c = 0; c < chunks; c++) acc[i][c] = dp(acc[i][c], p, vc[c]);
            }
        } else {
            for (int64_t i = 0; i < tile; i++) {
                if (t >= total[i]) continue;
                const uint16_t *r0 = v + vo + (t < shared ? t : path[i][t - shared]) * vs;
                const int second = t + 1 < total[i];
                const uint16_t *r1 = second ? v + vo + (t + 1 < shared ? t + 1 : path[i][t + 1 - shared]) * vs : r0;
                const __m512i p = _mm512_set1_epi32((int)pairs[i]);
                for (int64_t c = 0; c < chunks; c++) {
                    const __m256i b = second ? half_row(r1, c) : _mm256_setzero_si256();
                    acc[i][c] = dp(acc[i][c], p, interleave(half_row(r0, c), b, inter));
                }
            }
        }
    }
    for (int64_t i = 0; i < tile; i++) {
        const float zi = z[i];
        for (int64_t c = 0; c < chunks; c++) {
            const __m512 r = zi > 0.0f ? _mm512_div_ps(acc[i][c], _mm512_set1_ps(zi)) : _mm512_setzero_ps();
            _mm512_storeu_ps(o[i] + c * LANES, r); /* a row that sees nothing: zeros */
        }
    }
}

/* Scores of key t, -inf in the lanes whose keys end at or before t (none before the first lane's end, `least`; lanes
 * past the group's pairs hold no pair and are never read). */
static inline __m512 seen_only(__m512 scores, int64_t t, int64_t least, __m512 totals) {
    if (t < least) return scores;
    const __mmask16 seen = _mm512_cmp_ps_mask(_mm512_set1_ps((float)t), totals, _CMP_LT_OQ);
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, scores);
}

/* One group: `lanes` pairs (<= 16) of one kv head; pair l's query at q + qo[l], its logical keys the slots [0,
 * min(shared, total[l])) then path[l][0 .. total[l] - shared). Scratch: s [(most + KEY_BATCH) * 16] floats, eh
 * [(most / 2 + 1) * 16], qt and kt [d / 2 * 16] dwords. */
static void attend_group_bf16(const uint16_t *q, const int64_t *qo, int64_t lanes, const uint16_t *k, int64_t ko,
                              int64_t ks, const uint16_t *v, int64_t vo, int64_t vs, int64_t shared,
                              const int64_t *const *path, const int64_t *total, float *const *o, int64_t d,
                              float scale, float *s, uint32_t *eh, uint32_t *qt, uint32_t *kt) {
    const int64_t half = d / 2, chunks = d / LANES;
    int64_t most = 0;
    for (int64_t l = 0; l < lanes; l++) most = total[l] > most ? total[l] : most;
    /* the queries as dword columns: qt[j] holds dword j (elements 2j, 2j + 1) of every lane's query */
    memset(qt, 0, (size_t)(half * GROUP) * sizeof(uint32_t));
    for (int64_t l = 0; l < lanes; l++) {
        const uint32_t *row = (const uint32_t *)(q + qo[l]);
        for (int64_t j = 0; j < half; j++) qt[j * GROUP + l] = row[j];
    }
    __m512 totals;
    {
        float tf[GROUP];
        for (int64_t l = 0; l < GROUP; l++) tf[l] = l < lanes ? (float)total[l] : 0.0f;
        totals = _mm512_loadu_ps(tf);
    }
    const __m512 scale_v = _mm512_set1_ps(scale);
    /* shared scores, KEY_BATCH keys at a time (each key's chain is its own: the batch only interleaves them); from
     * the first lane's end on, each lane's keys past its own end are masked */
    int64_t least = most;
    for (int64_t l = 0; l < lanes; l++) least = total[l] < least ? total[l] : least;
    int64_t t = 0;
    for (; t + KEY_BATCH <= shared; t += KEY_BATCH) {
        __m512 acc[KEY_BATCH];
        const uint32_t *rows[KEY_BATCH];
        for (int64_t b = 0; b < KEY_BATCH; b++) {
            acc[b] = _mm512_setzero_ps();
            rows[b] = (const uint32_t *)(k + ko + (t + b) * ks);
        }
        for (int64_t j = 0; j < half; j++) {
            const __m512i qj = _mm512_loadu_si512(qt + j * GROUP);
            for (int64_t b = 0; b < KEY_BATCH; b++) acc[b] = dp(acc[b], qj, _mm512_set1_epi32((int)rows[b][j]));
        }
        for (int64_t b = 0; b < KEY_BATCH; b++)
            _mm512_storeu_ps(s + (t + b) * GROUP, seen_only(_mm512_mul_ps(acc[b], scale_v), t + b, least, totals));
    }
    for (; t < shared; t++) {
        __m512 acc = _mm512_setzero_ps();
        const uint32_t *row = (const uint32_t *)(k + ko + t * ks);
        for (int64_t j = 0; j < half; j++)
            acc = dp(acc, _mm512_loadu_si512(qt + j * GROUP), _mm512_set1_epi32((int)row[j]));
        _mm512_storeu_ps(s + t * GROUP, seen_only(_mm512_mul_ps(acc, scale_v), t, least, totals));
    }
    /* tree scores: each lane its own key (its path's), gathered into dword columns like the queries */
    for (; t < most; t++) {
        memset(kt, 0, (size_t)(half * GROUP) * sizeof(uint32_t));
        for (int64_t l = 0; l < lanes; l++) {
            if (t >= total[l]) continue;
            const uint32_t *row = (const uint32_t *)(k + ko + path[l][t - shared] * ks);
            for (int64_t j = 0; j < half; j++) kt[j * GROUP + l] = row[j];
        }
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < half; j++)
            acc = dp(acc, _mm512_loadu_si512(qt + j * GROUP), _mm512_loadu_si512(kt + j * GROUP));
        _mm512_storeu_ps(s + t * GROUP, seen_only(_mm512_mul_ps(acc, scale_v), t, least, totals));
    }
    /* weights: lane-wise max, exp, rounding to bf16 and the sum z, t in order */
    vf top = splat(-INFINITY);
    for (t = 0; t < most; t++) {
        vf x;
        memcpy(&x, s + t * GROUP, sizeof x);
        top = pick(x > top, x, top);
    }
    vf zl = {0};
    for (t = 0; t < most; t++) {
        vf x;
        memcpy(&x, s + t * GROUP, sizeof x);
        const vi bits = (vi)vexp(x - top);
        const vi rounded = (vi)(((vu)bits + 0x7fffu + (((vu)bits >> 16) & 1u)) & 0xffff0000u);
        zl = zl + (vf)rounded;
        memcpy(s + t * GROUP, &rounded, sizeof rounded);
    }
    if (most % 2) memset(s + most * GROUP, 0, GROUP * sizeof(float)); /* the odd last key's partner: weight 0 */
    for (t = 0; t < most; t += 2) {
        vi a, b;
        memcpy(&a, s + t * GROUP, sizeof a);
        memcpy(&b, s + (t + 1) * GROUP, sizeof b);
        const vi pair = (vi)(((vu)a >> 16) | ((vu)b & 0xffff0000u));
        memcpy(eh + (t / 2) * GROUP, &pair, sizeof pair);
    }
    float z[GROUP];
    memcpy(z, &zl, sizeof z);
    /* values: tiles of pairs within the registers */
    const int64_t widest = TILE_VECTORS / chunks > 0 ? TILE_VECTORS / chunks : 1;
    for (int64_t first = 0; first < lanes; first += widest) {
        const int64_t tile = lanes - first < widest ? lanes - first : widest;
        /* the tile's pairs: lanes [first, first + tile) of the weights, their sums, paths and outputs */
        const uint32_t *te = eh + first;
        const float *tz = z + first;
        const int64_t *const *tp = path + first;
        const int64_t *tt = total + first;
        float *const *to = o + first;
        if (chunks == 4) {
            switch (tile) {
            case 6: values_tile(v, vo, vs, shared, tp, tt, te, to, tz, 4, 6); break;
            case 5: values_tile(v, vo, vs, shared, tp, tt, te, to, tz, 4, 5); break;
            case 4: values_tile(v, vo, vs, shared, tp, tt, te, to, tz, 4, 4); break;
            case 3: values_tile(v, vo, vs, shared, tp, tt, te, to, tz, 4, 3); break;
            case 2: values_tile(v, vo, vs, shared, tp, tt, te, to, tz, 4, 2); break;
            default: values_tile(v, vo, vs, shared, tp, tt, te, to, tz, 4, 1); break;
            }
        } else if (chunks == 8) {
            switch (tile) {
            case 3: values_tile(v, vo, vs, shared, tp, tt, te, to, tz, 8, 3); break;
            case 2: values_tile(v, vo, vs, shared, tp, tt, te, to, tz, 8, 2); break;
            default: values_tile(v, vo, vs, shared, tp, tt, te, to, tz, 8, 1); break;
            }
        } else {
            for (int64_t i = 0; i < tile; i++)
                values_tile(v, vo, vs, shared, tp + i, tt + i, te + i, to + i, tz + i, chunks, 1);
        }
    }
}
#endif

/* Word w of a mask row of n bits, without the bits past n. */
static inline uint32_t mask_word(const int32_t *bits, int64_t w, int64_t n) {
    const int64_t left = n - w * 32;
    return left <= 0 ? 0u : (uint32_t)bits[w] & (left >= 32 ? 0xffffffffu : (1u << left) - 1u);
}

/* (row, head) pairs [first, first + count) of kv head g in batch b (pair p: row p / group, head g * group + p %
 * group): each one's query offset, output row and key count. Returns `shared`: the keys [0, shared) are, for every
 * pair that sees them, the slots [0, shared) themselves (the prefix, then the tree slots every pair's path takes in
 * order from the first: a causal chunk's rows share all of them, a tree's the root and its common trunk). Past it,
 * each pair's tree slots are written to paths (n each) and pointed to by path. */
static int64_t pairs_of(int64_t first, int64_t count, int64_t g, int64_t b, int64_t group, int64_t hq, int64_t n,
                        int64_t d, int64_t prefix, const int32_t *mask, int64_t words, int64_t q_sb, int64_t q_sh,
                        int64_t q_sn, float *out, int64_t *paths, int64_t *qo, int64_t *total, const int64_t **path,
                        float **o) {
    const int32_t *rows[GROUP];
    int64_t shared = prefix + n;
    for (int64_t i = 0; i < count; i++) {
        const int64_t row = (first + i) / group, h = g * group + (first + i) % group;
        const int32_t *bits = rows[i] = mask + (b * n + row) * words;
        int64_t seen = 0, run = 0, gap = 0; /* run: set bits from bit 0 up to the first clear one */
        for (int64_t w = 0; w < words; w++) {
            const uint32_t x = mask_word(bits, w, n);
            seen += __builtin_popcount(x);
            if (!gap) {
                const int ones = x == 0xffffffffu ? 32 : __builtin_ctz(~x);
                run += ones;
                gap = ones < 32;
            }
        }
        if (run < seen && prefix + run < shared) shared = prefix + run; /* its path leaves the slots' order there */
        total[i] = prefix + seen;
        qo[i] = b * q_sb + h * q_sh + row * q_sn;
        o[i] = out + ((b * hq + h) * n + row) * d;
    }
    int64_t most = prefix;
    for (int64_t i = 0; i < count; i++) most = total[i] > most ? total[i] : most;
    if (shared > most) shared = most; /* no pair sees a key past the last one's end */
    for (int64_t i = 0; i < count; i++) {
        int64_t *mine = paths + i * n, kept = 0, skip = shared - prefix; /* its first skip bits are the shared run */
        path[i] = mine;
        if (total[i] <= shared) continue;
        for (int64_t w = 0; w < words; w++) {
            uint32_t x = mask_word(rows[i], w, n);
            for (; x; x &= x - 1) {
                const int64_t j = w * 32 + __builtin_ctz(x);
                if (j >= skip) mine[kept++] = prefix + j;
            }
        }
    }
    return shared;
}

/* Whether inputs of head size d (bf16: bfloat16, else float32) take the bf16 route, which rounds the softmax
 * weights to bf16 (`attend_group_bf16`); 0: `attend_tile`, float32 throughout. */
int spectree_rounds_weights(int64_t d, int bf16) { return HAVE_DPBF16 && bf16 && d > 0 && d % (2 * LANES) == 0; }

/* spectree_tree_attention (below) on inputs as they come. */
static int attention(const void *q, int64_t q_sb, int64_t q_sh, int64_t q_sn, const void *k, int64_t k_sb,
                     int64_t k_sh, int64_t k_ss, const void *v, int64_t v_sb, int64_t v_sh, int64_t v_ss,
                     const int32_t *mask, int64_t words, float *out, int64_t batch, int64_t hq, int64_t hkv,
                     int64_t n, int64_t s, int64_t d, float scale, int bf16) {
    const int64_t prefix = s - n, group = hq / hkv, chunks = (d + LANES - 1) / LANES;
    /* pairs (row, head) of one kv head, row-major, cut into tiles; the common head sizes get wide tiles */
    const int64_t widest = WIDE_TILES && (d == 64 || d == 128) ? TILE_VECTORS / chunks : 1;
    const int64_t pairs = n * group, tile_max = widest < pairs ? widest : pairs;
    const int64_t padded = (s + LANES - 1) / LANES * LANES;
    int failed = 0;
    /* work items: groups of 16 pairs on the bf16 route, tiles otherwise */
    const int grouped = spectree_rounds_weights(d, bf16);
    const int64_t unit = grouped ? GROUP : tile_max, units = (pairs + unit - 1) / unit;
#pragma omp parallel
    {
        /* at least one lane's worth each: aligned_alloc / malloc of 0 bytes may give NULL */
        float *w = grouped ? malloc((size_t)((s + KEY_BATCH + 1) * GROUP) * sizeof(float))
                           : aligned_alloc(sizeof(vf), (size_t)(tile_max * padded + LANES) * sizeof(float));
        uint32_t *eh = grouped ? malloc((size_t)((s / 2 + 2) * GROUP) * sizeof(uint32_t)) : NULL;
        uint32_t *qt = grouped ? malloc((size_t)(d / 2 * GROUP) * sizeof(uint32_t)) : NULL;
        uint32_t *kt = grouped ? malloc((size_t)(d / 2 * GROUP) * sizeof(uint32_t)) : NULL;
        int64_t *paths = malloc((size_t)(unit * n + 1) * sizeof(int64_t)); /* each pair's tree slots */
        if (!w || !paths || (grouped && (!eh || !qt || !kt))) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < batch * hkv * units; item++) {
            if (failed) continue;
            const int64_t first = (item % units) * unit, g = (item / units) % hkv, b = item / (units * hkv);
            const int64_t tile = pairs - first < unit ? pairs - first : unit;
            int64_t qo[GROUP], total[GROUP];
            const int64_t *path[GROUP];
            float *o[GROUP];
            const int64_t shared = pairs_of(first, tile, g, b, group, hq, n, d, prefix, mask, words, q_sb, q_sh, q_sn,
                                            out, paths, qo, total, path, o);
            const int64_t ko = b * k_sb + g * k_sh, vo = b * v_sb + g * v_sh;
            if (grouped) {
#if HAVE_DPBF16
                attend_group_bf16((const uint16_t *)q, qo, tile, (const uint16_t *)k, ko, k_ss, (const uint16_t *)v, vo,
                                  v_ss, shared, path, total, o, d, scale, w, eh, qt, kt);
#endif
            } else if (d == 64) {
                if (bf16) { TILES(64, 64 / LANES, 1) } else { TILES(64, 64 / LANES, 0) }
            } else if (d == 128) {
                if (bf16) { TILES(128, 128 / LANES, 1) } else { TILES(128, 128 / LANES, 0) }
            } else {
                if (bf16) attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, shared, path, total, w, padded, o, d, chunks,
                                      1, scale, 1);
                else attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, shared, path, total, w, padded, o, d, chunks, 1,
                                 scale, 0);
            }
        }
        free(w);
        free(eh);
        free(qt);
        free(kt);
        free(paths);
    }
    return failed ? -1 : 0;
}

/* `rows` rows of d bfloat16 values, row r at src + r * stride elements, widened into dst, contiguous. */
static void widen_rows(const uint16_t *src, int64_t rows, int64_t stride, int64_t d, float *dst) {
#pragma omp parallel for schedule(static) if (rows * d >= 16384)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < d; i++) dst[r * d + i] = bf16_to_f32(src[r * stride + i]);
}

/* Tree attention over q [B, Hq, N, D], k / v [B, Hkv, S, D] (S = L + N; the last dimension contiguous, the others
 * at the given strides in elements: batch, head, position), the packed mask [B, N, words] (contiguous) into out
 * [B, Hq, N, D] (contiguous float32). bf16: q, k and v hold bfloat16 (as uint16) rather than float32. Returns 0, or
 * -1 when scratch memory could not be allocated.
 * bfloat16 inputs off the bf16 route are widened to float32 once here (exactly), rather than each key once per query
 * head that reads it: the float32 route then computes the same values with a third of the work for GQA's groups. */
int spectree_tree_attention(const void *q, int64_t q_sb, int64_t q_sh, int64_t q_sn, const void *k, int64_t k_sb,
                            int64_t k_sh, int64_t k_ss, const void *v, int64_t v_sb, int64_t v_sh, int64_t v_ss,
                            const int32_t *mask, int64_t words, float *out, int64_t batch, int64_t hq, int64_t hkv,
                            int64_t n, int64_t s, int64_t d, float scale, int bf16) {
    if (batch == 0 || hq == 0 || n == 0 || d == 0) return 0; /* no output element */
    if (!bf16 || spectree_rounds_weights(d, bf16))
        return attention(q, q_sb, q_sh, q_sn, k, k_sb, k_sh, k_ss, v, v_sb, v_sh, v_ss, mask, words, out, batch, hq,
                         hkv, n, s, d, scale, bf16);
    float *qf = malloc((size_t)(batch * hq * n * d) * sizeof(float));
    float *kf = malloc((size_t)(batch * hkv * s * d) * sizeof(float));
    float *vf32 = malloc((size_t)(batch * hkv * s * d) * sizeof(float));
    int rc = -1;
    if (qf && kf && vf32) {
        /* q rows (b, h, t): at b * q_sb + h * q_sh + t * q_sn; enumerate as (b * hq + h) * n + t */
        for (int64_t bh = 0; bh < batch * hq; bh++)
            widen_rows((const uint16_t *)q + (bh / hq) * q_sb + (bh % hq) * q_sh, n, q_sn, d, qf + bh * n * d);
        for (int64_t bg = 0; bg < batch * hkv; bg++) {
            widen_rows((const uint16_t *)k + (bg / hkv) * k_sb + (bg % hkv) * k_sh, s, k_ss, d, kf + bg * s * d);
            widen_rows((const uint16_t *)v + (bg / hkv) * v_sb + (bg % hkv) * v_sh, s, v_ss, d, vf32 + bg * s * d);
        }
        rc = attention(qf, hq * n * d, n * d, d, kf, hkv * s * d, s * d, d, vf32, hkv * s * d, s * d, d, mask, words,
                       out, batch, hq, hkv, n, s, d, scale, 0);
    }
    free(qf);
    free(kf);
    free(vf32);
    return rc;
}

/* The AVX-512 intrinsics the kernels use, emulated with portable vector code, so that a CPU without AVX-512 runs the
 * kernels' AVX-512 routes (their lane counts, tiles, packing and lane sums) and the tests check them there. Forced into
 * every kernel's build by SPECTREE_EMULATE (plugins/native_build.py), never otherwise: the emulated routes are slow.
 *
 * Each function follows the Intel Intrinsics Guide's operation for its instruction; where an operation's rounding
 * order matters it is the instruction's (fmadd: one rounding, fmaf) or GCC's own (reduce_add: GCC's tree of halves).
 * VDPBF16PS (SPECTREE_EMULATE_BF16) adds the odd pair's product, then the even pair's, to each float32 lane; a product
 * of two bfloat16 values is exact in float32, so each step rounds once, as the instruction does (its denormals flushed
 * to zero are not emulated: the tests use normal values). */

#ifndef SPECTREE_EMULATE_AVX512_H
#define SPECTREE_EMULATE_AVX512_H

#include <immintrin.h> /* first, while __AVX512F__ is undefined: GCC's headers then declare the real intrinsics for
                          their own target only, and the macros below take the names the kernels call */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#error "SPECTREE_EMULATE: this build already targets AVX-512; there is nothing to emulate"
#endif
#define __AVX512F__ 1
#ifdef SPECTREE_EMULATE_BF16
#define __AVX512BF16__ 1
#endif

typedef float emu_f16x __attribute__((vector_size(64)));
typedef int32_t emu_i16x __attribute__((vector_size(64)));
typedef uint32_t emu_u16x __attribute__((vector_size(64)));
typedef int16_t emu_h32x __attribute__((vector_size(64)));
typedef uint16_t emu_uh32x __attribute__((vector_size(64)));

#define EMU static inline __attribute__((always_inline))

EMU __m512 emu_setzero_ps(void) { return (__m512)(emu_f16x){0}; }
EMU __m512 emu_set1_ps(float x) { return (__m512)((emu_f16x){0} + x); }
EMU __m512i emu_set1_epi32(int x) { return (__m512i)((emu_i16x){0} + x); }
EMU __m512 emu_loadu_ps(const void *p) {
    __m512 v;
    memcpy(&v, p, sizeof v);
    return v;
}
EMU __m512i emu_loadu_si512(const void *p) {
    __m512i v;
    memcpy(&v, p, sizeof v);
    return v;
}
EMU void emu_storeu_ps(void *p, __m512 a) { memcpy(p, &a, sizeof a); }
EMU __m512 emu_add_ps(__m512 a, __m512 b) { return (__m512)((emu_f16x)a + (emu_f16x)b); }
EMU __m512 emu_mul_ps(__m512 a, __m512 b) { return (__m512)((emu_f16x)a * (emu_f16x)b); }
EMU __m512 emu_div_ps(__m512 a, __m512 b) { return (__m512)((emu_f16x)a / (emu_f16x)b); }
EMU __m512 emu_fmadd_ps(__m512 a, __m512 b, __m512 c) {
    emu_f16x x = (emu_f16x)a, y = (emu_f16x)b, z = (emu_f16x)c, r;
    for (int i = 0; i < 16; i++) r[i] = fmaf(x[i], y[i], z[i]);
    return (__m512)r;
}
/* GCC's _mm512_reduce_add_ps: the upper 256 bits plus the lower, then the upper 128 of that plus the lower, then
 * lanes (0 + 2, 1 + 3), then those two */
EMU float emu_reduce_add_ps(__m512 a) {
    emu_f16x x = (emu_f16x)a;
    float t3[8], t6[4];
    for (int i = 0; i < 8; i++) t3[i] = x[8 + i] + x[i];
    for (int i = 0; i < 4; i++) t6[i] = t3[4 + i] + t3[i];
    const float t80 = t6[0] + t6[2], t81 = t6[1] + t6[3];
    return t80 + t81;
}
EMU __m512 emu_castsi512_ps(__m512i a) { return (__m512)a; }
EMU __m512i emu_castsi256_si512(__m256i a) {
    __m512i r = {0};
    memcpy(&r, &a, sizeof a);
    return r;
}
EMU __m512i emu_slli_epi32(__m512i a, unsigned n) { return (__m512i)(n > 31 ? (emu_u16x){0} : (emu_u16x)a << n); }
EMU __m512i emu_srli_epi32(__m512i a, unsigned n) { return (__m512i)(n > 31 ? (emu_u16x){0} : (emu_u16x)a >> n); }
EMU __m512i emu_and_si512(__m512i a, __m512i b) { return a & b; }
EMU __m512 emu_cvtepi32_ps(__m512i a) { return (__m512)__builtin_convertvector((emu_i16x)a, emu_f16x); }
/* _mm512_cvtepi8_epi32, _mm512_cvtepu8_epi32, _mm512_cvtepu16_epi32: 16 narrow integers widened to int32 lanes */
#define EMU_WIDEN(name, narrow_t, from_t)                                                                              \
    EMU __m512i name(from_t a) {                                                                                       \
        narrow_t b[16];                                                                                                \
        memcpy(b, &a, sizeof b);                                                                                       \
        emu_i16x r;                                                                                                    \
        for (int i = 0; i < 16; i++) r[i] = b[i];                                                                      \
        return (__m512i)r;                                                                                             \
    }
EMU_WIDEN(emu_cvtepi8_epi32, int8_t, __m128i)
EMU_WIDEN(emu_cvtepu8_epi32, uint8_t, __m128i)
EMU_WIDEN(emu_cvtepu16_epi32, uint16_t, __m256i)
#undef EMU_WIDEN
/* _mm512_set_epi16(e31, ..., e0): element i is e_i, the last argument first */
EMU __m512i emu_set_epi16(short e31, short e30, short e29, short e28, short e27, short e26, short e25, short e24,
                          short e23, short e22, short e21, short e20, short e19, short e18, short e17, short e16,
                          short e15, short e14, short e13, short e12, short e11, short e10, short e9, short e8,
                          short e7, short e6, short e5, short e4, short e3, short e2, short e1, short e0) {
    return (__m512i)(emu_h32x){e0,  e1,  e2,  e3,  e4,  e5,  e6,  e7,  e8,  e9,  e10, e11, e12, e13, e14, e15,
                               e16, e17, e18, e19, e20, e21, e22, e23, e24, e25, e26, e27, e28, e29, e30, e31};
}
/* element i: idx[i] bits 0-4 pick an element of a (bit 5 clear) or b (bit 5 set) */
EMU __m512i emu_permutex2var_epi16(__m512i a, __m512i idx, __m512i b) {
    emu_uh32x x = (emu_uh32x)a, y = (emu_uh32x)b, s = (emu_uh32x)idx, r;
    for (int i = 0; i < 32; i++) r[i] = (s[i] & 32) ? y[s[i] & 31] : x[s[i] & 31];
    return (__m512i)r;
}
/* only the predicate the kernels use: _CMP_LT_OQ (ordered, false for NaN) */
EMU __mmask16 emu_cmp_ps_mask(__m512 a, __m512 b, const int predicate) {
    emu_f16x x = (emu_f16x)a, y = (emu_f16x)b;
    __mmask16 m = 0;
    if (predicate != _CMP_LT_OQ) __builtin_trap();
    for (int i = 0; i < 16; i++) m |= (__mmask16)((x[i] < y[i]) << i);
    return m;
}
EMU __m512 emu_mask_mov_ps(__m512 src, __mmask16 k, __m512 a) {
    emu_f16x s = (emu_f16x)src, x = (emu_f16x)a, r;
    for (int i = 0; i < 16; i++) r[i] = (k >> i) & 1 ? x[i] : s[i];
    return (__m512)r;
}

#define _mm512_setzero_ps emu_setzero_ps
#define _mm512_set1_ps emu_set1_ps
#define _mm512_set1_epi32 emu_set1_epi32
#define _mm512_loadu_ps emu_loadu_ps
#define _mm512_loadu_si512 emu_loadu_si512
#define _mm512_storeu_ps emu_storeu_ps
#define _mm512_add_ps emu_add_ps
#define _mm512_mul_ps emu_mul_ps
#define _mm512_div_ps emu_div_ps
#define _mm512_fmadd_ps emu_fmadd_ps
#define _mm512_reduce_add_ps emu_reduce_add_ps
#define _mm512_castsi512_ps emu_castsi512_ps
#define _mm512_castsi256_si512 emu_castsi256_si512
#define _mm512_slli_epi32 emu_slli_epi32
#define _mm512_srli_epi32 emu_srli_epi32
#define _mm512_and_si512 emu_and_si512
#define _mm512_cvtepi32_ps emu_cvtepi32_ps
#define _mm512_cvtepi8_epi32 emu_cvtepi8_epi32
#define _mm512_cvtepu8_epi32 emu_cvtepu8_epi32
#define _mm512_cvtepu16_epi32 emu_cvtepu16_epi32
#define _mm512_set_epi16 emu_set_epi16
#define _mm512_permutex2var_epi16 emu_permutex2var_epi16
#define _mm512_cmp_ps_mask emu_cmp_ps_mask
#define _mm512_mask_mov_ps emu_mask_mov_ps

#ifdef SPECTREE_EMULATE_BF16
typedef uint16_t emu_bh32x __attribute__((vector_size(64)));
static inline float emu_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
/* the kernels call it with operands cast from __m512i, so it takes any 64-byte vector */
#define _mm512_dpbf16_ps(acc, a, b) emu_dpbf16_ps((acc), (emu_bh32x)(a), (emu_bh32x)(b))
#define __m512bh emu_bh32x
EMU __m512 emu_dpbf16_ps(__m512 acc, emu_bh32x a, emu_bh32x b) {
    emu_f16x r = (emu_f16x)acc;
    for (int i = 0; i < 16; i++) {
        r[i] = r[i] + emu_bf16(a[2 * i + 1]) * emu_bf16(b[2 * i + 1]);
        r[i] = r[i] + emu_bf16(a[2 * i]) * emu_bf16(b[2 * i]);
    }
    return (__m512)r;
}
#endif

#undef EMU
#endif

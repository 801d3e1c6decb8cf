#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

static inline uint16_t bf16_round(float f) {
    if (isnan(f)) return 0x7FC0;
    uint32_t u; memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float bf16_load(const uint16_t *p) { uint32_t u = (uint32_t)(*p) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float bf16_rounded(float f) { uint32_t u = (uint32_t)bf16_round(f) << 16; float r; memcpy(&r, &u, 4); return r; }

typedef __m512 (*exp16_fn)(__m512);

/* one row: out[i] = dtype(dtype(silu(g[i])) * u[i]) */
static void row16(const void *g, const void *u, void *out, int64_t n, int bf16, exp16_fn vexp, int64_t step) {
    int64_t i = 0;
    const int64_t full = n - n % step;
    float tmp[16];
    for (; i < full; i += 16) {
        __m512 x;
        if (bf16) {
            __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i));
            x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        } else x = _mm512_loadu_ps((const float *)g + i);
        __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x80000000)));
        __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), vexp(neg)));
        if (bf16) {
            const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
            __m512i su = _mm512_castps_si512(s);
            su = _mm512_add_epi32(su, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(su, 16), one)));
            __m512 sr = _mm512_castsi512_ps(_mm512_and_si512(su, _mm512_set1_epi32((int)0xffff0000u)));
            __m256i uh = _mm256_loadu_si256((const __m256i *)((const uint16_t *)u + i));
            __m512 uf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(uh), 16));
            __m512i p = _mm512_castps_si512(_mm512_mul_ps(sr, uf));
            p = _mm512_add_epi32(p, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(p, 16), one)));
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(p, 16)));
        } else {
            _mm512_storeu_ps((float *)out + i, _mm512_mul_ps(s, _mm512_loadu_ps((const float *)u + i)));
        }
    }
    for (; i < n; i++) {
        float x = bf16 ? bf16_load((const uint16_t *)g + i) : ((const float *)g)[i];
        float s = x / (1.0f + expf(-x));
        if (bf16) ((uint16_t *)out)[i] = bf16_round(bf16_rounded(s) * bf16_load((const uint16_t *)u + i));
        else ((float *)out)[i] = s * ((const float *)u)[i];
    }
}
void spectree_swiglu(const void *gu, int64_t rows, int64_t inter, int64_t row_stride, void *out, int bf16, void *fn) {
    int64_t step = bf16 ? 64 : 32;
    for (int64_t r = 0; r < rows; r++) {
        const char *base = (const char *)gu + r * row_stride * (bf16 ? 2 : 4);
        row16(base, base + inter * (bf16 ? 2 : 4), (char *)out + r * inter * (bf16 ? 2 : 4), inter, bf16, (exp16_fn)fn, step);
    }
}

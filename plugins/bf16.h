/* bfloat16 <-> float32 for the plugins' C kernels (included by their sources; plugins/native_build.py hashes it with
 * each of them). A bfloat16 is the top 16 bits of a float32: widening is exact; narrowing rounds to nearest even, as
 * torch's cast does (c10::BFloat16), a NaN becoming torch's 0x7FC0. */
#ifndef SPECTREE_BF16_H
#define SPECTREE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7FC0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element i of an array of float32 (bf16 = 0) or bfloat16 values, as float32; and stored back, rounded to the dtype. */
static inline float elem_load(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void elem_store(void *base, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)base)[i] = f32_to_bf16(v);
    else ((float *)base)[i] = v;
}

#endif

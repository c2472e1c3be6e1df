/* simd_avx512.h: the AVX-512 vector codecs and memory access of kernel_avx512.c.
 *
 * Each function is the 16-lane form of a line of codecs.h (the scalar twin), included by
 * kernel_avx512.c inside its target("avx512f,avx512bw,avx512vl") region; nothing else may
 * include it. Split out so that each file stays one concern: this one the codecs, the kernel
 * file the update loops.
 */
#ifndef ADAMBRIDGE_SIMD_AVX512_H
#define ADAMBRIDGE_SIMD_AVX512_H

/* ---- masked memory access: k selects the lanes (all 16 when full) ---------------------- */

AB_INLINE __m512 avx512_load_f32(const float *src, __mmask16 k, int full)
{
    return full ? _mm512_loadu_ps(src) : _mm512_maskz_loadu_ps(k, src);
}
AB_INLINE void avx512_store_f32(float *dst, __m512 x, __mmask16 k, int full)
{
    if (full)
        _mm512_storeu_ps(dst, x);
    else
        _mm512_mask_storeu_ps(dst, k, x);
}
AB_INLINE __m256i avx512_load_u16(const uint16_t *src, __mmask16 k, int full)
{
    return full ? _mm256_loadu_si256((const __m256i *)src) : _mm256_maskz_loadu_epi16(k, src);
}
AB_INLINE void avx512_store_u16(uint16_t *dst, __m256i x, __mmask16 k, int full)
{
    if (full)
        _mm256_storeu_si256((__m256i *)dst, x);
    else
        _mm256_mask_storeu_epi16(dst, k, x);
}
AB_INLINE __m128i avx512_load_u8(const uint8_t *src, __mmask16 k, int full)
{
    return full ? _mm_loadu_si128((const __m128i *)src) : _mm_maskz_loadu_epi8(k, src);
}
AB_INLINE void avx512_store_u8(uint8_t *dst, __m128i x, __mmask16 k, int full)
{
    if (full)
        _mm_storeu_si128((__m128i *)dst, x);
    else
        _mm_mask_storeu_epi8(dst, k, x);
}

/* ---- codecs ---------------------------------------------------------------------------- */

/* mix32(x) on 16 lanes (section 2). */
AB_INLINE __m512i avx512_mix32(__m512i x)
{
    /* x ^= x >> 16; x *= 0x7feb352d */
    x = _mm512_mullo_epi32(_mm512_xor_si512(x, _mm512_srli_epi32(x, 16)),
                           _mm512_set1_epi32(0x7feb352d));
    /* x ^= x >> 15; x *= 0x846ca68b */
    x = _mm512_mullo_epi32(_mm512_xor_si512(x, _mm512_srli_epi32(x, 15)),
                           _mm512_set1_epi32((int)0x846ca68bu));
    /* x ^= x >> 16 */
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* 16 u16 -> fp32: bf16 as_f32(b << 16), or fp16 exactly (vcvtph2ps). */
AB_INLINE __m512 avx512_half_to_f32(__m256i h, int dtype)
{
    if (dtype == AB_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

AB_INLINE __m512 avx512_load_grad(const void *g, int64_t i, int dtype, __mmask16 k, int full)
{
    if (dtype == AB_F32)
        return avx512_load_f32((const float *)g + i, k, full);
    return avx512_half_to_f32(avx512_load_u16((const uint16_t *)g + i, k, full), dtype);
}

/* bf16 RNE on 16 lanes, as u32 lanes: (u + 0x7fff + ((u >> 16) & 1)) >> 16. The kept lowest
 * bit is tested into a mask and added under it: one uop where a shift and an and took two, and
 * shifts have the fewest ports. */
AB_INLINE __m512i avx512_bf16_rne(__m512 x)
{
    __m512i u = _mm512_castps_si512(x);
    __mmask16 odd = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x10000));
    u = _mm512_add_epi32(u, _mm512_set1_epi32(0x7fff));
    u = _mm512_mask_add_epi32(u, odd, u, _mm512_set1_epi32(1));
    return _mm512_srli_epi32(u, 16);
}


AB_INLINE void avx512_store_out(void *out, int64_t i, __m512 p, int dtype, int nt, __mmask16 k,
                                int full)
{
    if (dtype == AB_F32) {
        if (nt && full)
            _mm512_stream_ps((float *)out + i, p);
        else
            avx512_store_f32((float *)out + i, p, k, full);
        return;
    }
    if (dtype == AB_NONE)
        return;
    __m256i h = dtype == AB_BF16 ? _mm512_cvtepi32_epi16(avx512_bf16_rne(p))
                                 : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    uint16_t *dst = (uint16_t *)out + i;
    if (nt && full)
        _mm256_stream_si256((__m256i *)dst, h);
    else
        avx512_store_u16(dst, h, k, full);
}

/* fp8 decode through F16C, exact. An E5M2 code is the top byte of the fp16 with the same
 * value. An E4M3 code c re-laid as the fp16 bits (c & 0x80) << 8 | (c & 0x7f) << 7 decodes to
 * dec_e4m3(c) / 256, subnormals included (both formats put their subnormals at the same place
 * relative to the exponent bias), and the 256 goes into the block's scale: (h * 256) * scale
 * and h * (256 * scale) round the same product once. The E5M2 codes with E == 31 are fp16
 * inf and NaN, as in the scalar decode; the E4M3 NaN code is selected separately. */
/* 16 bytes -> 16 u16 lanes holding c << 8: one byte shuffle of both 128-bit lanes, where a
 * zero-extend and a shift took two uops. */
AB_INLINE __m256i avx512_u8_to_high16(__m128i c)
{
    const __m256i high = _mm256_setr_epi8(-1, 0, -1, 1, -1, 2, -1, 3, -1, 4, -1, 5, -1, 6, -1, 7,
                                          -1, 8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14,
                                          -1, 15);
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(c), high);
}

AB_INLINE __m512 avx512_e5m2_decode(__m128i c)
{
    return _mm512_cvtph_ps(avx512_u8_to_high16(c));
}

/* E4M3 / 256 for codes other than the NaN code (see avx512_e4m3_decode_div256). */
AB_INLINE __m512 avx512_e4m3_decode_div256_finite(__m128i c)
{
    /* (c << 8) >> 1 with the sign kept in bit 15 and cleared from bit 14 */
    __m256i h = _mm256_srai_epi16(avx512_u8_to_high16(c), 1);
    return _mm512_cvtph_ps(_mm256_and_si256(h, _mm256_set1_epi16((short)0xbfff)));
}

AB_INLINE __m512 avx512_e4m3_decode_div256(__m128i c)
{
    __m512 x = avx512_e4m3_decode_div256_finite(c);
    /* the NaN code 0x7f / 0xff (a finite fp16 in this layout) decodes as NaN */
    __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(c, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
    return _mm512_mask_mov_ps(x, nan, _mm512_castsi512_ps(_mm512_set1_epi32((int)AB_CANON_NAN)));
}

/* fp8 encode of 16 lanes x >= 0, at most one ulp past max, or non-finite (ab_fp8_encode), the
 * code in bits 0-7 of each u32 lane, in the integer domain: b = min(as_u32(x * 2^(-126-emin)),
 * 0x7f << (23-mbits)) (unsigned: a non-finite x gives the NaN code), code = (b + rnd) >>
 * (23-mbits) with rnd = r16 << (7 - mbits) from the caller (SR) or 2^(22-mbits) - 1 + the
 * kept lowest bit (nearest even). finite: every x is finite, so the min is a no-op (x is at
 * most max * (1 + 2^-22), whose pattern is far below the NaN code's) and is left out. wide:
 * no x is below 2^emin and an E5M2 x comes already multiplied by 2^(-126-emin) (see
 * avx512_fp8_wide in kernel_avx512.c). */
AB_INLINE __m512i avx512_fp8_encode(__m512 x, int emin, int mbits, int sr, int finite, int wide,
                                    __m512i rnd)
{
    const int drop = 23 - mbits;
    __m512i b;
    if (wide && mbits == AB_E4M3_MBITS) {
        /* normal = as_u32(x) - ((126 + emin) << 23), the right candidate for x >= 2^emin */
        b = _mm512_sub_epi32(_mm512_castps_si512(x), _mm512_set1_epi32((126 + emin) << 23));
    } else if (wide) {
        b = _mm512_castps_si512(x);                    /* x * 2^(-126-emin), done by the caller */
    } else if (mbits == AB_E4M3_MBITS) {
        /* no subnormal product (codecs.h): max(small, normal) */
        __m512 y = _mm512_add_ps(x, _mm512_set1_ps(ab_as_f32((uint32_t)(127 + emin) << 23)));
        __m512i small = _mm512_sub_epi32(_mm512_castps_si512(y), _mm512_set1_epi32((127 + emin) << 23));
        __m512i normal = _mm512_sub_epi32(_mm512_castps_si512(x), _mm512_set1_epi32((126 + emin) << 23));
        b = _mm512_max_epi32(small, normal);
    } else {
        b = _mm512_castps_si512(_mm512_mul_ps(x, _mm512_set1_ps(ab_fp8_to_f32_grid(emin))));
    }
    if (!finite)
        b = _mm512_min_epu32(b, _mm512_set1_epi32((int)(AB_FP8_NAN << drop)));
    if (!sr) {
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, drop), _mm512_set1_epi32(1));
        rnd = _mm512_add_epi32(odd, _mm512_set1_epi32((1 << (drop - 1)) - 1));
    }
    return _mm512_srli_epi32(_mm512_add_epi32(b, rnd), drop);
}

/* Whether the n <= 128 codes of m at qm hold the E4M3 NaN code (0x7f or 0xff). */
AB_INLINE int avx512_has_e4m3_nan(const uint8_t *qm, int64_t n)
{
    const __m512i low7 = _mm512_set1_epi8(0x7f);
    __mmask64 k0 = n >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << n) - 1;
    __mmask64 k1 = n >= 128 ? ~(__mmask64)0 : n <= 64 ? 0 : ((__mmask64)1 << (n - 64)) - 1;
    __m512i c0 = _mm512_and_si512(_mm512_maskz_loadu_epi8(k0, qm), low7);
    __m512i c1 = _mm512_and_si512(_mm512_maskz_loadu_epi8(k1, qm + 64), low7);
    return (_mm512_mask_cmpeq_epi8_mask(k0, c0, low7) | _mm512_mask_cmpeq_epi8_mask(k1, c1, low7)) != 0;
}

/* |x| with integer ops (_mm512_and_ps would need AVX512DQ). */
AB_INLINE __m512 avx512_abs(__m512 x)
{
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
}

/* Narrow two vectors of 16 u32 lanes holding values < 2^16 to 32 u16, in order: one packus
 * (which interleaves the 128-bit lanes of a and b) and one qword permute, where two vpmovdw
 * would cost four uops. */
AB_INLINE __m512i avx512_narrow16x2(__m512i a, __m512i b)
{
    const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    return _mm512_permutexvar_epi64(order, _mm512_packus_epi32(a, b));
}

#endif /* ADAMBRIDGE_SIMD_AVX512_H */

/* simd_avx2.h: the AVX2 (+F16C) vector codecs of kernel_avx2.c.
 *
 * Each function is the 8-lane form of a line of codecs.h (the scalar twin), included by
 * kernel_avx2.c inside its target("avx2,fma,f16c") region; nothing else may include it.
 * Split out so that each file stays one concern: this one the codecs, the kernel file the
 * update loops.
 */
#ifndef ADAMBRIDGE_SIMD_AVX2_H
#define ADAMBRIDGE_SIMD_AVX2_H

/* ---- codecs ---------------------------------------------------------------------------- */

/* mix32(x) on 8 lanes (section 2). */
AB_INLINE __m256i avx2_mix32(__m256i x)
{
    /* x ^= x >> 16; x *= 0x7feb352d */
    x = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 16)),
                           _mm256_set1_epi32(0x7feb352d));
    /* x ^= x >> 15; x *= 0x846ca68b */
    x = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 15)),
                           _mm256_set1_epi32((int)0x846ca68bu));
    /* x ^= x >> 16 */
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* 8 u16 -> fp32: bf16 as_f32(b << 16), or fp16 exactly (vcvtph2ps). */
AB_INLINE __m256 avx2_load_half(const uint16_t *src, int dtype)
{
    __m128i h = _mm_loadu_si128((const __m128i *)src);
    if (dtype == AB_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

AB_INLINE __m256 avx2_load_grad(const void *g, int64_t i, int dtype)
{
    if (dtype == AB_F32)
        return _mm256_loadu_ps((const float *)g + i);
    return avx2_load_half((const uint16_t *)g + i, dtype);
}

/* Narrow 8 u32 lanes holding values < 2^16 to 8 u16, in order. */
AB_INLINE __m128i avx2_narrow16(__m256i x)
{
    return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

/* bf16 RNE on 8 lanes, as u32 lanes: (u + 0x7fff + ((u >> 16) & 1)) >> 16. */
AB_INLINE __m256i avx2_bf16_rne(__m256 x)
{
    __m256i u = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
    return _mm256_srli_epi32(u, 16);
}


AB_INLINE void avx2_store_out(void *out, int64_t i, __m256 p, int dtype, int nt)
{
    if (dtype == AB_F32) {
        if (nt)
            _mm256_stream_ps((float *)out + i, p);
        else
            _mm256_storeu_ps((float *)out + i, p);
        return;
    }
    if (dtype == AB_NONE)
        return;
    __m128i h = dtype == AB_BF16 ? avx2_narrow16(avx2_bf16_rne(p))
                                 : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
    __m128i *dst = (__m128i *)((uint16_t *)out + i);
    if (nt)
        _mm_stream_si128(dst, h);
    else
        _mm_storeu_si128(dst, h);
}

/* fp8 decode through F16C, exact. An E5M2 code is the top byte of the fp16 with the same
 * value. An E4M3 code c re-laid as the fp16 bits (c & 0x80) << 8 | (c & 0x7f) << 7 decodes to
 * dec_e4m3(c) / 256, subnormals included (both formats put their subnormals at the same place
 * relative to the exponent bias), and the 256 goes into the block's scale: (h * 256) * scale
 * and h * (256 * scale) round the same product once. The E5M2 codes with E == 31 are fp16
 * inf and NaN, as in the scalar decode; the E4M3 NaN code is selected separately. */
AB_INLINE __m256 avx2_e5m2_decode(__m128i c)   /* the 8 codes in the low 8 bytes */
{
    return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), c));
}

/* E4M3 / 256 for codes other than the NaN code (see avx2_e4m3_decode_div256). */
AB_INLINE __m256 avx2_e4m3_decode_div256_finite(__m128i c)
{
    /* (c << 8) >> 1 with the sign kept in bit 15 and cleared from bit 14 */
    __m128i h = _mm_srai_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), c), 1);
    return _mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16((short)0xbfff)));
}

AB_INLINE __m256 avx2_e4m3_decode_div256(__m128i c)
{
    __m256 x = avx2_e4m3_decode_div256_finite(c);
    /* the NaN code 0x7f / 0xff (a finite fp16 in this layout) decodes as NaN */
    __m128i nan8 = _mm_cmpeq_epi8(_mm_and_si128(c, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
    __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(nan8));
    return _mm256_blendv_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32((int)AB_CANON_NAN)), nan);
}

/* fp8 encode of 8 lanes x >= 0, at most one ulp past max, or non-finite (ab_fp8_encode), the
 * code in bits 0-7 of each u32 lane, in the integer domain: b = min(as_u32(x * 2^(-126-emin)),
 * 0x7f << (23-mbits)) (unsigned: a non-finite x gives the NaN code), code = (b + rnd) >>
 * (23-mbits) with rnd = r16 << (7 - mbits) from the caller (SR) or 2^(22-mbits) - 1 + the
 * kept lowest bit (nearest even). finite: every x is finite, so the min is a no-op (x is at
 * most max * (1 + 2^-22), whose pattern is far below the NaN code's) and is left out. wide:
 * no x is below 2^emin and an E5M2 x comes already multiplied by 2^(-126-emin) (see
 * avx512_fp8_wide in kernel_avx512.c). */
AB_INLINE __m256i avx2_fp8_encode(__m256 x, int emin, int mbits, int sr, int finite, int wide,
                                  __m256i rnd)
{
    const int drop = 23 - mbits;
    __m256i b;
    if (wide && mbits == AB_E4M3_MBITS) {
        /* normal = as_u32(x) - ((126 + emin) << 23), the right candidate for x >= 2^emin */
        b = _mm256_sub_epi32(_mm256_castps_si256(x), _mm256_set1_epi32((126 + emin) << 23));
    } else if (wide) {
        b = _mm256_castps_si256(x);                    /* x * 2^(-126-emin), done by the caller */
    } else if (mbits == AB_E4M3_MBITS) {
        /* no subnormal product (codecs.h): max(small, normal) */
        __m256 y = _mm256_add_ps(x, _mm256_set1_ps(ab_as_f32((uint32_t)(127 + emin) << 23)));
        __m256i small = _mm256_sub_epi32(_mm256_castps_si256(y), _mm256_set1_epi32((127 + emin) << 23));
        __m256i normal = _mm256_sub_epi32(_mm256_castps_si256(x), _mm256_set1_epi32((126 + emin) << 23));
        b = _mm256_max_epi32(small, normal);
    } else {
        b = _mm256_castps_si256(_mm256_mul_ps(x, _mm256_set1_ps(ab_fp8_to_f32_grid(emin))));
    }
    if (!finite)
        b = _mm256_min_epu32(b, _mm256_set1_epi32((int)(AB_FP8_NAN << drop)));
    if (!sr) {
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, drop), _mm256_set1_epi32(1));
        rnd = _mm256_add_epi32(odd, _mm256_set1_epi32((1 << (drop - 1)) - 1));
    }
    return _mm256_srli_epi32(_mm256_add_epi32(b, rnd), drop);
}

#endif /* ADAMBRIDGE_SIMD_AVX2_H */

/* kernel_avx2.c: the fused AdamW update, 8 lanes of AVX2 (+F16C for fp16).
 *
 * Contract: exactly kernel_scalar.c, bit for bit (docs/numerics.md), 8 elements at a time.
 * Every math line below carries the scalar line it implements. No FMA: every multiply and add
 * rounds separately (codecs.h turns contraction off even without -ffp-contract=off).
 * Tails (fewer than 8 elements) run the scalar code from codecs.h. Loads and stores are
 * unaligned; only the write-only `out` stream may use non-temporal stores.
 *
 * Flags when compiled alone: -mavx2 -mfma -mf16c. The target pragma below lets the file also
 * compile inside the unity build of tests/native/selftest.c with no flags at all.
 * Reference: https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html
 */
#include "codecs.h"

#if defined(AB_HAVE_AVX2)

#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

/* The per-tensor scalars, broadcast once per call. */
typedef struct {
    __m256 decay, beta1, omb1, beta2, omb2, eps, step_size;
} avx2_hyper;

static void avx2_hyper_init(avx2_hyper *h, const ab_hyper *s)
{
    h->decay = _mm256_set1_ps(s->decay);
    h->beta1 = _mm256_set1_ps(s->beta1);
    h->omb1 = _mm256_set1_ps(s->one_minus_beta1);
    h->beta2 = _mm256_set1_ps(s->beta2);
    h->omb2 = _mm256_set1_ps(s->one_minus_beta2);
    h->eps = _mm256_set1_ps(s->eps);
    h->step_size = _mm256_set1_ps(s->step_size);
}

/* ab_canon on 8 lanes: a NaN becomes 0x7fc00000. */
AB_INLINE __m256 avx2_canon(__m256 x)
{
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32((int)AB_CANON_NAN)), nan);
}

/* Section 1 on 8 lanes; returns s = sqrt(v); a NaN p is left as the arithmetic made it. */
AB_INLINE __m256 avx2_adamw_raw(const avx2_hyper *h, __m256 *p, __m256 g, __m256 *m, __m256 *v)
{
    /* p = p * decay */
    *p = _mm256_mul_ps(*p, h->decay);
    /* m = m * beta1_f */
    *m = _mm256_mul_ps(*m, h->beta1);
    /* m = m + g * omb1 */
    *m = _mm256_add_ps(*m, _mm256_mul_ps(g, h->omb1));
    /* v = v * beta2_f */
    *v = _mm256_mul_ps(*v, h->beta2);
    /* v = v + (g * g) * omb2 */
    *v = _mm256_add_ps(*v, _mm256_mul_ps(_mm256_mul_ps(g, g), h->omb2));
    /* s = sqrt(v) */
    __m256 s = _mm256_sqrt_ps(*v);
    /* d = s + eps_hat */
    __m256 d = _mm256_add_ps(s, h->eps);
    /* p = p - step_hat * (m / d) */
    *p = _mm256_sub_ps(*p, _mm256_mul_ps(h->step_size, _mm256_div_ps(*m, d)));
    return s;
}

/* Section 1 on 8 lanes; returns s = sqrt(v); p is canonical. */
AB_INLINE __m256 avx2_adamw(const avx2_hyper *h, __m256 *p, __m256 g, __m256 *m, __m256 *v)
{
    __m256 s = avx2_adamw_raw(h, p, g, m, v);
    *p = avx2_canon(*p);
    return s;
}

#include "simd_avx2.h"

/* ---- fp32 and bf16 moments: 16 elements in the unpack layout -----------------------------
 * NOTE: 16 bf16 elements loaded as 32 bytes widen to fp32 with one unpack each half
 * (unpacklo/hi_epi16 with zero puts b << 16 in 32-bit lanes) and the 16-bit results narrow
 * back with one packus, where the natural order costs a zero-extend and a shift per 8
 * elements to widen and a permute per 16 to narrow. The unpacks work within 128-bit lanes, so
 * the two vectors of a step hold elements {0-3, 8-11} (.a) and {4-7, 12-15} (.b) of it, and
 * packus(a, b) is back in order. The fp32 streams (master, fp32 moments, gradient or copy)
 * load and store their 16-byte quarters into that order, the hash indices follow it. Every
 * element is computed exactly as in the natural order: only which lane holds it changes. The
 * bf16 moments went from 1.88 to 1.41 cycles per element (cache-resident, SR) with this and
 * avx2_any_nan2. */
typedef struct {
    __m256 a, b;
} avx2_half_pair;

AB_INLINE avx2_half_pair avx2_load16_bf16(const uint16_t *src)
{
    __m256i x = _mm256_loadu_si256((const __m256i *)src), z = _mm256_setzero_si256();
    avx2_half_pair r = {_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x)),
                        _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x))};
    return r;
}

AB_INLINE avx2_half_pair avx2_load16_f32(const float *src)
{
    avx2_half_pair r = {
        _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(src)), _mm_loadu_ps(src + 8), 1),
        _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(src + 4)), _mm_loadu_ps(src + 12), 1)};
    return r;
}

AB_INLINE void avx2_store16_f32(float *dst, avx2_half_pair x, int nt)
{
    if (nt) {
        _mm_stream_ps(dst, _mm256_castps256_ps128(x.a));
        _mm_stream_ps(dst + 8, _mm256_extractf128_ps(x.a, 1));
        _mm_stream_ps(dst + 4, _mm256_castps256_ps128(x.b));
        _mm_stream_ps(dst + 12, _mm256_extractf128_ps(x.b, 1));
        return;
    }
    _mm_storeu_ps(dst, _mm256_castps256_ps128(x.a));
    _mm_storeu_ps(dst + 8, _mm256_extractf128_ps(x.a, 1));
    _mm_storeu_ps(dst + 4, _mm256_castps256_ps128(x.b));
    _mm_storeu_ps(dst + 12, _mm256_extractf128_ps(x.b, 1));
}

AB_INLINE avx2_half_pair avx2_load16_grad(const void *g, int64_t i, int dtype)
{
    if (dtype == AB_F32)
        return avx2_load16_f32((const float *)g + i);
    if (dtype == AB_BF16)
        return avx2_load16_bf16((const uint16_t *)g + i);
    /* fp16: F16C in order, then the 128-bit halves into the unpack layout */
    __m256 n0 = avx2_load_half((const uint16_t *)g + i, AB_F16);
    __m256 n1 = avx2_load_half((const uint16_t *)g + i + 8, AB_F16);
    avx2_half_pair r = {_mm256_permute2f128_ps(n0, n1, 0x20), _mm256_permute2f128_ps(n0, n1, 0x31)};
    return r;
}

/* 16-bit values in u32 lanes of a and b (unpack layout) -> 16 u16 in order. */
AB_INLINE __m256i avx2_narrow16_pair(__m256i a, __m256i b) { return _mm256_packus_epi32(a, b); }

AB_INLINE void avx2_store16_out(void *out, int64_t i, avx2_half_pair p, int dtype, int nt)
{
    if (dtype == AB_NONE)
        return;
    if (dtype == AB_F32) {
        avx2_store16_f32((float *)out + i, p, nt);
        return;
    }
    if (dtype == AB_BF16) {
        __m256i c = avx2_narrow16_pair(avx2_bf16_rne(p.a), avx2_bf16_rne(p.b));
        if (nt)
            _mm256_stream_si256((__m256i *)((uint16_t *)out + i), c);
        else
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), c);
        return;
    }
    /* fp16: elements {0-3, 8-11} and {4-7, 12-15}, regrouped by 64-bit halves */
    __m128i ha = _mm256_cvtps_ph(p.a, _MM_FROUND_TO_NEAREST_INT);
    __m128i hb = _mm256_cvtps_ph(p.b, _MM_FROUND_TO_NEAREST_INT);
    __m128i lo = _mm_unpacklo_epi64(ha, hb), hi = _mm_unpackhi_epi64(ha, hb);
    __m128i *dst = (__m128i *)((uint16_t *)out + i);
    if (nt) {
        _mm_stream_si128(dst, lo);
        _mm_stream_si128(dst + 1, hi);
    } else {
        _mm_storeu_si128(dst, lo);
        _mm_storeu_si128(dst + 1, hi);
    }
}

/* The bf16 codes of m and v in u32 lanes: stochastic (r from the hash) or nearest even. */
AB_INLINE void avx2_bf16_codes(__m256 m, __m256 v, __m256i kh, __m256i idx, int sr, __m256i *qm,
                               __m256i *qv)
{
    if (sr) {
        __m256i r = avx2_mix32(_mm256_xor_si256(kh, idx));
        /* qm = (as_u32(m) + (r & 0xffff)) >> 16 */
        *qm = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(m),
                                _mm256_and_si256(r, _mm256_set1_epi32(0xffff))), 16);
        /* qv = (as_u32(v) + (r >> 16)) >> 16 */
        *qv = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(v),
                                _mm256_srli_epi32(r, 16)), 16);
    } else {
        *qm = avx2_bf16_rne(m);
        *qv = avx2_bf16_rne(v);
    }
}

/* NOTE: a NaN m or v always makes p a NaN (m / d is a NaN when m is, and d is when v is), so
 * when neither p of a step is a NaN (one compare of the pair and one movemask) no m or v is,
 * and the six canonicalising blends are skipped: the same bits, fewer uops in the common case. */
AB_INLINE int avx2_any_nan2(__m256 a, __m256 b)
{
    return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q)) != 0;
}

/* 16 elements from i with fp32 or bf16 moments, in the unpack layout; idx holds lo32 of the
 * global indices of lanes .a (i + {0-3, 8-11}); .b's are 4 more. */
AB_INLINE void avx2_flat_step16(const avx2_hyper *h, float *pp, const void *gp, void *mp,
                                void *vp, void *op, int64_t i, __m256i kh, __m256i idx, int G,
                                int O, int prec, int sr, int nt)
{
    avx2_half_pair p = avx2_load16_f32(pp + i), g = avx2_load16_grad(gp, i, G), m, v;
    if (prec == AB_MOMENTS_F32) {
        m = avx2_load16_f32((float *)mp + i);
        v = avx2_load16_f32((float *)vp + i);
    } else {
        m = avx2_load16_bf16((uint16_t *)mp + i);             /* m = as_f32(qm << 16) */
        v = avx2_load16_bf16((uint16_t *)vp + i);             /* v = as_f32(qv << 16) */
    }
    avx2_adamw_raw(h, &p.a, g.a, &m.a, &v.a);
    avx2_adamw_raw(h, &p.b, g.b, &m.b, &v.b);
    if (__builtin_expect(avx2_any_nan2(p.a, p.b), 0)) {
        /* a NaN p, m or v is stored as 0x7fc00000 */
        p.a = avx2_canon(p.a), p.b = avx2_canon(p.b);
        m.a = avx2_canon(m.a), m.b = avx2_canon(m.b);
        v.a = avx2_canon(v.a), v.b = avx2_canon(v.b);
    }
    avx2_store16_f32(pp + i, p, 0);
    if (prec == AB_MOMENTS_F32) {
        avx2_store16_f32((float *)mp + i, m, 0);
        avx2_store16_f32((float *)vp + i, v, 0);
    } else {
        __m256i qma, qva, qmb, qvb;
        avx2_bf16_codes(m.a, v.a, kh, idx, sr, &qma, &qva);
        avx2_bf16_codes(m.b, v.b, kh, _mm256_add_epi32(idx, _mm256_set1_epi32(4)), sr, &qmb, &qvb);
        _mm256_storeu_si256((__m256i *)((uint16_t *)mp + i), avx2_narrow16_pair(qma, qmb));
        _mm256_storeu_si256((__m256i *)((uint16_t *)vp + i), avx2_narrow16_pair(qva, qvb));
    }
    avx2_store16_out(op, i, p, O, nt);
}

AB_INLINE void avx2_loop_flat(const ab_tensor *t, int64_t begin, int64_t end, int G, int O,
                              int prec, int sr, int nt)
{
    avx2_hyper h;
    avx2_hyper_init(&h, &t->hparams);
    float *pp = t->param;
    const void *gp = t->grad;
    void *mp = t->exp_avg, *vp = t->exp_avg_sq, *op = t->out;
    uint64_t gi = (uint64_t)(t->offset + begin);
    /* r(i) = mix32(key ^ lo32(i) ^ mix32(hi32(i))): hi32 is constant over the call */
    __m256i kh = _mm256_set1_epi32((int)(t->key ^ ab_mix32_inline((uint32_t)(gi >> 32))));
    __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)gi),
                                   _mm256_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11));
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
        if (((i - begin) & 31) == 0)           /* prefetch ahead (codecs.h AB_PREFETCH) */
            ab_prefetch_streams(pp, gp, mp, vp, i + AB_PREFETCH, 32, ab_dtype_size(G),
                                prec == AB_MOMENTS_F32 ? 4 : 2);
        avx2_flat_step16(&h, pp, gp, mp, vp, op, i, kh, idx, G, O, prec, sr, nt);
        idx = _mm256_add_epi32(idx, _mm256_set1_epi32(16));
    }
    if (i < end)
        ab_update_scalar(t, i, end, 0);                /* tail: the scalar lines */
}

/* ---- fp8 moments ------------------------------------------------------------------------ */

/* lo32 of the global indices of 8 elements in order, from that of the first. */
#define AVX2_IOTA _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)

/* Whether the block must take the scalar path: 256 * scale_m overflows (see
 * avx2_e4m3_decode_div256); never written, possible only in a hand-made state. */
AB_INLINE int avx2_fp8_scale_odd(float scale_m)
{
    uint32_t s = ab_as_u32(scale_m) & 0x7fffffffu;
    return s >= 0x7b800000u && s < 0x7f800000u;        /* 2^120 <= |scale_m| < inf */
}

/* A block between its two passes: where its codes go, the kept m and s, 1/scale. */
typedef struct {
    uint8_t *qm, *qv;
    float *mbuf, *sbuf;
    __m256 inv_m, inv_v;
    __m256i idx;             /* lo32 of the global indices of the next 8 elements to encode */
} avx2_fp8_pending;

/* NOTE (pass 1): the block maxima are unsigned integer maxima of the patterns of |m|
 * and s: for non-negative finite floats the order of the patterns is the order of the values,
 * so the result is the same float. A non-finite |m| or s (or an s with its sign bit set: -0 or
 * a negative NaN, possible only with beta2 > 1) has a pattern >= 0x7f800000, and then the
 * block's maxima are taken again over its finite values by the scalar lines. The E4M3 NaN
 * code's select (a compare, a widening and a blend per 8 elements) runs only in blocks that
 * hold that code (one test per block), and p is canonicalised only where a pair of vectors
 * holds a NaN. The same bits as before in every case. */
#define AVX2_FP8_NONFINITE 0x7f800000u

/* A block's pattern maxima and minima of |m| and s, lane by lane. */
typedef struct {
    __m256i max_m, max_s, min_m, min_s;
} avx2_fp8_extrema;

/* Pass 1 on 8 elements j..j+7 of the block at b0: decode, update, keep m and s, track the
 * pattern maxima; returns p as the arithmetic made it. sm holds 256 * scale_m (see
 * avx2_e4m3_decode_div256); nan_codes: the block may hold the E4M3 NaN code. */
AB_INLINE __m256 avx2_fp8_update8(const ab_tensor *t, const avx2_hyper *h, int64_t b0, int64_t j,
                                  __m256 sm, __m256 sv, float *mbuf, float *sbuf,
                                  avx2_fp8_extrema *ex, int G, int nan_codes)
{
    int64_t i = b0 + j;
    const uint8_t *qm = (const uint8_t *)t->exp_avg + i, *qv = (const uint8_t *)t->exp_avg_sq + i;
    __m256 p = _mm256_loadu_ps(t->param + i);
    __m256 g = avx2_load_grad(t->grad, i, G);
    /* m = dec_e4m3(qm) * scale_m */
    __m128i cm = _mm_loadl_epi64((const __m128i *)qm);
    __m256 dm = nan_codes ? avx2_e4m3_decode_div256(cm) : avx2_e4m3_decode_div256_finite(cm);
    __m256 m = _mm256_mul_ps(dm, sm);
    /* sv = dec_e5m2(qv) * scale_v; v = sv * sv */
    __m256 s = _mm256_mul_ps(avx2_e5m2_decode(_mm_loadl_epi64((const __m128i *)qv)), sv);
    __m256 v = _mm256_mul_ps(s, s);
    s = avx2_adamw_raw(h, &p, g, &m, &v);
    /* amax_m = max |m|; amax_s = max s, as patterns (see the NOTE above) */
    __m256i am = _mm256_and_si256(_mm256_castps_si256(m), _mm256_set1_epi32(0x7fffffff));
    __m256i as = _mm256_castps_si256(s);
    ex->max_m = _mm256_max_epu32(ex->max_m, am);
    ex->max_s = _mm256_max_epu32(ex->max_s, as);
    ex->min_m = _mm256_min_epu32(ex->min_m, am);      /* and the minima (see avx2_fp8_wide) */
    ex->min_s = _mm256_min_epu32(ex->min_s, as);
    _mm256_store_ps(mbuf + j, m);
    _mm256_store_ps(sbuf + j, s);
    return p;
}

/* Pass 1 on 16 elements j..j+15: two 8-lane updates, p canonicalised where a NaN is, the bf16
 * copy narrowed in one packus and one permute. */
AB_INLINE void avx2_fp8_update16(const ab_tensor *t, const avx2_hyper *h, int64_t b0, int64_t j,
                                 __m256 sm, __m256 sv, float *mbuf, float *sbuf, avx2_fp8_extrema *ex, int G, int O, int nt, int nan_codes)
{
    int64_t i = b0 + j;
    __m256 p0 = avx2_fp8_update8(t, h, b0, j, sm, sv, mbuf, sbuf, ex, G, nan_codes);
    __m256 p1 = avx2_fp8_update8(t, h, b0, j + 8, sm, sv, mbuf, sbuf, ex, G,
                                 nan_codes);
    if (__builtin_expect(avx2_any_nan2(p0, p1), 0))
        p0 = avx2_canon(p0), p1 = avx2_canon(p1);     /* a NaN p is stored as 0x7fc00000 */
    _mm256_storeu_ps(t->param + i, p0);
    _mm256_storeu_ps(t->param + i + 8, p1);
    if (O == AB_BF16) {
        __m256i c = _mm256_permute4x64_epi64(
            _mm256_packus_epi32(avx2_bf16_rne(p0), avx2_bf16_rne(p1)), 0xd8);
        __m256i *dst = (__m256i *)((uint16_t *)t->out + i);
        if (nt)
            _mm256_stream_si256(dst, c);
        else
            _mm256_storeu_si256(dst, c);
    } else {
        avx2_store_out(t->out, i, p0, O, nt);
        avx2_store_out(t->out, i + 8, p1, O, nt);
    }
}

/* Whether the n codes of m at qm hold the E4M3 NaN code (0x7f or 0xff). */
AB_INLINE int avx2_has_e4m3_nan(const uint8_t *qm, int64_t n)
{
    __m256i any = _mm256_setzero_si256(), low7 = _mm256_set1_epi8(0x7f);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        __m256i c = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(qm + j)), low7);
        any = _mm256_or_si256(any, _mm256_cmpeq_epi8(c, low7));
    }
    int found = _mm256_movemask_epi8(any) != 0;
    for (; j < n; j++)
        found |= (qm[j] & 0x7f) == 0x7f;
    return found;
}

/* Pass 1 of a block: its whole multiples of 8 elements; returns how many it did. */
AB_INLINE int64_t avx2_fp8_pass1(const ab_tensor *t, const avx2_hyper *h, int64_t b0, int64_t n,
                                 __m256 sm, __m256 sv, float *mbuf, float *sbuf,
                                 avx2_fp8_extrema *ex, int G, int O, int nt,
                                 int nan_codes)
{
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        avx2_fp8_update16(t, h, b0, j, sm, sv, mbuf, sbuf, ex, G, O, nt, nan_codes);
    if (j + 8 <= n) {
        __m256 p = avx2_canon(avx2_fp8_update8(t, h, b0, j, sm, sv, mbuf, sbuf, ex, G,
                                               nan_codes));
        _mm256_storeu_ps(t->param + b0 + j, p);
        avx2_store_out(t->out, b0 + j, p, O, nt);
        j += 8;
    }
    return j;
}

/* The block's new scales from its absmax; fills in 1/scale for the encode. */
AB_INLINE void avx2_fp8_rescale(avx2_fp8_pending *b, float *scale_m, float *scale_v,
                                float amax_m, float amax_s)
{
    /* scale_m = amax_m / 448; scale_v = amax_s / 57344;
     * inv_m = 448 / amax_m, inv_v = 57344 / amax_s, each 0 where not finite (amax 0, or too
     * small for the quotient; the scales are always finite) (one divps for the four) */
    __m128 num = _mm_setr_ps(amax_m, amax_s, AB_E4M3_MAX, AB_E5M2_MAX);
    __m128 den = _mm_setr_ps(AB_E4M3_MAX, AB_E5M2_MAX, amax_m, amax_s);
    __m128 q = _mm_div_ps(num, den);
    q = _mm_and_ps(q, _mm_cmplt_ps(q, _mm_set1_ps(ab_as_f32(0x7f800000u))));
    _mm_store_ss(scale_m, q);
    _mm_store_ss(scale_v, _mm_shuffle_ps(q, q, 1));
    b->inv_m = _mm256_broadcastss_ps(_mm_shuffle_ps(q, q, 2));
    b->inv_v = _mm256_broadcastss_ps(_mm_shuffle_ps(q, q, 3));
}

/* The unsigned max (or min) of the 8 lanes of a and of b, as *fa and *fb. */
AB_INLINE void avx2_fold_pair(__m256i a, __m256i b, int min, uint32_t *fa, uint32_t *fb)
{
    /* [a lanes 0-3, b lanes 0-3] op [a lanes 4-7, b lanes 4-7], then within each half */
    __m256i lo = _mm256_permute2x128_si256(a, b, 0x20), hi = _mm256_permute2x128_si256(a, b, 0x31);
    __m256i x = min ? _mm256_min_epu32(lo, hi) : _mm256_max_epu32(lo, hi);
    __m256i y = _mm256_shuffle_epi32(x, 0x4e);
    x = min ? _mm256_min_epu32(x, y) : _mm256_max_epu32(x, y);
    y = _mm256_shuffle_epi32(x, 0xb1);
    x = min ? _mm256_min_epu32(x, y) : _mm256_max_epu32(x, y);
    *fa = (uint32_t)_mm256_cvtsi256_si32(x);
    *fb = (uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(x, 1));
}

/* The block maxima of the pattern lanes as floats; 0 when either is not finite (the caller
 * then takes the maxima the scalar way). */
AB_INLINE int avx2_fp8_amax(const avx2_fp8_extrema *ex, float *amax_m, float *amax_s)
{
    uint32_t bm, bs;
    avx2_fold_pair(ex->max_m, ex->max_s, 0, &bm, &bs);
    *amax_m = ab_as_f32(bm), *amax_s = ab_as_f32(bs);
    return bm < AVX2_FP8_NONFINITE && bs < AVX2_FP8_NONFINITE;
}

/* Whether a finite block is wide (see avx512_fp8_wide in kernel_avx512.c): every x_m >= 2^-6,
 * every x_v > 2^-14 and inv_v >= 2^-14, from the minima of |m| and s. */
AB_INLINE int avx2_fp8_wide(const avx2_fp8_extrema *ex, float inv_m, float inv_v)
{
    uint32_t bm, bs;
    avx2_fold_pair(ex->min_m, ex->min_s, 1, &bm, &bs);
    float tiny_m = ab_as_f32((uint32_t)(127 + AB_E4M3_EMIN) << 23);   /* 2^-6 */
    float tiny_v = ab_as_f32((uint32_t)(127 + AB_E5M2_EMIN) << 23);   /* 2^-14 */
    return ab_as_f32(bm) * inv_m >= tiny_m && ab_as_f32(bs) * inv_v > tiny_v && inv_v >= tiny_v;
}

/* Pass 2 on 8 elements j..j+7 of a rescaled block: the codes of m and s in u32 lanes.
 * finite: every m and s of the block is finite (and s >= +0), as the block maxima showed. */
AB_INLINE void avx2_fp8_codes8(avx2_fp8_pending *b, int64_t j, __m256i kh, int sr, int finite,
                               int wide, __m256i *cm_out, __m256i *cv_out)
{
    __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_load_ps(b->mbuf + j), s = _mm256_load_ps(b->sbuf + j);
    __m256i rnd_m = _mm256_setzero_si256(), rnd_v = _mm256_setzero_si256();
    if (sr) {
        /* r(i); r_m = r & 0xffff, r_v = r >> 16, placed below the kept bits: r_m << 4 (E4M3),
         * r_v << 5 (E5M2) */
        __m256i r = avx2_mix32(_mm256_xor_si256(kh, b->idx));
        rnd_m = _mm256_srli_epi32(_mm256_slli_epi32(r, 16), 16 - (7 - AB_E4M3_MBITS));
        rnd_v = _mm256_slli_epi32(_mm256_srli_epi32(r, 16), 7 - AB_E5M2_MBITS);
        b->idx = _mm256_add_epi32(b->idx, _mm256_set1_epi32(8));
    }
    /* x_m = |m| * inv_m; x_v = s * inv_v (wide: b->inv_v holds inv_v * 2^-112) */
    __m256i cm = avx2_fp8_encode(_mm256_mul_ps(_mm256_and_ps(m, abs_mask), b->inv_m),
                                 AB_E4M3_EMIN, AB_E4M3_MBITS, sr, finite, wide, rnd_m);
    *cv_out = avx2_fp8_encode(_mm256_mul_ps(s, b->inv_v), AB_E5M2_EMIN, AB_E5M2_MBITS, sr, finite,
                              wide, rnd_v);
    /* sign bit when m < 0 and the code is not the NaN code, i.e. m negative, nonzero and
     * finite (only a non-finite m gets the NaN code): in a finite block that is m < 0; else
     * as_u32(m) in (0x80000000, 0xff800000), that is as_i32(m) - 1 < as_i32(0xff7fffff)
     * signed (-0 wraps to INT_MAX; -inf and the negative NaNs are above), one subtract and
     * one compare */
    __m256i neg = finite ? _mm256_castps_si256(_mm256_cmp_ps(m, _mm256_setzero_ps(), _CMP_LT_OQ))
                         : _mm256_cmpgt_epi32(_mm256_set1_epi32((int)0xff7fffffu),
                                              _mm256_sub_epi32(_mm256_castps_si256(m),
                                                               _mm256_set1_epi32(1)));
    *cm_out = _mm256_or_si256(cm, _mm256_and_si256(neg, _mm256_set1_epi32(0x80)));
}

/* Pass 2 on 8 elements j..j+7: encode m and s, store the codes. */
AB_INLINE void avx2_fp8_encode8(avx2_fp8_pending *b, int64_t j, __m256i kh, int sr, int finite,
                                int wide)
{
    const __m256i pick_m = _mm256_setr_epi8(
        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i pick_v = _mm256_setr_epi8(
        -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
        -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i cm, cv;
    avx2_fp8_codes8(b, j, kh, sr, finite, wide, &cm, &cv);
    /* lane 0: m0-3 v0-3, lane 1: m4-7 v4-7 -> m0-7 | v0-7 */
    __m256i c = _mm256_or_si256(_mm256_shuffle_epi8(cm, pick_m), _mm256_shuffle_epi8(cv, pick_v));
    __m128i mv = _mm_unpacklo_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64((__m128i *)(b->qm + j), mv);
    _mm_storeu_si64(b->qv + j, _mm_unpackhi_epi64(mv, mv)); /* unaligned: qv + j is any byte */
}

/* Four vectors of 8 codes (u32 lanes, each <= 0xff) -> 32 bytes in order: two packus to u16
 * and one to u8 (each interleaving the 128-bit lanes), then one dword permute, where four
 * avx2_fp8_encode8 stores would take six shuffles each. */
AB_INLINE __m256i avx2_pack_codes32(__m256i c0, __m256i c1, __m256i c2, __m256i c3)
{
    __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Pass 2 on 32 elements j..j+31: encode m and s, one 32-byte store each. */
AB_INLINE void avx2_fp8_encode32(avx2_fp8_pending *b, int64_t j, __m256i kh, int sr, int finite,
                                 int wide)
{
    __m256i cm0, cv0, cm1, cv1, cm2, cv2, cm3, cv3;
    avx2_fp8_codes8(b, j, kh, sr, finite, wide, &cm0, &cv0);
    avx2_fp8_codes8(b, j + 8, kh, sr, finite, wide, &cm1, &cv1);
    avx2_fp8_codes8(b, j + 16, kh, sr, finite, wide, &cm2, &cv2);
    avx2_fp8_codes8(b, j + 24, kh, sr, finite, wide, &cm3, &cv3);
    _mm256_storeu_si256((__m256i *)(b->qm + j), avx2_pack_codes32(cm0, cm1, cm2, cm3));
    _mm256_storeu_si256((__m256i *)(b->qv + j), avx2_pack_codes32(cv0, cv1, cv2, cv3));
}

/* Pass 2 on the whole multiples of 8 elements of a block: encode, store the codes; returns
 * how many it did. */
AB_INLINE int64_t avx2_fp8_pass2(avx2_fp8_pending *b, int64_t n, __m256i kh, int sr, int finite,
                                 int wide)
{
    int64_t j = 0;
    for (; j + 32 <= n; j += 32)
        avx2_fp8_encode32(b, j, kh, sr, finite, wide);
    for (; j + 8 <= n; j += 8)
        avx2_fp8_encode8(b, j, kh, sr, finite, wide);
    return j;
}

/* One block [b0, b0 + n), n <= 128, by itself: decode, update, keep m and s, rescale, encode;
 * the elements past the last multiple of 8 take the scalar lines. */
AB_INLINE void avx2_fp8_block(const ab_tensor *t, const avx2_hyper *h, int64_t b0, int64_t n,
                              __m256i kh, int G, int O, int sr, int nt)
{
    AB_ALIGN64 float mbuf[AB_BLOCK];
    AB_ALIGN64 float sbuf[AB_BLOCK];
    uint8_t *qm = (uint8_t *)t->exp_avg + b0, *qv = (uint8_t *)t->exp_avg_sq + b0;
    float *scale_m = &t->exp_avg_scale[b0 / AB_BLOCK];
    float *scale_v = &t->exp_avg_sq_scale[b0 / AB_BLOCK];
    __m256 sm = _mm256_set1_ps(*scale_m * 256.0f), sv = _mm256_set1_ps(*scale_v);
    avx2_fp8_extrema ex = {_mm256_setzero_si256(), _mm256_setzero_si256(),
                           _mm256_set1_epi32(-1), _mm256_set1_epi32(-1)};
    int64_t j = avx2_has_e4m3_nan(qm, n)
        ? avx2_fp8_pass1(t, h, b0, n, sm, sv, mbuf, sbuf, &ex, G, O, nt, 1)
        : avx2_fp8_pass1(t, h, b0, n, sm, sv, mbuf, sbuf, &ex, G, O, nt, 0);
    int64_t nvec = j;
    for (; j < n; j++)                                 /* tail: the scalar lines */
        sbuf[j] = ab_fp8_elem_update(t, b0 + j, qm[j], qv[j], *scale_m, *scale_v, &mbuf[j], G, O);
    float amax_m, amax_s;
    int finite = avx2_fp8_amax(&ex, &amax_m, &amax_s);   /* the vector part's */
    if (finite) {
        for (j = nvec; j < n; j++)                     /* the tail's finite values */
            ab_fp8_elem_amax(mbuf[j], sbuf[j], &amax_m, &amax_s);
    } else {                                           /* a non-finite value: all again */
        amax_m = 0.0f, amax_s = 0.0f;
        for (j = 0; j < n; j++)
            ab_fp8_elem_amax(mbuf[j], sbuf[j], &amax_m, &amax_s);
    }
    avx2_fp8_pending b = {qm, qv, mbuf, sbuf, _mm256_setzero_ps(), _mm256_setzero_ps(),
                          _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)(t->offset + b0)),
                                           AVX2_IOTA)};
    avx2_fp8_rescale(&b, scale_m, scale_v, amax_m, amax_s);
    float inv_m = _mm256_cvtss_f32(b.inv_m), inv_v = _mm256_cvtss_f32(b.inv_v);
    if (finite && avx2_fp8_wide(&ex, inv_m, inv_v)) {
        b.inv_v = _mm256_set1_ps(inv_v * ab_fp8_to_f32_grid(AB_E5M2_EMIN));
        j = avx2_fp8_pass2(&b, n, kh, sr, 1, 1);
    } else {
        j = finite ? avx2_fp8_pass2(&b, n, kh, sr, 1, 0) : avx2_fp8_pass2(&b, n, kh, sr, 0, 0);
    }
    for (; j < n; j++) {                               /* tail: the scalar lines */
        uint32_t r = sr ? ab_hash_inline(t->key, (uint64_t)(t->offset + b0 + j)) : 0u;
        ab_fp8_elem_encode(mbuf[j], sbuf[j], inv_m, inv_v, sr, r, &qm[j], &qv[j]);
    }
}

AB_INLINE void avx2_loop_fp8(const ab_tensor *t, int64_t begin, int64_t end, int G, int O,
                             int sr, int nt)
{
    avx2_hyper h;
    avx2_hyper_init(&h, &t->hparams);
    uint64_t gi = (uint64_t)(t->offset + begin);
    __m256i kh = _mm256_set1_epi32((int)(t->key ^ ab_mix32_inline((uint32_t)(gi >> 32))));
    /* NOTE: the blocks read the tensor's fields from a copy whose address never escapes:
     * through `t`, every store of a code (a byte store, which may alias anything) made the
     * compiler reload the pointers; full blocks get a constant length */
    const ab_tensor local = *t;
    for (int64_t b0 = begin; b0 < end; b0 += AB_BLOCK) {
        ab_prefetch_streams(local.param, local.grad, local.exp_avg, local.exp_avg_sq,
                            b0 + AB_PREFETCH, AB_BLOCK, ab_dtype_size(G), 1);
        int64_t n = end - b0 < AB_BLOCK ? end - b0 : AB_BLOCK;
        if (avx2_fp8_scale_odd(local.exp_avg_scale[b0 / AB_BLOCK]))
            ab_update_scalar(t, b0, b0 + n, 0);
        else if (n == AB_BLOCK)
            avx2_fp8_block(&local, &h, b0, AB_BLOCK, kh, G, O, sr, nt);
        else
            avx2_fp8_block(&local, &h, b0, n, kh, G, O, sr, nt);
    }
}

/* ---- entry: one specialised loop per (precision, rounding, grad dtype, out dtype) -------- */

#define AVX2_F32(G, O) avx2_loop_flat(t, begin, end, G, O, AB_MOMENTS_F32, 0, nt)
#define AVX2_BF16_SR(G, O) avx2_loop_flat(t, begin, end, G, O, AB_MOMENTS_BF16, 1, nt)
#define AVX2_BF16_RNE(G, O) avx2_loop_flat(t, begin, end, G, O, AB_MOMENTS_BF16, 0, nt)
#define AVX2_FP8_SR(G, O) avx2_loop_fp8(t, begin, end, G, O, 1, nt)
#define AVX2_FP8_RNE(G, O) avx2_loop_fp8(t, begin, end, G, O, 0, nt)

AB_NOINLINE void avx2_f32(const ab_tensor *t, int64_t begin, int64_t end, int nt)
{
    AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, AVX2_F32)
}
AB_NOINLINE void avx2_bf16(const ab_tensor *t, int64_t begin, int64_t end, int nt)
{
    if (t->stochastic_rounding) {
        AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, AVX2_BF16_SR)
    } else {
        AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, AVX2_BF16_RNE)
    }
}
AB_NOINLINE void avx2_fp8(const ab_tensor *t, int64_t begin, int64_t end, int nt)
{
    if (t->stochastic_rounding) {
        AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, AVX2_FP8_SR)
    } else {
        AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, AVX2_FP8_RNE)
    }
}

void ab_update_avx2(const ab_tensor *t, int64_t begin, int64_t end, int flags)
{
    int osize = ab_dtype_size(t->out_dtype);
    /* non-temporal stores need every store of `out` aligned: 32 bytes for the widest (16 bf16
     * or 8 fp32 elements), 16 for the 8-element fp16 and bf16 ones; the loops advance by whole
     * stores, so checking the first for 32 covers all (a 16-byte check let a bf16 copy 16
     * bytes past 32-byte alignment fault) */
    int nt = (flags & AB_KFLAG_STREAM_OUT) && osize &&
             ((uintptr_t)((char *)t->out + begin * osize) % 32) == 0;
    if (t->precision == AB_MOMENTS_F32)
        avx2_f32(t, begin, end, nt);
    else if (t->precision == AB_MOMENTS_BF16)
        avx2_bf16(t, begin, end, nt);
    else
        avx2_fp8(t, begin, end, nt);
    if (nt)
        _mm_sfence();  /* order the streamed `out` before the pool reports the work done */
}

#undef AVX2_F32
#undef AVX2_BF16_SR
#undef AVX2_BF16_RNE
#undef AVX2_FP8_SR
#undef AVX2_FP8_RNE
#undef AVX2_IOTA

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif /* AB_HAVE_AVX2 */

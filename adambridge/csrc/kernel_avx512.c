/* kernel_avx512.c: the fused AdamW update, 16 lanes of AVX-512 (F, BW, VL).
 *
 * Contract: exactly kernel_scalar.c, bit for bit (docs/numerics.md), 16 elements at a time; the
 * same structure as kernel_avx2.c, line for line, with the scalar line above the intrinsics.
 * No FMA. Tails use masked loads and stores (never touching memory past the end), so the
 * scalar code is not needed here. Only the write-only `out` stream may be non-temporal.
 *
 * NOTE: AVX512-BF16 (vcvtneps2bf16) is not used for the bf16 copy: it flushes subnormal inputs
 * to zero, which the integer round-to-nearest-even of numerics.md section 3 does not.
 *
 * Flags when compiled alone: -mavx512f -mavx512bw -mavx512vl. The target pragma below lets
 * the file also compile inside the unity build of tests/native/selftest.c with no flags.
 * Reference: https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html
 */
#include "codecs.h"

#if defined(AB_HAVE_AVX512)

#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
#endif

typedef struct {
    __m512 decay, beta1, omb1, beta2, omb2, eps, step_size;
} avx512_hyper;

static void avx512_hyper_init(avx512_hyper *h, const ab_hyper *s)
{
    h->decay = _mm512_set1_ps(s->decay);
    h->beta1 = _mm512_set1_ps(s->beta1);
    h->omb1 = _mm512_set1_ps(s->one_minus_beta1);
    h->beta2 = _mm512_set1_ps(s->beta2);
    h->omb2 = _mm512_set1_ps(s->one_minus_beta2);
    h->eps = _mm512_set1_ps(s->eps);
    h->step_size = _mm512_set1_ps(s->step_size);
}

/* ab_canon on 16 lanes: a NaN becomes 0x7fc00000. */
AB_INLINE __m512 avx512_canon(__m512 x)
{
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(x, nan, _mm512_castsi512_ps(_mm512_set1_epi32((int)AB_CANON_NAN)));
}

/* Section 1 on 16 lanes; returns s = sqrt(v); a NaN p is left as the arithmetic made it. */
AB_INLINE __m512 avx512_adamw_raw(const avx512_hyper *h, __m512 *p, __m512 g, __m512 *m,
                                  __m512 *v)
{
    /* p = p * decay */
    *p = _mm512_mul_ps(*p, h->decay);
    /* m = m * beta1_f */
    *m = _mm512_mul_ps(*m, h->beta1);
    /* m = m + g * omb1 */
    *m = _mm512_add_ps(*m, _mm512_mul_ps(g, h->omb1));
    /* v = v * beta2_f */
    *v = _mm512_mul_ps(*v, h->beta2);
    /* v = v + (g * g) * omb2 */
    *v = _mm512_add_ps(*v, _mm512_mul_ps(_mm512_mul_ps(g, g), h->omb2));
    /* s = sqrt(v) */
    __m512 s = _mm512_sqrt_ps(*v);
    /* d = s + eps_hat */
    __m512 d = _mm512_add_ps(s, h->eps);
    /* p = p - step_hat * (m / d) */
    *p = _mm512_sub_ps(*p, _mm512_mul_ps(h->step_size, _mm512_div_ps(*m, d)));
    return s;
}

/* Section 1 on 16 lanes; returns s = sqrt(v); p is canonical. */
AB_INLINE __m512 avx512_adamw(const avx512_hyper *h, __m512 *p, __m512 g, __m512 *m, __m512 *v)
{
    __m512 s = avx512_adamw_raw(h, p, g, m, v);
    *p = avx512_canon(*p);
    return s;
}

#include "simd_avx512.h"

/* ---- fp32 and bf16 moments ------------------------------------------------------------- */

#define AVX512_IOTA _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)

/* Decode and update 16 elements from i (the lanes in k when not full), store p and fp32
 * moments; for bf16 moments return their codes in u32 lanes (*qm, *qv). */
AB_INLINE __m512 avx512_flat_update(const avx512_hyper *h, float *pp, const void *gp, void *mp,
                                    void *vp, int64_t i, __m512i kh, __m512i idx, int G, int prec,
                                    int sr, __mmask16 k, int full, __m512i *qm, __m512i *qv)
{
    __m512 p = avx512_load_f32(pp + i, k, full);
    __m512 g = avx512_load_grad(gp, i, G, k, full);
    __m512 m, v;
    if (prec == AB_MOMENTS_F32) {
        m = avx512_load_f32((float *)mp + i, k, full);
        v = avx512_load_f32((float *)vp + i, k, full);
    } else {
        /* m = as_f32(qm << 16); v = as_f32(qv << 16) */
        m = avx512_half_to_f32(avx512_load_u16((uint16_t *)mp + i, k, full), AB_BF16);
        v = avx512_half_to_f32(avx512_load_u16((uint16_t *)vp + i, k, full), AB_BF16);
    }
    avx512_adamw_raw(h, &p, g, &m, &v);
    /* a NaN p, m or v is stored as 0x7fc00000; a NaN m or v makes p a NaN (m / d is a NaN when
     * m is, d when v is), so when no p is one (one compare into a mask) neither is any m or v,
     * and the three canonicalising blends are skipped: the same bits, fewer uops */
    if (__builtin_expect(_mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q) != 0, 0)) {
        p = avx512_canon(p);
        m = avx512_canon(m);
        v = avx512_canon(v);
    }
    avx512_store_f32(pp + i, p, k, full);
    if (prec == AB_MOMENTS_F32) {
        avx512_store_f32((float *)mp + i, m, k, full);
        avx512_store_f32((float *)vp + i, v, k, full);
    } else if (sr) {
        __m512i r = avx512_mix32(_mm512_xor_si512(kh, idx));
        /* qm = (as_u32(m) + (r & 0xffff)) >> 16 */
        *qm = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(m),
                                _mm512_and_si512(r, _mm512_set1_epi32(0xffff))), 16);
        /* qv = (as_u32(v) + (r >> 16)) >> 16 */
        *qv = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(v),
                                _mm512_srli_epi32(r, 16)), 16);
    } else {
        *qm = avx512_bf16_rne(m);
        *qv = avx512_bf16_rne(v);
    }
    return p;
}

/* 16 elements from i (the lanes in k when not full): update, store codes and the copy. */
AB_INLINE void avx512_flat_step(const avx512_hyper *h, float *pp, const void *gp, void *mp, void *vp,
                                void *op, int64_t i, __m512i kh, __m512i idx, int G, int O,
                                int prec, int sr, int nt, __mmask16 k, int full)
{
    __m512i qm, qv;
    __m512 p = avx512_flat_update(h, pp, gp, mp, vp, i, kh, idx, G, prec, sr, k, full, &qm, &qv);
    if (prec != AB_MOMENTS_F32) {
        avx512_store_u16((uint16_t *)mp + i, _mm512_cvtepi32_epi16(qm), k, full);
        avx512_store_u16((uint16_t *)vp + i, _mm512_cvtepi32_epi16(qv), k, full);
    }
    avx512_store_out(op, i, p, O, nt, k, full);
}

/* 32 elements from i with fp32 moments: two 16-lane updates whose bf16 copies are narrowed
 * in pairs (avx512_narrow16x2) into one 64-byte store. */
AB_INLINE void avx512_flat_step32(const avx512_hyper *h, float *pp, const void *gp, void *mp,
                                  void *vp, void *op, int64_t i, __m512i kh, __m512i idx, int G,
                                  int O, int prec, int sr, int nt)
{
    __m512i qm0, qv0, qm1, qv1;
    __m512i idx1 = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
    /* prefetch AB_PREFETCH elements ahead in every read stream (see codecs.h) */
    ab_prefetch_streams(pp, gp, mp, vp, i + AB_PREFETCH, 32, ab_dtype_size(G),
                        prec == AB_MOMENTS_F32 ? 4 : 2);
    __m512 p0 = avx512_flat_update(h, pp, gp, mp, vp, i, kh, idx, G, prec, sr, 0xffff, 1, &qm0, &qv0);
    __m512 p1 = avx512_flat_update(h, pp, gp, mp, vp, i + 16, kh, idx1, G, prec, sr, 0xffff, 1,
                                   &qm1, &qv1);
    if (O == AB_BF16) {
        /* the copy: RNE of both halves, narrowed together */
        __m512i c = avx512_narrow16x2(avx512_bf16_rne(p0), avx512_bf16_rne(p1));
        if (nt)
            _mm512_stream_si512((__m512i *)((uint16_t *)op + i), c);
        else
            _mm512_storeu_si512((uint16_t *)op + i, c);
    } else {
        avx512_store_out(op, i, p0, O, nt, 0xffff, 1);
        avx512_store_out(op, i + 16, p1, O, nt, 0xffff, 1);
    }
}

/* ---- bf16 moments: 32 elements in the unpack layout ---------------------------------------
 * NOTE: as in kernel_avx2.c: 32 bf16 elements loaded as 64 bytes widen to fp32 with one
 * unpack per 16 (unpacklo/hi_epi16 with zero puts b << 16 in 32-bit lanes) and narrow back
 * with one packus, where the natural order costs a zero-extend and a shift per 16 to widen
 * and a permute per 32 to narrow. The unpacks work within 128-bit lanes, so .a holds elements
 * {0-3, 8-11, 16-19, 24-27} of the step and .b the other four of each eight; the fp32 streams
 * (master, fp32 gradient or copy) enter and leave that order with one two-source permute per
 * vector, the hash indices follow it. Each element is computed exactly as in natural order. */
typedef struct {
    __m512 a, b;
} avx512_half_pair;

#define AVX512_UNPACK_A _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)

AB_INLINE avx512_half_pair avx512_load32_bf16(const uint16_t *src)
{
    __m512i x = _mm512_loadu_si512(src), z = _mm512_setzero_si512();
    avx512_half_pair r = {_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, x)),
                          _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, x))};
    return r;
}

/* Two vectors of 16 in order -> the unpack layout. */
AB_INLINE avx512_half_pair avx512_to_unpack(__m512 n0, __m512 n1)
{
    const __m512i ia = AVX512_UNPACK_A;
    const __m512i ib = _mm512_add_epi32(ia, _mm512_set1_epi32(4));
    avx512_half_pair r = {_mm512_permutex2var_ps(n0, ia, n1), _mm512_permutex2var_ps(n0, ib, n1)};
    return r;
}

/* The unpack layout -> two vectors of 16 in order. */
AB_INLINE void avx512_from_unpack(avx512_half_pair x, __m512 *n0, __m512 *n1)
{
    const __m512i j0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i j1 = _mm512_add_epi32(j0, _mm512_set1_epi32(8));
    *n0 = _mm512_permutex2var_ps(x.a, j0, x.b);
    *n1 = _mm512_permutex2var_ps(x.a, j1, x.b);
}

AB_INLINE avx512_half_pair avx512_load32_grad(const void *g, int64_t i, int dtype)
{
    if (dtype == AB_BF16)
        return avx512_load32_bf16((const uint16_t *)g + i);
    return avx512_to_unpack(avx512_load_grad(g, i, dtype, 0xffff, 1),
                            avx512_load_grad(g, i + 16, dtype, 0xffff, 1));
}

AB_INLINE void avx512_store32_out(void *out, int64_t i, avx512_half_pair p, int dtype, int nt)
{
    if (dtype == AB_NONE)
        return;
    if (dtype == AB_BF16) {
        /* the copy: RNE of both halves, one packus back to order */
        __m512i c = _mm512_packus_epi32(avx512_bf16_rne(p.a), avx512_bf16_rne(p.b));
        if (nt)
            _mm512_stream_si512((__m512i *)((uint16_t *)out + i), c);
        else
            _mm512_storeu_si512((uint16_t *)out + i, c);
        return;
    }
    __m512 n0, n1;
    avx512_from_unpack(p, &n0, &n1);
    avx512_store_out(out, i, n0, dtype, nt, 0xffff, 1);
    avx512_store_out(out, i + 16, n1, dtype, nt, 0xffff, 1);
}

/* The bf16 codes of m and v in u32 lanes: stochastic (r from the hash) or nearest even. */
AB_INLINE void avx512_bf16_codes(__m512 m, __m512 v, __m512i kh, __m512i idx, int sr,
                                 __m512i *qm, __m512i *qv)
{
    if (sr) {
        __m512i r = avx512_mix32(_mm512_xor_si512(kh, idx));
        /* qm = (as_u32(m) + (r & 0xffff)) >> 16 */
        *qm = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(m),
                                _mm512_and_si512(r, _mm512_set1_epi32(0xffff))), 16);
        /* qv = (as_u32(v) + (r >> 16)) >> 16 */
        *qv = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(v),
                                _mm512_srli_epi32(r, 16)), 16);
    } else {
        *qm = avx512_bf16_rne(m);
        *qv = avx512_bf16_rne(v);
    }
}

/* 32 elements from i with bf16 moments, in the unpack layout; idx holds lo32 of the global
 * index of element i. */
AB_INLINE void avx512_bf16_step32(const avx512_hyper *h, float *pp, const void *gp, uint16_t *mp,
                                  uint16_t *vp, void *op, int64_t i, __m512i kh, __m512i idx,
                                  int G, int O, int sr, int nt)
{
    /* prefetch AB_PREFETCH elements ahead in every read stream (see codecs.h) */
    ab_prefetch_streams(pp, gp, mp, vp, i + AB_PREFETCH, 32, ab_dtype_size(G), 2);
    avx512_half_pair p = avx512_to_unpack(_mm512_loadu_ps(pp + i), _mm512_loadu_ps(pp + i + 16));
    avx512_half_pair g = avx512_load32_grad(gp, i, G);
    avx512_half_pair m = avx512_load32_bf16(mp + i);          /* m = as_f32(qm << 16) */
    avx512_half_pair v = avx512_load32_bf16(vp + i);          /* v = as_f32(qv << 16) */
    avx512_adamw_raw(h, &p.a, g.a, &m.a, &v.a);
    avx512_adamw_raw(h, &p.b, g.b, &m.b, &v.b);
    /* a NaN p, m or v is stored as 0x7fc00000; only p needs testing (see avx512_flat_update) */
    if (__builtin_expect(_mm512_cmp_ps_mask(p.a, p.b, _CMP_UNORD_Q) != 0, 0)) {
        p.a = avx512_canon(p.a), p.b = avx512_canon(p.b);
        m.a = avx512_canon(m.a), m.b = avx512_canon(m.b);
        v.a = avx512_canon(v.a), v.b = avx512_canon(v.b);
    }
    __m512 p0, p1;
    avx512_from_unpack(p, &p0, &p1);
    _mm512_storeu_ps(pp + i, p0);
    _mm512_storeu_ps(pp + i + 16, p1);
    __m512i ia = _mm512_add_epi32(idx, AVX512_UNPACK_A), qma, qva, qmb, qvb;
    avx512_bf16_codes(m.a, v.a, kh, ia, sr, &qma, &qva);
    avx512_bf16_codes(m.b, v.b, kh, _mm512_add_epi32(ia, _mm512_set1_epi32(4)), sr, &qmb, &qvb);
    _mm512_storeu_si512(mp + i, _mm512_packus_epi32(qma, qmb));
    _mm512_storeu_si512(vp + i, _mm512_packus_epi32(qva, qvb));
    avx512_store32_out(op, i, p, O, nt);
}

AB_INLINE void avx512_loop_flat(const ab_tensor *t, int64_t begin, int64_t end, int G, int O,
                                int prec, int sr, int nt)
{
    avx512_hyper h;
    avx512_hyper_init(&h, &t->hparams);
    float *pp = t->param;
    const void *gp = t->grad;
    void *mp = t->exp_avg, *vp = t->exp_avg_sq, *op = t->out;
    uint64_t gi = (uint64_t)(t->offset + begin);
    /* r(i) = mix32(key ^ lo32(i) ^ mix32(hi32(i))): hi32 is constant over the call */
    __m512i kh = _mm512_set1_epi32((int)(t->key ^ ab_mix32_inline((uint32_t)(gi >> 32))));
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)gi), AVX512_IOTA);
    int64_t i = begin;
    for (; i + 32 <= end; i += 32) {
        if (prec == AB_MOMENTS_BF16)
            avx512_bf16_step32(&h, pp, gp, (uint16_t *)mp, (uint16_t *)vp, op, i, kh,
                               _mm512_set1_epi32((int)(uint32_t)(gi + (uint64_t)(i - begin))),
                               G, O, sr, nt);
        else
            avx512_flat_step32(&h, pp, gp, mp, vp, op, i, kh, idx, G, O, prec, sr, nt);
        idx = _mm512_add_epi32(idx, _mm512_set1_epi32(32));
    }
    for (; i + 16 <= end; i += 16) {
        avx512_flat_step(&h, pp, gp, mp, vp, op, i, kh, idx, G, O, prec, sr, nt, 0xffff, 1);
        idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
    }
    if (i < end) {                                     /* tail: masked lanes */
        __mmask16 k = (__mmask16)((1u << (end - i)) - 1u);
        avx512_flat_step(&h, pp, gp, mp, vp, op, i, kh, idx, G, O, prec, sr, nt, k, 0);
    }
}

/* ---- fp8 moments ------------------------------------------------------------------------ */

/* NOTE: the block maxima are taken as unsigned integer maxima of the bit patterns of |m| and
 * s: for non-negative finite floats the order of the patterns is the order of the values, so
 * the result is the same float. A non-finite |m| or s (and an s with its sign bit set, a -0 or
 * negative NaN, possible only with beta2 > 1) has a pattern >= 0x7f800000; then the block's
 * maxima are taken again over its finite values the scalar way (avx512_fp8_amax). That
 * replaces two compares and two masked float maxima per 16 elements by two integer maxima. */
#define AVX512_FP8_NONFINITE 0x7f800000u

/* A block's pattern maxima and minima of |m| and s, lane by lane. */
typedef struct {
    __m512i max_m, max_s, min_m, min_s;
} avx512_fp8_extrema;

/* Decode and update 16 elements of a block (lanes k), keeping m and s for the encode; returns
 * p as the arithmetic made it, for the caller to canonicalise and store. sm holds 256 * scale_m (see avx512_e4m3_decode_div256). */
AB_INLINE __m512 avx512_fp8_update(const ab_tensor *t, const avx512_hyper *h, int64_t b0,
                                   int64_t j, __m512 sm, __m512 sv, float *mbuf, float *sbuf,
                                   avx512_fp8_extrema *ex, int G, int nan_codes,
                                   __mmask16 k, int full)
{
    int64_t i = b0 + j;
    float *pp = t->param;
    const uint8_t *qm = (const uint8_t *)t->exp_avg + b0, *qv = (const uint8_t *)t->exp_avg_sq + b0;
    __m512 p = avx512_load_f32(pp + i, k, full);
    __m512 g = avx512_load_grad(t->grad, i, G, k, full);
    /* m = dec_e4m3(qm) * scale_m */
    __m128i cm = avx512_load_u8(qm + j, k, full);
    __m512 dm = nan_codes ? avx512_e4m3_decode_div256(cm) : avx512_e4m3_decode_div256_finite(cm);
    __m512 m = _mm512_mul_ps(dm, sm);
    /* sv = dec_e5m2(qv) * scale_v; v = sv * sv */
    __m512 s = _mm512_mul_ps(avx512_e5m2_decode(avx512_load_u8(qv + j, k, full)), sv);
    __m512 v = _mm512_mul_ps(s, s);
    s = avx512_adamw_raw(h, &p, g, &m, &v);
    /* amax_m = max |m|; amax_s = max s, as patterns (the lanes in k; see the NOTE above), and
     * their minima (see avx512_fp8_wide) */
    __m512i am = _mm512_castps_si512(avx512_abs(m)), as = _mm512_castps_si512(s);
    ex->max_m = _mm512_mask_max_epu32(ex->max_m, k, ex->max_m, am);
    ex->max_s = _mm512_mask_max_epu32(ex->max_s, k, ex->max_s, as);
    ex->min_m = _mm512_mask_min_epu32(ex->min_m, k, ex->min_m, am);
    ex->min_s = _mm512_mask_min_epu32(ex->min_s, k, ex->min_s, as);
    _mm512_store_ps(mbuf + j, m);
    _mm512_store_ps(sbuf + j, s);
    return p;
}

/* 32 elements from j: two 16-lane updates whose bf16 copies are narrowed together
 * (avx512_narrow16x2) into one 64-byte store. */
AB_INLINE void avx512_fp8_update32(const ab_tensor *t, const avx512_hyper *h, int64_t b0,
                                   int64_t j, __m512 sm, __m512 sv, float *mbuf, float *sbuf,
                                   avx512_fp8_extrema *ex, int G, int O, int nt,
                                   int nan_codes)
{
    __m512 p0 = avx512_fp8_update(t, h, b0, j, sm, sv, mbuf, sbuf, ex, G, nan_codes,
                                  0xffff, 1);
    __m512 p1 = avx512_fp8_update(t, h, b0, j + 16, sm, sv, mbuf, sbuf, ex, G,
                                  nan_codes, 0xffff, 1);
    int64_t i = b0 + j;
    /* a NaN p is stored as 0x7fc00000: one compare for the pair */
    if (__builtin_expect(_mm512_cmp_ps_mask(p0, p1, _CMP_UNORD_Q) != 0, 0))
        p0 = avx512_canon(p0), p1 = avx512_canon(p1);
    _mm512_storeu_ps(t->param + i, p0);
    _mm512_storeu_ps(t->param + i + 16, p1);
    if (O == AB_BF16) {
        __m512i c = avx512_narrow16x2(avx512_bf16_rne(p0), avx512_bf16_rne(p1));
        if (nt)
            _mm512_stream_si512((__m512i *)((uint16_t *)t->out + i), c);
        else
            _mm512_storeu_si512((uint16_t *)t->out + i, c);
    } else {
        avx512_store_out(t->out, i, p0, O, nt, 0xffff, 1);
        avx512_store_out(t->out, i + 16, p1, O, nt, 0xffff, 1);
    }
}

/* Pass 1 of a block of n <= 128 elements. nan_codes: its m codes may hold the NaN code (the
 * decode selects NaN only then; a test per block instead of three uops per 16 elements). */
AB_INLINE void avx512_fp8_pass1(const ab_tensor *t, const avx512_hyper *h, int64_t b0, int64_t n,
                                __m512 sm, __m512 sv, float *mbuf, float *sbuf,
                                avx512_fp8_extrema *ex, int G, int O, int nt, int nan_codes)
{
    int64_t j = 0;
    for (; j + 32 <= n; j += 32)
        avx512_fp8_update32(t, h, b0, j, sm, sv, mbuf, sbuf, ex, G, O, nt, nan_codes);
    for (; j < n; j += 16) {                           /* the rest: 16 lanes, then masked */
        int full = j + 16 <= n;
        __mmask16 k = full ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
        __m512 p = avx512_canon(avx512_fp8_update(t, h, b0, j, sm, sv, mbuf, sbuf, ex, G,
                                                  nan_codes, k, full));
        avx512_store_f32(t->param + b0 + j, p, k, full);
        avx512_store_out(t->out, b0 + j, p, O, nt, k, full);
    }
}

/* amax_m = max finite |m|, amax_s = max finite s of a block's n kept values (the scalar lines),
 * for a block whose pattern maxima were not finite. */
AB_INLINE void avx512_fp8_amax(const float *mbuf, const float *sbuf, int64_t n, float *amax_m,
                               float *amax_s)
{
    *amax_m = 0.0f, *amax_s = 0.0f;
    for (int64_t j = 0; j < n; j++)
        ab_fp8_elem_amax(mbuf[j], sbuf[j], amax_m, amax_s);
}

/* The codes of 16 elements of a block from the kept m and s, in u32 lanes. finite: every m
 * and s of the block is finite (and s >= +0), as the block maxima showed. */
AB_INLINE void avx512_fp8_codes(int64_t j, const float *mbuf, const float *sbuf, __m512 vinv_m,
                                __m512 vinv_v, __m512i kh, __m512i idx, int sr, int finite,
                                int wide, __m512i *cm_out, __m512i *cv_out)
{
    __m512 m = _mm512_load_ps(mbuf + j), s = _mm512_load_ps(sbuf + j);
    __m512i rnd_m = _mm512_setzero_si512(), rnd_v = _mm512_setzero_si512();
    if (sr) {
        /* r(i); r_m = r & 0xffff, r_v = r >> 16, placed below the kept bits: r_m << 4 (E4M3),
         * r_v << 5 (E5M2) */
        __m512i r = avx512_mix32(_mm512_xor_si512(kh, idx));
        /* one shift and one and each: 512-bit shifts have one port, logic two */
        rnd_m = _mm512_slli_epi32(_mm512_and_si512(r, _mm512_set1_epi32(0xffff)),
                                  7 - AB_E4M3_MBITS);
        rnd_v = _mm512_and_si512(_mm512_srli_epi32(r, 16 - (7 - AB_E5M2_MBITS)),
                                 _mm512_set1_epi32(0xffff << (7 - AB_E5M2_MBITS)));
    }
    /* x_m = |m| * inv_m; x_v = s * inv_v (wide: vinv_v holds inv_v * 2^-112, see
     * avx512_fp8_wide) */
    __m512i cm = avx512_fp8_encode(_mm512_mul_ps(avx512_abs(m), vinv_m), AB_E4M3_EMIN,
                                   AB_E4M3_MBITS, sr, finite, wide, rnd_m);
    *cv_out = avx512_fp8_encode(_mm512_mul_ps(s, vinv_v), AB_E5M2_EMIN, AB_E5M2_MBITS, sr, finite,
                                wide, rnd_v);
    /* sign bit when m < 0 and the code is not the NaN code, i.e. m negative, nonzero and
     * finite (only a non-finite m gets the NaN code): in a finite block that is m < 0; else
     * as_u32(m) in (0x80000000, 0xff800000), that is as_i32(m) - 1 < as_i32(0xff7fffff)
     * signed (-0 wraps to INT_MAX; -inf and the negative NaNs are above) */
    __mmask16 neg = finite ? _mm512_cmp_ps_mask(m, _mm512_setzero_ps(), _CMP_LT_OQ)
                           : _mm512_cmplt_epi32_mask(
                                 _mm512_sub_epi32(_mm512_castps_si512(m), _mm512_set1_epi32(1)),
                                 _mm512_set1_epi32((int)0xff7fffffu));
    *cm_out = _mm512_mask_or_epi32(cm, neg, cm, _mm512_set1_epi32(0x80));
}

/* Encode 16 elements of a block (lanes k) from the kept m and s. */
AB_INLINE void avx512_fp8_encode_step(const ab_tensor *t, int64_t b0, int64_t j, const float *mbuf,
                                      const float *sbuf, __m512 vinv_m, __m512 vinv_v, __m512i kh,
                                      __m512i idx, int sr, int finite, int wide, __mmask16 k,
                                      int full)
{
    uint8_t *qm = (uint8_t *)t->exp_avg + b0, *qv = (uint8_t *)t->exp_avg_sq + b0;
    __m512i cm, cv;
    avx512_fp8_codes(j, mbuf, sbuf, vinv_m, vinv_v, kh, idx, sr, finite, wide, &cm, &cv);
    avx512_store_u8(qm + j, _mm512_cvtepi32_epi8(cm), k, full);
    avx512_store_u8(qv + j, _mm512_cvtepi32_epi8(cv), k, full);
}

/* Four vectors of 16 codes (u32 lanes, each <= 0xff) -> 64 bytes in order: two packus to u16
 * and one to u8 (each interleaving the 128-bit lanes), then one dword permute, where four
 * vpmovdb take two uops each. */
AB_INLINE __m512i avx512_pack_codes64(__m512i c0, __m512i c1, __m512i c2, __m512i c3)
{
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512i bytes = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
    return _mm512_permutexvar_epi32(order, bytes);
}

/* Encode 64 elements of a block from j, one 64-byte store per stream. */
AB_INLINE void avx512_fp8_encode64(const ab_tensor *t, int64_t b0, int64_t j, const float *mbuf,
                                   const float *sbuf, __m512 vinv_m, __m512 vinv_v, __m512i kh,
                                   __m512i idx, int sr, int finite, int wide)
{
    __m512i cm[4], cv[4];
    for (int q = 0; q < 4; q++)
        avx512_fp8_codes(j + 16 * q, mbuf, sbuf, vinv_m, vinv_v, kh,
                         _mm512_add_epi32(idx, _mm512_set1_epi32(16 * q)), sr, finite, wide,
                         &cm[q], &cv[q]);
    _mm512_storeu_si512((uint8_t *)t->exp_avg + b0 + j, avx512_pack_codes64(cm[0], cm[1], cm[2], cm[3]));
    _mm512_storeu_si512((uint8_t *)t->exp_avg_sq + b0 + j,
                        avx512_pack_codes64(cv[0], cv[1], cv[2], cv[3]));
}

/* Pass 2 of a block of n <= 128 elements: encode the kept m and s. */
AB_INLINE void avx512_fp8_pass2(const ab_tensor *t, int64_t b0, int64_t n, const float *mbuf,
                                const float *sbuf, __m512 vinv_m, __m512 vinv_v, __m512i kh,
                                int sr, int finite, int wide)
{
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)(t->offset + b0)), AVX512_IOTA);
    int64_t j = 0;
    for (; j + 64 <= n; j += 64) {
        avx512_fp8_encode64(t, b0, j, mbuf, sbuf, vinv_m, vinv_v, kh, idx, sr, finite, wide);
        idx = _mm512_add_epi32(idx, _mm512_set1_epi32(64));
    }
    for (; j < n; j += 16) {                           /* the rest: 16 lanes, then masked */
        int full = j + 16 <= n;
        __mmask16 k = full ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
        avx512_fp8_encode_step(t, b0, j, mbuf, sbuf, vinv_m, vinv_v, kh, idx, sr, finite, wide,
                               k, full);
        idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
    }
}

/* NOTE: whether a finite block is "wide": every x_m = |m| * inv_m >= 2^-6 and every x_v =
 * s * inv_v > 2^-14, with inv_v >= 2^-14, which the minima of |m| and s show (the products
 * round monotonically, so the smallest x is the product of the smallest value). Then no code
 * is an fp8 subnormal or zero, and the encode is shorter with the same bits: for E4M3 `normal`
 * alone is the right candidate (codecs.h), and for E5M2 s * (inv_v * 2^-112) is one rounding
 * of the same product as (s * inv_v) * 2^-112 (scaling by a power of two is exact while the
 * result is normal, and inv_v * 2^-112 is). Blocks with a zero (unused rows) or a value 2^-16
 * below the block's largest are not wide and take the full encode. */
AB_INLINE int avx512_fp8_wide(const avx512_fp8_extrema *ex, float inv_m, float inv_v)
{
    float min_m = ab_as_f32(_mm512_reduce_min_epu32(ex->min_m));
    float min_s = ab_as_f32(_mm512_reduce_min_epu32(ex->min_s));
    float tiny_m = ab_as_f32((uint32_t)(127 + AB_E4M3_EMIN) << 23);   /* 2^-6 */
    float tiny_v = ab_as_f32((uint32_t)(127 + AB_E5M2_EMIN) << 23);   /* 2^-14 */
    return min_m * inv_m >= tiny_m && min_s * inv_v > tiny_v && inv_v >= tiny_v;
}

/* One block [b0, b0 + n), n <= 128: decode, update, keep m and s, rescale, encode. */
AB_INLINE void avx512_fp8_block(const ab_tensor *t, const avx512_hyper *h, int64_t b0, int64_t n,
                                __m512i kh, int G, int O, int sr, int nt)
{
    AB_ALIGN64 float mbuf[AB_BLOCK];
    AB_ALIGN64 float sbuf[AB_BLOCK];
    float *scale_m = &t->exp_avg_scale[b0 / AB_BLOCK];
    float *scale_v = &t->exp_avg_sq_scale[b0 / AB_BLOCK];
    __m512 sm = _mm512_set1_ps(*scale_m * 256.0f), sv = _mm512_set1_ps(*scale_v);
    avx512_fp8_extrema ex = {_mm512_setzero_si512(), _mm512_setzero_si512(),
                             _mm512_set1_epi32(-1), _mm512_set1_epi32(-1)};
    if (avx512_has_e4m3_nan((const uint8_t *)t->exp_avg + b0, n))
        avx512_fp8_pass1(t, h, b0, n, sm, sv, mbuf, sbuf, &ex, G, O, nt, 1);
    else
        avx512_fp8_pass1(t, h, b0, n, sm, sv, mbuf, sbuf, &ex, G, O, nt, 0);
    uint32_t bits_m = _mm512_reduce_max_epu32(ex.max_m), bits_s = _mm512_reduce_max_epu32(ex.max_s);
    float amax_m = ab_as_f32(bits_m), amax_s = ab_as_f32(bits_s);
    int finite = bits_m < AVX512_FP8_NONFINITE && bits_s < AVX512_FP8_NONFINITE;
    if (!finite)
        avx512_fp8_amax(mbuf, sbuf, n, &amax_m, &amax_s);     /* over the finite values only */
    *scale_m = amax_m / AB_E4M3_MAX;                   /* scale_m = amax_m / 448 */
    *scale_v = amax_s / AB_E5M2_MAX;                   /* scale_v = amax_s / 57344 */
    float inv_m = ab_fp8_inverse_scale(AB_E4M3_MAX, amax_m);  /* 448 / amax_m, or 0 */
    float inv_v = ab_fp8_inverse_scale(AB_E5M2_MAX, amax_s);  /* 57344 / amax_s, or 0 */
    __m512 vinv_m = _mm512_set1_ps(inv_m), vinv_v = _mm512_set1_ps(inv_v);
    if (finite && avx512_fp8_wide(&ex, inv_m, inv_v)) {
        __m512 vinv_v_grid = _mm512_set1_ps(inv_v * ab_fp8_to_f32_grid(AB_E5M2_EMIN));
        avx512_fp8_pass2(t, b0, n, mbuf, sbuf, vinv_m, vinv_v_grid, kh, sr, 1, 1);
    } else if (finite) {
        avx512_fp8_pass2(t, b0, n, mbuf, sbuf, vinv_m, vinv_v, kh, sr, 1, 0);
    } else {
        avx512_fp8_pass2(t, b0, n, mbuf, sbuf, vinv_m, vinv_v, kh, sr, 0, 0);
    }
}

/* Whether the block must take the scalar path: 256 * scale_m overflows (see
 * avx512_e4m3_decode_div256); never written, possible only in a hand-made state. */
AB_INLINE int avx512_fp8_scale_odd(float scale_m)
{
    uint32_t s = ab_as_u32(scale_m) & 0x7fffffffu;
    return s >= 0x7b800000u && s < 0x7f800000u;        /* 2^120 <= |scale_m| < inf */
}

AB_INLINE void avx512_loop_fp8(const ab_tensor *t, int64_t begin, int64_t end, int G, int O,
                               int sr, int nt)
{
    avx512_hyper h;
    avx512_hyper_init(&h, &t->hparams);
    uint64_t gi = (uint64_t)(t->offset + begin);
    __m512i kh = _mm512_set1_epi32((int)(t->key ^ ab_mix32_inline((uint32_t)(gi >> 32))));
    /* NOTE: the blocks read the tensor's fields from a copy whose address never escapes:
     * through `t`, every store of a code (a byte store, which may alias anything) made the
     * compiler reload the pointers, about one scalar instruction per element */
    const ab_tensor local = *t;
    for (int64_t b0 = begin; b0 < end; b0 += AB_BLOCK) {
        int64_t n = end - b0 < AB_BLOCK ? end - b0 : AB_BLOCK;
        ab_prefetch_streams(local.param, local.grad, local.exp_avg, local.exp_avg_sq,
                            b0 + AB_PREFETCH, AB_BLOCK, ab_dtype_size(G), 1);
        if (avx512_fp8_scale_odd(local.exp_avg_scale[b0 / AB_BLOCK]))
            ab_update_scalar(t, b0, b0 + n, 0);
        else if (n == AB_BLOCK)
            avx512_fp8_block(&local, &h, b0, AB_BLOCK, kh, G, O, sr, nt);
        else
            avx512_fp8_block(&local, &h, b0, n, kh, G, O, sr, nt);
    }
}

/* ---- entry: one specialised loop per (precision, rounding, grad dtype, out dtype) -------- */

#define AVX512_F32(G, O) avx512_loop_flat(t, begin, end, G, O, AB_MOMENTS_F32, 0, nt)
#define AVX512_BF16_SR(G, O) avx512_loop_flat(t, begin, end, G, O, AB_MOMENTS_BF16, 1, nt)
#define AVX512_BF16_RNE(G, O) avx512_loop_flat(t, begin, end, G, O, AB_MOMENTS_BF16, 0, nt)
#define AVX512_FP8_SR(G, O) avx512_loop_fp8(t, begin, end, G, O, 1, nt)
#define AVX512_FP8_RNE(G, O) avx512_loop_fp8(t, begin, end, G, O, 0, nt)

AB_NOINLINE void avx512_f32(const ab_tensor *t, int64_t begin, int64_t end, int nt)
{
    AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, AVX512_F32)
}
AB_NOINLINE void avx512_bf16(const ab_tensor *t, int64_t begin, int64_t end, int nt)
{
    if (t->stochastic_rounding) {
        AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, AVX512_BF16_SR)
    } else {
        AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, AVX512_BF16_RNE)
    }
}
AB_NOINLINE void avx512_fp8(const ab_tensor *t, int64_t begin, int64_t end, int nt)
{
    if (t->stochastic_rounding) {
        AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, AVX512_FP8_SR)
    } else {
        AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, AVX512_FP8_RNE)
    }
}

void ab_update_avx512(const ab_tensor *t, int64_t begin, int64_t end, int flags)
{
    int osize = ab_dtype_size(t->out_dtype);
    /* non-temporal stores need every store of `out` aligned (64 bytes: 32 bf16 or 16 fp32
     * elements, 16 fp16): check the first */
    int nt = (flags & AB_KFLAG_STREAM_OUT) && osize &&
             ((uintptr_t)((char *)t->out + begin * osize) % 64) == 0;
    if (t->precision == AB_MOMENTS_F32)
        avx512_f32(t, begin, end, nt);
    else if (t->precision == AB_MOMENTS_BF16)
        avx512_bf16(t, begin, end, nt);
    else
        avx512_fp8(t, begin, end, nt);
    if (nt)
        _mm_sfence();  /* order the streamed `out` before the pool reports the work done */
}

#undef AVX512_F32
#undef AVX512_BF16_SR
#undef AVX512_BF16_RNE
#undef AVX512_FP8_SR
#undef AVX512_FP8_RNE
#undef AVX512_IOTA

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif /* AB_HAVE_AVX512 */

/* kernel_neon.c: the fused AdamW update, 4 lanes of AArch64 Advanced SIMD (NEON).
 *
 * Contract: exactly kernel_scalar.c, bit for bit (docs/numerics.md), 4 elements at a time; the
 * same structure as kernel_avx2.c, line for line, with the scalar line above the intrinsics.
 * No FMA (vfmaq is never used and codecs.h turns contraction off). NEON's vmaxq/vminq return
 * NaN for a NaN operand, unlike the scalar `a > b ? a : b`, so max and min are written as a
 * compare and a select. Tails run the scalar code from codecs.h. No non-temporal stores.
 *
 * Flags: none (NEON is part of the AArch64 base architecture).
 * Reference: https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html
 */
#include "codecs.h"

#if defined(AB_HAVE_NEON)

#include <arm_neon.h>

typedef struct {
    float32x4_t decay, beta1, omb1, beta2, omb2, eps, step_size;
} neon_hyper;

static void neon_hyper_init(neon_hyper *h, const ab_hyper *s)
{
    h->decay = vdupq_n_f32(s->decay);
    h->beta1 = vdupq_n_f32(s->beta1);
    h->omb1 = vdupq_n_f32(s->one_minus_beta1);
    h->beta2 = vdupq_n_f32(s->beta2);
    h->omb2 = vdupq_n_f32(s->one_minus_beta2);
    h->eps = vdupq_n_f32(s->eps);
    h->step_size = vdupq_n_f32(s->step_size);
}

/* ab_canon on 4 lanes: a NaN becomes 0x7fc00000. */
AB_INLINE float32x4_t neon_canon(float32x4_t x)
{
    return vbslq_f32(vceqq_f32(x, x), x, vreinterpretq_f32_u32(vdupq_n_u32(AB_CANON_NAN)));
}

/* Section 1 on 4 lanes; returns s = sqrt(v); p is canonical. */
AB_INLINE float32x4_t neon_adamw(const neon_hyper *h, float32x4_t *p, float32x4_t g,
                                 float32x4_t *m, float32x4_t *v)
{
    /* p = p * decay */
    *p = vmulq_f32(*p, h->decay);
    /* m = m * beta1_f */
    *m = vmulq_f32(*m, h->beta1);
    /* m = m + g * omb1 */
    *m = vaddq_f32(*m, vmulq_f32(g, h->omb1));
    /* v = v * beta2_f */
    *v = vmulq_f32(*v, h->beta2);
    /* v = v + (g * g) * omb2 */
    *v = vaddq_f32(*v, vmulq_f32(vmulq_f32(g, g), h->omb2));
    /* s = sqrt(v) */
    float32x4_t s = vsqrtq_f32(*v);
    /* d = s + eps_hat */
    float32x4_t d = vaddq_f32(s, h->eps);
    /* p = p - step_hat * (m / d) */
    *p = neon_canon(vsubq_f32(*p, vmulq_f32(h->step_size, vdivq_f32(*m, d))));
    return s;
}

AB_INLINE float32x4_t neon_abs(float32x4_t x)
{
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(x), vdupq_n_u32(0x7fffffffu)));
}

/* ---- codecs ---------------------------------------------------------------------------- */

/* mix32(x) on 4 lanes (section 2). */
AB_INLINE uint32x4_t neon_mix32(uint32x4_t x)
{
    /* x ^= x >> 16; x *= 0x7feb352d */
    x = vmulq_u32(veorq_u32(x, vshrq_n_u32(x, 16)), vdupq_n_u32(0x7feb352du));
    /* x ^= x >> 15; x *= 0x846ca68b */
    x = vmulq_u32(veorq_u32(x, vshrq_n_u32(x, 15)), vdupq_n_u32(0x846ca68bu));
    /* x ^= x >> 16 */
    return veorq_u32(x, vshrq_n_u32(x, 16));
}

/* 4 u16 -> fp32: bf16 as_f32(b << 16), or fp16 exactly (fcvtl). */
AB_INLINE float32x4_t neon_load_half(const uint16_t *src, int dtype)
{
    uint16x4_t h = vld1_u16(src);
    if (dtype == AB_BF16)
        return vreinterpretq_f32_u32(vshlq_n_u32(vmovl_u16(h), 16));
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}

AB_INLINE float32x4_t neon_load_grad(const void *g, int64_t i, int dtype)
{
    if (dtype == AB_F32)
        return vld1q_f32((const float *)g + i);
    return neon_load_half((const uint16_t *)g + i, dtype);
}

/* bf16 RNE on 4 lanes, as u32 lanes: (u + 0x7fff + ((u >> 16) & 1)) >> 16. */
AB_INLINE uint32x4_t neon_bf16_rne(float32x4_t x)
{
    uint32x4_t u = vreinterpretq_u32_f32(x);
    uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    u = vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), odd);
    return vshrq_n_u32(u, 16);
}


AB_INLINE void neon_store_out(void *out, int64_t i, float32x4_t p, int dtype)
{
    if (dtype == AB_F32)
        vst1q_f32((float *)out + i, p);
    else if (dtype == AB_BF16)
        vst1_u16((uint16_t *)out + i, vmovn_u32(neon_bf16_rne(p)));
    else if (dtype == AB_F16)
        vst1_u16((uint16_t *)out + i, vreinterpret_u16_f16(vcvt_f16_f32(p)));
}

/* 4 fp8 codes -> u32 lanes. */
AB_INLINE uint32x4_t neon_load_u8x4(const uint8_t *src)
{
    uint32_t w;
    memcpy(&w, src, 4);
    return vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(w)))));
}

AB_INLINE void neon_store_u8x4(uint8_t *dst, uint32x4_t codes)
{
    uint16x4_t h = vmovn_u32(codes);
    uint8x8_t b = vmovn_u16(vcombine_u16(h, h));
    uint32_t w = vget_lane_u32(vreinterpret_u32_u8(b), 0);
    memcpy(dst, &w, 4);
}

/* fp8 decode of 4 codes (sign included), exact:
 * E == 0 ? M * 2^(emin-mbits) : as_f32((mag << (23-mbits)) + ((emin+126) << 23)),
 * and the non-finite codes (mag >= special) as 0x7f800000 | (M << (23-mbits)): inf or NaN. */
AB_INLINE float32x4_t neon_fp8_decode(const uint8_t *src, int emin, int mbits)
{
    uint32x4_t c = neon_load_u8x4(src);
    uint32x4_t mag = vandq_u32(c, vdupq_n_u32(0x7f));
    float32x4_t sub = vmulq_f32(vcvtq_f32_u32(mag),
                                vdupq_n_f32(ab_as_f32((uint32_t)(127 + emin - mbits) << 23)));
    uint32x4_t nrm = vaddq_u32(vshlq_u32(mag, vdupq_n_s32(23 - mbits)),
                               vdupq_n_u32((uint32_t)(emin + 126) << 23));
    uint32x4_t is_sub = vcltq_u32(mag, vdupq_n_u32(1u << mbits));
    float32x4_t x = vbslq_f32(is_sub, sub, vreinterpretq_f32_u32(nrm));
    uint32_t special = mbits == AB_E4M3_MBITS ? 0x7fu : 0x7cu;
    uint32x4_t nonfinite = vorrq_u32(vdupq_n_u32(0x7f800000u),
                                     vshlq_u32(vandq_u32(mag, vdupq_n_u32((1u << mbits) - 1u)),
                                               vdupq_n_s32(23 - mbits)));
    x = vbslq_f32(vcgeq_u32(mag, vdupq_n_u32(special)), vreinterpretq_f32_u32(nonfinite), x);
    uint32x4_t sign = vshlq_n_u32(vandq_u32(c, vdupq_n_u32(0x80)), 24);
    return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(x), sign));
}

/* fp8 encode of 4 lanes x >= 0, at most one ulp past max, or non-finite (ab_fp8_encode), codes
 * in u32 lanes, in the integer domain: b = min(as_u32(x * 2^(-126-emin)), 0x7f << (23-mbits)),
 * code = (b + rnd) >> (23-mbits) with rnd = r16 <<
 * (7 - mbits) (SR) or 2^(22-mbits) - 1 + the kept lowest bit (nearest even). The shifts
 * are by constants at every use (the function is always inlined). finite: every x is finite,
 * so the min is a no-op (x is at most max * (1 + 2^-22), whose pattern is far below the NaN
 * code's) and is left out. wide: no x is below 2^emin and an E5M2 x comes already multiplied by
 * 2^(-126-emin) (see avx512_fp8_wide in kernel_avx512.c). */
AB_INLINE uint32x4_t neon_fp8_encode(float32x4_t x, int emin, int mbits, int sr, int finite,
                                     int wide, uint32x4_t r16)
{
    const int drop = 23 - mbits;
    uint32x4_t b;
    if (wide && mbits == AB_E4M3_MBITS) {
        /* normal = as_u32(x) - ((126 + emin) << 23), the right candidate for x >= 2^emin */
        b = vsubq_u32(vreinterpretq_u32_f32(x), vdupq_n_u32((uint32_t)(126 + emin) << 23));
    } else if (wide) {
        b = vreinterpretq_u32_f32(x);                  /* x * 2^(-126-emin), done by the caller */
    } else if (mbits == AB_E4M3_MBITS) {
        /* no subnormal product (codecs.h: Arm has no assist, but the bits must match) */
        float32x4_t y = vaddq_f32(x, vdupq_n_f32(ab_as_f32((uint32_t)(127 + emin) << 23)));
        int32x4_t small = vsubq_s32(vreinterpretq_s32_f32(y), vdupq_n_s32((127 + emin) << 23));
        int32x4_t normal = vsubq_s32(vreinterpretq_s32_f32(x), vdupq_n_s32((126 + emin) << 23));
        b = vreinterpretq_u32_s32(vmaxq_s32(small, normal));
    } else {
        b = vreinterpretq_u32_f32(vmulq_f32(x, vdupq_n_f32(ab_fp8_to_f32_grid(emin))));
    }
    if (!finite)
        b = vminq_u32(b, vdupq_n_u32(AB_FP8_NAN << drop)); /* a non-finite x: the NaN code */
    uint32x4_t rnd;
    if (sr) {
        rnd = vshlq_u32(r16, vdupq_n_s32(7 - mbits));
    } else {
        uint32x4_t odd = vandq_u32(vshlq_u32(b, vdupq_n_s32(-drop)), vdupq_n_u32(1));
        rnd = vaddq_u32(odd, vdupq_n_u32((1u << (drop - 1)) - 1u));
    }
    return vshlq_u32(vaddq_u32(b, rnd), vdupq_n_s32(-drop));
}

/* ---- fp32 and bf16 moments ------------------------------------------------------------- */

AB_INLINE void neon_loop_flat(const ab_tensor *t, int64_t begin, int64_t end, int G, int O,
                              int prec, int sr)
{
    neon_hyper h;
    neon_hyper_init(&h, &t->hparams);
    float *pp = t->param;
    const void *gp = t->grad;
    void *mp = t->exp_avg, *vp = t->exp_avg_sq, *op = t->out;
    uint64_t gi = (uint64_t)(t->offset + begin);
    /* r(i) = mix32(key ^ lo32(i) ^ mix32(hi32(i))): hi32 is constant over the call */
    uint32x4_t kh = vdupq_n_u32(t->key ^ ab_mix32_inline((uint32_t)(gi >> 32)));
    static const uint32_t iota[4] = {0, 1, 2, 3};
    uint32x4_t idx = vaddq_u32(vdupq_n_u32((uint32_t)gi), vld1q_u32(iota));
    int64_t i = begin;
    for (; i + 4 <= end; i += 4) {
        if (((i - begin) & 31) == 0)           /* prefetch ahead (codecs.h AB_PREFETCH) */
            ab_prefetch_streams(pp, gp, mp, vp, i + AB_PREFETCH, 32, ab_dtype_size(G),
                                prec == AB_MOMENTS_F32 ? 4 : 2);
        float32x4_t p = vld1q_f32(pp + i);
        float32x4_t g = neon_load_grad(gp, i, G);
        float32x4_t m, v;
        if (prec == AB_MOMENTS_F32) {
            m = vld1q_f32((float *)mp + i);
            v = vld1q_f32((float *)vp + i);
        } else {
            m = neon_load_half((uint16_t *)mp + i, AB_BF16);     /* m = as_f32(qm << 16) */
            v = neon_load_half((uint16_t *)vp + i, AB_BF16);     /* v = as_f32(qv << 16) */
        }
        neon_adamw(&h, &p, g, &m, &v);
        m = neon_canon(m);                             /* a NaN m or v: 0x7fc00000 */
        v = neon_canon(v);
        vst1q_f32(pp + i, p);
        if (prec == AB_MOMENTS_F32) {
            vst1q_f32((float *)mp + i, m);
            vst1q_f32((float *)vp + i, v);
        } else {
            uint32x4_t qm, qv;
            if (sr) {
                uint32x4_t r = neon_mix32(veorq_u32(kh, idx));
                /* qm = (as_u32(m) + (r & 0xffff)) >> 16 */
                qm = vshrq_n_u32(vaddq_u32(vreinterpretq_u32_f32(m), vandq_u32(r, vdupq_n_u32(0xffff))), 16);
                /* qv = (as_u32(v) + (r >> 16)) >> 16 */
                qv = vshrq_n_u32(vaddq_u32(vreinterpretq_u32_f32(v), vshrq_n_u32(r, 16)), 16);
                idx = vaddq_u32(idx, vdupq_n_u32(4));
            } else {
                qm = neon_bf16_rne(m);
                qv = neon_bf16_rne(v);
            }
            vst1_u16((uint16_t *)mp + i, vmovn_u32(qm));
            vst1_u16((uint16_t *)vp + i, vmovn_u32(qv));
        }
        neon_store_out(op, i, p, O);
    }
    if (i < end)
        ab_update_scalar(t, i, end, 0);                /* tail: the scalar lines */
}

/* ---- fp8 moments ------------------------------------------------------------------------ */

/* NOTE: as in kernel_avx2.c, the block maxima are unsigned integer maxima of the patterns of
 * |m| and s: for non-negative finite floats the order of the patterns is the order of the
 * values, so the result is the same float. A non-finite |m| or s (or an s with its sign bit
 * set) has a pattern >= 0x7f800000, and then the maxima are taken again over the finite values
 * by the scalar lines; otherwise the encode knows every value finite. */
#define NEON_FP8_NONFINITE 0x7f800000u

/* Pass 2 on the whole multiples of 4 elements of a block: encode the kept m and s, store the
 * codes; returns how many it did. finite: every m and s of those is finite (and s >= +0). */
AB_INLINE int64_t neon_fp8_pass2(const ab_tensor *t, int64_t b0, int64_t n, const float *mbuf,
                                 const float *sbuf, float inv_m, float inv_v, uint32x4_t kh,
                                 int sr, int finite, int wide)
{
    uint8_t *qm = (uint8_t *)t->exp_avg + b0, *qv = (uint8_t *)t->exp_avg_sq + b0;
    /* wide: x_v = s * (inv_v * 2^-112), see avx512_fp8_wide */
    float32x4_t vinv_m = vdupq_n_f32(inv_m);
    float32x4_t vinv_v = vdupq_n_f32(wide ? inv_v * ab_fp8_to_f32_grid(AB_E5M2_EMIN) : inv_v);
    static const uint32_t iota[4] = {0, 1, 2, 3};
    uint32x4_t idx = vaddq_u32(vdupq_n_u32((uint32_t)(t->offset + b0)), vld1q_u32(iota));
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        float32x4_t m = vld1q_f32(mbuf + j), s = vld1q_f32(sbuf + j);
        uint32x4_t r = sr ? neon_mix32(veorq_u32(kh, idx)) : vdupq_n_u32(0);
        idx = vaddq_u32(idx, vdupq_n_u32(4));
        /* x_m = |m| * inv_m; x_v = s * inv_v */
        uint32x4_t cm = neon_fp8_encode(vmulq_f32(neon_abs(m), vinv_m), AB_E4M3_EMIN,
                                        AB_E4M3_MBITS, sr, finite, wide,
                                        vandq_u32(r, vdupq_n_u32(0xffff)));
        uint32x4_t cv = neon_fp8_encode(vmulq_f32(s, vinv_v), AB_E5M2_EMIN, AB_E5M2_MBITS, sr,
                                        finite, wide, vshrq_n_u32(r, 16));
        /* sign bit when m < 0 and the code is not the NaN code (in a finite block: m < 0) */
        uint32x4_t neg = vcltq_f32(m, vdupq_n_f32(0.0f));
        if (!finite)
            neg = vbicq_u32(neg, vceqq_u32(cm, vdupq_n_u32(AB_FP8_NAN)));
        cm = vorrq_u32(cm, vandq_u32(neg, vdupq_n_u32(0x80)));
        neon_store_u8x4(qm + j, cm);
        neon_store_u8x4(qv + j, cv);
    }
    return j;
}

/* Whether a finite block is wide (see avx512_fp8_wide in kernel_avx512.c): every x_m >= 2^-6,
 * every x_v > 2^-14 and inv_v >= 2^-14, from the pattern minima of |m| and s. */
AB_INLINE int neon_fp8_wide(uint32x4_t vmin_m, uint32x4_t vmin_s, float inv_m, float inv_v)
{
    float tiny_m = ab_as_f32((uint32_t)(127 + AB_E4M3_EMIN) << 23);   /* 2^-6 */
    float tiny_v = ab_as_f32((uint32_t)(127 + AB_E5M2_EMIN) << 23);   /* 2^-14 */
    return ab_as_f32(vminvq_u32(vmin_m)) * inv_m >= tiny_m &&
           ab_as_f32(vminvq_u32(vmin_s)) * inv_v > tiny_v && inv_v >= tiny_v;
}

/* One block [b0, b0 + n), n <= 128: decode, update, keep m and s, rescale, encode. */
AB_INLINE void neon_fp8_block(const ab_tensor *t, const neon_hyper *h, int64_t b0, int64_t n,
                              uint32x4_t kh, int G, int O, int sr)
{
    AB_ALIGN64 float mbuf[AB_BLOCK];
    AB_ALIGN64 float sbuf[AB_BLOCK];
    float *pp = t->param;
    uint8_t *qm = (uint8_t *)t->exp_avg + b0, *qv = (uint8_t *)t->exp_avg_sq + b0;
    float *scale_m = &t->exp_avg_scale[b0 / AB_BLOCK];
    float *scale_v = &t->exp_avg_sq_scale[b0 / AB_BLOCK];
    float32x4_t sm = vdupq_n_f32(*scale_m), sv = vdupq_n_f32(*scale_v);
    uint32x4_t vmax_m = vdupq_n_u32(0), vmax_s = vdupq_n_u32(0);
    uint32x4_t vmin_m = vdupq_n_u32(0xffffffffu), vmin_s = vdupq_n_u32(0xffffffffu);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        int64_t i = b0 + j;
        float32x4_t p = vld1q_f32(pp + i);
        float32x4_t g = neon_load_grad(t->grad, i, G);
        /* m = dec_e4m3(qm) * scale_m */
        float32x4_t m = vmulq_f32(neon_fp8_decode(qm + j, AB_E4M3_EMIN, AB_E4M3_MBITS), sm);
        /* sv = dec_e5m2(qv) * scale_v; v = sv * sv */
        float32x4_t s = vmulq_f32(neon_fp8_decode(qv + j, AB_E5M2_EMIN, AB_E5M2_MBITS), sv);
        float32x4_t v = vmulq_f32(s, s);
        s = neon_adamw(h, &p, g, &m, &v);
        vst1q_f32(pp + i, p);
        neon_store_out(t->out, i, p, O);
        /* amax_m = max |m|; amax_s = max s, as patterns (see the NOTE above) */
        uint32x4_t am = vreinterpretq_u32_f32(neon_abs(m)), as = vreinterpretq_u32_f32(s);
        vmax_m = vmaxq_u32(vmax_m, am);
        vmax_s = vmaxq_u32(vmax_s, as);
        vmin_m = vminq_u32(vmin_m, am);                /* and the minima (see neon_fp8_wide) */
        vmin_s = vminq_u32(vmin_s, as);
        vst1q_f32(mbuf + j, m);
        vst1q_f32(sbuf + j, s);
    }
    int64_t nvec = j;
    uint32_t bits_m = vmaxvq_u32(vmax_m), bits_s = vmaxvq_u32(vmax_s);
    float amax_m = ab_as_f32(bits_m), amax_s = ab_as_f32(bits_s);
    int finite = bits_m < NEON_FP8_NONFINITE && bits_s < NEON_FP8_NONFINITE;   /* the vector part's */
    if (!finite) {                                     /* over the finite values only */
        amax_m = 0.0f, amax_s = 0.0f;
        for (int64_t k = 0; k < nvec; k++)
            ab_fp8_elem_amax(mbuf[k], sbuf[k], &amax_m, &amax_s);
    }
    for (; j < n; j++) {                               /* tail: the scalar lines */
        sbuf[j] = ab_fp8_elem_update(t, b0 + j, qm[j], qv[j], *scale_m, *scale_v, &mbuf[j], G, O);
        ab_fp8_elem_amax(mbuf[j], sbuf[j], &amax_m, &amax_s);
    }
    *scale_m = amax_m / AB_E4M3_MAX;                   /* scale_m = amax_m / 448 */
    *scale_v = amax_s / AB_E5M2_MAX;                   /* scale_v = amax_s / 57344 */
    float inv_m = ab_fp8_inverse_scale(AB_E4M3_MAX, amax_m);  /* 448 / amax_m, or 0 */
    float inv_v = ab_fp8_inverse_scale(AB_E5M2_MAX, amax_s);  /* 57344 / amax_s, or 0 */
    if (finite && neon_fp8_wide(vmin_m, vmin_s, inv_m, inv_v))
        j = neon_fp8_pass2(t, b0, n, mbuf, sbuf, inv_m, inv_v, kh, sr, 1, 1);
    else if (finite)
        j = neon_fp8_pass2(t, b0, n, mbuf, sbuf, inv_m, inv_v, kh, sr, 1, 0);
    else
        j = neon_fp8_pass2(t, b0, n, mbuf, sbuf, inv_m, inv_v, kh, sr, 0, 0);
    for (; j < n; j++) {                               /* tail: the scalar lines */
        uint32_t r = sr ? ab_hash_inline(t->key, (uint64_t)(t->offset + b0 + j)) : 0u;
        ab_fp8_elem_encode(mbuf[j], sbuf[j], inv_m, inv_v, sr, r, &qm[j], &qv[j]);
    }
}

AB_INLINE void neon_loop_fp8(const ab_tensor *t, int64_t begin, int64_t end, int G, int O, int sr)
{
    neon_hyper h;
    neon_hyper_init(&h, &t->hparams);
    uint64_t gi = (uint64_t)(t->offset + begin);
    uint32x4_t kh = vdupq_n_u32(t->key ^ ab_mix32_inline((uint32_t)(gi >> 32)));
    /* NOTE: as in kernel_avx2.c, the blocks read a copy of the tensor whose address never
     * escapes (byte stores of codes made the compiler reload its pointers); full blocks get a
     * constant length */
    const ab_tensor local = *t;
    for (int64_t b0 = begin; b0 < end; b0 += AB_BLOCK) {
        ab_prefetch_streams(local.param, local.grad, local.exp_avg, local.exp_avg_sq,
                            b0 + AB_PREFETCH, AB_BLOCK, ab_dtype_size(G), 1);
        int64_t n = end - b0 < AB_BLOCK ? end - b0 : AB_BLOCK;
        if (n == AB_BLOCK)
            neon_fp8_block(&local, &h, b0, AB_BLOCK, kh, G, O, sr);
        else
            neon_fp8_block(&local, &h, b0, n, kh, G, O, sr);
    }
}

/* ---- entry: one specialised loop per (precision, rounding, grad dtype, out dtype) -------- */

#define NEON_F32(G, O) neon_loop_flat(t, begin, end, G, O, AB_MOMENTS_F32, 0)
#define NEON_BF16_SR(G, O) neon_loop_flat(t, begin, end, G, O, AB_MOMENTS_BF16, 1)
#define NEON_BF16_RNE(G, O) neon_loop_flat(t, begin, end, G, O, AB_MOMENTS_BF16, 0)
#define NEON_FP8_SR(G, O) neon_loop_fp8(t, begin, end, G, O, 1)
#define NEON_FP8_RNE(G, O) neon_loop_fp8(t, begin, end, G, O, 0)

AB_NOINLINE void neon_f32(const ab_tensor *t, int64_t begin, int64_t end)
{
    AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, NEON_F32)
}
AB_NOINLINE void neon_bf16(const ab_tensor *t, int64_t begin, int64_t end)
{
    if (t->stochastic_rounding) {
        AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, NEON_BF16_SR)
    } else {
        AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, NEON_BF16_RNE)
    }
}
AB_NOINLINE void neon_fp8(const ab_tensor *t, int64_t begin, int64_t end)
{
    if (t->stochastic_rounding) {
        AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, NEON_FP8_SR)
    } else {
        AB_SWITCH_DTYPES(t->grad_dtype, t->out_dtype, NEON_FP8_RNE)
    }
}

void ab_update_neon(const ab_tensor *t, int64_t begin, int64_t end, int flags)
{
    (void)flags;
    if (t->precision == AB_MOMENTS_F32)
        neon_f32(t, begin, end);
    else if (t->precision == AB_MOMENTS_BF16)
        neon_bf16(t, begin, end);
    else
        neon_fp8(t, begin, end);
}

#undef NEON_F32
#undef NEON_BF16_SR
#undef NEON_BF16_RNE
#undef NEON_FP8_SR
#undef NEON_FP8_RNE

#endif /* AB_HAVE_NEON */

/* kernel_scalar.c: the portable fused AdamW update, one element at a time.
 *
 * Contract (docs/numerics.md): one pass per element reads the fp32 master p, the gradient
 * (fp32/bf16/fp16) and the moments m, v (fp32, bf16 or block-scaled fp8), applies section 1
 * with one rounding per operation, stores m, v back in their precision (section 3) and writes
 * the low-precision copy of p (section 4). This file is the reference the SIMD files are
 * tested against bit for bit (tests/native/selftest.c); it needs no compiler flags.
 *
 * Reference: https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html
 */
#include "codecs.h"

/* Moments stored as fp32: plain loads and stores. */
static void sc_run_f32(const ab_tensor *t, int64_t begin, int64_t end)
{
    float *p = t->param, *m = (float *)t->exp_avg, *v = (float *)t->exp_avg_sq;
    for (int64_t i = begin; i < end; i++) {
        float g = ab_load_grad(t->grad, i, t->grad_dtype);
        float mi = m[i], vi = v[i];
        ab_adamw_elem(&t->hparams, &p[i], g, &mi, &vi);
        m[i] = ab_canon(mi);                                  /* NaN -> 0x7fc00000 */
        v[i] = ab_canon(vi);
        ab_store_out(t->out, i, p[i], t->out_dtype);
    }
}

/* Moments stored as bf16: decode exactly, update, encode with SR (r & 0xffff for m,
 * r >> 16 for v, one hash per element) or with round-to-nearest-even. */
static void sc_run_bf16(const ab_tensor *t, int64_t begin, int64_t end)
{
    float *p = t->param;
    uint16_t *qm = (uint16_t *)t->exp_avg, *qv = (uint16_t *)t->exp_avg_sq;
    for (int64_t i = begin; i < end; i++) {
        float g = ab_load_grad(t->grad, i, t->grad_dtype);
        float m = ab_bf16_decode(qm[i]);                      /* m = as_f32(qm << 16) */
        float v = ab_bf16_decode(qv[i]);                      /* v = as_f32(qv << 16) */
        ab_adamw_elem(&t->hparams, &p[i], g, &m, &v);
        m = ab_canon(m);                                      /* NaN -> 0x7fc00000 */
        v = ab_canon(v);
        if (t->stochastic_rounding) {
            uint32_t r = ab_hash_inline(t->key, (uint64_t)(t->offset + i));   /* r(i) */
            qm[i] = ab_bf16_sr(m, r & 0xffffu);               /* (as_u32(m) + r_m) >> 16 */
            qv[i] = ab_bf16_sr(v, r >> 16);                   /* (as_u32(v) + r_v) >> 16 */
        } else {
            qm[i] = ab_bf16_rne(m);
            qv[i] = ab_bf16_rne(v);
        }
        ab_store_out(t->out, i, p[i], t->out_dtype);
    }
}

/* One fp8 block [b0, b0 + n), n <= 128, b0 a multiple of 128: decode with the block's scales,
 * update every element, then rescale the block to the absmax of its finite values and encode
 * (a non-finite m or s is stored as the NaN code, numerics.md section 6). */
static void sc_fp8_block(const ab_tensor *t, int64_t b0, int64_t n)
{
    float mbuf[AB_BLOCK], sbuf[AB_BLOCK];
    uint8_t *qm = (uint8_t *)t->exp_avg + b0, *qv = (uint8_t *)t->exp_avg_sq + b0;
    float *scale_m = &t->exp_avg_scale[b0 / AB_BLOCK];
    float *scale_v = &t->exp_avg_sq_scale[b0 / AB_BLOCK];
    float amax_m = 0.0f, amax_s = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        sbuf[j] = ab_fp8_elem_update(t, b0 + j, qm[j], qv[j], *scale_m, *scale_v, &mbuf[j],
                                     t->grad_dtype, t->out_dtype);
        ab_fp8_elem_amax(mbuf[j], sbuf[j], &amax_m, &amax_s);   /* finite values only */
    }
    *scale_m = amax_m / AB_E4M3_MAX;                          /* scale_m = amax_m / 448 */
    *scale_v = amax_s / AB_E5M2_MAX;                          /* scale_v = amax_s / 57344 */
    float inv_m = ab_fp8_inverse_scale(AB_E4M3_MAX, amax_m);  /* 448 / amax_m, or 0 */
    float inv_v = ab_fp8_inverse_scale(AB_E5M2_MAX, amax_s);  /* 57344 / amax_s, or 0 */
    int sr = t->stochastic_rounding;
    for (int64_t j = 0; j < n; j++) {
        uint32_t r = sr ? ab_hash_inline(t->key, (uint64_t)(t->offset + b0 + j)) : 0u;
        ab_fp8_elem_encode(mbuf[j], sbuf[j], inv_m, inv_v, sr, r, &qm[j], &qv[j]);
    }
}

static void sc_run_fp8(const ab_tensor *t, int64_t begin, int64_t end)
{
    for (int64_t b0 = begin; b0 < end; b0 += AB_BLOCK)
        sc_fp8_block(t, b0, end - b0 < AB_BLOCK ? end - b0 : AB_BLOCK);
}

void ab_update_scalar(const ab_tensor *t, int64_t begin, int64_t end, int flags)
{
    (void)flags;
    if (t->precision == AB_MOMENTS_F32)
        sc_run_f32(t, begin, end);
    else if (t->precision == AB_MOMENTS_BF16)
        sc_run_bf16(t, begin, end);
    else
        sc_run_fp8(t, begin, end);
}

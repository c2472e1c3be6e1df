/* codecs.h: the scalar arithmetic, codecs and counter hash shared by every ISA file.
 *
 * This header is the C twin of adambridge/update/codecs.py. Every function here implements one line
 * of docs/numerics.md bit for bit; the SIMD kernels (kernel_avx2.c, kernel_avx512.c,
 * kernel_neon.c) do the same arithmetic on vectors and fall back to these for their tails.
 * Everything is static inline so each ISA file (and the unity build in tests/native/selftest.c)
 * gets its own copy.
 *
 * Spec: docs/numerics.md (sections 1-4).
 */
#ifndef ADAMBRIDGE_CODECS_H
#define ADAMBRIDGE_CODECS_H

/* NOTE: one rounding per operation. The build passes -ffp-contract=off, but the unity build
 * (`cc -O2 tests/native/selftest.c`) does not, and GCC contracts even _mm256_mul_ps followed
 * by _mm256_add_ps into vfmadd inside an FMA-enabled function. These pragmas make every
 * function defined after this header contraction-free whatever the command line says. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <stdint.h>
#include <string.h>

#include "adambridge.h"

#if defined(_MSC_VER) && !defined(__clang__)
#define AB_INLINE static __forceinline
#define AB_NOINLINE static __declspec(noinline)
#define AB_ALIGN64 __declspec(align(64))
#include <math.h>
#define ab_sqrtf sqrtf
#else
#define AB_INLINE static inline __attribute__((always_inline))
#define AB_NOINLINE static __attribute__((noinline))
#define AB_ALIGN64 __attribute__((aligned(64)))
#define ab_sqrtf __builtin_sqrtf  /* IEEE sqrt, correctly rounded (sqrtss / fsqrt) */
#endif

#if defined(__x86_64__) || defined(_M_X64)
#define AB_X86_64 1
#endif
#if defined(__aarch64__) || defined(_M_ARM64)
#define AB_AARCH64 1
#endif

/* Which ISA files carry kernels in this build (-DAB_NO_AVX512 etc. leave one out, e.g. for an
 * old compiler). */
#if defined(AB_X86_64) && !defined(AB_NO_AVX2)
#define AB_HAVE_AVX2 1
#endif
#if defined(AB_X86_64) && !defined(AB_NO_AVX512)
#define AB_HAVE_AVX512 1
#endif
#if defined(AB_AARCH64) && !defined(AB_NO_NEON)
#define AB_HAVE_NEON 1
#endif

/* An fp8 block: 128 elements counted from the first element of the range's state, which is
 * the parameter's start or an FSDP2 shard's (docs/numerics.md section 3). */
#define AB_BLOCK AB_FP8_BLOCK

/* ---- kernel entry points, one per ISA file ------------------------------------------------
 * Update elements [begin, end) of the range `t` (local indices). Preconditions, which
 * dispatch.c guarantees: the tensor is valid; for fp8, begin is a multiple of 128 (so whole
 * blocks, the last one possibly short at the end of the range); the global indices
 * t->offset + [begin, end) share their high 32 bits (one hash key per call), except in
 * calls of ab_update_scalar, which hashes each element by itself.
 * flags: AB_KFLAG_STREAM_OUT allows non-temporal stores for `out`. */
#define AB_KFLAG_STREAM_OUT 1
typedef void (*ab_kernel_fn)(const ab_tensor *t, int64_t begin, int64_t end, int flags);
void ab_update_scalar(const ab_tensor *t, int64_t begin, int64_t end, int flags);
#if defined(AB_HAVE_AVX2)
void ab_update_avx2(const ab_tensor *t, int64_t begin, int64_t end, int flags);
#endif
#if defined(AB_HAVE_AVX512)
void ab_update_avx512(const ab_tensor *t, int64_t begin, int64_t end, int flags);
#endif
#if defined(AB_HAVE_NEON)
void ab_update_neon(const ab_tensor *t, int64_t begin, int64_t end, int flags);
#endif

#define AB_CANON_NAN 0x7fc00000u    /* the one NaN the kernels store (numerics.md section 6) */

/* ---- bit casts ---------------------------------------------------------------------------- */

AB_INLINE uint32_t ab_as_u32(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
AB_INLINE float ab_as_f32(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* x, or the canonical quiet NaN 0x7fc00000 when x is a NaN (numerics.md section 6): the NaN
 * payloads of IEEE arithmetic depend on operand order, so no stored NaN may carry one. */
AB_INLINE float ab_canon(float x) { return x != x ? ab_as_f32(AB_CANON_NAN) : x; }

/* |x| < inf, false for inf and NaN (the fp8 block max and encode skip such elements). */
AB_INLINE int ab_finite(float x) { return (ab_as_u32(x) & 0x7fffffffu) < 0x7f800000u; }

/* ---- the counter hash (section 2) --------------------------------------------------------- */

AB_INLINE uint32_t ab_mix32_inline(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* r(i) = mix32(key ^ lo32(i) ^ mix32(hi32(i))), i the global element index. */
AB_INLINE uint32_t ab_hash_inline(uint32_t key, uint64_t i)
{
    return ab_mix32_inline(key ^ (uint32_t)i ^ ab_mix32_inline((uint32_t)(i >> 32)));
}

/* ---- bf16 (section 3) --------------------------------------------------------------------- */

/* Decode: as_f32(b << 16), exact. */
AB_INLINE float ab_bf16_decode(uint16_t b) { return ab_as_f32((uint32_t)b << 16); }

/* Stochastic rounding: (as_u32(x) + r16) >> 16. */
AB_INLINE uint16_t ab_bf16_sr(float x, uint32_t r16)
{
    return (uint16_t)((ab_as_u32(x) + r16) >> 16);
}

/* Round to nearest even: (u + 0x7fff + ((u >> 16) & 1)) >> 16. No NaN case (moments). */
AB_INLINE uint16_t ab_bf16_rne(float x)
{
    uint32_t u = ab_as_u32(x);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The parameter copy (section 4): RNE. The master is never a NaN other than 0x7fc00000
 * (section 6), which the formula maps to the canonical bf16 NaN 0x7fc0. */
AB_INLINE uint16_t ab_bf16_out(float x) { return ab_bf16_rne(x); }

/* ---- IEEE binary16 (gradients in, parameter copy out) ------------------------------------- */

/* Exact fp16 -> fp32, the same bits as F16C vcvtph2ps / Arm fcvtl (a NaN is quieted). */
AB_INLINE float ab_f16_decode(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    if (e == 0) {
        /* zero or subnormal: m * 2^-24, exact in fp32 */
        float x = (float)m * 5.9604644775390625e-8f;
        return ab_as_f32(ab_as_u32(x) | sign);
    }
    if (e == 31)
        return ab_as_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x00400000u : 0u));
    return ab_as_f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* fp32 -> fp16, round to nearest even, subnormals kept, overflow to inf; a NaN keeps its sign
 * and top payload bits with the quiet bit set (F16C vcvtps2ph, Arm fcvtn, torch .to(float16)). */
AB_INLINE uint16_t ab_f16_rne(float x)
{
    uint32_t u = ab_as_u32(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)                    /* NaN */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u)                   /* >= 65520 rounds to inf (65504 is odd) */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) {                 /* normal: rebias 127 -> 15, round 13 bits */
        uint32_t r = a - (112u << 23);
        r += 0x0fffu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    /* subnormal or zero: 0.5 + |x| rounds |x| to a multiple of 2^-24 (the ulp of 0.5), ties
     * to even, and the low bits of the sum are the fp16 code (1024 = the smallest normal). */
    float s = ab_as_f32(a) + 0.5f;
    return (uint16_t)(sign | (ab_as_u32(s) - 0x3f000000u));
}

/* ---- fp8 (section 3) ---------------------------------------------------------------------- */

#define AB_E4M3_EMIN (-6)
#define AB_E4M3_MBITS 3
#define AB_E4M3_MAX 448.0f
#define AB_E5M2_EMIN (-14)
#define AB_E5M2_MBITS 2
#define AB_E5M2_MAX 57344.0f
#define AB_FP8_NAN 0x7fu            /* the code stored for a non-finite m or s (section 6) */

/* Decode a code, sign included: E == 0 ? M * 2^(emin-mbits) : (2^mbits + M) * 2^(E-1+emin-mbits),
 * exact, except the codes past the largest finite one, which decode as torch does (section 6):
 * E4M3 0x7f/0xff is NaN; E5M2 with E == 31 is inf (M == 0) or NaN. */
AB_INLINE float ab_fp8_decode(uint32_t c, int emin, int mbits)
{
    uint32_t mag = c & 0x7fu;
    uint32_t E = mag >> mbits;
    uint32_t M = mag & ((1u << mbits) - 1u);
    uint32_t special = mbits == AB_E4M3_MBITS ? 0x7fu : 0x7cu;   /* the first non-finite code */
    float x;
    if (mag >= special)
        x = ab_as_f32(0x7f800000u | (M << (23 - mbits)));        /* inf when M == 0, else NaN */
    else if (E == 0)
        x = (float)M * ab_as_f32((uint32_t)(127 + emin - mbits) << 23);
    else
        x = ab_as_f32(((uint32_t)((int)E - 1 + emin + 127) << 23) | (M << (23 - mbits)));
    return ab_as_f32(ab_as_u32(x) | ((c & 0x80u) << 24));
}
AB_INLINE float ab_e4m3_decode(uint8_t c) { return ab_fp8_decode(c, AB_E4M3_EMIN, AB_E4M3_MBITS); }
AB_INLINE float ab_e5m2_decode(uint8_t c) { return ab_fp8_decode(c, AB_E5M2_EMIN, AB_E5M2_MBITS); }

/* 2^(-126 - emin), the factor that puts the fp8 grid on the fp32 one (section 3): 2^-120 for
 * E4M3, 2^-112 for E5M2, built from its exponent field 1 - emin. */
AB_INLINE float ab_fp8_to_f32_grid(int emin) { return ab_as_f32((uint32_t)(1 - emin) << 23); }

/* NOTE: the SIMD kernels compute as_u32(x * 2^(-126-emin)) for E4M3 without the multiply:
 * where x is an fp8 subnormal the product is an fp32 subnormal, and on x86 every vector
 * multiply with a subnormal result takes a microcode assist (~150 cycles; a block with one
 * outlier made the whole fp8 update 3.5x slower). The same bits come from two candidates,
 *   small  = as_u32(x + 2^emin) - ((127 + emin) << 23)   (x + 2^emin rounds x at 2^(emin-23),
 *            the subnormal product's spacing, ties to even alike; right for x < 2^emin)
 *   normal = as_u32(x) - ((126 + emin) << 23)              (the exact product for x >= 2^emin)
 * and their signed maximum is the right one: RN(x + 2^emin) <= 2x exactly when x >= 2^emin,
 * >= 2x when x < 2^emin, and as_u32(2x) - ((127 + emin) << 23) is `normal`. For an infinite or
 * NaN x both are above the NaN code's pattern as unsigned, so the clamp still gives 0x7f.
 * E5M2 keeps the multiply: its subnormal range starts 2^-14 / 57344 below the block's largest
 * sqrt(v), which practically never holds an element. */

/* Round x >= 0, at most one ulp past max (or inf, NaN), to the fp8 grid and return the code
 * (sign excluded), in the integer domain: z = x * 2^(-126-emin) (fp8 subnormals become fp32
 * subnormals), b = min(as_u32(z), 0x7f << (23 - mbits)) (only a non-finite x reaches the NaN
 * code 0x7f), then sr: (b + (r16 << (7 - mbits))) >> (23 - mbits), else the same with half an
 * ulp less one plus the kept lowest bit (nearest even). */
AB_INLINE uint32_t ab_fp8_encode(float x, int emin, int mbits, int sr, uint32_t r16)
{
    const int drop = 23 - mbits;
    uint32_t b = ab_as_u32(x * ab_fp8_to_f32_grid(emin));    /* as_u32(x * 2^(-126-emin)) */
    b = b < (AB_FP8_NAN << drop) ? b : (AB_FP8_NAN << drop); /* b = min(b, 0x7f << drop) */
    if (sr)
        return (b + (r16 << (7 - mbits))) >> drop;           /* 16 random bits below the kept */
    return (b + (1u << (drop - 1)) - 1u + ((b >> drop) & 1u)) >> drop;    /* nearest even */
}

/* inv = top / amax, or 0 where that is not finite (amax == 0, or amax < top / FLT_MAX). */
AB_INLINE float ab_fp8_inverse_scale(float top, float amax)
{
    float inv = amax > 0.0f ? top / amax : 0.0f;
    return ab_finite(inv) ? inv : 0.0f;
}

/* ---- the update of one element (section 1) ------------------------------------------------ */

/* Updates *p, *m, *v in place with gradient g and returns s = sqrt(v). A NaN p comes out as
 * the canonical NaN; the callers canonicalise m and v where they store them as floats. */
AB_INLINE float ab_adamw_elem(const ab_hyper *h, float *p, float g, float *m, float *v)
{
    float pp = *p, mm = *m, vv = *v;
    pp = pp * h->decay;                     /* p = p * decay */
    mm = mm * h->beta1;                     /* m = m * beta1_f */
    mm = mm + g * h->one_minus_beta1;       /* m = m + g * omb1 */
    vv = vv * h->beta2;                     /* v = v * beta2_f */
    vv = vv + (g * g) * h->one_minus_beta2; /* v = v + (g * g) * omb2 */
    float s = ab_sqrtf(vv);                 /* s = sqrt(v) */
    float d = s + h->eps;                   /* d = s + eps_hat */
    pp = pp - h->step_size * (mm / d);      /* p = p - step_hat * (m / d) */
    *p = ab_canon(pp);                      /* a NaN is stored as 0x7fc00000 */
    *m = mm;
    *v = vv;
    return s;
}

/* ---- element access by dtype -------------------------------------------------------------- */

AB_INLINE float ab_load_grad(const void *g, int64_t i, int dtype)
{
    if (dtype == AB_F32)
        return ((const float *)g)[i];
    if (dtype == AB_BF16)
        return ab_bf16_decode(((const uint16_t *)g)[i]);
    return ab_f16_decode(((const uint16_t *)g)[i]);
}

AB_INLINE void ab_store_out(void *out, int64_t i, float p, int dtype)
{
    if (dtype == AB_F32)
        ((float *)out)[i] = p;
    else if (dtype == AB_BF16)
        ((uint16_t *)out)[i] = ab_bf16_out(p);
    else if (dtype == AB_F16)
        ((uint16_t *)out)[i] = ab_f16_rne(p);
}

/* ---- software prefetch ---------------------------------------------------------------------- */

/* NOTE: how far ahead (in elements) the SIMD loops prefetch their read streams. The update
 * alternates compute-heavy stretches (divide, sqrt, hash, codecs) with loads; without help
 * the hardware prefetchers let the memory system idle during the former, and bf16 moments
 * reached 0.68-0.71 of their own floor on the 2-vCPU Xeon (AVX-512); prefetching
 * 1024 elements ahead (4 KB of master) brought it to 0.95-0.97 in the same runs. A prefetch
 * never faults, so running past the end of a buffer is harmless. */
#ifndef AB_PREFETCH
#define AB_PREFETCH 1024
#endif

#if defined(__GNUC__) || defined(__clang__)
#define ab_prefetch(ptr) __builtin_prefetch((const void *)(ptr), 0, 3)
#else
#define ab_prefetch(ptr) ((void)(ptr))
#endif

/* Prefetch the lines of n elements from element i of p (fp32), g (gs bytes each), m and v
 * (ms bytes each): every read stream of the update. n, gs and ms are constants at each use. */
AB_INLINE void ab_prefetch_streams(const float *p, const void *g, const void *m, const void *v,
                                   int64_t i, int64_t n, int gs, int ms)
{
    for (int64_t b = 0; b < n * 4; b += 64)
        ab_prefetch((const char *)p + i * 4 + b);
    for (int64_t b = 0; b < n * gs; b += 64)
        ab_prefetch((const char *)g + i * gs + b);
    for (int64_t b = 0; b < n * ms; b += 64) {
        ab_prefetch((const char *)m + i * ms + b);
        ab_prefetch((const char *)v + i * ms + b);
    }
}

/* ---- the fp8 per-element lines (the scalar kernel and every SIMD tail) --------------------- */

/* Decode element i with its block's scales, update it, write its copy; returns s, sets *m. */
AB_INLINE float ab_fp8_elem_update(const ab_tensor *t, int64_t i, uint8_t qm, uint8_t qv,
                                   float scale_m, float scale_v, float *m_out, int G, int O)
{
    float g = ab_load_grad(t->grad, i, G);
    float m = ab_e4m3_decode(qm) * scale_m;                   /* m = dec_e4m3(qm) * scale_m */
    float sv = ab_e5m2_decode(qv) * scale_v;                  /* sv = dec_e5m2(qv) * scale_v */
    float v = sv * sv;                                        /* v = sv * sv */
    float s = ab_adamw_elem(&t->hparams, &t->param[i], g, &m, &v);
    ab_store_out(t->out, i, t->param[i], O);
    *m_out = m;
    return s;
}

/* amax_m = max |m|, amax_s = max s, over the finite values only. */
AB_INLINE void ab_fp8_elem_amax(float m, float s, float *amax_m, float *amax_s)
{
    float am = ab_as_f32(ab_as_u32(m) & 0x7fffffffu);         /* |m| */
    am = ab_finite(am) ? am : 0.0f;
    *amax_m = am > *amax_m ? am : *amax_m;
    float fs = ab_finite(s) ? s : 0.0f;
    *amax_s = fs > *amax_s ? fs : *amax_s;
}

/* The codes of m and s, given 1/scale of their block and r(i) (0 without SR). */
AB_INLINE void ab_fp8_elem_encode(float m, float s, float inv_m, float inv_v, int sr, uint32_t r,
                                  uint8_t *qm, uint8_t *qv)
{
    float xm = ab_as_f32(ab_as_u32(m) & 0x7fffffffu) * inv_m;   /* x_m = |m| * inv_m */
    float xv = s * inv_v;                                     /* x_v = s * inv_v */
    uint32_t cm = ab_fp8_encode(xm, AB_E4M3_EMIN, AB_E4M3_MBITS, sr, r & 0xffffu);
    uint32_t cv = ab_fp8_encode(xv, AB_E5M2_EMIN, AB_E5M2_MBITS, sr, r >> 16);
    cm |= m < 0.0f && cm != AB_FP8_NAN ? 0x80u : 0u;          /* sign: m < 0, not the NaN code */
    *qm = (uint8_t)cm;
    *qv = (uint8_t)cv;
}

/* Call CALL(G, O) with compile-time constants for the runtime grad dtype g and out dtype o,
 * so each ISA file gets one specialised loop per combination (3 x 4). */
#define AB_SWITCH_DTYPES(g, o, CALL)                                                          \
    switch ((g) * 4 + (o)) {                                                               \
    case AB_F32 * 4 + AB_F32: CALL(AB_F32, AB_F32); break;                                 \
    case AB_F32 * 4 + AB_BF16: CALL(AB_F32, AB_BF16); break;                               \
    case AB_F32 * 4 + AB_F16: CALL(AB_F32, AB_F16); break;                                 \
    case AB_F32 * 4 + AB_NONE: CALL(AB_F32, AB_NONE); break;                               \
    case AB_BF16 * 4 + AB_F32: CALL(AB_BF16, AB_F32); break;                               \
    case AB_BF16 * 4 + AB_BF16: CALL(AB_BF16, AB_BF16); break;                             \
    case AB_BF16 * 4 + AB_F16: CALL(AB_BF16, AB_F16); break;                               \
    case AB_BF16 * 4 + AB_NONE: CALL(AB_BF16, AB_NONE); break;                             \
    case AB_F16 * 4 + AB_F32: CALL(AB_F16, AB_F32); break;                                 \
    case AB_F16 * 4 + AB_BF16: CALL(AB_F16, AB_BF16); break;                               \
    case AB_F16 * 4 + AB_F16: CALL(AB_F16, AB_F16); break;                                 \
    default: CALL(AB_F16, AB_NONE); break;                                                 \
    }

/* Bytes per element of an ab_dtype (0 for AB_NONE). */
AB_INLINE int ab_dtype_size(int dtype)
{
    return dtype == AB_F32 ? 4 : (dtype == AB_NONE ? 0 : 2);
}

#endif /* ADAMBRIDGE_CODECS_H */

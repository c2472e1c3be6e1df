/* selftest_golden.c: the golden checks of selftest.c (known hash values, a golden fp32 step
 * computed with numpy, and the golden values of tests/update/test_golden.py worked out from
 * docs/numerics.md). Included by selftest.c after its helpers; not a translation unit. */

/* ---- hash, golden step ---------------------------------------------------------------------- */

static void check_hash(void)
{
    printf("hash: mix32(1) = 0x%08x, ab_hash(0x12345678, 5) = 0x%08x, "
           "ab_hash(1, (1<<32)+3) = 0x%08x\n",
           ab_mix32(1), ab_hash(0x12345678u, 5), ab_hash(1, (1ull << 32) + 3));
    CHECK(ab_mix32(0) == 0, "mix32(0) must be 0");
    CHECK(ab_mix32(1) == 0x688990c0u && ab_hash(0x12345678u, 5) == 0xf1a70114u &&
          ab_hash(1, (1ull << 32) + 3) == 0xcaffe390u, "hash known values");
}

/* One fp32 step computed with numpy float32, operation by operation, from numerics.md. */
static void check_golden(void)
{
    static const struct {
        double lr, b1, b2, eps, wd;
        int t;
        uint32_t in[4], out[3];   /* p, g, m, v -> p, m, v */
    } gold[] = {
        {1e-3, 0.9, 0.999, 1e-8, 0.01, 1,
         {0x3f800000, 0x3f000000, 0x00000000, 0x00000000}, {0x3f7fbdcf, 0x3d4ccccd, 0x3983126f}},
        {1e-3, 0.9, 0.999, 1e-8, 0.01, 10,
         {0xbf400000, 0xbe800000, 0x3dcccccd, 0x3c23d70a}, {0xbf400604, 0x3d851eb8, 0x3c24b33e}},
        {3e-4, 0.9, 0.95, 1e-6, 0.1, 1000,
         {0x3b23d70a, 0x3727c5ac, 0xb60637bd, 0x314e288f}, {0x3b241fc1, 0xb556bf94, 0x314431b1}},
    };
    for (int k = 0; k < 3; k++) {
        for (int ii = 0; ii < nisas; ii++) {
            float p = ab_as_f32(gold[k].in[0]), g = ab_as_f32(gold[k].in[1]);
            float m = ab_as_f32(gold[k].in[2]), v = ab_as_f32(gold[k].in[3]);
            ab_tensor t;
            memset(&t, 0, sizeof(t));
            t.param = &p, t.grad = &g, t.exp_avg = &m, t.exp_avg_sq = &v, t.n = 1;
            t.grad_dtype = AB_F32, t.out_dtype = AB_NONE, t.precision = AB_MOMENTS_F32;
            hyper_from(&t.hparams, gold[k].lr, gold[k].b1, gold[k].b2, gold[k].eps, gold[k].wd,
                       gold[k].t);
            ab_set_isa(isas[ii]);
            int st = ab_adamw_update(&t, 1);
            CHECK(st == 0 && ab_as_u32(p) == gold[k].out[0] && ab_as_u32(m) == gold[k].out[1] &&
                  ab_as_u32(v) == gold[k].out[2], "golden step %d on %s: p %08x m %08x v %08x", k,
                  ab_isa_name(isas[ii]), ab_as_u32(p), ab_as_u32(m), ab_as_u32(v));
        }
    }
}

/* The golden values of tests/update/test_golden.py, worked out there from docs/numerics.md in plain
 * Python: the hash, and three steps of five elements (one meeting an inf gradient at step 2)
 * in each precision, bf16 copy included. Every ISA must store exactly these bits. */
static uint32_t spec_key(uint64_t seed, uint32_t step, uint32_t param_index)
{
    uint32_t key = ab_mix32((uint32_t)seed ^ 0x9e3779b9u);
    key = ab_mix32(key ^ (uint32_t)(seed >> 32));
    key = ab_mix32(key ^ step);
    return ab_mix32(key ^ param_index);
}

static void check_golden_spec_hash(void)
{
    static const struct { uint64_t seed, step, pidx, i; uint32_t r; } gold[] = {
        {0x0123456789abcdefull, 1, 3, 0, 0xca8ea3afu}, {0x0123456789abcdefull, 1, 3, 4, 0x9c509ba4u},
        {0, 1, 0, 0, 0x7d2b5ea8u}, {0, 2, 0, 1, 0x3ce6cc92u}, {7, 3, 2, (1ull << 32) + 5, 0xeb7a31a3u},
        {~0ull, (1ull << 32) + 1, 1ull << 31, (1ull << 40) + 17, 0xfef72696u},
    };
    for (int k = 0; k < 6; k++) {
        uint32_t r = ab_hash(spec_key(gold[k].seed, (uint32_t)gold[k].step, (uint32_t)gold[k].pidx),
                             gold[k].i);
        CHECK(r == gold[k].r, "golden hash %d: %08x, want %08x", k, r, gold[k].r);
    }
}

/* GOLDEN_FP8_SUBNORMAL of tests/update/test_golden.py: where section 3's multiply onto the fp32 grid
 * rounds (numerics version 3), in the scalar codec every ISA's tails use. */
static void check_golden_fp8_subnormal(void)
{
    static const struct { float x; int e4m3, sr; uint32_t r16, code; } gold[] = {
        {0x1.400002p-8f, 1, 0, 0, 0x02}, {0x1.c00002p-8f, 1, 0, 0, 0x04},
        {0x1.400002p-15f, 0, 0, 0, 0x02}, {0x1.fffff8p-10f, 1, 1, 0, 0x01},
    };
    for (int k = 0; k < 4; k++) {
        int emin = gold[k].e4m3 ? AB_E4M3_EMIN : AB_E5M2_EMIN;
        int mbits = gold[k].e4m3 ? AB_E4M3_MBITS : AB_E5M2_MBITS;
        uint32_t c = ab_fp8_encode(gold[k].x, emin, mbits, gold[k].sr, gold[k].r16);
        CHECK(c == gold[k].code, "golden fp8 subnormal %d: %02x, want %02x", k, c, gold[k].code);
    }
}

static void check_golden_spec_steps(void)
{
    static const float p0[5] = {1.0f, -0.75f, 2.0f, 0.125f, -1.5f};
    static const float g[3][5] = {{0.5f, -3e-3f, 1e-6f, -2.0f, 0.0625f},
                                  {-0.25f, 2e-3f, 1e-6f, 4.0f, INFINITY},
                                  {0.125f, -1e-3f, -1e-6f, 1.0f, 0.5f}};
    static const uint32_t want_p[3][5] = {
        {0x3f7b2011u, 0xbf3bc981u, 0x3ffc5eb1u, 0x3e01d5a2u, 0x7fc00000u},
        {0x3f7b1fb5u, 0xbf3bc9f8u, 0x3ffc5f2au, 0x3e01d0cfu, 0x7fc00000u},
        {0x3f7b227cu, 0xbf3bdcd2u, 0x3ffdbb1du, 0x3e01d5a2u, 0x7fc00000u}};
    static const uint16_t want_out[3][5] = {{0x3f7b, 0xbf3c, 0x3ffc, 0x3e02, 0x7fc0},
                                            {0x3f7b, 0xbf3c, 0x3ffc, 0x3e02, 0x7fc0},
                                            {0x3f7b, 0xbf3c, 0x3ffe, 0x3e02, 0x7fc0}};
    static const uint32_t want_f32_m[5] = {0x3cf9db22u, 0xb92aeafcu, 0x339878a9u, 0x3e989375u, 0x7f800000u};
    static const uint32_t want_f32_v[5] = {0x39abbcbbu, 0x327023f2u, 0x2757f4e8u, 0x3cabd5dfu, 0x7f800000u};
    static const uint16_t want_bf16_m[5] = {0x3cfa, 0xb92a, 0x3399, 0x3e99, 0x7f80};
    static const uint16_t want_bf16_v[5] = {0x39ac, 0x326f, 0x2758, 0x3cac, 0x7f80};
    static const uint8_t want_fp8_m[5] = {0x63, 0xa5, 0x80, 0x7e, 0x7f};
    static const uint8_t want_fp8_v[5] = {0x6f, 0x51, 0x26, 0x7b, 0x7f};
    for (int ii = 0; ii < nisas; ii++)
        for (int prec = 0; prec < 3; prec++) {
            float p[5], m[5] = {0}, v[5] = {0}, scale_m = 0.0f, scale_v = 0.0f;
            uint16_t out[5];
            memcpy(p, p0, sizeof(p));
            ab_set_isa(isas[ii]);
            int st = 0;
            for (int t = 1; t <= 3; t++) {
                ab_tensor x;
                memset(&x, 0, sizeof(x));
                x.param = p, x.grad = g[t - 1], x.exp_avg = m, x.exp_avg_sq = v, x.out = out;
                x.exp_avg_scale = &scale_m, x.exp_avg_sq_scale = &scale_v;
                x.n = 5, x.key = spec_key(0x0123456789abcdefull, (uint32_t)t, 3);
                x.grad_dtype = AB_F32, x.out_dtype = AB_BF16, x.precision = prec;
                x.stochastic_rounding = 1;
                hyper_from(&x.hparams, 1e-2, 0.9, 0.999, 1e-8, 0.1, t);
                st |= ab_adamw_update(&x, 1);
            }
            int bad = st != 0 || memcmp(p, want_p[prec], sizeof(p)) || memcmp(out, want_out[prec], 10);
            if (prec == AB_MOMENTS_F32)
                bad |= memcmp(m, want_f32_m, 20) || memcmp(v, want_f32_v, 20);
            else if (prec == AB_MOMENTS_BF16)
                bad |= memcmp(m, want_bf16_m, 10) || memcmp(v, want_bf16_v, 10);
            else
                bad |= memcmp(m, want_fp8_m, 5) || memcmp(v, want_fp8_v, 5) ||
                       ab_as_u32(scale_m) != 0x3a2e5f61u || ab_as_u32(scale_v) != 0x36297e5du;
            CHECK(!bad, "golden spec steps, %s moments on %s (status %d)", prec_name[prec],
                  ab_isa_name(isas[ii]), st);
        }
}


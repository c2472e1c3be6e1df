/* selftest_codecs.c: the codec checks of selftest.c (fp8 round trips, error bounds and SR
 * bias, bf16 and fp16 known values, the scalar fp16 codec against F16C). Included by
 * selftest.c after its helpers (CHECK, the RNG); not a translation unit of its own. */

/* ---- codecs -------------------------------------------------------------------------------- */

static void check_fp8_codec(int emin, int mbits, float maxv, const char *name)
{
    int bad = 0, checked = 0;
    for (int c = 0; c < 256; c++) {
        float x = ab_fp8_decode((uint32_t)c, emin, mbits);
        if (!(fabsf(x) <= maxv))
            continue;                                    /* past the largest finite code */
        float ax = fabsf(x);
        uint32_t code = ab_fp8_encode(ax, emin, mbits, 0, 0) | (x < 0.0f ? 0x80u : 0u);
        uint32_t expect = c == 0x80 ? 0x00u : (uint32_t)c;  /* -0 is not < 0: encodes as +0 */
        for (uint32_t r = 0; r < 65536; r += 4369)
            if ((ab_fp8_encode(ax, emin, mbits, 1, r) | (x < 0.0f ? 0x80u : 0u)) != expect)
                bad++;
        if (code != expect)
            bad++;
        checked++;
    }
    CHECK(bad == 0 && checked == (mbits == 3 ? 254 : 248),
          "%s: %d of %d codes do not round-trip", name, bad, checked);
    /* error bounds on random x in [0, max]: RNE within q/2 (ties even), SR within q */
    int bad_rne = 0, bad_sr = 0;
    for (int k = 0; k < 200000; k++) {
        float x = (float)(maxv * pow(2.0, -24 * rng_unit()));
        if (k % 100 == 0)
            x = (float)(maxv * rng_unit());
        int e = (int)(ab_as_u32(x) >> 23) - 127;
        int ee = e > emin ? e : emin;
        double q = ldexp(1.0, ee - mbits);
        double yr = ab_fp8_decode(ab_fp8_encode(x, emin, mbits, 0, 0), emin, mbits);
        double ys = ab_fp8_decode(ab_fp8_encode(x, emin, mbits, 1, (uint32_t)(rng_u64() & 0xffff)),
                                  emin, mbits);
        if (fabs(yr - x) > q / 2 || yr > maxv)
            bad_rne++;
        if (fabs(ys - x) >= q || ys > maxv)
            bad_sr++;
    }
    CHECK(bad_rne == 0 && bad_sr == 0, "%s error bounds: rne %d bad, sr %d bad", name, bad_rne,
          bad_sr);
    /* SR is unbiased: the mean of many roundings of x approaches x */
    float x = (float)(maxv * 0.3137);
    double sum = 0;
    for (uint32_t r = 0; r < 65536; r++)
        sum += ab_fp8_decode(ab_fp8_encode(x, emin, mbits, 1, r), emin, mbits);
    int e = (int)(ab_as_u32(x) >> 23) - 127;
    CHECK(fabs(sum / 65536 - x) < ldexp(1.0, e - mbits) * 1e-3, "%s SR mean %.9g for %.9g", name,
          sum / 65536, (double)x);
}

static void check_codecs(void)
{
    check_fp8_codec(AB_E4M3_EMIN, AB_E4M3_MBITS, AB_E4M3_MAX, "e4m3");
    check_fp8_codec(AB_E5M2_EMIN, AB_E5M2_MBITS, AB_E5M2_MAX, "e5m2");
    CHECK(ab_e4m3_decode(0x7e) == 448.0f && ab_e5m2_decode(0x7b) == 57344.0f &&
          ab_e4m3_decode(0x01) == 0.001953125f && ab_e5m2_decode(0x01) == 1.52587890625e-5f &&
          ab_e4m3_decode(0xb8) == -1.0f && ab_e5m2_decode(0x3c) == 1.0f,
          "fp8 decode known values");
    CHECK(ab_fp8_encode(448.0f, AB_E4M3_EMIN, AB_E4M3_MBITS, 1, 0xffff) == 0x7e &&
          ab_fp8_encode(57344.0f, AB_E5M2_EMIN, AB_E5M2_MBITS, 1, 0xffff) == 0x7b,
          "fp8 SR at the maximum stays finite");

    /* bf16 round to nearest even: (bits in, bits out) */
    static const uint32_t bf[][2] = {
        {0x3f800000, 0x3f80}, {0x3f808000, 0x3f80}, {0x3f818000, 0x3f82}, {0x3f808001, 0x3f81},
        {0xc0200000, 0xc020}, {0x7f7fffff, 0x7f80}, {0x00018000, 0x0002}, {0x80008000, 0x8000},
        {0x3f80ffff, 0x3f81}, {0x4049fdb0, 0x404a}};
    int bad = 0;
    for (int k = 0; k < 10; k++)
        bad += ab_bf16_rne(ab_as_f32(bf[k][0])) != bf[k][1];
    CHECK(bad == 0, "bf16 RNE known values: %d wrong", bad);
    CHECK(ab_bf16_sr(ab_as_f32(0x3f808000), 0x7fff) == 0x3f80 &&
          ab_bf16_sr(ab_as_f32(0x3f808000), 0x8000) == 0x3f81 &&
          ab_bf16_out(ab_as_f32(AB_CANON_NAN)) == 0x7fc0 &&
          ab_as_u32(ab_canon(ab_as_f32(0xff812345))) == AB_CANON_NAN &&
          ab_as_u32(ab_canon(ab_as_f32(0xff800000))) == 0xff800000,
          "bf16 SR, canonical NaN and its copy");
    /* fp16: round to nearest even, subnormals, overflow */
    static const uint32_t hf[][2] = {
        {0x477fe000, 0x7bff}, {0x477ff000, 0x7c00}, {0x477fefff, 0x7bff}, {0x33800000, 0x0001},
        {0x33000000, 0x0000}, {0x33400000, 0x0001}, {0x38800000, 0x0400}, {0x3eaaaaab, 0x3555},
        {0x7fc00000, 0x7e00}, {0xff800000, 0xfc00}, {0x387fe000, 0x0400}, {0xb3c00000, 0x8002},
        {0x7f812345, 0x7e09}};
    bad = 0;
    for (int k = 0; k < 13; k++)
        bad += ab_f16_rne(ab_as_f32(hf[k][0])) != hf[k][1];
    CHECK(bad == 0, "fp16 RNE known values: %d wrong", bad);
    bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {               /* every finite fp16 round-trips */
        if ((h & 0x7c00) == 0x7c00)
            continue;
        bad += ab_f16_rne(ab_f16_decode((uint16_t)h)) != h;
    }
    CHECK(bad == 0, "fp16 decode/encode round trip: %d wrong", bad);
}

#if defined(AB_X86_64)
/* The scalar fp16 codec against the F16C instructions, exhaustively for decode. */
__attribute__((target("avx,f16c"))) static int f16c_mismatches(void)
{
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h += 8) {
        uint16_t in[8];
        float out[8];
        for (int k = 0; k < 8; k++)
            in[k] = (uint16_t)(h + k);
        _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)in)));
        for (int k = 0; k < 8; k++)
            bad += ab_as_u32(out[k]) != ab_as_u32(ab_f16_decode(in[k]));
    }
    for (int k = 0; k < 4000000; k += 8) {
        float in[8];
        uint16_t out[8];
        for (int j = 0; j < 8; j++)
            in[j] = ab_as_f32((uint32_t)rng_u64() >> (rng_u64() % 8));
        _mm_storeu_si128((__m128i *)out, _mm256_cvtps_ph(_mm256_loadu_ps(in), _MM_FROUND_TO_NEAREST_INT));
        for (int j = 0; j < 8; j++)
            bad += out[j] != ab_f16_rne(in[j]);
    }
    return bad;
}
#endif


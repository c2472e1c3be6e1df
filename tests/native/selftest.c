/* selftest.c: every compiled and supported ISA against the scalar kernel, bit for bit.
 *
 * Build and run (one command, no flags: the ISA files carry their own target pragmas):
 *     cc -O2 -pthread -o selftest tests/native/selftest.c -lm && ./selftest
 * For AArch64 (NEON) on an x86 machine, scripts/neon_check.sh cross-compiles it and runs it
 * under qemu-aarch64; for Windows, scripts/windows_check.sh builds it with MinGW-w64 gcc and
 * zig cc and runs it under wine64 (the pool runs Win32 threads there).
 * `./selftest --quick` leaves out the 3M-element tensors.
 * Checks: kernels (all sizes, dtypes, precisions, rounding modes, offsets, thread counts and
 * chunkings; guard bytes after every buffer; non-finite inputs), codecs (fp8 round trips and error bounds, bf16 and
 * fp16 known values), the hash, a golden step computed with numpy, validation and the pool.
 * Prints `selftest: N passed, M failed` and exits non-zero on any failure.
 */
#define _GNU_SOURCE
/* small pieces so that even small tensors go through the pool's split */
#define AB_SERIAL_MAX 1000
#define AB_PIECE_MIN 256
#define AB_PIECE_MAX 4096
#define AB_TENSOR_COST 100
#define AB_STREAM_MIN_BYTES (1 << 20)

#include "../../adambridge/csrc/kernel_scalar.c"
#include "../../adambridge/csrc/kernel_avx2.c"
#include "../../adambridge/csrc/kernel_avx512.c"
#include "../../adambridge/csrc/kernel_neon.c"
#include "../../adambridge/csrc/cpu_features.c"
#include "../../adambridge/csrc/pool.c"
#include "../../adambridge/csrc/dispatch.c"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* ---- the platform: aligned buffers and one extra thread, POSIX or Win32 ------------------- */

#if defined(_WIN32)
/* the Windows C runtime has no aligned_alloc (its free could not release it) */
#define test_aligned_alloc(align, bytes) _aligned_malloc((bytes), (align))
#define test_aligned_free _aligned_free
typedef struct {
    void *(*fn)(void *);
    void *arg;
    HANDLE handle;
} test_thread;
static unsigned __stdcall test_thread_entry(void *p)
{
    test_thread *t = (test_thread *)p;
    t->fn(t->arg);
    return 0;
}
static void test_thread_start(test_thread *t, void *(*fn)(void *), void *arg)
{
    t->fn = fn, t->arg = arg;
    t->handle = (HANDLE)_beginthreadex(NULL, 0, test_thread_entry, t, 0, NULL);
}
static void test_thread_join(test_thread *t)
{
    WaitForSingleObject(t->handle, INFINITE);
    CloseHandle(t->handle);
}
#else
#define test_aligned_alloc aligned_alloc
#define test_aligned_free free
typedef struct {
    pthread_t th;
} test_thread;
static void test_thread_start(test_thread *t, void *(*fn)(void *), void *arg)
{
    pthread_create(&t->th, NULL, fn, arg);
}
static void test_thread_join(test_thread *t) { pthread_join(t->th, NULL); }
#endif

static int n_pass, n_fail;

#define CHECK(cond, ...)                                                                       \
    do {                                                                                       \
        if (cond) {                                                                            \
            n_pass++;                                                                          \
        } else {                                                                               \
            n_fail++;                                                                          \
            if (n_fail <= 30) {                                                                \
                printf("FAIL %s:%d: ", __FILE__, __LINE__);                                    \
                printf(__VA_ARGS__);                                                           \
                printf("\n");                                                                  \
            }                                                                                  \
        }                                                                                      \
    } while (0)

/* ---- deterministic test data ---------------------------------------------------------------- */

static uint64_t rng_state = 0x243f6a8885a308d3ull;
static uint64_t rng_u64(void)   /* splitmix64 */
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double rng_unit(void) { return (double)(rng_u64() >> 11) * (1.0 / 9007199254740992.0); }
/* A signed value of random magnitude 10^[lo, hi), sometimes exactly zero. */
static float rng_mag(double lo, double hi)
{
    if (rng_u64() % 16 == 0)
        return 0.0f;
    double x = pow(10.0, lo + (hi - lo) * rng_unit());
    return (float)(rng_u64() & 1 ? -x : x);
}

/* ---- buffers with guard bytes and deliberate misalignment ----------------------------------- */

#define GUARD 64
typedef struct {
    unsigned char *base;
    unsigned char *data;
    size_t bytes;
} tbuf;

static tbuf tbuf_new(size_t bytes, size_t shift)
{
    tbuf b;
    b.bytes = bytes;
    b.base = (unsigned char *)test_aligned_alloc(64, (bytes + shift + GUARD + 63) / 64 * 64);
    b.data = b.base + shift;
    memset(b.base, 0xa5, shift);
    memset(b.data + bytes, 0xa5, GUARD);
    return b;
}
static int tbuf_guard_ok(const tbuf *b)
{
    for (size_t k = 0; k < GUARD; k++)
        if (b->data[b->bytes + k] != 0xa5)
            return 0;
    for (unsigned char *q = b->base; q < b->data; q++)
        if (*q != 0xa5)
            return 0;
    return 1;
}

/* One parameter's state: p, g, m, v, scales, out. */
typedef struct {
    int64_t n, offset;
    int gdt, odt, prec, sr;
    uint32_t key;
    ab_hyper hparams;
    tbuf p, g, m, v, sm, sv, out;
} state;

static size_t moment_size(int prec) { return prec == AB_MOMENTS_F32 ? 4 : prec == AB_MOMENTS_BF16 ? 2 : 1; }
static int64_t nblocks(int64_t n) { return (n + AB_BLOCK - 1) / AB_BLOCK; }

/* Where state_alloc puts the buffers relative to 64-byte alignment. */
#define PLACE_ALIGNED 0
#define PLACE_SHIFTED 1   /* every buffer but sm one element (v three) past 64-byte alignment */
#define PLACE_OUT16 2     /* `out` 16 bytes past 64-byte alignment (not 32: the AVX2 streams) */

static void state_alloc(state *s, int place)
{
    size_t gs = (size_t)ab_dtype_size(s->gdt), ms = moment_size(s->prec);
    size_t os = (size_t)ab_dtype_size(s->odt);
    int shift = place == PLACE_SHIFTED;
    s->p = tbuf_new((size_t)s->n * 4, shift ? 4 : 0);
    s->g = tbuf_new((size_t)s->n * gs, shift ? gs : 0);
    s->m = tbuf_new((size_t)s->n * ms, shift ? ms : 0);
    s->v = tbuf_new((size_t)s->n * ms, shift ? 3 * ms : 0);
    s->sm = tbuf_new((size_t)nblocks(s->n) * 4, 0);
    s->sv = tbuf_new((size_t)nblocks(s->n) * 4, shift ? 4 : 0);
    s->out = tbuf_new((size_t)s->n * (os ? os : 1),
                      shift ? os : place == PLACE_OUT16 ? 16 : 0);
}
static void state_free(state *s)
{
    test_aligned_free(s->p.base), test_aligned_free(s->g.base), test_aligned_free(s->m.base);
    test_aligned_free(s->v.base), test_aligned_free(s->sm.base), test_aligned_free(s->sv.base);
    test_aligned_free(s->out.base);
}
static void state_copy(state *dst, const state *src, int place)
{
    *dst = *src;
    state_alloc(dst, place);
    memcpy(dst->p.data, src->p.data, src->p.bytes);
    memcpy(dst->g.data, src->g.data, src->g.bytes);
    memcpy(dst->m.data, src->m.data, src->m.bytes);
    memcpy(dst->v.data, src->v.data, src->v.bytes);
    memcpy(dst->sm.data, src->sm.data, src->sm.bytes);
    memcpy(dst->sv.data, src->sv.data, src->sv.bytes);
    memcpy(dst->out.data, src->out.data, src->out.bytes);
}

static void hyper_from(ab_hyper *h, double lr, double b1, double b2, double eps, double wd, int t)
{
    h->beta1 = (float)b1;
    h->beta2 = (float)b2;
    h->one_minus_beta1 = (float)(1.0 - b1);
    h->one_minus_beta2 = (float)(1.0 - b2);
    h->decay = (float)(1.0 - lr * wd);
    h->step_size = (float)(lr * sqrt(1.0 - pow(b2, t)) / (1.0 - pow(b1, t)));  /* step_hat */
    h->eps = (float)(eps * sqrt(1.0 - pow(b2, t)));                            /* eps_hat */
}

/* 1 while check_nonfinite runs: state_fill then plants infinities, NaNs of every payload and
 * the fp8 non-finite codes, which every ISA must turn into the same bits (numerics.md s. 6). */
static int fill_nonfinite;

static uint32_t rng_nonfinite_bits(void)
{
    static const uint32_t bits[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc12345u,
                                    0x7f800001u, 0x7fffffffu, 0xffffffffu};
    return bits[rng_u64() % 7];
}

/* With fill_nonfinite, about one value in 8 of x becomes inf or a NaN. */
static float maybe_nonfinite(float x)
{
    return fill_nonfinite && rng_u64() % 8 == 0 ? ab_as_f32(rng_nonfinite_bits()) : x;
}

/* Random state, finite unless fill_nonfinite (every ISA must agree on every bit). */
static void state_fill(state *s)
{
    int t = 1 + (int)(rng_u64() % 2000);
    hyper_from(&s->hparams, rng_u64() & 1 ? 1e-3 : 0.05, 0.9, rng_u64() & 1 ? 0.999 : 0.95,
               1e-8, rng_u64() & 1 ? 0.01 : 0.0, t);
    float *p = (float *)s->p.data;
    for (int64_t i = 0; i < s->n; i++) {
        uint64_t kind = rng_u64() % 32;
        p[i] = kind == 0 ? rng_mag(-44, -38)            /* subnormal-ish copies */
             : kind == 1 ? rng_mag(4, 5.5)              /* fp16 overflow */
             : rng_mag(-6, 1);
        p[i] = maybe_nonfinite(p[i]);
    }
    for (int64_t i = 0; i < s->n; i++) {
        float g = maybe_nonfinite(rng_mag(-9, 2));
        if (s->gdt == AB_F32)
            ((float *)s->g.data)[i] = g;
        else if (s->gdt == AB_BF16)
            ((uint16_t *)s->g.data)[i] = ab_bf16_rne(g);
        else
            ((uint16_t *)s->g.data)[i] = ab_f16_rne(g);
    }
    for (int64_t i = 0; i < s->n; i++) {
        float m = maybe_nonfinite(rng_mag(-9, 0)), v = maybe_nonfinite(fabsf(rng_mag(-16, 1)));
        if (s->prec == AB_MOMENTS_F32) {
            ((float *)s->m.data)[i] = m;
            ((float *)s->v.data)[i] = v;
        } else if (s->prec == AB_MOMENTS_BF16) {
            ((uint16_t *)s->m.data)[i] = (uint16_t)(ab_as_u32(m) >> 16);   /* NaNs kept */
            ((uint16_t *)s->v.data)[i] = (uint16_t)(ab_as_u32(v) >> 16);
        } else {
            uint8_t cm = (uint8_t)(rng_u64() & 0xff), cv = (uint8_t)(rng_u64() % 0x7c);
            if ((cm & 0x7f) == 0x7f && !fill_nonfinite)
                cm &= 0xfe;                              /* no NaN codes */
            if (fill_nonfinite && rng_u64() % 8 == 0)    /* the codes of inf and NaN */
                cv = (uint8_t)(0x7c + rng_u64() % 4);
            ((uint8_t *)s->m.data)[i] = cm;
            ((uint8_t *)s->v.data)[i] = cv;
        }
    }
    for (int64_t b = 0; b < nblocks(s->n); b++) {
        int zero = rng_u64() % 8 == 0;                  /* a block never updated before */
        ((float *)s->sm.data)[b] = zero ? 0.0f : (float)pow(2.0, -30 * rng_unit()) / 448.0f;
        ((float *)s->sv.data)[b] = zero ? 0.0f : (float)pow(2.0, -20 * rng_unit()) / 57344.0f;
    }
    memset(s->out.data, 0x5a, s->out.bytes);
}

/* The ab_tensor for elements [a, b) of s. */
static ab_tensor state_range(const state *s, int64_t a, int64_t b)
{
    size_t gs = (size_t)ab_dtype_size(s->gdt), ms = moment_size(s->prec);
    size_t os = (size_t)ab_dtype_size(s->odt);
    ab_tensor t;
    memset(&t, 0, sizeof(t));
    t.param = (float *)s->p.data + a;
    t.grad = s->g.data + (size_t)a * gs;
    t.exp_avg = s->m.data + (size_t)a * ms;
    t.exp_avg_sq = s->v.data + (size_t)a * ms;
    if (s->prec == AB_MOMENTS_FP8) {
        t.exp_avg_scale = (float *)s->sm.data + a / AB_BLOCK;
        t.exp_avg_sq_scale = (float *)s->sv.data + a / AB_BLOCK;
    }
    t.out = s->odt == AB_NONE ? NULL : s->out.data + (size_t)a * os;
    t.n = b - a;
    t.offset = s->offset + a;
    t.key = s->key;
    t.grad_dtype = s->gdt;
    t.out_dtype = s->odt;
    t.precision = s->prec;
    t.stochastic_rounding = s->sr;
    t.hparams = s->hparams;
    return t;
}

/* Update s split into ranges at cuts (ascending, excluding 0 and n), all in one call. */
static int state_update(state *s, const int64_t *cuts, int ncuts)
{
    ab_tensor ts[64];
    int64_t a = 0;
    int k = 0;
    for (int c = 0; c <= ncuts; c++) {
        int64_t b = c < ncuts ? cuts[c] : s->n;
        ts[k++] = state_range(s, a, b);
        a = b;
    }
    return ab_adamw_update(ts, k);
}

static int state_equal(const state *a, const state *b, char *why)
{
    const tbuf *x[7] = {&a->p, &a->m, &a->v, &a->sm, &a->sv, &a->out, &a->g};
    const tbuf *y[7] = {&b->p, &b->m, &b->v, &b->sm, &b->sv, &b->out, &b->g};
    static const char *names[7] = {"p", "m", "v", "scale_m", "scale_v", "out", "grad"};
    for (int k = 0; k < 7; k++) {
        if (!tbuf_guard_ok(y[k])) {
            sprintf(why, "%s written out of bounds", names[k]);
            return 0;
        }
        if (memcmp(x[k]->data, y[k]->data, x[k]->bytes)) {
            size_t at = 0;
            while (x[k]->data[at] == y[k]->data[at])
                at++;
            sprintf(why, "%s differs at byte %zu", names[k], at);
            return 0;
        }
    }
    return 1;
}

/* ---- kernel checks ------------------------------------------------------------------------ */

static int isas[4], nisas;
static const char *dtype_name[4] = {"f32", "bf16", "f16", "none"};
static const char *prec_name[3] = {"f32", "bf16", "fp8"};

/* Cuts for chunking `variant` of n elements (multiples of 128 when fp8). */
static int make_cuts(int variant, int64_t n, int fp8, int64_t *cuts)
{
    int k = 0;
    if (variant == 1) {              /* 128-multiples of growing size */
        for (int64_t c = 128, step = 128; c < n && k < 60; step += 128, c += step)
            cuts[k++] = c;
    } else if (variant == 2) {       /* odd places (fp8: every other block) */
        static const int64_t odd[] = {1, 16, 17, 100, 129, 1000, 2047, 3000, 4000};
        for (int j = 0; j < 9; j++) {
            int64_t c = fp8 ? 256 * (j + 1) : odd[j];
            if (c < n)
                cuts[k++] = c;
        }
    }
    return k;
}

static void check_config(int64_t n, int64_t offset, int gdt, int odt, int prec, int sr,
                         int nvariants)
{
    state ref;
    memset(&ref, 0, sizeof(ref));
    ref.n = n, ref.offset = offset, ref.gdt = gdt, ref.odt = odt, ref.prec = prec, ref.sr = sr;
    ref.key = (uint32_t)rng_u64();
    state_alloc(&ref, 0);
    state_fill(&ref);
    state want;
    state_copy(&want, &ref, 0);
    ab_set_isa(AB_ISA_SCALAR);
    ab_pool_configure(1, NULL, 0);
    int st = state_update(&want, NULL, 0);
    CHECK(st == AB_OK, "scalar update returned %d", st);
    for (int ii = 0; ii < nisas; ii++) {
        for (int threads = 1; threads <= 2; threads++) {
            ab_pool_configure(threads, NULL, 0);
            ab_set_isa(isas[ii]);
            for (int variant = 0; variant < nvariants; variant++) {
                int64_t cuts[64];
                int ncuts = make_cuts(variant, n, prec == AB_MOMENTS_FP8, cuts);
                state got;
                state_copy(&got, &ref, variant == 1 ? PLACE_SHIFTED
                                       : variant == 2 ? PLACE_OUT16 : PLACE_ALIGNED);
                st = state_update(&got, cuts, ncuts);
                char why[128] = "";
                int ok = st == AB_OK && state_equal(&want, &got, why);
                CHECK(ok, "%s n=%lld off=%lld grad=%s out=%s moments=%s sr=%d threads=%d "
                      "chunking=%d: status %d %s", ab_isa_name(isas[ii]), (long long)n,
                      (long long)offset, dtype_name[gdt], dtype_name[odt], prec_name[prec], sr,
                      threads, variant, st, why);
                state_free(&got);
            }
        }
    }
    state_free(&want);
    state_free(&ref);
}

static void check_kernels(int quick)
{
    static const int64_t sizes[] = {0, 1, 15, 16, 17, 127, 128, 129, 4097};
    static const int64_t offsets[] = {0, 384, (1ll << 32) - 256, (3ll << 32) + 128 * 7, 7,
                                      (1ll << 32) - 5};
    /* fp8 too at offsets 7 and 2^32 - 5 (an FSDP2 shard may start anywhere): with 2^32 - 5
     * the block holding the crossing of 2^32 goes to the scalar kernel, the rest to the ISA */
    for (int si = 0; si < 9; si++)
        for (int oi = 0; oi < 6; oi++)
            for (int prec = 0; prec < 3; prec++) {
                for (int gdt = 0; gdt < 3; gdt++)
                    for (int odt = 0; odt < 4; odt++)
                        for (int sr = 0; sr < 2; sr++)
                            check_config(sizes[si], offsets[oi], gdt, odt, prec, sr, 3);
            }
    /* a 3M tensor: pieces of the real pool split, streamed (non-temporal) `out`, also 16
     * bytes past 64-byte alignment (variant 2) */
    for (int prec = 0; prec < 3 && !quick; prec++)
        for (int odt = 0; odt < 4; odt += 1)
            check_config(3000000 + 77 * (prec != AB_MOMENTS_FP8), 128, AB_BF16, odt, prec, 1, 3);
    /* the same split with fp8 off a block boundary, crossing 2^32 in the middle of a piece */
    if (!quick)
        check_config(3000000, (1ll << 32) - 1000037, AB_BF16, AB_BF16, AB_MOMENTS_FP8, 1, 3);
}

/* Non-finite values in every input, at every size and layout: every ISA equals scalar. */
static void check_nonfinite(void)
{
    static const int64_t sizes[] = {1, 15, 17, 129, 4097};
    fill_nonfinite = 1;
    for (int si = 0; si < 5; si++)
        for (int prec = 0; prec < 3; prec++)
            for (int gdt = 0; gdt < 3; gdt++)
                for (int odt = 0; odt < 4; odt++)
                    for (int sr = 0; sr < 2; sr++)
                        check_config(sizes[si], 384, gdt, odt, prec, sr, 2);
    fill_nonfinite = 0;
}

/* Thousands of small tensors in one call equal the same tensors updated one at a time. */
static void check_many_tensors(void)
{
    enum { COUNT = 3000 };
    static state ref[COUNT], want[COUNT], got[COUNT];
    static ab_tensor ts[COUNT];
    for (int k = 0; k < COUNT; k++) {
        memset(&ref[k], 0, sizeof(state));
        ref[k].n = (int64_t)(rng_u64() % 300);
        ref[k].prec = (int)(rng_u64() % 3);
        ref[k].offset = (int64_t)(rng_u64() % 1000);
        ref[k].gdt = (int)(rng_u64() % 3);
        ref[k].odt = (int)(rng_u64() % 4);
        ref[k].sr = (int)(rng_u64() & 1);
        ref[k].key = (uint32_t)rng_u64();
        state_alloc(&ref[k], 0);
        state_fill(&ref[k]);
        state_copy(&want[k], &ref[k], 0);
        ab_set_isa(AB_ISA_SCALAR);
        ab_pool_configure(1, NULL, 0);
        state_update(&want[k], NULL, 0);
    }
    for (int ii = 0; ii < nisas; ii++)
        for (int threads = 1; threads <= 2; threads++) {
            ab_set_isa(isas[ii]);
            ab_pool_configure(threads, NULL, 0);
            for (int k = 0; k < COUNT; k++) {
                state_copy(&got[k], &ref[k], k & 1 ? PLACE_SHIFTED : PLACE_ALIGNED);
                ts[k] = state_range(&got[k], 0, got[k].n);
            }
            int st = ab_adamw_update(ts, COUNT);
            int bad = -1;
            char why[128] = "";
            for (int k = 0; k < COUNT; k++) {
                if (bad < 0 && !state_equal(&want[k], &got[k], why))
                    bad = k;
                state_free(&got[k]);
            }
            CHECK(st == AB_OK && bad < 0, "%s threads=%d: %d tensors in one call: status %d, "
                  "tensor %d %s", ab_isa_name(isas[ii]), threads, COUNT, st, bad, why);
        }
    for (int k = 0; k < COUNT; k++)
        state_free(&ref[k]), state_free(&want[k]);
}

#include "selftest_codecs.c"
#include "selftest_golden.c"

/* ---- validation, ISA selection, pool -------------------------------------------------------- */

static void check_validation(void)
{
    state s;
    memset(&s, 0, sizeof(s));
    s.n = 300, s.gdt = AB_F32, s.odt = AB_BF16, s.prec = AB_MOMENTS_FP8, s.sr = 1;
    state_alloc(&s, 0);
    state_fill(&s);
    state before;
    state_copy(&before, &s, 0);
    ab_tensor ts[2] = {state_range(&s, 0, 128), state_range(&s, 128, 300)};
    char why[128];
    struct { const char *what; int field; int value; int expect; } bad[] = {
        {"reserved", 0, 1, AB_EINVAL}, {"grad dtype none", 1, AB_NONE, AB_EINVAL},
        {"out dtype 7", 2, 7, AB_EINVAL}, {"precision 3", 3, 3, AB_EINVAL},
        {"sr 2", 4, 2, AB_EINVAL}, {"negative offset", 5, -1, AB_EINVAL},
        {"NULL grad", 6, 0, AB_EINVAL}, {"NULL scale", 7, 0, AB_EINVAL},
        {"negative n", 8, -1, AB_EINVAL}, {"NULL out", 9, 0, AB_EINVAL},
    };
    for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
        ab_tensor copy[2] = {ts[0], ts[1]};
        ab_tensor *t = &copy[1];
        switch (bad[k].field) {
        case 0: t->reserved = bad[k].value; break;
        case 1: t->grad_dtype = bad[k].value; break;
        case 2: t->out_dtype = bad[k].value; break;
        case 3: t->precision = bad[k].value; break;
        case 4: t->stochastic_rounding = bad[k].value; break;
        case 5: t->offset = bad[k].value; break;
        case 6: t->grad = NULL; break;
        case 7: t->exp_avg_sq_scale = NULL; break;
        case 8: t->n = bad[k].value; break;
        case 9: t->out = NULL; break;
        }
        int st = ab_adamw_update(copy, 2);
        CHECK(st == bad[k].expect && state_equal(&before, &s, why),
              "validation %s: status %d (want %d), memory untouched: %s", bad[k].what, st,
              bad[k].expect, why);
    }
    ab_tensor empty;
    memset(&empty, 0, sizeof(empty));
    empty.grad_dtype = AB_BF16, empty.out_dtype = AB_NONE;
    CHECK(ab_adamw_update(&empty, 1) == AB_OK && ab_adamw_update(NULL, 0) == AB_OK &&
          ab_adamw_update(NULL, 1) == AB_EINVAL && ab_adamw_update(ts, -1) == AB_EINVAL,
          "empty tensors and counts");
    CHECK(ab_set_isa(99) == AB_EISA && ab_set_isa(-1) == AB_EISA, "ab_set_isa rejects unknown ISAs");
    for (int isa = 0; isa < 4; isa++)
        CHECK(ab_isa_supported(isa) ? ab_set_isa(isa) == AB_OK && ab_isa_active() == isa
                                    : ab_set_isa(isa) == AB_EISA,
              "ab_set_isa(%s)", ab_isa_name(isa));
    ab_set_isa(ab_isa_detected());
    CHECK(strlen(ab_strerror(AB_EALIGN)) > 0 && ab_abi_version() == AB_ABI_VERSION, "strerror, abi");
    state_free(&s);
    state_free(&before);
}

static int task_hits[64];
static void count_task(void *arg, int index) { (void)arg; __atomic_fetch_add(&task_hits[index], 1, __ATOMIC_RELAXED); }

/* A task that itself calls the kernel (nested: must run serially, not deadlock). */
static void nested_task(void *arg, int index)
{
    if (index == 0) {
        state *s = (state *)arg;
        ab_tensor t = state_range(s, 0, s->n);
        task_hits[63] = ab_adamw_update(&t, 1) == AB_OK;
    }
}

static void *concurrent_caller(void *arg)
{
    state *s = (state *)arg;
    for (int k = 0; k < 20; k++) {
        ab_tensor t = state_range(s, 0, s->n);
        ab_adamw_update(&t, 1);
    }
    return NULL;
}

/* The in-task flag must be per thread: a thread started from inside a task is not in one.
 * (A thread-local the compiler ignored would make it one process-wide flag, and a second
 * thread would take the unlocked nested path of ab_adamw_update.) */
static int tls_seen = -1;
static void *tls_probe(void *arg)
{
    (void)arg;
    tls_seen = ab_pool_in_task();
    return NULL;
}
static void tls_task(void *arg, int index)
{
    (void)arg;
    if (index == 0) {
        test_thread t;
        test_thread_start(&t, tls_probe, NULL);
        test_thread_join(&t);
    }
}

static void check_pool(void)
{
    ab_pool_run(tls_task, NULL);
    CHECK(tls_seen == 0, "the in-task flag is per thread: a thread started in a task saw %d", tls_seen);
    CHECK(ab_pool_configure(3, NULL, 0) == AB_OK && ab_pool_threads() == 3, "pool of 3");
    memset(task_hits, 0, sizeof(task_hits));
    ab_pool_run(count_task, NULL);
    CHECK(task_hits[0] == 1 && task_hits[1] == 1 && task_hits[2] == 1 && task_hits[3] == 0,
          "ab_pool_run runs each index once");
    int cpus[1] = {0};
    int st = ab_pool_configure(2, cpus, 1);
    CHECK(st == AB_OK && ab_pool_threads() == 2, "pinned pool: %d", st);
    CHECK(ab_pool_configure(2, NULL, 1) == AB_EINVAL && ab_pool_configure(2, (int[]){-1}, 1) == AB_EINVAL,
          "pool rejects bad cpu lists");
    size_t bytes = (size_t)40 << 20;
    unsigned char *buf = (unsigned char *)malloc(bytes + 3);
    memset(buf, 0x77, bytes + 3);
    st = ab_first_touch(buf + 1, (int64_t)bytes);
    size_t nonzero = 0;
    for (size_t k = 1; k <= bytes; k++)
        nonzero += buf[k] != 0;
    CHECK(st == AB_OK && nonzero == 0 && buf[0] == 0x77 && buf[bytes + 1] == 0x77,
          "ab_first_touch zeroes exactly its range (%zu nonzero)", nonzero);
    free(buf);

    /* nested call and two concurrent callers, each checked against the scalar result */
    state s[2], want[2];
    for (int k = 0; k < 2; k++) {
        memset(&s[k], 0, sizeof(state));
        s[k].n = 50000, s[k].gdt = AB_BF16, s[k].odt = AB_BF16, s[k].prec = k + 1, s[k].sr = 1;
        state_alloc(&s[k], 0);
        state_fill(&s[k]);
        state_copy(&want[k], &s[k], 0);
    }
    ab_set_isa(AB_ISA_SCALAR);
    ab_pool_configure(1, NULL, 0);
    ab_tensor t0 = state_range(&want[0], 0, s[0].n);
    ab_adamw_update(&t0, 1);
    for (int r = 0; r < 20; r++) {
        ab_tensor t1 = state_range(&want[1], 0, s[1].n);
        ab_adamw_update(&t1, 1);
    }
    ab_set_isa(ab_isa_detected());
    ab_pool_configure(2, NULL, 0);
    task_hits[63] = 0;
    ab_pool_run(nested_task, &s[0]);
    char why[128] = "";
    CHECK(task_hits[63] == 1 && state_equal(&want[0], &s[0], why), "nested update: %s", why);
    state c;
    state_copy(&c, &s[1], 0);
    test_thread th;
    test_thread_start(&th, concurrent_caller, &c);
    ab_tensor tmp;
    for (int r = 0; r < 20; r++) {                       /* meanwhile, a second caller */
        state junk;
        state_copy(&junk, &s[0], 0);
        tmp = state_range(&junk, 0, junk.n);
        ab_adamw_update(&tmp, 1);
        state_free(&junk);
    }
    test_thread_join(&th);
    CHECK(state_equal(&want[1], &c, why), "two concurrent callers: %s", why);
    state_free(&c);
    for (int k = 0; k < 2; k++)
        state_free(&s[k]), state_free(&want[k]);
}

int main(int argc, char **argv)
{
    /* --quick leaves out the 3M-element tensors (for emulators: qemu runs ~30x slower) */
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    for (int isa = 0; isa < 4; isa++) {
        if (ab_isa_supported(isa))
            isas[nisas++] = isa;
        printf("isa %-6s compiled %d supported %d\n", ab_isa_name(isa), ab_isa_compiled(isa),
               ab_isa_supported(isa));
    }
    printf("detected %s, L2 %lld bytes, %d online threads\n", ab_isa_name(ab_isa_detected()),
           (long long)ab_l2_cache_bytes(), ab_pool_threads());
    check_hash();
    check_codecs();
#if defined(AB_X86_64)
    if (ab_cpu_has_avx2()) {
        int bad = f16c_mismatches();
        CHECK(bad == 0, "scalar fp16 codec vs F16C: %d mismatches", bad);
    }
#endif
    check_golden();
    check_golden_spec_hash();
    check_golden_spec_steps();
    check_golden_fp8_subnormal();
    check_validation();
    check_pool();
    check_many_tensors();
    check_nonfinite();
    check_kernels(quick);
    printf("selftest: %d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

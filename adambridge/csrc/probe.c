/* probe.c: ab_memory_pass, the bandwidth floor the benchmarks compare the kernel against.
 *
 * It streams over exactly the buffers an update call would (read master, grad, m, v; write
 * master, m, v and the copy) with trivial integer work, split over the same pool, so
 * "kernel time / floor time" says how far the kernel is from the memory system's limit.
 * It scrambles the buffers' contents: use it on scratch state only.
 */
#include "codecs.h"

typedef struct {
    const ab_tensor *tensors;
    int64_t count;
    int nthreads;
} ab_probe_job;

/* One typed pass: every stream read once and written once, as the kernel does. Typed loops
 * so the compiler vectorises them; the work per element is a few integer ops. */
#define AB_PROBE_LOOP(GT, MT)                                                   \
    do {                                                                        \
        const GT *g = (const GT *)t->grad;                                      \
        MT *m = (MT *)t->exp_avg, *v = (MT *)t->exp_avg_sq;                     \
        if (out) {                                                              \
            for (int64_t i = lo; i < hi; i++) {                                 \
                uint32_t pi = p[i] ^ (uint32_t)g[i];                            \
                p[i] = pi;                                                      \
                m[i] = (MT)(m[i] ^ (MT)g[i]);                                   \
                v[i] = (MT)(v[i] ^ (MT)g[i]);                                   \
                out[i] = (uint16_t)(pi >> 16);                                  \
            }                                                                   \
        } else {                                                                \
            for (int64_t i = lo; i < hi; i++) {                                 \
                p[i] ^= (uint32_t)g[i];                                         \
                m[i] = (MT)(m[i] ^ (MT)g[i]);                                   \
                v[i] = (MT)(v[i] ^ (MT)g[i]);                                   \
            }                                                                   \
        }                                                                       \
    } while (0)

#define AB_PROBE_MOMENTS(GT)                                                    \
    do {                                                                        \
        if (t->precision == AB_MOMENTS_F32) AB_PROBE_LOOP(GT, uint32_t);        \
        else if (t->precision == AB_MOMENTS_BF16) AB_PROBE_LOOP(GT, uint16_t);  \
        else AB_PROBE_LOOP(GT, uint8_t);                                        \
    } while (0)

static void ab_probe_scalar_head(const ab_tensor *t, int64_t lo, int64_t hi);

static inline int ab_moment_size(int precision)
{
    return precision == AB_MOMENTS_F32 ? 4 : precision == AB_MOMENTS_BF16 ? 2 : 1;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* 64 elements per iteration at full AVX-512 width, for every layout (moments of 4, 2 or 1
 * bytes, a 2- or 4-byte gradient, a 0-, 2- or 4-byte copy): each stream is read once and the
 * read-modify-write ones written back, the copy with non-temporal stores as the kernel does.
 * ms, gs, os are constants in each caller, so every loop below unrolls completely. */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline int64_t
ab_probe_avx512_body(const ab_tensor *t, int64_t lo, int64_t hi, int ms, int gs, int os)
{
    char *p = (char *)t->param, *m = (char *)t->exp_avg, *v = (char *)t->exp_avg_sq;
    const char *g = (const char *)t->grad;
    char *out = (char *)t->out;
    int64_t i = lo;
    while (os && i < hi && ((uintptr_t)(out + i * os) & 63))
        i++;                                           /* scalar head until out is aligned */
    ab_probe_scalar_head(t, lo, i);
    const __m512i c = _mm512_set1_epi32(0x5a5a5a5a);
    for (; i + 64 <= hi; i += 64) {
        __m512i pv[4], acc = c;
        for (int k = 0; k < gs; k++)                   /* g: read */
            acc = _mm512_xor_si512(acc, _mm512_loadu_si512(g + i * gs + 64 * k));
        for (int k = 0; k < 4; k++) {                  /* p: read, write */
            pv[k] = _mm512_xor_si512(_mm512_loadu_si512(p + i * 4 + 64 * k), acc);
            _mm512_storeu_si512(p + i * 4 + 64 * k, pv[k]);
        }
        for (int k = 0; k < ms; k++) {                 /* m, v: read, write */
            _mm512_storeu_si512(m + i * ms + 64 * k,
                                _mm512_xor_si512(_mm512_loadu_si512(m + i * ms + 64 * k), acc));
            _mm512_storeu_si512(v + i * ms + 64 * k,
                                _mm512_xor_si512(_mm512_loadu_si512(v + i * ms + 64 * k), acc));
        }
        for (int k = 0; k < os; k++)                   /* the copy: write only, streamed */
            _mm512_stream_si512((__m512i *)(out + i * os + 64 * k), pv[k]);
    }
    _mm_sfence();
    return i;
}

#define AB_PROBE_OS(MS, GS)                                                              \
    (os == 4 ? ab_probe_avx512_body(t, lo, hi, MS, GS, 4)                                \
     : os == 2 ? ab_probe_avx512_body(t, lo, hi, MS, GS, 2)                              \
               : ab_probe_avx512_body(t, lo, hi, MS, GS, 0))
#define AB_PROBE_GS(MS) (gs == 4 ? AB_PROBE_OS(MS, 4) : AB_PROBE_OS(MS, 2))

__attribute__((target("avx512f,avx512bw"))) static int64_t ab_probe_avx512(const ab_tensor *t,
                                                                         int64_t lo, int64_t hi)
{
    int ms = ab_moment_size(t->precision), gs = ab_dtype_size(t->grad_dtype);
    int os = ab_dtype_size(t->out_dtype);
    if (ms == 4)
        return AB_PROBE_GS(4);
    if (ms == 2)
        return AB_PROBE_GS(2);
    return AB_PROBE_GS(1);
}
#undef AB_PROBE_OS
#undef AB_PROBE_GS

/* The benchmarks' layout (fp32 moments, 16-bit grad and copy) at full AVX2 width, with
 * non-temporal stores for the write-only copy as the kernel uses: a floor worth the name. */
__attribute__((target("avx2"))) static int64_t ab_probe_avx2(const ab_tensor *t, int64_t lo,
                                                              int64_t hi)
{
    uint32_t *p = (uint32_t *)t->param, *m = (uint32_t *)t->exp_avg, *v = (uint32_t *)t->exp_avg_sq;
    const uint16_t *g = (const uint16_t *)t->grad;
    uint16_t *out = (uint16_t *)t->out;
    int64_t i = lo;
    while (i < hi && ((uintptr_t)(out + i) & 15))
        i++;                                           /* scalar head until out is aligned */
    ab_probe_scalar_head(t, lo, i);
    for (; i + 8 <= hi; i += 8) {
        __m256i g8 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(g + i)));
        __m256i p8 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + i)), g8);
        _mm256_storeu_si256((__m256i *)(p + i), p8);
        _mm256_storeu_si256((__m256i *)(m + i),
                            _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(m + i)), g8));
        _mm256_storeu_si256((__m256i *)(v + i),
                            _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(v + i)), g8));
        __m256i hi16 = _mm256_srli_epi32(p8, 16);
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi16),
                                          _mm256_extracti128_si256(hi16, 1));
        _mm_stream_si128((__m128i *)(out + i), packed);
    }
    _mm_sfence();
    return i;
}
#endif

/* The widest pass the CPU runs: AVX-512 for every layout, else AVX2 for the fp32-moment one. */
static void ab_probe_range(const ab_tensor *t, int64_t lo, int64_t hi)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx512bw"))
        lo = ab_probe_avx512(t, lo, hi);
    else if (t->precision == AB_MOMENTS_F32 && t->grad_dtype != AB_F32 && t->out
             && t->out_dtype != AB_F32 && t->out_dtype != AB_NONE && __builtin_cpu_supports("avx2"))
        lo = ab_probe_avx2(t, lo, hi);
#endif
    ab_probe_scalar_head(t, lo, hi);
}

static void ab_probe_scalar_head(const ab_tensor *t, int64_t lo, int64_t hi)
{
    uint32_t *p = (uint32_t *)t->param;
    uint16_t *out = t->out_dtype == AB_BF16 || t->out_dtype == AB_F16 ? (uint16_t *)t->out : NULL;
    if (t->grad_dtype == AB_F32)
        AB_PROBE_MOMENTS(uint32_t);
    else
        AB_PROBE_MOMENTS(uint16_t);
}

static void ab_probe_task(void *arg, int index)
{
    const ab_probe_job *job = (const ab_probe_job *)arg;
    for (int64_t k = 0; k < job->count; k++) {
        const ab_tensor *t = &job->tensors[k];
        int64_t lo = t->n * index / job->nthreads;
        int64_t hi = t->n * (index + 1) / job->nthreads;
        ab_probe_range(t, lo, hi);
    }
}

AB_API int ab_memory_pass(const ab_tensor *tensors, int64_t count)
{
    if (count < 0 || (count > 0 && tensors == NULL))
        return AB_EINVAL;
    for (int64_t k = 0; k < count; k++) {
        const ab_tensor *t = &tensors[k];
        if (t->n < 0 || (t->n > 0 && (!t->param || !t->grad || !t->exp_avg || !t->exp_avg_sq)))
            return AB_EINVAL;
        if (t->grad_dtype < AB_F32 || t->grad_dtype > AB_F16)
            return AB_EINVAL;
    }
    ab_probe_job job = {tensors, count, ab_pool_threads()};
    return ab_pool_run(ab_probe_task, &job);
}

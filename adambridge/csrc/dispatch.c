/* dispatch.c: the public entry points: validation, the ISA function table, and the split of
 * one multi-tensor update into pieces for the thread pool.
 *
 * The table starts with the scalar kernel and is overridden in rising ISA order, each under
 * both its #if (compiled in) and its has_* (the CPU and OS can run it). Work is split into
 * pieces of whole fp8 blocks over the concatenation of all tensors, so one call can carry
 * thousands of small tensors; the element results never depend on the split (numerics.md s.5).
 */
#include "codecs.h"

#include <stdlib.h>

#if defined(_WIN32)
#include <windows.h>
#else
#include <pthread.h>
#endif

/* cpu_features.c */
int ab_cpu_has_avx2(void);
int ab_cpu_has_avx512(void);
int ab_cpu_has_neon(void);
/* pool.c (the call lock serialises callers; *_locked must be called with it held) */
void ab_pool_lock(void);
void ab_pool_unlock(void);
int ab_pool_run_locked(ab_task_fn fn, void *arg);
int ab_pool_threads_locked(void);
int ab_pool_in_task(void);

/* ---- tuning -------------------------------------------------------------------------------- */

/* (overridable so the unity-built self-test can exercise the pool with small tensors) */
#ifndef AB_PIECE_MIN
#define AB_PIECE_MIN 8192          /* elements per piece: small enough to balance threads */
#endif
#ifndef AB_PIECE_MAX
#define AB_PIECE_MAX 65536         /* ... large enough that the per-piece cost vanishes */
#endif
#ifndef AB_SERIAL_MAX
#define AB_SERIAL_MAX 32768        /* calls with less work than this never wake the pool */
#endif
#ifndef AB_TENSOR_COST
#define AB_TENSOR_COST 256         /* per-tensor overhead, in elements, when packing pieces */
#endif
#ifndef AB_STREAM_MIN_BYTES
#define AB_STREAM_MIN_BYTES (4 << 20)   /* `out` streams (non-temporal) from this size up */
#endif

/* ---- the function table ------------------------------------------------------------------ */

typedef struct {
    ab_kernel_fn update;
    int isa;
} ab_functable;

static ab_functable ab_table;
static int ab_isa_ok[4];           /* compiled in and runnable, per enum ab_isa */
static int ab_isa_best;

static void ab_functable_init(void)
{
    ab_isa_ok[AB_ISA_SCALAR] = 1;
    ab_table.update = ab_update_scalar;
    ab_table.isa = AB_ISA_SCALAR;
#if defined(AB_HAVE_AVX2)
    if (ab_cpu_has_avx2()) {
        ab_isa_ok[AB_ISA_AVX2] = 1;
        ab_table.update = ab_update_avx2;
        ab_table.isa = AB_ISA_AVX2;
    }
#endif
#if defined(AB_HAVE_AVX512)
    if (ab_cpu_has_avx512()) {
        ab_isa_ok[AB_ISA_AVX512] = 1;
        ab_table.update = ab_update_avx512;
        ab_table.isa = AB_ISA_AVX512;
    }
#endif
#if defined(AB_HAVE_NEON)
    if (ab_cpu_has_neon()) {
        ab_isa_ok[AB_ISA_NEON] = 1;
        ab_table.update = ab_update_neon;
        ab_table.isa = AB_ISA_NEON;
    }
#endif
    ab_isa_best = ab_table.isa;
}

#if defined(_WIN32)
static INIT_ONCE ab_init_once = INIT_ONCE_STATIC_INIT;
static BOOL CALLBACK ab_init_cb(PINIT_ONCE o, PVOID p, PVOID *c)
{
    (void)o, (void)p, (void)c;
    ab_functable_init();
    return TRUE;
}
static void ab_init(void) { InitOnceExecuteOnce(&ab_init_once, ab_init_cb, NULL, NULL); }
#else
static pthread_once_t ab_init_once = PTHREAD_ONCE_INIT;
static void ab_init(void) { pthread_once(&ab_init_once, ab_functable_init); }
#endif

/* ab_set_isa swaps the entry with atomic stores; an update reads the kernel once, at its start,
 * so a call in flight finishes with the ISA it began with. */
#if defined(_MSC_VER) && !defined(__clang__)
#define AB_LOAD(x) (x)
#define AB_STORE(x, v) ((x) = (v))
#else
#define AB_LOAD(x) __atomic_load_n(&(x), __ATOMIC_ACQUIRE)
#define AB_STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELEASE)
#endif

AB_API int ab_isa_detected(void) { ab_init(); return ab_isa_best; }
AB_API int ab_isa_supported(int isa)
{
    ab_init();
    return isa >= 0 && isa < 4 && ab_isa_ok[isa];
}
AB_API int ab_isa_compiled(int isa)
{
    switch (isa) {
    case AB_ISA_SCALAR: return 1;
#if defined(AB_HAVE_AVX2)
    case AB_ISA_AVX2: return 1;
#endif
#if defined(AB_HAVE_AVX512)
    case AB_ISA_AVX512: return 1;
#endif
#if defined(AB_HAVE_NEON)
    case AB_ISA_NEON: return 1;
#endif
    default: return 0;
    }
}
AB_API int ab_isa_active(void)
{
    ab_init();
    return AB_LOAD(ab_table.isa);
}
AB_API const char *ab_isa_name(int isa)
{
    static const char *const names[4] = {"scalar", "avx2", "avx512", "neon"};
    return isa >= 0 && isa < 4 ? names[isa] : "unknown";
}
AB_API int ab_set_isa(int isa)
{
    ab_init();
    if (!ab_isa_supported(isa))
        return AB_EISA;
    ab_kernel_fn fn = ab_update_scalar;
#if defined(AB_HAVE_AVX2)
    if (isa == AB_ISA_AVX2) fn = ab_update_avx2;
#endif
#if defined(AB_HAVE_AVX512)
    if (isa == AB_ISA_AVX512) fn = ab_update_avx512;
#endif
#if defined(AB_HAVE_NEON)
    if (isa == AB_ISA_NEON) fn = ab_update_neon;
#endif
    AB_STORE(ab_table.update, fn);
    AB_STORE(ab_table.isa, isa);
    return AB_OK;
}

/* ---- validation ---------------------------------------------------------------------------- */

static int ab_validate(const ab_tensor *t)
{
    if (t->n < 0 || t->offset < 0 || t->n > INT64_MAX - t->offset || t->reserved != 0)
        return AB_EINVAL;
    if (t->grad_dtype != AB_F32 && t->grad_dtype != AB_BF16 && t->grad_dtype != AB_F16)
        return AB_EINVAL;
    if (t->out_dtype < AB_F32 || t->out_dtype > AB_NONE)
        return AB_EINVAL;
    if (t->precision < AB_MOMENTS_F32 || t->precision > AB_MOMENTS_FP8)
        return AB_EINVAL;
    if (t->stochastic_rounding != 0 && t->stochastic_rounding != 1)
        return AB_EINVAL;
    if (t->n > 0) {
        if (!t->param || !t->grad || !t->exp_avg || !t->exp_avg_sq)
            return AB_EINVAL;
        if (t->out_dtype != AB_NONE && !t->out)
            return AB_EINVAL;
        if (t->precision == AB_MOMENTS_FP8 && (!t->exp_avg_scale || !t->exp_avg_sq_scale))
            return AB_EINVAL;
    }
    return AB_OK;
}

/* ---- splitting the work ------------------------------------------------------------------- */

static int ab_stream_flags(const ab_tensor *t)
{
    return t->n * ab_dtype_size(t->out_dtype) >= AB_STREAM_MIN_BYTES ? AB_KFLAG_STREAM_OUT : 0;
}

/* Elements [lo, hi) of t, cut where the global index crosses a multiple of 2^32 so that each
 * kernel call has one hash key. fp8 blocks start at the range's own start, and a range may
 * start anywhere (an FSDP2 shard): a block that holds such a crossing is updated by the
 * scalar kernel, which hashes every element by itself, so no block is ever cut. */
static void ab_run_range(ab_kernel_fn kernel, const ab_tensor *t, int64_t lo, int64_t hi)
{
    int flags = ab_stream_flags(t);
    while (lo < hi) {
        uint64_t g = (uint64_t)(t->offset + lo);
        uint64_t boundary = (g | 0xffffffffull) + 1;      /* next multiple of 2^32 */
        int64_t cut = hi;
        if ((uint64_t)(t->offset + hi) > boundary)
            cut = (int64_t)(boundary - (uint64_t)t->offset);
        if (cut < hi && t->precision == AB_MOMENTS_FP8 && cut % AB_BLOCK != 0) {
            int64_t b0 = cut / AB_BLOCK * AB_BLOCK;        /* lo is a block start: b0 >= lo */
            int64_t b1 = b0 + AB_BLOCK < hi ? b0 + AB_BLOCK : hi;
            if (lo < b0)
                kernel(t, lo, b0, flags);
            ab_update_scalar(t, b0, b1, flags);
            lo = b1;
            continue;
        }
        kernel(t, lo, cut, flags);
        lo = cut;
    }
}

typedef struct {
    const ab_tensor *tensors;
    int64_t count;
    const int64_t *start;      /* start[k]: where tensor k begins in the packed work space */
    int64_t total;             /* start[count] */
    int64_t piece;             /* a multiple of 128 */
    int64_t npieces;
    ab_kernel_fn kernel;
    int64_t next;              /* the next piece to take (atomic) */
} ab_update_job;

static int64_t ab_fetch_add(int64_t *x, int64_t d)
{
#if defined(_MSC_VER) && !defined(__clang__)
    return InterlockedExchangeAdd64((volatile LONG64 *)x, d);
#else
    return __atomic_fetch_add(x, d, __ATOMIC_RELAXED);
#endif
}

/* A cut at local position c, rounded up to a whole fp8 block (the same rounding for every
 * tensor keeps pieces aligned for SIMD and non-temporal stores). Both neighbours of a cut
 * round it the same way, so the pieces tile each tensor exactly. */
static int64_t ab_round_cut(int64_t c, int64_t n)
{
    if (c <= 0)
        return 0;
    if (c >= n)
        return n;
    c = (c + AB_BLOCK - 1) / AB_BLOCK * AB_BLOCK;
    return c < n ? c : n;
}

static void ab_update_piece(const ab_update_job *job, int64_t u)
{
    int64_t s = u * job->piece, e = s + job->piece;
    /* the last tensor k with start[k] <= s */
    int64_t lo = 0, hi = job->count - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo + 1) / 2;
        if (job->start[mid] <= s)
            lo = mid;
        else
            hi = mid - 1;
    }
    for (int64_t k = lo; k < job->count && job->start[k] < e; k++) {
        const ab_tensor *t = &job->tensors[k];
        int64_t a = ab_round_cut(s - job->start[k], t->n);
        int64_t b = ab_round_cut(e - job->start[k], t->n);
        if (a < b)
            ab_run_range(job->kernel, t, a, b);
    }
}

static void ab_update_task(void *arg, int index)
{
    ab_update_job *job = (ab_update_job *)arg;
    (void)index;
    for (;;) {
        int64_t u = ab_fetch_add(&job->next, 1);
        if (u >= job->npieces)
            break;
        ab_update_piece(job, u);
    }
}

static void ab_update_serial(ab_kernel_fn kernel, const ab_tensor *tensors, int64_t count)
{
    for (int64_t k = 0; k < count; k++)
        ab_run_range(kernel, &tensors[k], 0, tensors[k].n);
}

/* The packed start positions; grown under the call lock, kept between calls. */
static int64_t *ab_starts;
static int64_t ab_starts_cap;

AB_API int ab_adamw_update(const ab_tensor *tensors, int64_t count)
{
    if (count < 0 || (count > 0 && !tensors))
        return AB_EINVAL;
    for (int64_t k = 0; k < count; k++) {     /* validate all before touching anything */
        int status = ab_validate(&tensors[k]);
        if (status != AB_OK)
            return status;
    }
    if (count == 0)
        return AB_OK;
    ab_init();
    if (ab_pool_in_task()) {                  /* nested in a pool task: this thread only */
        ab_update_serial(AB_LOAD(ab_table.update), tensors, count);
        return AB_OK;
    }
    ab_pool_lock();
    ab_kernel_fn kernel = AB_LOAD(ab_table.update);
    int nthreads = ab_pool_threads_locked();
    int64_t total = 0;
    for (int64_t k = 0; k < count; k++)
        total += tensors[k].n + AB_TENSOR_COST;
    if (nthreads > 1 && total > AB_SERIAL_MAX && ab_starts_cap < count + 1) {
        int64_t *grown = (int64_t *)realloc(ab_starts, (size_t)(count + 1) * sizeof(int64_t));
        if (grown) {
            ab_starts = grown;
            ab_starts_cap = count + 1;
        }
    }
    if (nthreads == 1 || total <= AB_SERIAL_MAX || ab_starts_cap < count + 1) {
        ab_update_serial(kernel, tensors, count);
        ab_pool_unlock();
        return AB_OK;
    }
    ab_starts[0] = 0;
    for (int64_t k = 0; k < count; k++)
        ab_starts[k + 1] = ab_starts[k] + tensors[k].n + AB_TENSOR_COST;
    ab_update_job job;
    job.tensors = tensors;
    job.count = count;
    job.start = ab_starts;
    job.total = total;
    job.piece = total / ((int64_t)nthreads * 8);     /* ~8 pieces per thread to balance */
    job.piece = job.piece < AB_PIECE_MIN ? AB_PIECE_MIN : job.piece;
    job.piece = job.piece > AB_PIECE_MAX ? AB_PIECE_MAX : job.piece;
    job.piece = (job.piece + AB_BLOCK - 1) / AB_BLOCK * AB_BLOCK;
    job.npieces = (total + job.piece - 1) / job.piece;
    job.kernel = kernel;
    job.next = 0;
    int status = ab_pool_run_locked(ab_update_task, &job);
    ab_pool_unlock();
    return status;
}

/* ---- small exports ------------------------------------------------------------------------- */

AB_API int ab_abi_version(void) { return AB_ABI_VERSION; }
AB_API uint32_t ab_mix32(uint32_t x) { return ab_mix32_inline(x); }
AB_API uint32_t ab_hash(uint32_t key, uint64_t index) { return ab_hash_inline(key, index); }

AB_API const char *ab_strerror(int status)
{
    switch (status) {
    case AB_OK: return "success";
    case AB_EINVAL: return "invalid argument (dtype, precision, NULL pointer, size or reserved field)";
    case AB_EALIGN: return "fp8 range offset is not a multiple of 128";
    case AB_EISA: return "instruction set not compiled in or not supported by this CPU";
    case AB_ETHREAD: return "thread pool could not be created or pinned";
    default: return "unknown status";
    }
}

/* adambridge.h: the C ABI of the fused host AdamW kernel.
 *
 * Stateless: every call passes pointers, sizes, hyperparameters and the step's stream key.
 * Python owns every buffer. The only C-side object is a persistent thread pool.
 * The arithmetic is specified in docs/numerics.md; adambridge/update/reference.py is its torch twin.
 * Every function returns 0 on success or a negative AB_E* code (see ab_strerror).
 */
#ifndef ADAMBRIDGE_H
#define ADAMBRIDGE_H

#include <stdint.h>

#ifdef _WIN32
#define AB_API __declspec(dllexport)
#else
#define AB_API __attribute__((visibility("default")))
#endif

/* 2: ab_hyper carries step_size and eps already scaled by sqrt(1 - beta2^t) (one divide per
 * element); non-finite values follow docs/numerics.md section 6. */
#define AB_ABI_VERSION 2

/* Element types of gradients and of the low-precision parameter copy. */
enum ab_dtype { AB_F32 = 0, AB_BF16 = 1, AB_F16 = 2, AB_NONE = 3 };

/* How m and v are stored (docs/numerics.md section 3). */
enum ab_precision { AB_MOMENTS_F32 = 0, AB_MOMENTS_BF16 = 1, AB_MOMENTS_FP8 = 2 };

/* Instruction sets, in rising order. */
enum ab_isa { AB_ISA_SCALAR = 0, AB_ISA_AVX2 = 1, AB_ISA_AVX512 = 2, AB_ISA_NEON = 3 };

enum ab_status {
    AB_OK = 0,
    AB_EINVAL = -1,       /* a bad argument: dtype, precision, NULL pointer, negative size */
    AB_EALIGN = -2,       /* fp8 range whose offset is not a multiple of 128 */
    AB_EISA = -3,         /* the requested ISA is not compiled in or the CPU lacks it */
    AB_ETHREAD = -4,      /* the thread pool could not be created or pinned */
};

#define AB_FP8_BLOCK 128

/* Python and C name three fields differently (adambridge/update/items.py has the Python side):
 *   UpdateItem.master  is  ab_tensor.param
 *   Hyper.step_hat     is  ab_hyper.step_size
 *   Hyper.eps_hat      is  ab_hyper.eps
 * (Hyper.step_size and Hyper.eps are torch's lr / bc1 and eps, which C does not take.)
 * Every other field has the same name on both sides. */

/* Per-tensor scalars, already rounded to fp32 as docs/numerics.md section 1 says. */
typedef struct ab_hyper {
    float beta1;
    float beta2;
    float one_minus_beta1;
    float one_minus_beta2;
    float decay;      /* 1 - lr * weight_decay */
    float step_size;  /* step_hat = lr * sqrt(1 - beta2^t) / (1 - beta1^t) (Hyper.step_hat) */
    float eps;        /* eps_hat = eps * sqrt(1 - beta2^t) (Hyper.eps_hat) */
    float reserved;   /* ignored; 0 */
} ab_hyper;

/* One contiguous range [offset, offset + n) of one parameter. */
typedef struct ab_tensor {
    float *param;             /* fp32 master, n elements, updated in place */
    const void *grad;         /* n elements of grad_dtype */
    void *exp_avg;            /* m: n x (f32 | bf16 as uint16 | e4m3 as uint8) */
    void *exp_avg_sq;         /* v: n x (f32 | bf16 as uint16) or sqrt(v) as e5m2 uint8 */
    float *exp_avg_scale;     /* fp8: one per 128-block of the range, else NULL */
    float *exp_avg_sq_scale;  /* fp8: one per 128-block of the range, else NULL */
    void *out;                /* n x out_dtype low-precision copy of param, or NULL */
    int64_t n;                /* elements in this range (may be 0) */
    int64_t offset;           /* global index of element 0 within its parameter */
    uint32_t key;             /* stream key of (seed, step, parameter index) */
    int32_t grad_dtype;       /* enum ab_dtype, not AB_NONE */
    int32_t out_dtype;        /* enum ab_dtype: AB_BF16, AB_F16, AB_F32 or AB_NONE */
    int32_t precision;        /* enum ab_precision */
    int32_t stochastic_rounding; /* 0 or 1 (ignored for fp32 moments) */
    int32_t reserved;         /* must be 0 */
    ab_hyper hparams;         /* not "hyper": windows.h (rpcndr.h) defines hyper as a macro */
} ab_tensor;

AB_API int ab_abi_version(void);

/* Update `count` tensors in one call, split across the thread pool. */
AB_API int ab_adamw_update(const ab_tensor *tensors, int64_t count);

/* The counter hash of docs/numerics.md section 2 (for tests and the torch twin). */
AB_API uint32_t ab_mix32(uint32_t x);
AB_API uint32_t ab_hash(uint32_t key, uint64_t index);

/* Instruction sets: detected (cpuid + xgetbv), compiled in, active, and forcing one. */
AB_API int ab_isa_detected(void);     /* best ISA this CPU and this build support */
AB_API int ab_isa_compiled(int isa);  /* 1 when the library carries that ISA's kernels */
AB_API int ab_isa_supported(int isa); /* compiled in and the CPU (and OS) can run it */
AB_API int ab_isa_active(void);
AB_API int ab_set_isa(int isa);       /* AB_EISA when not supported */
AB_API const char *ab_isa_name(int isa);

/* The persistent pool: num_threads workers (the caller counts as one), optionally pinned
 * round-robin to cpus[0..ncpus). num_threads <= 0 means "one per online CPU". */
AB_API int ab_pool_configure(int num_threads, const int *cpus, int ncpus);
AB_API int ab_pool_threads(void);

/* Run fn(arg, i) for i in [0, nthreads) on the pool threads (the caller runs i = 0):
 * used to first-touch state on the threads that will update it. */
typedef void (*ab_task_fn)(void *arg, int index);
AB_API int ab_pool_run(ab_task_fn fn, void *arg);

/* Touch (write zero to) every page of [ptr, ptr+bytes) from the pool threads, each its share. */
AB_API int ab_first_touch(void *ptr, int64_t bytes);

/* The bandwidth floor (probe.c): one pass over the same buffers an update of these tensors
 * reads and writes, with trivial integer work. Scrambles their contents. */
AB_API int ab_memory_pass(const ab_tensor *tensors, int64_t count);

/* L2 cache size in bytes as cpuid reports it (0 when unknown). */
AB_API int64_t ab_l2_cache_bytes(void);

AB_API const char *ab_strerror(int status);

#endif /* ADAMBRIDGE_H */

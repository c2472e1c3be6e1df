/* pool.c: the persistent thread pool, the only C-side object.
 *
 * nthreads - 1 workers sleep on a condition variable between calls; a call publishes
 * (fn, arg), bumps a generation counter, wakes them, runs index 0 on the caller thread and waits
 * until every worker has finished its index. Nothing is created per call.
 *
 * NOTE: the pool is not re-entrant and serves one caller at a time. A process-wide call lock
 * serialises concurrent callers (two Python threads calling at once wait for each other instead
 * of corrupting the shared job), and a call made from inside a pool task runs serially on that
 * thread instead of deadlocking. POSIX builds use pthreads, Windows builds Win32 threads (SRW
 * locks and condition variables): the same pool, the same semantics, behind the ab_mutex,
 * ab_cond and ab_thread wrappers below.
 */
#if !defined(_GNU_SOURCE) && !defined(_WIN32)
#define _GNU_SOURCE   /* pthread_setaffinity_np, CPU_SET (before any system header) */
#endif
#include "codecs.h"

#include <stdlib.h>

#if defined(_WIN32)
#include <process.h>
#include <windows.h>
#else
#include <pthread.h>
#include <sched.h>
#include <unistd.h>
#endif

/* NOTE: a thread-local every compiler honours. GCC-family compilers targeting Windows (MinGW
 * gcc, zig cc) ignore __declspec(thread) with a warning, which would make the "inside a task"
 * flag one process-wide variable; they all implement C11 _Thread_local (and __thread). */
#if defined(_MSC_VER)
#define AB_TLS __declspec(thread)
#else
#define AB_TLS _Thread_local
#endif

#define AB_POOL_MAX_THREADS 1024
#if defined(_WIN32)
#define AB_MAX_CPU_ID 63   /* one processor group: SetThreadAffinityMask takes a 64-bit mask */
#elif defined(__linux__) && defined(CPU_SETSIZE)
#define AB_MAX_CPU_ID (CPU_SETSIZE - 1)
#else
#define AB_MAX_CPU_ID 0x7fffffff   /* not pinned there; any non-negative id is accepted */
#endif

/* ---- threads, locks and condition variables: pthreads or Win32 ------------------------------ */

#if defined(_WIN32)
typedef SRWLOCK ab_mutex;
typedef CONDITION_VARIABLE ab_cond;
typedef HANDLE ab_thread;
#define AB_MUTEX_INIT SRWLOCK_INIT
static void ab_mutex_init(ab_mutex *m) { InitializeSRWLock(m); }
static void ab_mutex_lock(ab_mutex *m) { AcquireSRWLockExclusive(m); }
static void ab_mutex_unlock(ab_mutex *m) { ReleaseSRWLockExclusive(m); }
static void ab_mutex_destroy(ab_mutex *m) { (void)m; }
static void ab_cond_init(ab_cond *c) { InitializeConditionVariable(c); }
static void ab_cond_wait(ab_cond *c, ab_mutex *m) { SleepConditionVariableSRW(c, m, INFINITE, 0); }
static void ab_cond_signal(ab_cond *c) { WakeConditionVariable(c); }
static void ab_cond_broadcast(ab_cond *c) { WakeAllConditionVariable(c); }
static void ab_cond_destroy(ab_cond *c) { (void)c; }

static void *ab_worker_main(void *p);
static unsigned __stdcall ab_worker_entry(void *p) { ab_worker_main(p); return 0; }

static int ab_thread_start(ab_thread *th, void *arg)
{
    /* _beginthreadex, not CreateThread: the C runtime sets up its per-thread state */
    uintptr_t h = _beginthreadex(NULL, 0, ab_worker_entry, arg, 0, NULL);
    *th = (HANDLE)h;
    return h ? 0 : -1;
}
static void ab_thread_join(ab_thread th)
{
    WaitForSingleObject(th, INFINITE);
    CloseHandle(th);
}
static int ab_pin(ab_thread th, int cpu)
{
    return SetThreadAffinityMask(th, (DWORD_PTR)1 << cpu) != 0 ? AB_OK : AB_ETHREAD;
}
static int ab_online_cpus(void)
{
    DWORD n = GetActiveProcessorCount(ALL_PROCESSOR_GROUPS);
    return n > 0 ? (int)(n < AB_POOL_MAX_THREADS ? n : AB_POOL_MAX_THREADS) : 1;
}
#else
typedef pthread_mutex_t ab_mutex;
typedef pthread_cond_t ab_cond;
typedef pthread_t ab_thread;
#define AB_MUTEX_INIT PTHREAD_MUTEX_INITIALIZER
static void ab_mutex_init(ab_mutex *m) { pthread_mutex_init(m, NULL); }
static void ab_mutex_lock(ab_mutex *m) { pthread_mutex_lock(m); }
static void ab_mutex_unlock(ab_mutex *m) { pthread_mutex_unlock(m); }
static void ab_mutex_destroy(ab_mutex *m) { pthread_mutex_destroy(m); }
static void ab_cond_init(ab_cond *c) { pthread_cond_init(c, NULL); }
static void ab_cond_wait(ab_cond *c, ab_mutex *m) { pthread_cond_wait(c, m); }
static void ab_cond_signal(ab_cond *c) { pthread_cond_signal(c); }
static void ab_cond_broadcast(ab_cond *c) { pthread_cond_broadcast(c); }
static void ab_cond_destroy(ab_cond *c) { pthread_cond_destroy(c); }

static void *ab_worker_main(void *p);
static int ab_thread_start(ab_thread *th, void *arg) { return pthread_create(th, NULL, ab_worker_main, arg); }
static void ab_thread_join(ab_thread th) { pthread_join(th, NULL); }

/* Pin a thread to one CPU. Linux only; a no-op elsewhere (macOS has no CPU affinity). */
static int ab_pin(ab_thread th, int cpu)
{
#if defined(__linux__) && defined(CPU_SET)
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(th, sizeof(set), &set) == 0 ? AB_OK : AB_ETHREAD;
#else
    (void)th;
    (void)cpu;
    return AB_OK;
#endif
}
static int ab_online_cpus(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)(n < AB_POOL_MAX_THREADS ? n : AB_POOL_MAX_THREADS) : 1;
}
#endif

/* 1 while this thread runs a pool task: a nested call must not wait on the pool. */
static AB_TLS int ab_in_task;

int ab_pool_in_task(void) { return ab_in_task; }

/* ---- the pool ------------------------------------------------------------------------------ */

typedef struct {
    int nthreads;             /* the caller counts as one */
    ab_thread *workers;       /* nthreads - 1 of them; worker k runs index k + 1 */
    ab_mutex mu;              /* guards everything below */
    ab_cond wake;             /* workers wait here for a new generation */
    ab_cond done;             /* the caller waits here for remaining == 0 */
    uint64_t generation;      /* bumped once per run */
    int remaining;            /* workers still running the current generation */
    int shutdown;
    ab_task_fn fn;
    void *arg;
} ab_pool_state;

typedef struct {
    ab_pool_state *pool;
    int index;
} ab_worker_arg;

static ab_mutex ab_call_lock = AB_MUTEX_INIT;
static ab_pool_state ab_pool;   /* nthreads == 0: not created yet */
static ab_worker_arg *ab_worker_args;

void ab_pool_lock(void) { ab_mutex_lock(&ab_call_lock); }
void ab_pool_unlock(void) { ab_mutex_unlock(&ab_call_lock); }

static void *ab_worker_main(void *p)
{
    ab_worker_arg *wa = (ab_worker_arg *)p;
    ab_pool_state *pool = wa->pool;
    ab_in_task = 1;
    uint64_t seen = 0;   /* the generation at creation: a run may start before we get here */
    ab_mutex_lock(&pool->mu);
    for (;;) {
        while (pool->generation == seen && !pool->shutdown)
            ab_cond_wait(&pool->wake, &pool->mu);
        if (pool->shutdown)
            break;
        seen = pool->generation;
        ab_task_fn fn = pool->fn;
        void *arg = pool->arg;
        ab_mutex_unlock(&pool->mu);
        fn(arg, wa->index);
        ab_mutex_lock(&pool->mu);
        if (--pool->remaining == 0)
            ab_cond_signal(&pool->done);
    }
    ab_mutex_unlock(&pool->mu);
    return NULL;
}

static void ab_pool_destroy(void)
{
    ab_pool_state *pool = &ab_pool;
    if (pool->nthreads == 0)
        return;
    ab_mutex_lock(&pool->mu);
    pool->shutdown = 1;
    ab_cond_broadcast(&pool->wake);
    ab_mutex_unlock(&pool->mu);
    for (int k = 0; k < pool->nthreads - 1; k++)
        ab_thread_join(pool->workers[k]);
    ab_cond_destroy(&pool->wake);
    ab_cond_destroy(&pool->done);
    ab_mutex_destroy(&pool->mu);
    free(pool->workers);
    free(ab_worker_args);
    ab_worker_args = NULL;
    memset(pool, 0, sizeof(*pool));
}

#if defined(_WIN32)
static void ab_register_atfork_once(void) {}   /* no fork on Windows */
#else
/* A forked child has none of the parent's workers: forget them (their memory leaks once) and
 * start over lazily, instead of waiting forever on threads that do not exist. */
static void ab_pool_after_fork_child(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&ab_call_lock, &fresh, sizeof(fresh));
    memset(&ab_pool, 0, sizeof(ab_pool));
    ab_worker_args = NULL;
    ab_in_task = 0;
}

static pthread_once_t ab_atfork_once = PTHREAD_ONCE_INIT;
static void ab_register_atfork(void) { pthread_atfork(NULL, NULL, ab_pool_after_fork_child); }
static void ab_register_atfork_once(void) { pthread_once(&ab_atfork_once, ab_register_atfork); }
#endif

/* Create a pool of n threads (the caller plus n - 1 workers). On failure to create a worker
 * the pool keeps the workers it has and AB_ETHREAD is returned. Call lock held. */
static int ab_pool_create(int n, const int *cpus, int ncpus)
{
    ab_pool_state *pool = &ab_pool;
    ab_register_atfork_once();
    memset(pool, 0, sizeof(*pool));
    ab_mutex_init(&pool->mu);
    ab_cond_init(&pool->wake);
    ab_cond_init(&pool->done);
    pool->nthreads = 1;
    int status = AB_OK;
    pool->workers = (ab_thread *)calloc((size_t)n, sizeof(ab_thread));
    ab_worker_args = (ab_worker_arg *)calloc((size_t)n, sizeof(ab_worker_arg));
    if (!pool->workers || !ab_worker_args)
        return n > 1 ? AB_ETHREAD : AB_OK;
    for (int k = 0; k < n - 1; k++) {
        ab_worker_args[k].pool = pool;
        ab_worker_args[k].index = k + 1;
        if (ab_thread_start(&pool->workers[k], &ab_worker_args[k]) != 0) {
            status = AB_ETHREAD;
            break;
        }
        pool->nthreads = k + 2;
        if (ncpus > 0 && ab_pin(pool->workers[k], cpus[(k + 1) % ncpus]) != AB_OK)
            status = AB_ETHREAD;
    }
    return status;
}

/* Create the default pool (one thread per online CPU) on first use. Call lock held. */
static void ab_pool_ensure(void)
{
    if (ab_pool.nthreads == 0)
        ab_pool_create(ab_online_cpus(), NULL, 0);
}

int ab_pool_threads_locked(void)
{
    ab_pool_ensure();
    return ab_pool.nthreads;
}

/* The size of the pool a task is running in (no lock: the caller of that run holds it). */
static int ab_pool_threads_current(void) { return ab_pool.nthreads > 0 ? ab_pool.nthreads : 1; }

/* Run fn(arg, i) for every i in [0, nthreads); the caller runs i = 0. Call lock held. */
int ab_pool_run_locked(ab_task_fn fn, void *arg)
{
    ab_pool_ensure();
    ab_pool_state *pool = &ab_pool;
    int outer = ab_in_task;
    if (pool->nthreads > 1) {
        ab_mutex_lock(&pool->mu);
        pool->fn = fn;
        pool->arg = arg;
        pool->remaining = pool->nthreads - 1;
        pool->generation++;
        ab_cond_broadcast(&pool->wake);
        ab_mutex_unlock(&pool->mu);
    }
    ab_in_task = 1;
    fn(arg, 0);
    ab_in_task = outer;
    if (pool->nthreads > 1) {
        ab_mutex_lock(&pool->mu);
        while (pool->remaining > 0)
            ab_cond_wait(&pool->done, &pool->mu);
        ab_mutex_unlock(&pool->mu);
    }
    return AB_OK;
}

AB_API int ab_pool_configure(int num_threads, const int *cpus, int ncpus)
{
    if (ncpus < 0 || (ncpus > 0 && !cpus))
        return AB_EINVAL;
    for (int k = 0; k < ncpus; k++)
        if (cpus[k] < 0 || cpus[k] > AB_MAX_CPU_ID)
            return AB_EINVAL;
    if (ab_in_task)
        return AB_ETHREAD;        /* reconfiguring from inside a task would deadlock */
    int n = num_threads > 0 ? num_threads : ab_online_cpus();
    if (n > AB_POOL_MAX_THREADS)
        n = AB_POOL_MAX_THREADS;
    ab_pool_lock();
    ab_pool_destroy();
    int status = ab_pool_create(n, cpus, ncpus);
    ab_pool_unlock();
    return status;
}

/* ---- the public entry points ------------------------------------------------------------- */

AB_API int ab_pool_threads(void)
{
    if (ab_in_task)               /* the running call holds the lock: the pool cannot change */
        return ab_pool_threads_current();
    ab_pool_lock();
    int n = ab_pool_threads_locked();
    ab_pool_unlock();
    return n;
}

/* Called from inside a task: run every index on this thread, in order (no deadlock). */
static int ab_pool_run_nested(ab_task_fn fn, void *arg, int n)
{
    for (int i = 0; i < n; i++)
        fn(arg, i);
    return AB_OK;
}

AB_API int ab_pool_run(ab_task_fn fn, void *arg)
{
    if (!fn)
        return AB_EINVAL;
    if (ab_in_task)
        return ab_pool_run_nested(fn, arg, ab_pool_threads_current());
    ab_pool_lock();
    int status = ab_pool_run_locked(fn, arg);
    ab_pool_unlock();
    return status;
}

typedef struct {
    char *base;
    int64_t bytes;
    int64_t grain;    /* shares start and end on multiples of this (page or huge page) */
    int nthreads;
} ab_touch_job;

static void ab_touch_task(void *arg, int index)
{
    ab_touch_job *job = (ab_touch_job *)arg;
    uintptr_t lo = (uintptr_t)job->base, hi = lo + (uintptr_t)job->bytes;
    uintptr_t grain = (uintptr_t)job->grain;
    uintptr_t first = lo / grain, last = (hi + grain - 1) / grain;   /* grains overlapped */
    uintptr_t per = (last - first) / (uintptr_t)job->nthreads;
    uintptr_t extra = (last - first) % (uintptr_t)job->nthreads, k = (uintptr_t)index;
    uintptr_t g0 = first + k * per + (k < extra ? k : extra);
    uintptr_t g1 = g0 + per + (k < extra ? 1 : 0);
    uintptr_t a = g0 * grain, b = g1 * grain;
    a = a < lo ? lo : a;
    b = b > hi ? hi : b;
    if (a < b)
        memset((void *)a, 0, (size_t)(b - a));
}

/* Zero [ptr, ptr + bytes), each pool thread its share of whole pages, so that on a NUMA
 * machine the pages land on the node of the thread that will update them. */
AB_API int ab_first_touch(void *ptr, int64_t bytes)
{
    if (bytes < 0 || (bytes > 0 && !ptr))
        return AB_EINVAL;
    if (bytes == 0)
        return AB_OK;
    if (ab_in_task) {
        memset(ptr, 0, (size_t)bytes);
        return AB_OK;
    }
    ab_pool_lock();
    int n = ab_pool_threads_locked();
    ab_touch_job job = {(char *)ptr, bytes, 4096, n};
    if (bytes >= (int64_t)n * 8 * (2 << 20))
        job.grain = 2 << 20;     /* whole 2 MiB huge pages per thread */
    int status = ab_pool_run_locked(ab_touch_task, &job);
    ab_pool_unlock();
    return status;
}

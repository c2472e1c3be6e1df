/* pool.c: the persistent thread pool, the only C-side object.
 *
 * nthreads - 1 workers sleep on a condition variable between calls; a call publishes
 * (fn, arg), bumps a generation counter, wakes them, runs index 0 on the caller thread and waits
 * until every worker has finished its index. Nothing is created per call.
 *
 * NOTE: the pool is not re-entrant and serves one caller at a time. A process-wide call lock
 * serialises concurrent callers (two Python threads calling at once wait for each other instead
 * of corrupting the shared job), and a call made from inside a pool task runs serially on that
 * thread instead of deadlocking. Windows builds have no workers: everything runs on the caller.
 */
#if !defined(_GNU_SOURCE) && !defined(_WIN32)
#define _GNU_SOURCE   /* pthread_setaffinity_np, CPU_SET (before any system header) */
#endif
#include "codecs.h"

#include <stdlib.h>

#if defined(_WIN32)
#include <windows.h>
#define AB_TLS __declspec(thread)
#else
#include <pthread.h>
#include <sched.h>
#include <unistd.h>
#define AB_TLS __thread
#endif

#define AB_POOL_MAX_THREADS 1024

/* 1 while this thread runs a pool task: a nested call must not wait on the pool. */
static AB_TLS int ab_in_task;

int ab_pool_in_task(void) { return ab_in_task; }

static int ab_online_cpus(void)
{
#if defined(_WIN32)
    return 1;
#else
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)(n < AB_POOL_MAX_THREADS ? n : AB_POOL_MAX_THREADS) : 1;
#endif
}

#if defined(_WIN32)
/* ---- Windows: serial fallback ------------------------------------------------------------ */

static SRWLOCK ab_call_lock = SRWLOCK_INIT;

void ab_pool_lock(void) { AcquireSRWLockExclusive(&ab_call_lock); }
void ab_pool_unlock(void) { ReleaseSRWLockExclusive(&ab_call_lock); }
int ab_pool_threads_locked(void) { return 1; }
static int ab_pool_threads_current(void) { return 1; }

int ab_pool_run_locked(ab_task_fn fn, void *arg)
{
    int outer = ab_in_task;
    ab_in_task = 1;
    fn(arg, 0);
    ab_in_task = outer;
    return AB_OK;
}

AB_API int ab_pool_configure(int num_threads, const int *cpus, int ncpus)
{
    (void)num_threads;
    if (ncpus < 0 || (ncpus > 0 && !cpus))
        return AB_EINVAL;
    return AB_OK;
}

#else
/* ---- POSIX threads ------------------------------------------------------------------------ */

typedef struct {
    int nthreads;             /* the caller counts as one */
    pthread_t *workers;       /* nthreads - 1 of them; worker k runs index k + 1 */
    pthread_mutex_t mu;       /* guards everything below */
    pthread_cond_t wake;      /* workers wait here for a new generation */
    pthread_cond_t done;      /* the caller waits here for remaining == 0 */
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

static pthread_mutex_t ab_call_lock = PTHREAD_MUTEX_INITIALIZER;
static ab_pool_state ab_pool;   /* nthreads == 0: not created yet */
static ab_worker_arg *ab_worker_args;

void ab_pool_lock(void) { pthread_mutex_lock(&ab_call_lock); }
void ab_pool_unlock(void) { pthread_mutex_unlock(&ab_call_lock); }

static void *ab_worker_main(void *p)
{
    ab_worker_arg *wa = (ab_worker_arg *)p;
    ab_pool_state *pool = wa->pool;
    ab_in_task = 1;
    uint64_t seen = 0;   /* the generation at creation: a run may start before we get here */
    pthread_mutex_lock(&pool->mu);
    for (;;) {
        while (pool->generation == seen && !pool->shutdown)
            pthread_cond_wait(&pool->wake, &pool->mu);
        if (pool->shutdown)
            break;
        seen = pool->generation;
        ab_task_fn fn = pool->fn;
        void *arg = pool->arg;
        pthread_mutex_unlock(&pool->mu);
        fn(arg, wa->index);
        pthread_mutex_lock(&pool->mu);
        if (--pool->remaining == 0)
            pthread_cond_signal(&pool->done);
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

static void ab_pool_destroy(void)
{
    ab_pool_state *pool = &ab_pool;
    if (pool->nthreads == 0)
        return;
    pthread_mutex_lock(&pool->mu);
    pool->shutdown = 1;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mu);
    for (int k = 0; k < pool->nthreads - 1; k++)
        pthread_join(pool->workers[k], NULL);
    pthread_cond_destroy(&pool->wake);
    pthread_cond_destroy(&pool->done);
    pthread_mutex_destroy(&pool->mu);
    free(pool->workers);
    free(ab_worker_args);
    ab_worker_args = NULL;
    memset(pool, 0, sizeof(*pool));
}

/* Pin worker k (index k + 1) to cpus[(k + 1) % ncpus]. Linux only; a no-op elsewhere. */
static int ab_pin(pthread_t th, int cpu)
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

/* Create a pool of n threads (the caller plus n - 1 workers). On failure to create a worker
 * the pool keeps the workers it has and AB_ETHREAD is returned. Call lock held. */
static int ab_pool_create(int n, const int *cpus, int ncpus)
{
    ab_pool_state *pool = &ab_pool;
    pthread_once(&ab_atfork_once, ab_register_atfork);
    memset(pool, 0, sizeof(*pool));
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    pool->nthreads = 1;
    int status = AB_OK;
    pool->workers = (pthread_t *)calloc((size_t)n, sizeof(pthread_t));
    ab_worker_args = (ab_worker_arg *)calloc((size_t)n, sizeof(ab_worker_arg));
    if (!pool->workers || !ab_worker_args)
        return n > 1 ? AB_ETHREAD : AB_OK;
    for (int k = 0; k < n - 1; k++) {
        ab_worker_args[k].pool = pool;
        ab_worker_args[k].index = k + 1;
        if (pthread_create(&pool->workers[k], NULL, ab_worker_main, &ab_worker_args[k]) != 0) {
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
        pthread_mutex_lock(&pool->mu);
        pool->fn = fn;
        pool->arg = arg;
        pool->remaining = pool->nthreads - 1;
        pool->generation++;
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->mu);
    }
    ab_in_task = 1;
    fn(arg, 0);
    ab_in_task = outer;
    if (pool->nthreads > 1) {
        pthread_mutex_lock(&pool->mu);
        while (pool->remaining > 0)
            pthread_cond_wait(&pool->done, &pool->mu);
        pthread_mutex_unlock(&pool->mu);
    }
    return AB_OK;
}

AB_API int ab_pool_configure(int num_threads, const int *cpus, int ncpus)
{
    if (ncpus < 0 || (ncpus > 0 && !cpus))
        return AB_EINVAL;
    for (int k = 0; k < ncpus; k++) {
#if defined(__linux__) && defined(CPU_SETSIZE)
        if (cpus[k] < 0 || cpus[k] >= CPU_SETSIZE)
            return AB_EINVAL;
#else
        if (cpus[k] < 0)
            return AB_EINVAL;
#endif
    }
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
#endif /* _WIN32 */

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

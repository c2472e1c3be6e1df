/* uring.c: io_uring for the NVMe tier through io_uring_setup/io_uring_enter and mmap'd rings.
 *
 * No liburing: the user's machine then needs nothing beyond the kernel. Where the kernel or a
 * seccomp filter refuses io_uring_setup (ENOSYS, EPERM, io_uring_disabled=2), ab_uring_open
 * says so and Python uses its thread pool instead. The ring is not thread-safe: the Python
 * engine serialises submit and reap with one lock.
 */
#if !defined(_GNU_SOURCE) && !defined(_WIN32)
#define _GNU_SOURCE   /* syscall() under -std=c11 */
#endif
#include "uring.h"

#include <errno.h>

#if defined(__has_include)
#if defined(__linux__) && __has_include(<linux/io_uring.h>)
#define AB_HAVE_URING 1
#endif
#endif

#ifndef AB_HAVE_URING

#ifndef ENOSYS
#define ENOSYS 38
#endif
AB_API int ab_uring_open(uint32_t entries, void **ring) {
    (void)entries;
    *ring = 0;
    return -ENOSYS;
}
AB_API void ab_uring_close(void *ring) { (void)ring; }
AB_API int ab_uring_register_buffers(void *ring, void *const *addrs, const uint64_t *lens,
                                     int count) {
    (void)ring; (void)addrs; (void)lens; (void)count;
    return -ENOSYS;
}
AB_API int ab_uring_submit(void *ring, int op, int fd, void *buf, uint32_t len, uint64_t offset,
                           int buf_index, uint64_t tag) {
    (void)ring; (void)op; (void)fd; (void)buf; (void)len; (void)offset; (void)buf_index;
    (void)tag;
    return -ENOSYS;
}
AB_API int ab_uring_reap(void *ring, int min_complete, uint64_t *tags, int32_t *results, int max) {
    (void)ring; (void)min_complete; (void)tags; (void)results; (void)max;
    return -ENOSYS;
}

#else

#include <linux/io_uring.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

typedef struct {
    int fd;
    void *rings;          /* SQ and CQ rings: one mapping (IORING_FEAT_SINGLE_MMAP) or two */
    size_t rings_bytes;
    void *cq_map;         /* the second mapping on kernels without SINGLE_MMAP, else NULL */
    size_t cq_bytes;
    struct io_uring_sqe *sqes;
    size_t sqes_bytes;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_entries, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
} ab_ring;

static int setup(unsigned entries, struct io_uring_params *p) {
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int enter(int fd, unsigned submit, unsigned min_complete, unsigned flags) {
    return (int)syscall(__NR_io_uring_enter, fd, submit, min_complete, flags, NULL, 0);
}

static int register_op(int fd, unsigned opcode, void *arg, unsigned count) {
    return (int)syscall(__NR_io_uring_register, fd, opcode, arg, count);
}

static void unmap_all(ab_ring *r) {
    if (r->sqes) munmap(r->sqes, r->sqes_bytes);
    if (r->cq_map) munmap(r->cq_map, r->cq_bytes);
    if (r->rings) munmap(r->rings, r->rings_bytes);
}

static void *map(int fd, size_t bytes, unsigned long long what) {
    void *at = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                    (off_t)what);
    return at == MAP_FAILED ? NULL : at;
}

static int map_rings(ab_ring *r, const struct io_uring_params *p) {
    size_t sq_bytes = p->sq_off.array + p->sq_entries * sizeof(unsigned);
    size_t cq_bytes = p->cq_off.cqes + p->cq_entries * sizeof(struct io_uring_cqe);
    int single = (p->features & IORING_FEAT_SINGLE_MMAP) != 0;
    r->rings_bytes = single && cq_bytes > sq_bytes ? cq_bytes : sq_bytes;
    r->rings = map(r->fd, r->rings_bytes, IORING_OFF_SQ_RING);
    if (!r->rings) return -errno;
    char *cq = r->rings;
    if (!single) {
        r->cq_bytes = cq_bytes;
        r->cq_map = map(r->fd, cq_bytes, IORING_OFF_CQ_RING);
        if (!r->cq_map) return -errno;
        cq = r->cq_map;
    }
    r->sqes_bytes = p->sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = map(r->fd, r->sqes_bytes, IORING_OFF_SQES);
    if (!r->sqes) return -errno;
    char *sq = r->rings;
    r->sq_head = (unsigned *)(sq + p->sq_off.head);
    r->sq_tail = (unsigned *)(sq + p->sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p->sq_off.ring_mask);
    r->sq_entries = (unsigned *)(sq + p->sq_off.ring_entries);
    r->sq_array = (unsigned *)(sq + p->sq_off.array);
    r->cq_head = (unsigned *)(cq + p->cq_off.head);
    r->cq_tail = (unsigned *)(cq + p->cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p->cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p->cq_off.cqes);
    return 0;
}

AB_API int ab_uring_open(uint32_t entries, void **ring) {
    *ring = NULL;
    ab_ring *r = calloc(1, sizeof *r);
    if (!r) return -ENOMEM;
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    r->fd = setup(entries, &p);
    if (r->fd < 0) {
        int err = -errno;
        free(r);
        return err;
    }
    int status = map_rings(r, &p);
    if (status != 0) {
        unmap_all(r);
        close(r->fd);
        free(r);
        return status;
    }
    *ring = r;
    return 0;
}

AB_API void ab_uring_close(void *ring) {
    ab_ring *r = ring;
    if (!r) return;
    unmap_all(r);
    close(r->fd);
    free(r);
}

AB_API int ab_uring_register_buffers(void *ring, void *const *addrs, const uint64_t *lens,
                                     int count) {
    ab_ring *r = ring;
    if (count <= 0) return -EINVAL;
    struct iovec *iov = calloc((size_t)count, sizeof *iov);
    if (!iov) return -ENOMEM;
    for (int i = 0; i < count; i++) {
        iov[i].iov_base = addrs[i];
        iov[i].iov_len = (size_t)lens[i];
    }
    /* ENXIO: nothing was registered yet, which is fine. */
    if (register_op(r->fd, IORING_UNREGISTER_BUFFERS, NULL, 0) < 0 && errno != ENXIO) {
        int err = -errno;
        free(iov);
        return err;
    }
    int status = register_op(r->fd, IORING_REGISTER_BUFFERS, iov, (unsigned)count) < 0 ? -errno : 0;
    free(iov);
    return status;
}

AB_API int ab_uring_submit(void *ring, int op, int fd, void *buf, uint32_t len, uint64_t offset,
                           int buf_index, uint64_t tag) {
    ab_ring *r = ring;
    if (op != AB_URING_READ && op != AB_URING_WRITE) return -EINVAL;
    unsigned tail = *r->sq_tail;  /* only this side writes the tail */
    unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
    if (tail - head >= *r->sq_entries) return -EBUSY;
    unsigned index = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[index];
    memset(sqe, 0, sizeof *sqe);
    if (buf_index >= 0) {
        sqe->opcode = op == AB_URING_READ ? IORING_OP_READ_FIXED : IORING_OP_WRITE_FIXED;
        sqe->buf_index = (uint16_t)buf_index;
    } else {
        sqe->opcode = op == AB_URING_READ ? IORING_OP_READ : IORING_OP_WRITE;
    }
    sqe->fd = fd;
    sqe->addr = (uint64_t)(uintptr_t)buf;
    sqe->len = len;
    sqe->off = offset;
    sqe->user_data = tag;
    r->sq_array[index] = index;
    /* Release: the kernel must see the filled entry before it sees the new tail. */
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    for (;;) {
        int done = enter(r->fd, 1, 0, 0);
        if (done >= 0) return 0;
        if (errno != EINTR) return -errno;
    }
}

AB_API int ab_uring_reap(void *ring, int min_complete, uint64_t *tags, int32_t *results, int max) {
    ab_ring *r = ring;
    unsigned head = *r->cq_head;  /* only this side writes the head */
    unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    while ((int)(tail - head) < min_complete) {
        if (enter(r->fd, 0, (unsigned)min_complete, IORING_ENTER_GETEVENTS) < 0 && errno != EINTR)
            return -errno;
        tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    }
    int moved = 0;
    for (; head != tail && moved < max; head++, moved++) {
        const struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
        tags[moved] = cqe->user_data;
        results[moved] = cqe->res;
    }
    /* Release: the entries are copied out before the kernel may reuse their slots. */
    __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    return moved;
}

#endif

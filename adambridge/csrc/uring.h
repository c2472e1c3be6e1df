/* uring.h: the io_uring submission path of the NVMe tier (uring.c), raw system calls only.
 *
 * One ring per tier. Python submits whole page records (read, write) tagged with a 64-bit id
 * and reaps completions on the thread that waits for them: no thread per request. Every
 * function returns 0 (or a count) on success and a negative errno on failure; -ENOSYS means
 * this build has no io_uring (not Linux, or no <linux/io_uring.h> at build time).
 */
#ifndef ADAMBRIDGE_URING_H
#define ADAMBRIDGE_URING_H

#include "adambridge.h"

enum ab_uring_op { AB_URING_READ = 0, AB_URING_WRITE = 1 };

/* A ring of at least `entries` submissions; *ring is NULL on failure. */
AB_API int ab_uring_open(uint32_t entries, void **ring);
AB_API void ab_uring_close(void *ring);
/* Pin `count` buffers once (IORING_REGISTER_BUFFERS) so requests into them skip the per-I/O
 * page pinning; any earlier registration is dropped first. No request may be in flight. */
AB_API int ab_uring_register_buffers(void *ring, void *const *addrs, const uint64_t *lens,
                                     int count);
/* Queue one request and hand it to the kernel; -EBUSY when the submission queue is full.
 * buf_index >= 0: buf lies in that registered buffer (IORING_OP_READ_FIXED/WRITE_FIXED). */
AB_API int ab_uring_submit(void *ring, int op, int fd, void *buf, uint32_t len, uint64_t offset,
                           int buf_index, uint64_t tag);
/* Wait until at least `min_complete` completions are ready (0: do not wait), then move up to
 * `max` of them into tags[] / results[] (bytes moved or -errno); returns how many were moved. */
AB_API int ab_uring_reap(void *ring, int min_complete, uint64_t *tags, int32_t *results, int max);

#endif

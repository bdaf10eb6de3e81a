/* k3_tensors.c: shard file reads. */
#include <errno.h>
#include <unistd.h>

#include "k3_internal.h"

int kt_pread_full(int fd, void *buf, uint64_t n, uint64_t off) {
    uint8_t *p = (uint8_t *)buf;
    while (n > 0) {
        size_t chunk = n > (1u << 30) ? (1u << 30) : (size_t)n;
        ssize_t r = pread(fd, p, chunk, (off_t)off);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) return -EIO; /* file shorter than its header promised */
        p += r;
        off += (uint64_t)r;
        n -= (uint64_t)r;
    }
    return 0;
}

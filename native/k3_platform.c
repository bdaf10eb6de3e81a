/* k3_platform.c: uncached reads per operating system (see k3_platform.h).
 *
 * Linux: O_DIRECT, and posix_fadvise(DONTNEED) after buffered reads.  macOS: F_NOCACHE on
 * the descriptor (macOS has neither O_DIRECT nor posix_fadvise).  Elsewhere: buffered
 * reads only; asking for direct I/O is then reported as refused (k3_stats).
 */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* O_DIRECT */
#endif
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include "k3.h"
#include "k3_platform.h"

#if defined(__APPLE__)

const char *kos_uncached_kind(void) { return "F_NOCACHE"; }

int kos_open_uncached(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    if (fcntl(fd, F_NOCACHE, 1) == -1) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

/* F_NOCACHE covers a whole descriptor, and macOS has no per-range advice. */
void kos_drop_cached(int fd, uint64_t off, uint64_t len) {
    (void)fd;
    (void)off;
    (void)len;
}

#elif defined(__linux__)

const char *kos_uncached_kind(void) { return "O_DIRECT"; }

int kos_open_uncached(const char *path) { return open(path, O_RDONLY | O_CLOEXEC | O_DIRECT); }

void kos_drop_cached(int fd, uint64_t off, uint64_t len) {
    /* advice only: a refusal changes nothing the engine computes */
    (void)posix_fadvise(fd, (off_t)off, (off_t)len, POSIX_FADV_DONTNEED);
}

#else

const char *kos_uncached_kind(void) { return "none"; }

int kos_open_uncached(const char *path) {
    (void)path;
    errno = ENOTSUP;
    return -1;
}

void kos_drop_cached(int fd, uint64_t off, uint64_t len) {
    (void)fd;
    (void)off;
    (void)len;
}

#endif

const char *k3_direct_io_kind(void) { return kos_uncached_kind(); }

/* k3_platform.h: what differs between operating systems (prefix kos_).
 *
 * Only k3_platform.c names O_DIRECT, posix_fadvise or F_NOCACHE: the rest of the engine
 * asks through these calls, so it builds unchanged on Linux, macOS and other POSIX
 * systems (tests/test_platform_io.py greps for it).
 */
#ifndef K3_PLATFORM_H
#define K3_PLATFORM_H

#include <stdint.h>

/* How reads bypass the page cache here: "O_DIRECT" (Linux), "F_NOCACHE" (macOS) or
 * "none" (elsewhere: reads are buffered). */
const char *kos_uncached_kind(void);

/* A read-only descriptor whose reads bypass the page cache, or -1 with errno set
 * (ENOTSUP where the platform has no such mode).  Reads through it use buffers, offsets
 * and lengths aligned to 4096 bytes: O_DIRECT needs that, F_NOCACHE accepts it. */
int kos_open_uncached(const char *path);

/* The cached pages of [off, off+len) will not be read again soon: drop them
 * (posix_fadvise DONTNEED on Linux; nothing elsewhere, where no such call exists). */
void kos_drop_cached(int fd, uint64_t off, uint64_t len);

#endif

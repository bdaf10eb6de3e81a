/* macos_shim.h: force-included (with -U__linux__ -D__APPLE__) to compile-check the macOS
 * branch of the engine on Linux.  It gives what glibc lacks and macOS has (F_NOCACHE) and
 * poisons what macOS lacks (posix_fadvise), so a Linux-only call outside the Linux branch
 * fails the compile; O_DIRECT is undefined here because _GNU_SOURCE is not set.  This
 * proves the branch is valid C against POSIX declarations, not that it builds with
 * Apple's SDK. */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <unistd.h>
#ifndef F_NOCACHE
#define F_NOCACHE 48 /* <sys/fcntl.h> on macOS */
#endif
#pragma GCC poison posix_fadvise

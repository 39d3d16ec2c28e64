/* Live heap bytes of a process and their peak, for benchmarks/_heap.py.
 *
 * Loaded with LD_PRELOAD, it wraps glibc's allocation entry points and counts the
 * usable size of every live block (malloc_usable_size), in every thread. torch's CPU
 * tensors come from posix_memalign, Inductor's buffers too, so the counter follows
 * them; Python's small objects come from its own arenas, which are counted as blocks.
 * shim_reset_peak() starts a new peak at the current count. See
 * [Note: A heap peak on the CPU] in _heap.py. glibc only: it calls the __libc_*
 * functions, which glibc exports for exactly this use.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

static _Atomic long live = 0, peak = 0;

static void count(void *p) {
    if (!p) return;
    long n = (long)malloc_usable_size(p);
    long now = atomic_fetch_add(&live, n) + n;
    long seen = atomic_load(&peak);
    while (now > seen && !atomic_compare_exchange_weak(&peak, &seen, now)) {
    }
}

static void uncount(void *p) {
    if (p) atomic_fetch_sub(&live, (long)malloc_usable_size(p));
}

void *malloc(size_t n) { void *p = __libc_malloc(n); count(p); return p; }
void free(void *p) { uncount(p); __libc_free(p); }
void *calloc(size_t k, size_t n) { void *p = __libc_calloc(k, n); count(p); return p; }
void *realloc(void *old, size_t n) {
    uncount(old);
    void *p = __libc_realloc(old, n);
    if (p) count(p);
    else if (old && n) count(old); /* failed: the old block is still live */
    return p;
}
void *memalign(size_t a, size_t n) { void *p = __libc_memalign(a, n); count(p); return p; }
void *aligned_alloc(size_t a, size_t n) { return memalign(a, n); }
void *valloc(size_t n) { return memalign(4096, n); }
int posix_memalign(void **out, size_t a, size_t n) {
    void *p = __libc_memalign(a, n);
    if (!p) return ENOMEM;
    count(p);
    *out = p;
    return 0;
}

long shim_live_bytes(void) { return atomic_load(&live); }
long shim_peak_bytes(void) { return atomic_load(&peak); }
void shim_reset_peak(void) { atomic_store(&peak, atomic_load(&live)); }

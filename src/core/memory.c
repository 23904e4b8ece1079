/*
 * Large long-lived buffers (kvc__alloc_large, internal.h). A KV page pool is
 * read in random page order by every decode step: on 4 KiB pages a long
 * context misses the TLB on most pages it reads, so a buffer of at least
 * HUGE_MIN bytes is aligned to 2 MiB and offered to the kernel's transparent
 * huge pages. It is a hint: where THP is off ("never") nothing changes;
 * where it is "madvise" (Debian, Ubuntu) this is what enables it.
 */
#if defined(__linux__)
#define _DEFAULT_SOURCE /* madvise, MADV_HUGEPAGE */
#include <sys/mman.h>
#endif
#include <stdlib.h>

#include "internal.h"

#define HUGE_PAGE ((size_t)2 << 20)
#define HUGE_MIN ((size_t)8 << 20)

void *kvc__alloc_large(size_t size, size_t align) {
    if (align < sizeof(void *)) align = sizeof(void *);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (size >= HUGE_MIN && align <= HUGE_PAGE) {
        size = (size + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
        void *p = aligned_alloc(HUGE_PAGE, size);
        if (p) (void)madvise(p, size, MADV_HUGEPAGE); /* a hint: failure changes nothing */
        return p;
    }
#endif
    size = (size + align - 1) / align * align;
    return aligned_alloc(align, size ? size : align);
}

/* Shared by the GGUF reader and the model loader (not exported). */
#ifndef KVC_GGUF_INTERNAL_H
#define KVC_GGUF_INTERNAL_H

#include "kvcache/gguf.h"

/* kvc_gguf_open_read, calling fn(fraction of the file read, user) as the
 * read goes (fn may be NULL; a kvc_progress_fn): a large file takes seconds. */
kvc_status kvc__gguf_open_read(const char *path, void (*fn)(float, void *), void *user,
                               kvc_gguf **out);

#endif

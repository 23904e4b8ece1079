/* Shared by the GGUF reader and the model loader (not exported). */
#ifndef KVC_GGUF_INTERNAL_H
#define KVC_GGUF_INTERNAL_H

#include "kvcache/gguf.h"
#include "kvcache/model.h" /* kvc_progress_fn */

/* kvc_gguf_open_read, calling fn(fraction of the file read, user) as the
 * read goes (fn may be NULL): a large file takes seconds. */
kvc_status kvc__gguf_open_read(const char *path, kvc_progress_fn fn, void *user, kvc_gguf **out);

#endif

/* placeholder, replaced in the next commit */
#include "kvfmt_internal.h"
kvc_status kvc_kvfmt_append(const kvc_kvfmt *f, kvc_tensor *pages, const kvc_kvfmt_seq *seqs,
                            int64_t n_seqs, const int64_t *row_indptr, const kvc_tensor *key,
                            const kvc_tensor *value, kvc_threadpool *pool) {
    (void)f; (void)pages; (void)seqs; (void)n_seqs; (void)row_indptr; (void)key; (void)value; (void)pool;
    return kvc__error(KVC_ERR_UNSUPPORTED, "kvc_kvfmt_append: not yet");
}

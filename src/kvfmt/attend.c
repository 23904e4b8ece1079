/* placeholder, replaced in the next commit */
#include "kvfmt_internal.h"
kvc_status kvc_kvfmt_attention(const kvc_kvfmt *f, const kvc_tensor *pages,
                               const kvc_kvfmt_seq *seqs, int64_t n_seqs, const kvc_tensor *q,
                               const int32_t *q_seq, const int32_t *q_pos,
                               const kvc_attn_params *params, kvc_tensor *out, kvc_tensor *lse,
                               kvc_threadpool *pool) {
    (void)f; (void)pages; (void)seqs; (void)n_seqs; (void)q; (void)q_seq; (void)q_pos; (void)params; (void)out; (void)lse; (void)pool;
    return kvc__error(KVC_ERR_UNSUPPORTED, "kvc_kvfmt_attention: not yet");
}

/* What the engine needs from the model runtime. Internal. */
#ifndef KVC_MODEL_INTERNAL_H
#define KVC_MODEL_INTERNAL_H

#include "kvcache/model.h"

/* KVC_OK if n positions fit the model's context limit (info.n_ctx), else
 * KVC_ERR_INVALID_ARG with one message for every caller: "fn: what n
 * tokens, past the context limit of ..." naming the override. */
kvc_status kvc__model_check_ctx(const kvc_model *m, const char *fn, const char *what, int64_t n);

#endif

/* Model metadata (hparams.c): the architectures the forward pass implements
 * and the reading of a GGUF's keys into kvc_model_info, refusing every key
 * that would change the computation in a way the runtime does not follow. */
#ifndef KVC_MODEL_HPARAMS_H
#define KVC_MODEL_HPARAMS_H

#include <stdint.h>

#include "kvcache/gguf.h"
#include "kvcache/model.h"

/* llama and its variants, as llama.cpp names the architectures. */
typedef struct kvc__arch {
    const char *name;  /* general.architecture and the key prefix */
    int rope_neox;     /* rotary on halves (x[i], x[i + n_rot/2]), not adjacent pairs */
    int qkv_bias;      /* blk.N.attn_{q,k,v}.bias: 0 refused, 1 optional, 2 required */
    int other_bias;    /* blk.N.attn_output / ffn_{gate,up,down}.bias accepted (optional) */
    int rope_freqs;    /* rope_freqs.weight accepted (optional) */
} kvc__arch;

typedef struct kvc__hparams {
    const kvc__arch *arch;
    int64_t vocab_size; /* <arch>.vocab_size, -1 if absent (checked against token_embd) */
} kvc__hparams;

/* Reads general.architecture and the <arch>.* keys into *in (name, sizes,
 * head dim, rope, norm epsilon; not n_vocab and the tensor-derived fields)
 * after checking every key of the file: general.* and quantize.* are
 * informational, tokenizer.* belongs to the tokenizer loader, split.* is
 * accepted for a single-file model; an <arch>.* key the runtime does not
 * implement, a value it does not follow (rope scaling other than linear,
 * experts, non-causal attention, ...) or any other namespace is refused
 * naming the key. KVC_ERR_CORRUPT for a missing, mistyped or out-of-range
 * value, KVC_ERR_UNSUPPORTED for what is valid but not implemented. */
kvc_status kvc__model_hparams(const kvc_gguf *g, kvc_model_info *in, kvc__hparams *hp);

#endif

/*
 * Tokenizer stored in a GGUF model: byte-level BPE ("gpt2" tokenizer model)
 * with the model's pre-tokenizer rules (tokenizer.ggml.pre), special tokens,
 * and the model's chat template.
 *
 * Encoding: special tokens (control/user-defined types) are matched first
 * when parse_special is set (longest match), the rest is split by the
 * pre-tokenizer regexes, each piece mapped byte -> unicode as GPT-2 does and
 * merged by BPE rank. Decoding maps tokens back to raw bytes: a piece may end
 * inside a UTF-8 sequence (callers that stream text concatenate bytes).
 */
#ifndef KVCACHE_TOKENIZER_H
#define KVCACHE_TOKENIZER_H

#include <stddef.h>

#include "kvcache/core.h"
#include "kvcache/gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Token types (tokenizer.ggml.token_type, llama.cpp numbering). */
typedef enum kvc_token_type {
    KVC_TOKEN_UNDEFINED = 0,
    KVC_TOKEN_NORMAL = 1,
    KVC_TOKEN_UNKNOWN = 2,
    KVC_TOKEN_CONTROL = 3,
    KVC_TOKEN_USER_DEFINED = 4,
    KVC_TOKEN_UNUSED = 5,
    KVC_TOKEN_BYTE = 6
} kvc_token_type;

/*
 * A vocabulary given as arrays (what kvc_tokenizer_from_gguf reads from
 * tokenizer.ggml.*). Everything is copied.
 *   tokens[i], token_lens[i]   token text (GPT-2 byte-to-unicode form), n_vocab
 *   token_types                (n_vocab) kvc_token_type, or NULL (all normal)
 *   merges[i], merge_lens[i]   "left right" strings, rank = i, n_merges
 *   pre                        pre-tokenizer name ("smollm", "llama3", "gpt2", ...)
 *   bos/eos/eot/unk/pad ids    -1 when absent
 */
typedef struct kvc_tokenizer_vocab {
    int32_t n_vocab;
    const char *const *tokens;
    const size_t *token_lens;
    const int32_t *token_types;
    int32_t n_merges;
    const char *const *merges;
    const size_t *merge_lens;
    const char *pre;
    int32_t bos_id, eos_id, eot_id, unk_id, pad_id;
    int32_t add_bos; /* tokenizer.ggml.add_bos_token */
} kvc_tokenizer_vocab;

typedef struct kvc_tokenizer kvc_tokenizer;

KVC_API kvc_status kvc_tokenizer_create(const kvc_tokenizer_vocab *vocab, kvc_tokenizer **out);
/* Reads tokenizer.ggml.{model,pre,tokens,token_type,merges,*_token_id,
 * add_bos_token} and tokenizer.chat_template. KVC_ERR_UNSUPPORTED for a
 * tokenizer model other than "gpt2" or an unknown pre-tokenizer. */
KVC_API kvc_status kvc_tokenizer_from_gguf(const kvc_gguf *g, kvc_tokenizer **out);
KVC_API void kvc_tokenizer_destroy(kvc_tokenizer *t); /* NULL is a no-op */

KVC_API int32_t kvc_tokenizer_n_vocab(const kvc_tokenizer *t);
KVC_API int32_t kvc_tokenizer_bos(const kvc_tokenizer *t); /* -1 if none */
KVC_API int32_t kvc_tokenizer_eos(const kvc_tokenizer *t); /* -1 if none */
/* End of turn for chat (e.g. <|im_end|>, <|eot_id|>), else eos. */
KVC_API int32_t kvc_tokenizer_eot(const kvc_tokenizer *t);
/* 1 if generation should stop at token id (eos, eot or another end-of-generation control). */
KVC_API int kvc_tokenizer_is_eog(const kvc_tokenizer *t, int32_t id);

/*
 * Encodes len bytes of UTF-8 text (invalid UTF-8 is encoded byte by byte,
 * never rejected). add_bos: prepend BOS (when the vocabulary has one);
 * parse_special: recognise special-token text such as "<|im_start|>".
 * Writes at most cap ids; *n_tokens receives the full count, and if it
 * exceeds cap the call returns KVC_ERR_NO_SPACE (call again with more room).
 */
KVC_API kvc_status kvc_tokenize(const kvc_tokenizer *t, const char *text, size_t len, int add_bos,
                                int parse_special, int32_t *tokens, int64_t cap,
                                int64_t *n_tokens);

/* Raw bytes of one token (special tokens render as their text). Writes at
 * most cap bytes; *len receives the full length (KVC_ERR_NO_SPACE if > cap). */
KVC_API kvc_status kvc_token_to_piece(const kvc_tokenizer *t, int32_t id, char *buf, size_t cap,
                                      size_t *len);

/* Concatenated bytes of n tokens, same conventions. */
KVC_API kvc_status kvc_detokenize(const kvc_tokenizer *t, const int32_t *ids, int64_t n,
                                  char *buf, size_t cap, size_t *len);

/* ---- chat template --------------------------------------------------------- */

typedef struct kvc_chat_message {
    const char *role;    /* "system", "user", "assistant" */
    const char *content; /* NUL-terminated UTF-8 */
} kvc_chat_message;

/*
 * Renders messages with a Jinja chat template (the subset chat templates
 * use: for/if/elif/else/set, loop.first/last/index, messages[i]['role'],
 * string concatenation with +, comparisons, `not`/`and`/`or`, `in`, filters
 * `trim`, raise_exception, add_generation_prompt, bos_token/eos_token).
 * template_str NULL: the tokenizer's own template (tokenizer.chat_template);
 * t may be NULL when template_str is given. Output bytes as kvc_tokenize's
 * input: writes at most cap bytes, *len the full length (KVC_ERR_NO_SPACE
 * if > cap). KVC_ERR_UNSUPPORTED for template syntax outside the subset,
 * KVC_ERR_INVALID_ARG for a template that raises.
 */
KVC_API kvc_status kvc_chat_apply_template(const kvc_tokenizer *t, const char *template_str,
                                           const kvc_chat_message *messages, int64_t n_messages,
                                           int add_generation_prompt, char *buf, size_t cap,
                                           size_t *len);

#ifdef __cplusplus
}
#endif
#endif

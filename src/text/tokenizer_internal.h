/* What the chat-template renderer (chat.c) needs from a tokenizer. Internal. */
#ifndef KVC_MODEL_TOKENIZER_INTERNAL_H
#define KVC_MODEL_TOKENIZER_INTERNAL_H

#include <stddef.h>

#include "kvcache/tokenizer.h"

/* tokenizer.chat_template, or NULL (*len 0) if the vocabulary had none. */
const char *kvc__tokenizer_chat_template(const kvc_tokenizer *t, size_t *len);

/* Decoded bytes of token id (what kvc_token_to_piece writes), or NULL when
 * id is out of range. Valid while t lives. */
const char *kvc__tokenizer_piece(const kvc_tokenizer *t, int32_t id, size_t *len);

/* 1 if text holds the text of a CONTROL token (what parse_special changes). */
int kvc__has_control_text(const kvc_tokenizer *t, const char *text, size_t len);

/* Splits text[0..len) (no special tokens) with the pre-tokenizer named pre
 * and writes the end offset of every piece into ends (at most cap; *n the
 * full count, KVC_ERR_NO_SPACE if more). For tests of the scanners. */
kvc_status kvc__pretokenize(const char *pre, const char *text, size_t len, size_t *ends,
                            size_t cap, size_t *n);

#endif

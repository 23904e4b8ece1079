/*
 * Tokenizer stored in a GGUF model: byte-level BPE ("gpt2" tokenizer model)
 * with the model's pre-tokenizer rules (tokenizer.ggml.pre), special tokens,
 * and the model's chat template.
 *
 * Encoding, in order:
 *   1. special tokens are cut out of the text first, leftmost match, longest
 *      first: CONTROL tokens (<|im_start|>, <|eot_id|>, ...) only with
 *      parse_special, USER_DEFINED tokens (added words) always, as Hugging
 *      Face tokenizers and llama.cpp do. BPE never produces them from text;
 *   2. the rest is split into pieces by the pre-tokenizer's regexes
 *      (hand-written scanners; classes from Unicode 16.0 tables, as Hugging
 *      Face tokenizers 0.23; llama.cpp's are 15.1, without 16.0's letters):
 *        "gpt2" (also mpt, olmo, jais):
 *            's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *        "smollm" (also starcoder, refact, command-r, codeshell, exaone):
 *            every \p{N} code point alone, then "gpt2" on the text between
 *        "llama-bpe" / "llama3" (also dbrx, smaug-bpe):
 *            (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
 *            | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *            and, for llama-bpe / llama3 only, a piece that is itself a token
 *            is not merged (ignore_merges)
 *        "qwen2" (also stablelm2): as llama3 with \p{N} instead of \p{N}{1,3}
 *      (the contractions' case folding is ASCII-only);
 *   3. each piece's bytes become GPT-2 byte tokens (bytes_to_unicode), then
 *      adjacent pairs merge lowest merge rank first, leftmost on ties.
 * Invalid UTF-8 is never rejected: an ill-formed byte is a code point of
 * class "other" (like Python's surrogateescape U+DC80..U+DCFF) and goes
 * through its byte token. A byte the vocabulary has no token for (SmolLM2
 * lacks 21, e.g. 0xFF) becomes the unknown token, or fails with
 * KVC_ERR_INVALID_ARG if there is none.
 *
 * Decoding maps tokens back to raw bytes; CONTROL, USER_DEFINED and UNKNOWN
 * tokens render as their text. A piece may end inside a UTF-8 sequence:
 * callers that stream text pass the bytes through kvc_utf8_stream (below),
 * which holds an incomplete character back and repairs ill-formed bytes.
 *
 * Thread safety: a tokenizer is immutable after creation; any number of
 * threads may encode, decode and render templates with it at once.
 * Every call that fails leaves caller buffers unchanged.
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
 * tokenizer.ggml.*). Everything is copied: the arrays may be freed after
 * kvc_tokenizer_create returns.
 *   tokens[i], token_lens[i]   token text (GPT-2 byte-to-unicode form, e.g.
 *                              "Ġworld" for " world"; CONTROL/USER_DEFINED
 *                              tokens as raw UTF-8), n_vocab > 0 entries;
 *                              token_lens NULL: the texts are NUL-terminated.
 *                              Of duplicate texts the first id wins.
 *   token_types                (n_vocab) kvc_token_type, or NULL (all normal)
 *   merges[i], merge_lens[i]   "left right" strings, rank = i, n_merges >= 0
 *                              (merge_lens NULL: NUL-terminated). Split at the
 *                              first space after the first byte; a merge whose
 *                              parts or result are not tokens is ignored.
 *   pre                        pre-tokenizer name ("smollm", "llama-bpe",
 *                              "gpt2", "qwen2", ... see above); NULL = "gpt2"
 *   bos/eos/eot/unk/pad ids    in [0, n_vocab), or -1 when absent. eot -1:
 *                              the id of "<|im_end|>", "<|eot_id|>", "<|end|>"
 *                              or "<end_of_turn>" if present, else eos.
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

/* Builds a tokenizer (*out NULL on failure). KVC_ERR_INVALID_ARG for a bad
 * vocabulary (ids out of range, token types outside 0..6, a merge without a
 * space), KVC_ERR_UNSUPPORTED for an unknown pre-tokenizer, KVC_ERR_NOMEM. */
KVC_API kvc_status kvc_tokenizer_create(const kvc_tokenizer_vocab *vocab, kvc_tokenizer **out);
/* Reads tokenizer.ggml.{model,pre,tokens,token_type,merges,bos/eos/eot/
 * unknown/padding_token_id,add_bos_token} and tokenizer.chat_template.
 * Everything is copied: g may be closed right after. KVC_ERR_NOT_FOUND if
 * the file has no tokenizer, KVC_ERR_UNSUPPORTED for a tokenizer model other
 * than "gpt2" (e.g. SentencePiece "llama") or an unknown or missing
 * pre-tokenizer, KVC_ERR_CORRUPT for malformed tokenizer keys (wrong types,
 * counts that disagree, ids outside the vocabulary). */
KVC_API kvc_status kvc_tokenizer_from_gguf(const kvc_gguf *g, kvc_tokenizer **out);
KVC_API void kvc_tokenizer_destroy(kvc_tokenizer *t); /* NULL is a no-op */

/* Accessors of a NULL t: n_vocab 0, ids -1, add_bos and is_eog 0,
 * token_type -1. */
KVC_API int32_t kvc_tokenizer_n_vocab(const kvc_tokenizer *t);
KVC_API int32_t kvc_tokenizer_bos(const kvc_tokenizer *t); /* -1 if none */
/* 1 if the vocabulary asks for BOS before a prompt: what to pass as
 * kvc_tokenize's add_bos for a fresh prompt. From a GGUF it is
 * tokenizer.ggml.add_bos_token, or without that key llama.cpp's default:
 * 1 for its Llama 3 pre-tokenizers (llama3, llama-v3, llama-bpe, falcon3),
 * 0 for the others. */
KVC_API int kvc_tokenizer_add_bos(const kvc_tokenizer *t);
KVC_API int32_t kvc_tokenizer_eos(const kvc_tokenizer *t); /* -1 if none */
/* End of turn for chat (e.g. <|im_end|>, <|eot_id|>), else eos. */
KVC_API int32_t kvc_tokenizer_eot(const kvc_tokenizer *t);
/* 1 if generation should stop at token id: eos, eot, or a CONTROL token whose
 * text is one of <|im_end|> <|eot_id|> <|end|> <end_of_turn> <|endoftext|>
 * <|eom_id|> <|end_of_text|> <EOT> <|return|>. 0 for anything else, out of
 * range ids included. */
KVC_API int kvc_tokenizer_is_eog(const kvc_tokenizer *t, int32_t id);

/* The kvc_token_type of id, -1 for an id outside [0, n_vocab). Decoders
 * skip KVC_TOKEN_CONTROL tokens (bos, eos, <|im_end|>, ...) for
 * transformers' skip_special_tokens. */
KVC_API int32_t kvc_tokenizer_token_type(const kvc_tokenizer *t, int32_t id);

/*
 * Encodes len bytes of UTF-8 text (invalid UTF-8 is encoded byte by byte,
 * never rejected; text may be NULL when len is 0). add_bos: prepend BOS
 * (when the vocabulary has one; tokenizer.ggml.add_bos_token is the model's
 * preference, the caller decides); parse_special: recognise CONTROL token
 * text such as "<|im_start|>". The count never exceeds len + 1, so
 * cap = len + 1 always suffices. *n_tokens receives the full count; if it
 * exceeds cap the call returns KVC_ERR_NO_SPACE without writing tokens
 * (call again with more room, or with cap 0 and tokens NULL to measure).
 * Speed: ~5 million tokens/s on one core (100 KB of mixed text in ~7 ms).
 */
KVC_API kvc_status kvc_tokenize(const kvc_tokenizer *t, const char *text, size_t len, int add_bos,
                                int parse_special, int32_t *tokens, int64_t cap,
                                int64_t *n_tokens);

/*
 * kvc_tokenize with parse_special on, except inside the plain spans: n_spans
 * [begin, end) byte ranges of text (plain_spans[2i], plain_spans[2i + 1]),
 * sorted and disjoint, where CONTROL token text is plain text (as with
 * parse_special off; a CONTROL token reaching into a span is not taken).
 * Text across span edges is split and merged as one, exactly as
 * kvc_tokenize would: with no control text in the spans the result is
 * kvc_tokenize's with parse_special on. Same buffer contract as kvc_tokenize;
 * KVC_ERR_INVALID_ARG for spans unsorted, overlapping or past len.
 */
KVC_API kvc_status kvc_tokenize_spans(const kvc_tokenizer *t, const char *text, size_t len,
                                      int add_bos, const size_t *plain_spans, int64_t n_spans,
                                      int32_t *tokens, int64_t cap, int64_t *n_tokens);

/* Raw bytes of one token (special tokens render as their text), not
 * NUL-terminated. *len receives the full length; KVC_ERR_NO_SPACE (nothing
 * written) if it exceeds cap; KVC_ERR_INVALID_ARG for id outside [0, n_vocab). */
KVC_API kvc_status kvc_token_to_piece(const kvc_tokenizer *t, int32_t id, char *buf, size_t cap,
                                      size_t *len);

/* Concatenated bytes of n tokens, same conventions; an id out of range is
 * KVC_ERR_INVALID_ARG naming its index. */
KVC_API kvc_status kvc_detokenize(const kvc_tokenizer *t, const int32_t *ids, int64_t n,
                                  char *buf, size_t cap, size_t *len);

/* ---- streaming detokenization ------------------------------------------------ */

/*
 * Turns the bytes of a token stream (kvc_token_to_piece, one token at a
 * time) into valid UTF-8 as they come: complete characters pass through, an
 * incomplete trailing sequence is held until the next bytes complete it,
 * and ill-formed bytes (from byte tokens: stray continuation bytes, C0/C1
 * and other overlong leads, surrogates, F5..FF, a sequence cut short) become
 * U+FFFD, one per maximal subpart of an ill-formed sequence. At the end,
 * kvc_utf8_stream_flush turns a held incomplete tail into one U+FFFD (as
 * Python's bytes.decode("utf-8", "replace") and transformers' decode do),
 * so the whole stream's output, however the bytes were split, is exactly
 * what Python's decode with errors="replace" gives for all of them.
 * The struct is the caller's (stack or heap, no allocation): init it, feed,
 * flush; its fields are private. Not for sharing between threads.
 */
typedef struct kvc_utf8_stream {
    unsigned char held[4]; /* private: bytes of an incomplete character */
    unsigned char n_held;  /* private: 0..3 */
} kvc_utf8_stream;

KVC_API void kvc_utf8_stream_init(kvc_utf8_stream *s); /* NULL is a no-op */
/* Output bytes that feeding n bytes can produce at most (3 (n + 4)): a cap
 * that never gives KVC_ERR_NO_SPACE. */
KVC_API size_t kvc_utf8_stream_bound(size_t n);
/* Appends n bytes (in may be NULL when n is 0) and writes the valid UTF-8
 * they complete to out; *out_len receives its length, also when it exceeds
 * cap: then KVC_ERR_NO_SPACE, out and the stream unchanged (feed again with
 * that much room). */
KVC_API kvc_status kvc_utf8_stream_feed(kvc_utf8_stream *s, const char *in, size_t n, char *out,
                                        size_t cap, size_t *out_len);
/* Ends the stream: a held incomplete character becomes U+FFFD (3 bytes,
 * else nothing is written); the stream is then empty and may be reused.
 * Buffer contract as kvc_utf8_stream_feed (cap < 3 with a held tail:
 * KVC_ERR_NO_SPACE, the tail still held). */
KVC_API kvc_status kvc_utf8_stream_flush(kvc_utf8_stream *s, char *out, size_t cap,
                                         size_t *out_len);

/* ---- chat template --------------------------------------------------------- */

typedef struct kvc_chat_message {
    const char *role;    /* "system", "user", "assistant" */
    const char *content; /* NUL-terminated UTF-8 */
} kvc_chat_message;

/*
 * Renders messages with a Jinja chat template, producing exactly what
 * Python's jinja2 renders in the environment Hugging Face transformers'
 * apply_chat_template uses (sandboxed, trim_blocks and lstrip_blocks on,
 * loop controls, {% generation %}, its tojson filter and strftime_now; one
 * trailing newline of the template dropped, \r\n -> \n).
 * Variables: messages (list of {"role", "content"}; a NULL role or content
 * is None), add_generation_prompt, bos_token and eos_token (the tokens' text,
 * "" without a tokenizer or token), tools and documents (None); functions
 * raise_exception, namespace, range, strftime_now.
 * The supported Jinja subset (statements, macros, expressions, tests,
 * filters, methods), what is refused only when evaluated, and the known
 * differences from jinja2: docs/CHAT_TEMPLATES.md.
 * template_str NULL: the tokenizer's own template (tokenizer.chat_template;
 * KVC_ERR_NOT_FOUND if it has none); t may be NULL when template_str is
 * given. Output bytes are kvc_tokenize's input (parse_special on, which also
 * makes control-token text inside message contents special: kvc_chat_tokenize
 * keeps contents plain text); *len the full length, KVC_ERR_NO_SPACE
 * (nothing written) if > cap. Errors, all with the template line in the
 * message:
 *   KVC_ERR_UNSUPPORTED  syntax outside the subset, a construct jinja2 has
 *                        and kvcache lacks when it is evaluated (floats,
 *                        '/', other filters, ...), nesting deeper than 200;
 *   KVC_ERR_INVALID_ARG  a template that calls raise_exception (its message
 *                        in kvc_last_error()) or fails at run time (type
 *                        errors, undefined values used, wrong macro or
 *                        filter arguments, integers beyond 64 bits), or
 *                        passes a cap: output over 256 MiB, strings, lists
 *                        and parse tree over 256 MiB together, more than 50
 *                        million loop iterations and macro calls, more than
 *                        4 GiB searched, split, stripped or copied by string
 *                        operations (templates come from model files, so
 *                        none can run for long or take much memory);
 *   KVC_ERR_NOMEM        the machine's memory ran out.
 */
KVC_API kvc_status kvc_chat_apply_template(const kvc_tokenizer *t, const char *template_str,
                                           const kvc_chat_message *messages, int64_t n_messages,
                                           int add_generation_prompt, char *buf, size_t cap,
                                           size_t *len);

/*
 * The chat's prompt tokens: kvc_chat_apply_template, then tokenization with
 * only the template's own text parsed for special tokens. A message content
 * is plain text (parse_special_content 0: "<|im_end|>" typed by a user is
 * the tokens of those characters, never the control token), as
 * llama.cpp's chat and transformers' tokenized apply_chat_template should;
 * parse_special_content 1 tokenizes the rendered prompt as one string, as
 * kvc_tokenize(prompt, parse_special 1) does. Contents without control-token
 * text give the same tokens either way. add_bos as in kvc_tokenize (most
 * templates write BOS themselves: then pass 0).
 * A content with control-token text is found in the prompt by rendering
 * again with a placeholder in its place (its leading and trailing whitespace
 * kept, so `| trim` acts alike); KVC_ERR_UNSUPPORTED if the template changes
 * such a content otherwise (e.g. splits it, or tests its length), so its
 * place cannot be known. Buffer contract as kvc_tokenize (cap 0 and tokens
 * NULL measure); the template's statuses as kvc_chat_apply_template.
 */
KVC_API kvc_status kvc_chat_tokenize(const kvc_tokenizer *t, const char *template_str,
                                     const kvc_chat_message *messages, int64_t n_messages,
                                     int add_generation_prompt, int add_bos,
                                     int parse_special_content, int32_t *tokens, int64_t cap,
                                     int64_t *n_tokens);

/*
 * kvc_chat_apply_template with the variables given as a JSON object, for
 * what role/content strings cannot say: tool_calls (with their function
 * name and arguments), tool messages, name, tool_call_id,
 * reasoning_content, the tools list (JSON schemas), documents, and extra
 * variables such as enable_thinking or date_string, as transformers'
 * apply_chat_template(messages, tools=..., documents=..., **kwargs) passes
 * them to the template.
 * context_json: NUL-terminated UTF-8 JSON text, one object; every member
 * becomes a variable (and hides a function of the same name, as render()'s
 * variables hide jinja2's globals). It must have "messages", an array; it
 * may set "bos_token" and "eos_token" (else the tokenizer's, as above),
 * "tools" and "documents" (else None); "add_generation_prompt" comes from
 * the argument only (the member is refused).
 * JSON values: strings -> str, integers -> int, true/false -> bool, null ->
 * None, arrays -> lists, objects -> dicts in document order (a duplicate
 * key keeps its first place and its last value, as Python's json.loads).
 * Parsing is strict RFC 8259 (json.loads is the reference for meaning).
 * Same template, buffer contract and caps as kvc_chat_apply_template (the
 * context's strings, lists and dicts count toward the 256 MiB); errors
 * about the context name its byte offset ("context JSON, offset N: ..."):
 *   KVC_ERR_INVALID_ARG  context_json not a JSON object, malformed (also:
 *                        invalid UTF-8, a byte order mark, a lone surrogate
 *                        escape such as "\ud800", arrays and objects
 *                        nested more than 500 deep), without a "messages"
 *                        array, or with "add_generation_prompt";
 *   KVC_ERR_UNSUPPORTED  a well-formed context holding a number with a
 *                        fraction or exponent, NaN, Infinity or -Infinity
 *                        (Python floats; kvcache's templates have no
 *                        floats) or an integer beyond 64 bits (the message
 *                        names the value's path, e.g. tools[0]['x']);
 *   and the template's statuses as above.
 */
KVC_API kvc_status kvc_chat_apply_template_json(const kvc_tokenizer *t, const char *template_str,
                                                const char *context_json,
                                                int add_generation_prompt, char *buf, size_t cap,
                                                size_t *len);

#ifdef __cplusplus
}
#endif
#endif

/*
 * Helpers shared by the commands that generate text (run, chat) and read
 * prompts (bench-serve): prompt files, model loading, the options of a
 * generation, tokenization of plain and chat prompts, prefill progress and
 * one request streamed through the engine.
 */
#ifndef KVCACHE_TOOLS_CLI_GEN_H
#define KVCACHE_TOOLS_CLI_GEN_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvcache/kvcache.h"

/* Prompts with at least this many tokens to compute show a progress line
 * (on a terminal only): below it prefill takes about a second or less. */
#define CLI_PROGRESS_MIN_TOKENS 256

/* The most bytes an input file (a prompt, a system message, a chat template,
 * a perplexity text) or a chat line may hold: 256 MiB. Text runs about 4
 * bytes a token, and a token is rarely over 64 bytes (the longest pieces of
 * common vocabularies are runs of spaces or code), so 256 MiB is 4 M tokens
 * even at 64 bytes each: past any model's context (and hours of perplexity),
 * while /dev/zero or a wrong file is refused before it takes the memory. */
#define CLI_MAX_INPUT_BYTES ((size_t)256 << 20)

/* Reads a whole file, "-" = standard input, into a NUL-terminated buffer
 * (*text, freed by the caller; *len bytes, NULs inside kept). On failure
 * prints "kvcache: CMD: cannot read PATH: reason" and returns -1; a file
 * over CLI_MAX_INPUT_BYTES is a failure, found by its size when it has one
 * (a regular file) or once that many bytes are read (a pipe, a device). */
int cli_read_file(const char *cmd, const char *path, char **text, size_t *len);
/* How messages name a file argument: "standard input" for "-", else path. */
const char *cli_file_name(const char *path);
/* cli_read_file for a prompt (-f, a system message): one trailing newline is
 * dropped, as llama.cpp's -f does, so `echo TEXT > FILE` gives -p TEXT. */
int cli_read_prompt(const char *cmd, const char *path, char **text, size_t *len);

/* Loads a GGUF model with the context limit n_ctx (0: the model's trained
 * context; kvc_model_params.n_ctx), mapped or, with no_mmap, read into memory
 * (kvc_model_params.use_mmap), with a load percentage on stderr when it is a
 * terminal and !quiet. On failure prints why (and how to fetch the default
 * model when the file is missing) and returns NULL. */
kvc_model *cli_load_model(const char *cmd, const char *path, int quiet, int64_t n_ctx,
                          int no_mmap);

/* Options every generating command takes. */
typedef struct cli_gen_opts {
    const char *model_path;
    int64_t n_predict, threads, top_k;
    uint64_t seed;
    double temp, top_p;
    int kv_dtype, ignore_eos, quiet, no_mmap;
} cli_gen_opts;

/* Their lines for a command's --help. */
extern const char cli_gen_opts_help[];
/* --no-mmap's lines, for the commands with parsers of their own too. */
#define CLI_NO_MMAP_HELP                                                                           \
    "  --no-mmap           read the model into memory instead of mapping it (faster\n"            \
    "                      decode where the kernel backs it with huge pages; memory\n"           \
    "                      not shared with other processes)\n"

void cli_gen_opts_default(cli_gen_opts *o, int64_t n_predict);
/* If argv[*i] is one of the shared options, parses it (and its value,
 * advancing *i) into o and returns 1; 0 if it is not one; CLI_EXIT_USAGE
 * (> 1) after printing the error for a bad or missing value. */
int cli_gen_opts_parse(const char *cmd, int argc, char **argv, int *i, cli_gen_opts *o);
kvc_sampling_params cli_gen_sampling(const cli_gen_opts *o);

/* Text to tokens (*ids allocated, freed by the caller). */
kvc_status cli_tokenize(const kvc_tokenizer *tok, const char *text, size_t len, int add_bos,
                        int parse_special, int32_t **ids, int64_t *n_ids);

/* A conversation to the prompt of the assistant's next reply: msgs rendered
 * by the chat template (tmpl, or the model's when NULL) with
 * add_generation_prompt, then tokenized (kvc_chat_tokenize: message contents
 * are plain text unless special, only the template's own markers become
 * control tokens). The one place chat text becomes tokens, so `run --chat`
 * and `chat` tokenize alike. */
kvc_status cli_chat_tokens(const kvc_tokenizer *tok, const char *tmpl,
                           const kvc_chat_message *msgs, int64_t n_msgs, int special,
                           int32_t **ids, int64_t *n_ids);

/* One-line "\r" progress of a prefill on stderr, only when stderr is a
 * terminal, not quiet, and at least CLI_PROGRESS_MIN_TOKENS are to be
 * computed; nothing at all otherwise (piped stderr stays clean). */
typedef struct cli_progress {
    int on;
    int64_t total;
    const char *label;
} cli_progress;

void cli_progress_begin(cli_progress *p, const char *label, int64_t to_compute, int64_t total,
                        int quiet);
void cli_progress_update(cli_progress *p, int64_t done);
void cli_progress_end(cli_progress *p); /* erases the line */

/* One request through the engine: prefill (with progress), then the reply's
 * tokens streamed to out as they come (an end-of-generation token is not
 * written), always as valid UTF-8 (kvc_utf8_stream: a character split over
 * tokens is written once complete, a tail cut by the end becomes U+FFFD). echo, if not NULL, is written to out just before the first
 * token, after the progress line is gone. When keep is not NULL the reply's
 * bytes are also appended to *keep (reallocated, NUL-terminated; *keep_len
 * bytes). */
typedef struct cli_gen_result {
    int64_t n_prompt; /* prompt tokens */
    int64_t n_reused; /* of them served from the prefix cache */
    int64_t n_gen;    /* tokens generated, an end-of-generation one included */
    double t_prefill; /* seconds to the first token */
    double t_decode;  /* seconds from the first token to the last */
    int finish;       /* kvc_finish_reason */
} cli_gen_result;

int cli_generate(const char *cmd, kvc_engine *eng, const kvc_tokenizer *tok, const int32_t *ids,
                 int64_t n_ids, int32_t n_predict, const kvc_sampling_params *sp, int ignore_eos,
                 int quiet, const char *echo, size_t echo_len, FILE *out, char **keep,
                 size_t *keep_len, cli_gen_result *res);

#endif

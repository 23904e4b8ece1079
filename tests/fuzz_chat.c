/*
 * libFuzzer target for the chat-template interpreter (templates come from
 * model files, so they are untrusted input). Input layout:
 *   byte 0     bits 0-2 number of messages (0-7), bit 3 add_generation_prompt,
 *              bit 4 a tokenizer (bos/eos texts) instead of none,
 *              bit 5 the last message has a NULL role, bit 6 a NULL content
 *   then       the template text up to the first NUL byte, then the
 *              messages' contents separated by NUL bytes (missing ones "")
 * Roles cycle system, user, assistant. Checked on every input:
 *   - the status is OK or a documented error (UNSUPPORTED, INVALID_ARG for
 *     run-time errors and the caps) whose message names a template line
 *     (>= 1), or NOMEM (the machine's memory);
 *   - measuring (cap 0) and rendering agree on the length; one byte short is
 *     KVC_ERR_NO_SPACE with nothing written; a failed render writes nothing;
 *   - rendering is deterministic (twice, byte for byte).
 * The fuzz build lowers the interpreter's caps (KVC_CHAT_MAX_* below, set in
 * tests/CMakeLists.txt) so a run stays short under the sanitizers; the
 * library's own caps are the same code with larger numbers.
 * Built with clang -fsanitize=fuzzer,address,undefined when -DKVC_FUZZ=ON;
 * otherwise fuzz_replay.c replays the seed corpus through the same entry.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/tokenizer.h"
#include "fuzz.h"

/* A minimal vocabulary whose BOS/EOS texts the templates can print. */
static kvc_tokenizer *make_tokenizer(void) {
    static const char *const toks[] = {"a", "b", "<|im_start|>", "<|im_end|>", "<s>"};
    static const int32_t types[] = {KVC_TOKEN_NORMAL, KVC_TOKEN_NORMAL, KVC_TOKEN_CONTROL,
                                    KVC_TOKEN_CONTROL, KVC_TOKEN_CONTROL};
    kvc_tokenizer_vocab v = {0};
    v.n_vocab = 5;
    v.tokens = toks;
    v.token_types = types;
    v.bos_id = 4;
    v.eos_id = 3;
    v.eot_id = v.unk_id = v.pad_id = -1;
    kvc_tokenizer *t = NULL;
    CHECK(kvc_tokenizer_create(&v, &t) == KVC_OK);
    return t;
}

/* 1 if msg names a template line: "chat template, line N: ..." with N >= 1. */
static int line_named(const char *msg) {
    const char *p = strstr(msg, "chat template, line ");
    if (!p) return 0;
    char *end;
    long line = strtol(p + strlen("chat template, line "), &end, 10);
    return line >= 1 && *end == ':';
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static kvc_tokenizer *tok;
    if (!tok) tok = make_tokenizer();
    if (size < 1) return 0;
    uint8_t mode = data[0];
    /* one NUL-terminated copy: template, then contents, each ending in NUL */
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data + 1, size - 1);
    text[size - 1] = 0;
    const char *end = text + size - 1;
    const char *tmpl = text;
    const char *p = tmpl + strlen(tmpl) + (tmpl + strlen(tmpl) < end);
    static const char *const roles[] = {"system", "user", "assistant"};
    kvc_chat_message msgs[7];
    int n_msgs = mode & 7;
    for (int i = 0; i < n_msgs; i++) {
        msgs[i].role = roles[i % 3];
        msgs[i].content = p < end ? p : "";
        if (p < end) p += strlen(p) + 1;
    }
    if (n_msgs > 0 && (mode & 32)) msgs[n_msgs - 1].role = NULL;
    if (n_msgs > 0 && (mode & 64)) msgs[n_msgs - 1].content = NULL;
    int gen = (mode >> 3) & 1;
    const kvc_tokenizer *t = (mode & 16) ? tok : NULL;

    size_t need = 12345;
    kvc_status st = kvc_chat_apply_template(t, tmpl, msgs, n_msgs, gen, NULL, 0, &need);
    if (st != KVC_OK && st != KVC_ERR_NO_SPACE) {
        CHECK(st == KVC_ERR_UNSUPPORTED || st == KVC_ERR_INVALID_ARG || st == KVC_ERR_NOMEM);
        CHECK(kvc_last_error()[0] != 0);
        /* only the machine running out of memory may not know the line */
        if (st != KVC_ERR_NOMEM) CHECK(line_named(kvc_last_error()));
        char canary[8];
        memset(canary, 0x5A, sizeof canary);
        size_t n2 = 0;
        CHECK(kvc_chat_apply_template(t, tmpl, msgs, n_msgs, gen, canary, sizeof canary, &n2) ==
              st);
        for (size_t i = 0; i < sizeof canary; i++) CHECK(canary[i] == 0x5A);
        free(text);
        return 0;
    }
    CHECK((st == KVC_OK) == (need == 0));
    char *a = malloc(need + 1), *b = malloc(need + 1);
    if (a && b) {
        size_t n1 = 0, n2 = 0;
        if (need) {
            memset(a, 0x5A, need + 1);
            CHECK(kvc_chat_apply_template(t, tmpl, msgs, n_msgs, gen, a, need - 1, &n1) ==
                  KVC_ERR_NO_SPACE);
            CHECK(n1 == need);
            for (size_t i = 0; i <= need; i++) CHECK(a[i] == 0x5A);
        }
        CHECK(kvc_chat_apply_template(t, tmpl, msgs, n_msgs, gen, a, need, &n1) == KVC_OK);
        CHECK(kvc_chat_apply_template(t, tmpl, msgs, n_msgs, gen, b, need, &n2) == KVC_OK);
        CHECK(n1 == need && n2 == need && (need == 0 || memcmp(a, b, need) == 0));
        if (need) CHECK(a[need] == 0x5A); /* nothing past the reported length */
    }
    free(a);
    free(b);
    free(text);
    return 0;
}

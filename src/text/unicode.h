/*
 * Unicode helpers for the tokenizer and the chat-template renderer: strict
 * UTF-8 decoding, code-point classes for the pre-tokenizer regexes, Python's
 * str.isspace(), and GPT-2's byte <-> unicode mapping. Internal: nothing here
 * is exported.
 */
#ifndef KVC_MODEL_UNICODE_H
#define KVC_MODEL_UNICODE_H

#include <stddef.h>
#include <stdint.h>

/* Code-point classes (mutually exclusive), as the regexes see them:
 * LETTER = \p{L}, NUMBER = \p{N}, SPACE = \s (Unicode White_Space). */
enum {
    KVC__CP_OTHER = 0,
    KVC__CP_LETTER = 1,
    KVC__CP_NUMBER = 2,
    KVC__CP_SPACE = 3
};

typedef struct kvc__cp_range {
    uint32_t first, last; /* inclusive */
    uint8_t cls;          /* KVC__CP_* */
} kvc__cp_range;

typedef struct kvc__cp_span {
    uint32_t first, last; /* inclusive */
} kvc__cp_span;

/* First code point of an invalid byte b: U+DC00 + b, as Python's
 * "surrogateescape" error handler does. Lone surrogates cannot come out of
 * valid UTF-8, so the mapping is unambiguous, and they are class OTHER
 * (general category Cs), which is how the reference regexes see them too. */
#define KVC__CP_BAD_BYTE_BASE 0xDC00u

/*
 * Decodes one code point from s[0..len) (len >= 1). Well-formed sequences
 * are exactly those of Unicode Table 3-7 (no overlongs, no surrogates,
 * nothing above U+10FFFF). For anything else one byte is consumed and
 * KVC__CP_BAD_BYTE_BASE + s[0] returned, so every byte of an ill-formed
 * sequence becomes its own code point. *adv receives the bytes consumed (1-4).
 */
uint32_t kvc__utf8_decode(const unsigned char *s, size_t len, int *adv);

/* Writes cp (<= U+10FFFF) as UTF-8 into out (4 bytes of room); returns the
 * length. Surrogates are written as their 3-byte form (only used for the
 * GPT-2 mapping, whose code points are all below U+0200). */
int kvc__utf8_encode(uint32_t cp, unsigned char *out);

/* KVC__CP_* of a code point (ASCII by table, the rest by binary search). */
int kvc__cp_class(uint32_t cp);

/* Python's str.isspace() for one code point (what Jinja's trim filter and
 * whitespace control strip): White_Space plus U+001C..U+001F. */
int kvc__py_isspace(uint32_t cp);

/* Python's str.isprintable() for one code point: 0 for the code points
 * repr() escapes (controls, format characters, surrogates, private use,
 * unassigned, line and paragraph separators, spaces other than U+0020). */
int kvc__py_isprintable(uint32_t cp);

/* Unicode's Cased property (Lu, Ll, Lt, Other_Uppercase, Other_Lowercase):
 * Python's str.title() lowercases after a cased code point. */
int kvc__is_cased(uint32_t cp);

/* GPT-2 byte-level mapping: byte b -> code point (printable bytes map to
 * themselves, the other 68 to U+0100.. in byte order). */
uint32_t kvc__byte_to_cp(unsigned char b);
/* Inverse: the byte of code point cp, or -1 if cp is not in the image. */
int kvc__cp_to_byte(uint32_t cp);

/* Unicode version of the class table ("16.0.0"; the chat templates' tables
 * follow the str of the Python that generated them). */
const char *kvc__unicode_version(void);

#endif

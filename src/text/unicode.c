/*
 * Unicode helpers: strict UTF-8 decoding, the code-point classes the
 * pre-tokenizer scanners ask for, and GPT-2's byte <-> unicode table.
 *
 * The class table (unicode_tables.h) is generated from Unicode 16.0's data
 * by scripts/gen_unicode_tables.py: ~800 sorted ranges, searched by bisection
 * for non-ASCII code points; ASCII has its own 128-entry table because almost
 * all text the tokenizer sees is mostly ASCII.
 */
#include "unicode.h"

#include <stddef.h>
#include <string.h>

#include "unicode_tables.h"

/* ---- UTF-8 ---------------------------------------------------------------- */

uint32_t kvc__utf8_decode(const unsigned char *s, size_t len, int *adv) {
    unsigned c = s[0];
    *adv = 1;
    if (c < 0x80) return c;
    /* Lead byte -> length and the allowed range of the second byte
     * (Unicode Table 3-7, "Well-Formed UTF-8 Byte Sequences"). */
    int n;
    unsigned lo = 0x80, hi = 0xBF;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
        n = 2;
        cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        cp = c & 0x0F;
        if (c == 0xE0) lo = 0xA0; /* no overlongs */
        if (c == 0xED) hi = 0x9F; /* no surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        cp = c & 0x07;
        if (c == 0xF0) lo = 0x90; /* no overlongs */
        if (c == 0xF4) hi = 0x8F; /* nothing above U+10FFFF */
    } else {
        return KVC__CP_BAD_BYTE_BASE + c; /* C0, C1, F5..FF, or a stray continuation */
    }
    if ((size_t)n > len) return KVC__CP_BAD_BYTE_BASE + c;
    for (int i = 1; i < n; i++) {
        unsigned b = s[i];
        unsigned blo = i == 1 ? lo : 0x80, bhi = i == 1 ? hi : 0xBF;
        if (b < blo || b > bhi) return KVC__CP_BAD_BYTE_BASE + c;
        cp = (cp << 6) | (b & 0x3F);
    }
    *adv = n;
    return cp;
}

int kvc__utf8_encode(uint32_t cp, unsigned char *out) {
    if (cp < 0x80) {
        out[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (unsigned char)(0xC0 | (cp >> 6));
        out[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (unsigned char)(0xE0 | (cp >> 12));
        out[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (unsigned char)(0xF0 | (cp >> 18));
    out[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* ---- classes ---------------------------------------------------------------- */

/* ASCII classes: digits, letters, and \t \n \v \f \r space. */
static const uint8_t ascii_class[128] = {
#define S_ KVC__CP_SPACE
#define L_ KVC__CP_LETTER
#define N_ KVC__CP_NUMBER
    0,  0,  0,  0,  0,  0,  0,  0,  0,  S_, S_, S_, S_, S_, 0,  0,  /* 0x00 */
    0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  /* 0x10 */
    S_, 0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  /* 0x20 */
    N_, N_, N_, N_, N_, N_, N_, N_, N_, N_, 0,  0,  0,  0,  0,  0,  /* 0x30 */
    0,  L_, L_, L_, L_, L_, L_, L_, L_, L_, L_, L_, L_, L_, L_, L_,  /* 0x40 */
    L_, L_, L_, L_, L_, L_, L_, L_, L_, L_, L_, 0,  0,  0,  0,  0,  /* 0x50 */
    0,  L_, L_, L_, L_, L_, L_, L_, L_, L_, L_, L_, L_, L_, L_, L_,  /* 0x60 */
    L_, L_, L_, L_, L_, L_, L_, L_, L_, L_, L_, 0,  0,  0,  0,  0,  /* 0x70 */
#undef S_
#undef L_
#undef N_
};

/* Index of the span of the n sorted, disjoint spans at table (elements of
 * `size` bytes that begin with a kvc__cp_span) that holds cp, or n. */
static size_t find_span(const void *table, size_t n, size_t size, uint32_t cp) {
    const unsigned char *t = table;
    kvc__cp_span s;
    size_t lo = 0, hi = n;
    while (lo < hi) { /* first span whose last >= cp */
        size_t mid = lo + (hi - lo) / 2;
        memcpy(&s, t + mid * size, sizeof s);
        if (s.last < cp)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == n) return n;
    memcpy(&s, t + lo * size, sizeof s);
    return s.first <= cp ? lo : n;
}
_Static_assert(offsetof(kvc__cp_range, first) == offsetof(kvc__cp_span, first) &&
                   offsetof(kvc__cp_range, last) == offsetof(kvc__cp_span, last),
               "a kvc__cp_range begins with a kvc__cp_span");

#define SPANS(table) (table), sizeof(table) / sizeof((table)[0]), sizeof((table)[0])

int kvc__cp_class(uint32_t cp) {
    if (cp < 128) return ascii_class[cp];
    const size_t n = sizeof kvc__cp_ranges / sizeof kvc__cp_ranges[0];
    const size_t i = find_span(SPANS(kvc__cp_ranges), cp);
    return i < n ? kvc__cp_ranges[i].cls : KVC__CP_OTHER;
}

int kvc__py_isspace(uint32_t cp) {
    /* str.isspace(): bidirectional class WS, B or S, or category Zs; that is
     * White_Space plus the four information separators U+001C..U+001F. */
    if (cp >= 0x1C && cp <= 0x1F) return 1;
    return kvc__cp_class(cp) == KVC__CP_SPACE;
}

int kvc__py_isprintable(uint32_t cp) {
    if (cp < 128) return cp >= 0x20 && cp < 0x7F;
    const size_t n = sizeof kvc__nonprint_ranges / sizeof kvc__nonprint_ranges[0];
    return find_span(SPANS(kvc__nonprint_ranges), cp) == n;
}

int kvc__is_cased(uint32_t cp) {
    if (cp < 128) return (cp | 32) >= 'a' && (cp | 32) <= 'z';
    const size_t n = sizeof kvc__cased_ranges / sizeof kvc__cased_ranges[0];
    return find_span(SPANS(kvc__cased_ranges), cp) < n;
}

const char *kvc__unicode_version(void) {
    return KVC__UNICODE_VERSION;
}

/* ---- GPT-2 byte <-> unicode ----------------------------------------------- */

/* GPT-2 (openai/gpt-2 encoder.py, bytes_to_unicode) keeps the bytes whose
 * Latin-1 character is printable and not a space -- '!'..'~', U+00A1..U+00AC,
 * U+00AE..U+00FF -- as themselves and maps the other 68 bytes, in increasing
 * order, to U+0100, U+0101, ... so every byte has a visible character. */
static int byte_is_kept(unsigned b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
}

uint32_t kvc__byte_to_cp(unsigned char b) {
    if (byte_is_kept(b)) return b;
    /* Rank of b among the remapped bytes: 0x00..0x20 (33), 0x7F..0xA0 (34), 0xAD. */
    unsigned rank;
    if (b <= 0x20)
        rank = b;
    else if (b <= 0xA0)
        rank = 33 + (b - 0x7F);
    else
        rank = 67; /* 0xAD */
    return 0x100 + rank;
}

int kvc__cp_to_byte(uint32_t cp) {
    if (cp < 0x100) return byte_is_kept(cp) ? (int)cp : -1;
    if (cp >= 0x100 + 68) return -1;
    unsigned rank = cp - 0x100;
    if (rank <= 32) return (int)rank;
    if (rank <= 66) return (int)(0x7F + rank - 33);
    return 0xAD;
}

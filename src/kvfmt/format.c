/* Format members, parameter checks and the page layout (docs/KV_FORMATS.md
 * sections 1, 2 and 5). */
#include <string.h>
#include <strings.h>

#include "../kernels/kernels.h"
#include "kvfmt_internal.h"

static const char *const k_names[KVC_KVFMT_COUNT] = {"none", "kivi8", "kivi4"};

const char *kvc_kv_format_name(kvc_kv_format f) {
    return (int)f >= 0 && f < KVC_KVFMT_COUNT ? k_names[f] : "?";
}

kvc_status kvc_kv_format_from_name(const char *name, kvc_kv_format *out) {
    KVC_CHECK(out != NULL, "kvc_kv_format_from_name: out is NULL");
    for (int i = 0; name && i < KVC_KVFMT_COUNT; i++)
        if (strcasecmp(name, k_names[i]) == 0) {
            *out = (kvc_kv_format)i;
            return KVC_OK;
        }
    return kvc__error(KVC_ERR_INVALID_ARG, "unknown KV format '%s' (expected kivi8, kivi4 or none)",
                      name ? name : "(null)");
}

kvc_status kvc_kvfmt_check(const kvc_kvfmt *f) {
    static const char fn[] = "kvc_kvfmt_check";
    KVC_CHECK(f != NULL, "%s: format is NULL", fn);
    const int64_t H = f->num_kv_heads, Dh = f->head_dim, P = f->page_size, G = f->group;
    KVC_CHECK(f->bits == 8 || f->bits == 4, "%s: bits %d (expected 8 or 4)", fn, (int)f->bits);
    KVC_CHECK(H >= 1 && Dh >= 1 && P >= 1 && G >= 1 && f->v_group >= 1,
              "%s: num_kv_heads %lld, head_dim %lld, page_size %lld, group %lld and v_group %d "
              "must be >= 1", fn, (long long)H, (long long)Dh, (long long)P, (long long)G,
              (int)f->v_group);
    KVC_CHECK(Dh <= KVC_ATTN_MAX_HEAD_DIM, "%s: head_dim %lld above %d", fn, (long long)Dh,
              KVC_ATTN_MAX_HEAD_DIM);
    /* the append and attention kernels hold a group's rows on the stack */
    KVC_CHECK(G <= 512, "%s: group %lld above 512", fn, (long long)G);
    KVC_CHECK(Dh % f->v_group == 0, "%s: v_group %d does not divide head_dim %lld", fn,
              (int)f->v_group, (long long)Dh);
    KVC_CHECK(P % G == 0 || G % P == 0, "%s: group %lld and page_size %lld: one must divide the "
              "other", fn, (long long)G, (long long)P);
    KVC_CHECK(G <= P || (H * Dh) % (G / P) == 0, "%s: with group %lld > page_size %lld, %lld "
              "pages share a group's K parameters and must divide H * Dh = %lld", fn,
              (long long)G, (long long)P, (long long)(G / P), (long long)(H * Dh));
    KVC_CHECK(f->bits == 8 || (Dh % 2 == 0 && P % 2 == 0), "%s: 4-bit codes need an even "
              "head_dim and page_size (head_dim %lld, page_size %lld)", fn, (long long)Dh,
              (long long)P);
    KVC_CHECK(f->bits == 8 || G >= P || G % 2 == 0, "%s: 4-bit codes with groups smaller than "
              "a page need an even group (got %lld)", fn, (long long)G);
    KVC_CHECK(!f->rotate_v || (Dh & (Dh - 1)) == 0, "%s: the V rotation needs a power-of-two "
              "head_dim (got %lld)", fn, (long long)Dh);
    KVC_CHECK(f->window >= 0 && f->window % G == 0 && f->window <= 4096,
              "%s: window %d must be a multiple of the group %lld in [0, 4096]", fn,
              (int)f->window, (long long)G);
    KVC_CHECK(f->sink >= 0 && f->sink < G && f->sink <= 16,
              "%s: sink %d must be in [0, %lld] (below the group %lld, at most 16)", fn,
              (int)f->sink, (long long)(G - 1 < 16 ? G - 1 : 16), (long long)G);
    KVC_CHECK(f->v_asym == 0 || f->v_asym == 1, "%s: v_asym must be 0 or 1", fn);
    KVC_CHECK(f->rotate_v == 0 || f->rotate_v == 1, "%s: rotate_v must be 0 or 1", fn);
    KVC_CHECK(H * Dh * P <= ((int64_t)1 << 40), "%s: page too large", fn);
    return KVC_OK;
}

kvc_status kvc_kvfmt_make(kvc_kv_format id, int32_t num_kv_heads, int32_t head_dim,
                          int32_t page_size, kvc_kvfmt *out) {
    KVC_CHECK(out != NULL, "kvc_kvfmt_make: out is NULL");
    KVC_CHECK(id == KVC_KVFMT_KIVI8 || id == KVC_KVFMT_KIVI4,
              "kvc_kvfmt_make: %d is not a compressed format (kivi8 %d, kivi4 %d)", (int)id,
              (int)KVC_KVFMT_KIVI8, (int)KVC_KVFMT_KIVI4);
    kvc_kvfmt f;
    memset(&f, 0, sizeof f);
    f.id = id;
    f.bits = id == KVC_KVFMT_KIVI8 ? 8 : 4;
    f.group = 64;
    f.v_group = 64; /* gcd(64, Dh): 64, or the largest power of two dividing Dh */
    while (head_dim > 0 && head_dim % f.v_group) f.v_group /= 2;
    f.v_asym = 1;
    f.rotate_v = id == KVC_KVFMT_KIVI4;
    f.sink = id == KVC_KVFMT_KIVI4; /* position 0 in float16 (appendix B) */
    f.num_kv_heads = num_kv_heads;
    f.head_dim = head_dim;
    f.page_size = page_size;
    kvc_status st = kvc_kvfmt_check(&f);
    if (st != KVC_OK)
        return kvc__error(st, "kvc_kvfmt_make: %s with %d KV heads, head_dim %d, page_size %d: "
                          "%s", k_names[id], (int)num_kv_heads, (int)head_dim, (int)page_size,
                          kvc_last_error());
    *out = f;
    return KVC_OK;
}

kvc__kvfmt_layout kvc__kvfmt_layout_of(const kvc_kvfmt *f) {
    kvc__kvfmt_layout l;
    const size_t H = (size_t)f->num_kv_heads, Dh = (size_t)f->head_dim;
    const size_t P = (size_t)f->page_size, G = (size_t)f->group;
    const size_t codes = H * P * Dh * (size_t)f->bits / 8, vpar = H * P * (Dh / f->v_group) * 2;
    l.k_share = (int64_t)(H * Dh * P / G);
    l.k_codes = 0;
    l.v_codes = codes;
    l.v_scale = 2 * codes;
    l.v_zero = l.v_scale + vpar;
    l.k_scale = l.v_zero + (f->v_asym ? vpar : 0);
    l.k_zero = l.k_scale + (size_t)l.k_share * 2;
    l.page = l.k_zero + (size_t)l.k_share * 2;
    return l;
}

size_t kvc_kvfmt_page_bytes(const kvc_kvfmt *f) {
    if (kvc_kvfmt_check(f) != KVC_OK) {
        kvc_clear_error();
        return 0;
    }
    return kvc__kvfmt_layout_of(f).page;
}

size_t kvc_kvfmt_tail_bytes(const kvc_kvfmt *f) {
    if (kvc_kvfmt_check(f) != KVC_OK) {
        kvc_clear_error();
        return 0;
    }
    return (size_t)2 * (f->group + f->window) * f->num_kv_heads * f->head_dim * 2;
}

size_t kvc_kvfmt_sink_bytes(const kvc_kvfmt *f) {
    if (kvc_kvfmt_check(f) != KVC_OK) {
        kvc_clear_error();
        return 0;
    }
    return (size_t)2 * f->sink * f->num_kv_heads * f->head_dim * 2;
}

void kvc__kvfmt_rotate(float *x, int32_t n) { kvc__kernels()->hadamard(x, n); }

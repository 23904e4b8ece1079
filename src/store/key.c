/* Keys as text (tier.h). */
#include "tier.h"

void kvc__store_key_hex(const kvc_store_key *k, char out[33]) {
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) {
        out[2 * i] = hex[k->b[i] >> 4];
        out[2 * i + 1] = hex[k->b[i] & 15];
    }
    out[32] = 0;
}

/* Built without hiredis: the Redis tier is refused with a message. */
#include "../core/internal.h"
#include "tier.h"

kvc_status kvc__tier_redis_open(const char *url, kvc_tier **out) {
    (void)url; /* not echoed: it may hold a password */
    if (out) *out = NULL;
    return kvc__error(KVC_ERR_UNSUPPORTED,
                      "redis tier: kvcache was built without hiredis (Debian: "
                      "libhiredis-dev; scripts/setup.sh installs it)");
}

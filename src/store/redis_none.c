/* Built without hiredis: the Redis tier is refused with a message. */
#include "../core/internal.h"
#include "tier.h"

kvc_status kvc__tier_redis_open(const char *url, kvc_tier **out) {
    return kvc__tier_redis_open_as(url, NULL, NULL, out);
}

kvc_status kvc__tier_redis_open_as(const char *url, const char *user, const char *pass,
                                   kvc_tier **out) {
    (void)url, (void)user, (void)pass; /* not echoed: they may hold a password */
    if (out) *out = NULL;
    return kvc__error(KVC_ERR_UNSUPPORTED,
                      "redis tier: kvcache was built without hiredis (Debian: "
                      "libhiredis-dev; scripts/setup.sh installs it)");
}

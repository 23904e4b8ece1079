/* Built without libzmq or msgpack-c: the event publisher is refused with a
 * message naming what to install. */
#include "../core/internal.h"
#include "kvcache/store.h"

kvc_store_events_params kvc_store_events_default_params(void) {
    kvc_store_events_params p = {NULL, 10000, (int64_t)64 << 20};
    return p;
}

kvc_status kvc_store_events_open(kvc_store *store, const char *endpoint,
                                 kvc_store_events **out) {
    return kvc_store_events_open_with(store, endpoint, NULL, out);
}

kvc_status kvc_store_events_open_with(kvc_store *store, const char *endpoint,
                                      const kvc_store_events_params *params,
                                      kvc_store_events **out) {
    (void)store, (void)endpoint, (void)params;
    if (out) *out = NULL;
    return kvc__error(KVC_ERR_UNSUPPORTED,
                      "kvc_store_events_open: kvcache was built without libzmq and msgpack-c "
                      "(Debian: libzmq3-dev and libmsgpack-dev; scripts/setup.sh installs "
                      "them)");
}

void kvc_store_events_close(kvc_store_events *ev) { (void)ev; }

kvc_status kvc_store_events_get_stats(kvc_store_events *ev, kvc_store_events_stats *out) {
    (void)ev, (void)out;
    return kvc__error(KVC_ERR_UNSUPPORTED, "kvc_store_events_get_stats: kvcache was built "
                      "without libzmq and msgpack-c");
}

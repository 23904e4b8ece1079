/* Built without libzmq or msgpack-c: the event publisher is refused with a
 * message naming what to install. */
#include "../core/internal.h"
#include "kvcache/store.h"

kvc_status kvc_store_events_open(kvc_store *store, const char *endpoint,
                                 kvc_store_events **out) {
    (void)store, (void)endpoint;
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

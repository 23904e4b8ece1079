/* Status strings, per-thread error messages and version queries. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* One message per thread so concurrent callers never see each other's errors. */
static _Thread_local char tls_msg[512];

const char *kvc_status_str(kvc_status status) {
    switch (status) {
    case KVC_OK: return "ok";
    case KVC_ERR_NOMEM: return "out of memory";
    case KVC_ERR_INVALID_ARG: return "invalid argument";
    case KVC_ERR_NO_SPACE: return "no space left in cache";
    case KVC_ERR_NOT_FOUND: return "not found";
    case KVC_ERR_UNSUPPORTED: return "unsupported";
    case KVC_ERR_IO: return "i/o error";
    case KVC_ERR_CORRUPT: return "corrupt data";
    case KVC_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}

/* Formats into a separate buffer first: callers may pass kvc_last_error()
 * (the buffer written here) as an argument, and vsnprintf with overlapping
 * source and destination is undefined (it garbled such messages). */
kvc_status kvc__error(kvc_status status, const char *fmt, ...) {
    char buf[sizeof tls_msg];
    buf[0] = 0; /* an encoding error leaves it unspecified */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    memcpy(tls_msg, buf, strlen(buf) + 1);
    return status;
}

const char *kvc_last_error(void) { return tls_msg; }

void kvc_clear_error(void) { tls_msg[0] = '\0'; }

unsigned kvc_version_number(void) { return KVC_VERSION_NUMBER; }

const char *kvc_version_string(void) { return KVC_VERSION_STRING; }

/* kvcache version macros. */
#ifndef KVCACHE_VERSION_H
#define KVCACHE_VERSION_H

#define KVC_VERSION_MAJOR 0
#define KVC_VERSION_MINOR 1
#define KVC_VERSION_PATCH 0
/* MAJOR*10000 + MINOR*100 + PATCH, for compile-time comparisons. */
#define KVC_VERSION_NUMBER \
    (KVC_VERSION_MAJOR * 10000 + KVC_VERSION_MINOR * 100 + KVC_VERSION_PATCH)
#define KVC_VERSION_STRING "0.1.0"

#endif

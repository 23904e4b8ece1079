/* Placeholder: replaced by the module's header. */
#ifndef KVCACHE_MLA_H
#define KVCACHE_MLA_H
#include "kvcache/core.h"
#endif

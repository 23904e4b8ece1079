/* Placeholder: replaced by the module's header. */
#ifndef KVCACHE_MODEL_H
#define KVCACHE_MODEL_H
#include "kvcache/core.h"
#endif

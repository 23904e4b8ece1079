/*
 * kvcache: a key/value cache library for LLM inference engines.
 *
 * Umbrella header. Modules:
 *   kvcache/core.h   status codes, dtypes, tensors, ISA dispatch, threads
 *   kvcache/quant.h  float16/bfloat16 conversion, int8/int4 group quantization
 *   kvcache/pmx.h    OpenPPL pmx KeyValueCache operators
 *   kvcache/paged.h  FlashInfer-compatible paged caches: page tables, appends
 *   kvcache/mask.h   packbits / segment_packbits, packed custom masks
 *   kvcache/cache.h  cache manager: page pool, sequences, forks, prefix caching
 *   kvcache/attention.h  decode attention over the caches, state merging
 *   kvcache/prefill.h    prefill attention (single, batched paged/ragged), cascade
 *   kvcache/mla.h        MLA decode over ckv/kpe pages
 *   kvcache/kvfmt.h      compressed paged KV formats (kivi8, kivi4)
 *   kvcache/gguf.h       GGUF reader
 *   kvcache/tokenizer.h  GGUF byte-level BPE tokenizers ("gpt2"), chat templates
 *   kvcache/model.h      model runtime: a GGUF transformer served through the cache
 * Not included: kvcache/store.h (KV store, its own library libkvcache_store).
 *
 * Minimal use (store one token of a float16 batch into an int8 cache):
 *
 *   kvc_pmx_kv_params p = kvc_pmx_kv_default_params();
 *   p.quant_bit = 8;
 *   kvc_status st = kvc_pmx_key_value_cache(&k, &v, &start_pos, &cache, &scale,
 *                                           &p, &key_out, &value_out, NULL);
 *   if (st != KVC_OK) fprintf(stderr, "%s\n", kvc_last_error());
 */
#ifndef KVCACHE_KVCACHE_H
#define KVCACHE_KVCACHE_H

#include "kvcache/version.h"
#include "kvcache/core.h"
#include "kvcache/quant.h"
#include "kvcache/pmx.h"
#include "kvcache/paged.h"
#include "kvcache/mask.h"
#include "kvcache/cache.h"
#include "kvcache/attention.h"
#include "kvcache/prefill.h"
#include "kvcache/mla.h"
#include "kvcache/kvfmt.h"
#include "kvcache/gguf.h"
#include "kvcache/tokenizer.h"
#include "kvcache/model.h"

#endif

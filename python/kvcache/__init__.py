"""kvcache: Python binding (ctypes + numpy) of the kvcache C library.

Modules:
    kvcache.pmx    OpenPPL KeyValueCache operators (static and dynamic batching)
    kvcache.quant  convert / quantize / dequantize (also re-exported here)
    kvcache.paged  FlashInfer-compatible paged caches (re-exported here)
    kvcache.mask   packbits / segment_packbits / packed custom masks (re-exported)
    kvcache.cache  PagedKVCache: page pool, sequences, forks, prefix caching
                   (re-exported)
    kvcache.attention  decode attention over the caches (single request and
                   BatchDecodeWithPagedKVCacheWrapper), merge_state(s)
                   (re-exported)
    kvcache.kvfmt  compressed paged KV formats kivi8/kivi4: KVFormat, KVSeq
                   (re-exported), append and attention (re-exported as
                   kvfmt_append, kvfmt_attention, kvfmt_append_attention)
    kvcache.gguf   GGUFFile: GGUF files through the C reader (re-exported);
                   ggml_dequantize: ggml blocks to float32
    kvcache.gguf_writer  GGUF writer, ggml quantizers (K-quants too), tiny llama models (tests)
    kvcache.prefill  prefill attention: single_prefill_with_kv_cache(_return_lse),
                   BatchPrefillWith{Paged,Ragged}KVCacheWrapper (re-exported)
    kvcache.cascade  MultiLevelCascadeAttentionWrapper (re-exported)
    kvcache.mla    BatchMLAPagedAttentionWrapper: MLA over ckv/kpe pages (re-exported)
    kvcache.tokenizer  Tokenizer: the GGUF's byte-level BPE and chat template
    kvcache.model  Model (GGUF llama through the cache), Engine (continuous
                   batching) (both re-exported), sample
    kvcache.store  KVStore: K/V pages that outlive the process (dir, Redis),
                   used by Model.generate / Engine (kv_store=) and
                   PagedKVCache.save_to_store / restore_from_store; the
                   store_* functions of the format (re-exported). Needs
                   libkvcache_store, loaded on first use

The shared library is found through the environment variable
``KVCACHE_LIBRARY``, else the repository's ``build/libkvcache.so``, else the
system library path. C errors are raised as :class:`KvcacheError` subclasses
carrying the library's message (``InvalidArgumentError`` is also a
``ValueError``). Arrays given as ``out=``/``lse=`` must not share memory with
the call's inputs (not checked; as in C, core.h).
"""

from __future__ import annotations

from . import _lib
from .core import (
    ISA_NAMES,
    best_isa,
    get_isa,
    isa_supported,
    set_isa,
    supported_isas,
    version,
    version_number,
)
from .errors import (
    CorruptError,
    InternalError,
    InvalidArgumentError,
    KvcacheError,
    KvcacheIOError,
    NoSpaceError,
    NotFoundError,
    OutOfMemoryError,
    UnsupportedError,
)
from .quant import convert, dequantize, quantize
from .paged import (
    append_paged_kv_cache,
    append_paged_mla_kv_cache,
    get_batch_indices_positions,
    get_seq_lens,
    page_table_to_pmx,
    pmx_to_page_table,
)
from .mask import build_packed_custom_mask, packbits, segment_packbits
from .cache import PagedKVCache
from .attention import (
    BatchDecodeWithPagedKVCacheWrapper,
    merge_state,
    merge_state_in_place,
    merge_states,
    single_decode_with_kv_cache,
)
from .prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)
from .cascade import MultiLevelCascadeAttentionWrapper
from .mla import BatchMLAPagedAttentionWrapper
from .kvfmt import KVFormat, KVSeq
from .kvfmt import append as kvfmt_append
from .kvfmt import attention as kvfmt_attention
from .kvfmt import append_attention as kvfmt_append_attention
from . import kvfmt  # noqa: E402  (re-exported submodule)
from .tokenizer import Tokenizer, Utf8Stream, render_chat_template
from . import pmx  # noqa: E402  (re-exported submodule)
from .gguf import GGUFFile  # noqa: E402
from .model import Engine, GenerateOutput, Model  # noqa: E402
from .store import (  # noqa: E402  (loads libkvcache_store only when used)
    KVStore,
    StoreMissError,
    StoreTimeoutError,
    StoreUnavailableError,
    store_available,
    store_gguf_digests,
    store_model_namespace,
    store_namespace,
    store_object_bytes,
    store_page_keys,
    store_restore_page,
    store_serialize_page,
    store_verify_object,
)

__version__ = version()
library_path = _lib.library_path

__all__ = [
    "__version__",
    "library_path",
    "ISA_NAMES",
    "best_isa",
    "get_isa",
    "isa_supported",
    "set_isa",
    "supported_isas",
    "version",
    "version_number",
    "convert",
    "quantize",
    "dequantize",
    "pmx",
    "get_seq_lens",
    "get_batch_indices_positions",
    "append_paged_kv_cache",
    "append_paged_mla_kv_cache",
    "page_table_to_pmx",
    "pmx_to_page_table",
    "packbits",
    "segment_packbits",
    "build_packed_custom_mask",
    "PagedKVCache",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "single_decode_with_kv_cache",
    "BatchDecodeWithPagedKVCacheWrapper",
    "Tokenizer",
    "Utf8Stream",
    "render_chat_template",
    "BatchMLAPagedAttentionWrapper",
    "kvfmt",
    "KVFormat",
    "KVSeq",
    "kvfmt_append",
    "kvfmt_attention",
    "kvfmt_append_attention",
    "GGUFFile",
    "Model",
    "Engine",
    "GenerateOutput",
    "KVStore",
    "StoreMissError",
    "StoreTimeoutError",
    "StoreUnavailableError",
    "store_available",
    "store_gguf_digests",
    "store_model_namespace",
    "store_namespace",
    "store_object_bytes",
    "store_page_keys",
    "store_restore_page",
    "store_serialize_page",
    "store_verify_object",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "KvcacheError",
    "InvalidArgumentError",
    "UnsupportedError",
    "OutOfMemoryError",
    "NoSpaceError",
    "NotFoundError",
    "KvcacheIOError",
    "CorruptError",
    "InternalError",
]

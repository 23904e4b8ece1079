"""FlashInfer-compatible paged KV caches (being written)."""

def _pending(*args, **kwargs):
    raise NotImplementedError("kvcache.paged is being written")

get_seq_lens = get_batch_indices_positions = append_paged_kv_cache = _pending
append_paged_mla_kv_cache = page_table_to_pmx = pmx_to_page_table = _pending

"""Bit packing for attention masks (being written)."""

def _pending(*args, **kwargs):
    raise NotImplementedError("kvcache.mask is being written")

packbits = segment_packbits = build_packed_custom_mask = _pending

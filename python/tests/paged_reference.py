"""numpy reference of the FlashInfer-compatible paged layout, written from
shared/docs/SEMANTICS.md section 4 (not from the C code), plus scenario
builders for the paged tests. Quantized stores reuse kvc_reference.Storage
(SEMANTICS section 1).
"""

from __future__ import annotations

import numpy as np

import kvc_reference as ref

# ---------------------------------------------------------------------------
# Page tables


def seq_lens(kv_indptr, kv_last_page_len, page_size):
    """page_size * (pages_b - 1) + last_page_len_b; 0 for a request without pages."""
    out = []
    for b in range(len(kv_last_page_len)):
        pages = int(kv_indptr[b + 1]) - int(kv_indptr[b])
        out.append(0 if pages == 0 else page_size * (pages - 1) + int(kv_last_page_len[b]))
    return np.array(out, np.int32)


def batch_indices_positions(append_indptr, lens):
    """batch_indices[j] = b, positions[j] = seq_lens[b] - (append_indptr[b+1] - j)."""
    bi, pos = [], []
    for b in range(len(append_indptr) - 1):
        for j in range(int(append_indptr[b]), int(append_indptr[b + 1])):
            bi.append(b)
            pos.append(int(lens[b]) - (int(append_indptr[b + 1]) - j))
    return np.array(bi, np.int32), np.array(pos, np.int32)


def page_and_slot(kv_indices, kv_indptr, page_size, b, pos):
    """Row at position pos of request b -> (page id, slot in the page)."""
    return int(kv_indices[int(kv_indptr[b]) + pos // page_size]), pos % page_size


def row_index(layout, page, slot, h):
    """Index of one (token, head) row in a 4-D K or V page array."""
    return (page, slot, h) if layout == "NHD" else (page, h, slot)


# ---------------------------------------------------------------------------
# Appends (per token, per head)


def append_paged_kv_cache(key, value, batch_indices, positions, k_cache, v_cache, kv_indices,
                          kv_indptr, page_size, layout, *, k_scale=None, v_scale=None,
                          quant_bit=0, quant_group=8):
    """Mutates k_cache/v_cache (4-D views) and k_scale/v_scale in place."""
    st = ref.Storage(quant_bit, quant_group)
    key, value = np.asarray(key), np.asarray(value)
    for j in range(key.shape[0]):
        page, slot = page_and_slot(kv_indices, kv_indptr, page_size, int(batch_indices[j]),
                                   int(positions[j]))
        for h in range(key.shape[1]):
            idx = row_index(layout, page, slot, h)
            st.store(k_cache, k_scale, idx, key[j, h])
            st.store(v_cache, v_scale, idx, value[j, h])


def append_paged_mla_kv_cache(ckv, kpe, batch_indices, positions, ckv_cache, kpe_cache,
                              kv_indices, kv_indptr, page_size):
    for j in range(ckv.shape[0]):
        page, slot = page_and_slot(kv_indices, kv_indptr, page_size, int(batch_indices[j]),
                                   int(positions[j]))
        ckv_cache[page, slot] = np.asarray(ckv[j]).astype(ckv_cache.dtype)
        kpe_cache[page, slot] = np.asarray(kpe[j]).astype(kpe_cache.dtype)


def page_table_to_pmx(kv_indptr, kv_indices, page_size, max_p):
    b = len(kv_indptr) - 1
    out = np.full((b, max_p), -1, np.int64)
    for i in range(b):
        for j in range(int(kv_indptr[i + 1]) - int(kv_indptr[i])):
            out[i, j] = int(kv_indices[int(kv_indptr[i]) + j]) * page_size
    return out


# ---------------------------------------------------------------------------
# Scenarios


class Batch:
    """A ragged append into a paged cache: old lengths, appended lengths, the
    page table that already includes the new tokens, and the rows' targets.

    Page ids are a random sample of range(max_pages), so unused pages exist."""

    def __init__(self, rng, page_size, old_lens, new_lens, spare_pages=3):
        self.page_size = page_size
        self.old_lens = np.array(old_lens, np.int64)
        self.app_lens = np.array(new_lens, np.int64)
        self.B = len(old_lens)
        self.seq_lens = (self.old_lens + self.app_lens).astype(np.int32)
        pages = [-(-int(n) // page_size) for n in self.seq_lens]
        self.kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        self.total_pages = int(self.kv_indptr[-1])
        self.max_pages = self.total_pages + spare_pages
        self.kv_indices = rng.permutation(self.max_pages)[:self.total_pages].astype(np.int32)
        self.kv_last_page_len = np.array(
            [0 if p == 0 else int(n) - page_size * (p - 1) for p, n in zip(pages, self.seq_lens)],
            np.int32)
        self.append_indptr = np.concatenate([[0], np.cumsum(self.app_lens)]).astype(np.int32)
        self.nnz = int(self.append_indptr[-1])
        self.batch_indices, self.positions = batch_indices_positions(self.append_indptr,
                                                                     self.seq_lens)

    def table(self):
        return self.kv_indices, self.kv_indptr, self.kv_last_page_len


def mixed_batch(rng, page_size, n_req=6, max_prefill=40):
    """Prefill + decode mix with empty requests: request kinds cycle through
    empty (0 old, 0 new), decode (many old, 1 new), prefill (0 old, many new),
    chunked prefill (some old, some new), idle (old tokens, 0 new)."""
    old, new = [], []
    for i in range(n_req):
        kind = i % 5
        if kind == 0:
            o, n = 0, 0
        elif kind == 1:
            o, n = int(rng.integers(1, 3 * page_size + 3)), 1
        elif kind == 2:
            o, n = 0, int(rng.integers(1, max_prefill))
        elif kind == 3:
            o, n = int(rng.integers(1, 2 * page_size + 2)), int(rng.integers(2, max_prefill))
        else:
            o, n = int(rng.integers(1, page_size + 2)), 0
        old.append(o)
        new.append(n)
    return Batch(rng, page_size, old, new)

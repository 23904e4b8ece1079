"""Compressed paged KV formats kivi8 and kivi4 (docs/KV_FORMATS.md;
include/kvcache/kvfmt.h).

K is quantized per channel over groups of ``G`` consecutive tokens of a
sequence, V per token over groups of ``gv`` channels (kivi4: after a Hadamard
rotation of each head's V). Tokens not yet in a complete group stay in a
per-sequence float16 *tail*, K and V alike. The first ``S`` positions (kivi4:
position 0, the attention sink) stay in float16 for good, in *sink rows*
``(2, S, H, Dh)`` that go with the sequence's first page: sequences sharing
that page share them.

- :class:`KVFormat`: a format's parameters for one geometry,
  ``KVFormat.member("kivi4", num_kv_heads, head_dim, page_size)``, with
  ``page_bytes`` (one page of one layer) and ``tail_bytes``.
- :class:`KVSeq`: one sequence of one layer as the kernels see it: its page
  ids (int32), its length ``n_kv`` and its tail, a float16 numpy array
  ``(2, G + W, H, Dh)`` (K then V; slot ``t % (G + W)`` holds position ``t``) that
  :func:`append` updates in place, and (kivi4) its sink rows.
- :func:`append` stores K/V rows of several sequences; :func:`attention`
  attends over them (decode or causal prefill).

Storage of one layer is a uint8 numpy array ``(num_pages, page_bytes)``
(row stride free, bytes contiguous), updated in place and never copied.
Every argument is validated before anything is written: a failing call raises
:class:`kvcache.InvalidArgumentError` and leaves pages and tails unchanged.
The bytes written depend only on the tokens' float16 K/V: not on the batch,
the rows per call, the thread count (``num_threads=None``: every CPU) or the
ISA.
"""

from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass, field

import numpy as np

from . import _lib
from .attention import _attn_params
from .errors import InvalidArgumentError

__all__ = ["KVFormat", "KVSeq", "append", "attention", "MEMBERS"]

MEMBERS = ("kivi8", "kivi4")

_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)
_byref = ctypes.byref


def _format_id(name) -> int:
    if not isinstance(name, str):
        raise InvalidArgumentError(f"format name must be a string, got {name!r}")
    out = ctypes.c_int(0)
    _lib.check(_lib.kvc_kv_format_from_name(name.encode("utf-8", "replace"), _byref(out)))
    return out.value


@dataclass(frozen=True)
class KVFormat:
    """A compressed KV format's parameters for one cache geometry (section 1).

    Use :meth:`member` for kivi8/kivi4; the constructor takes a custom tuple
    (``name="custom"``), checked by ``kvc_kvfmt_check``.

    Attributes:
        bits: 8 or 4, the width of K and V codes.
        group: ``G``, tokens per K group.
        v_group: ``gv``, V channels per scale.
        v_asym: True: V has a scale and a zero point; False: scale only.
        rotate_v: True: V is Hadamard-rotated before it is stored.
        num_kv_heads, head_dim, page_size: ``H``, ``Dh``, ``P``.
        window: ``W``, positions of complete groups before a query's own
            group that it still reads in float16 (a multiple of G).
        sink: ``S`` in [0, min(G - 1, 16)], positions [0, S) kept in float16
            (sink rows) and left out of group 0's K statistics (kivi4: 1).
        name: "kivi8", "kivi4" or "custom".
        page_bytes: bytes of one page of one layer.
        tail_bytes: bytes of one sequence's tail of one layer (``2*(G+W)*H*Dh*2``).
        sink_bytes: bytes of one sequence's sink rows of one layer (``2*S*H*Dh*2``).
    """

    bits: int
    group: int
    v_group: int
    v_asym: bool
    rotate_v: bool
    num_kv_heads: int
    head_dim: int
    page_size: int
    window: int = 0
    name: str = "custom"
    sink: int = 0
    page_bytes: int = field(init=False)
    tail_bytes: int = field(init=False)
    sink_bytes: int = field(init=False)
    _c: _lib.KvFmt = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        c = _lib.KvFmt()
        if self.name == "custom":
            c.id = _lib.KVC_KVFMT_NONE
        elif self.name in MEMBERS:
            c.id = _lib.KVC_KVFMT_KIVI8 if self.name == "kivi8" else _lib.KVC_KVFMT_KIVI4
        else:
            raise InvalidArgumentError(f"KVFormat name must be 'custom' (or a member's, from "
                                       f"KVFormat.member), got {self.name!r}")
        for attr in ("bits", "group", "v_group", "num_kv_heads", "head_dim", "page_size",
                     "window", "sink"):
            v = _lib.int32_attr(getattr(self, attr), attr)
            object.__setattr__(self, attr, v)
            setattr(c, attr, v)
        for attr in ("v_asym", "rotate_v"):
            v = _lib.flag(getattr(self, attr), attr)
            object.__setattr__(self, attr, v)
            setattr(c, attr, int(v))
        _lib.check(_lib.kvc_kvfmt_check(_byref(c)))
        if c.id != _lib.KVC_KVFMT_NONE:
            m = _lib.KvFmt()
            _lib.check(_lib.kvc_kvfmt_make(c.id, c.num_kv_heads, c.head_dim, c.page_size,
                                           _byref(m)))
            if bytes(m) != bytes(c):
                raise InvalidArgumentError(f"these parameters are not {self.name}'s; use "
                                           f"KVFormat.member or name='custom'")
        object.__setattr__(self, "_c", c)
        object.__setattr__(self, "page_bytes", int(_lib.kvc_kvfmt_page_bytes(_byref(c))))
        object.__setattr__(self, "tail_bytes", int(_lib.kvc_kvfmt_tail_bytes(_byref(c))))
        object.__setattr__(self, "sink_bytes", int(_lib.kvc_kvfmt_sink_bytes(_byref(c))))

    @classmethod
    def member(cls, name: str, num_kv_heads: int, head_dim: int, page_size: int) -> "KVFormat":
        """The member ``name`` ("kivi8" or "kivi4", any case) for H KV heads
        of Dh channels and pages of P tokens (``gv`` capped at Dh).

        Raises:
            InvalidArgumentError: an unknown name, or a geometry the format
                cannot hold (kivi4: Dh a power of two, even P; G = 64 and P:
                one divides the other; ...).
        """
        fid = _format_id(name)
        c = _lib.KvFmt()
        _lib.check(_lib.kvc_kvfmt_make(
            fid, _lib.int32_attr(num_kv_heads, "num_kv_heads"),
            _lib.int32_attr(head_dim, "head_dim"), _lib.int32_attr(page_size, "page_size"),
            _byref(c)))
        return cls(c.bits, c.group, c.v_group, bool(c.v_asym), bool(c.rotate_v),
                   c.num_kv_heads, c.head_dim, c.page_size, c.window,
                   _lib.kvc_kv_format_name(c.id).decode(), c.sink)

    @property
    def tail_shape(self) -> tuple:
        """(2, G + W, H, Dh): a sequence's tail, K then V; slot t % (G + W)
        holds position t."""
        return (2, self.group + self.window, self.num_kv_heads, self.head_dim)

    @property
    def sink_shape(self) -> tuple:
        """(2, S, H, Dh): a sequence's sink rows, K then V; row i holds
        position i."""
        return (2, self.sink, self.num_kv_heads, self.head_dim)

    def new_sink(self):
        """Zeroed float16 sink rows (2, S, H, Dh), or None when S is 0."""
        return np.zeros(self.sink_shape, _F16) if self.sink else None

    def new_pages(self, num_pages: int) -> np.ndarray:
        """A zeroed uint8 page array (num_pages, page_bytes)."""
        return np.zeros((operator.index(num_pages), self.page_bytes), _U8)

    def new_tail(self) -> np.ndarray:
        """A zeroed float16 tail (2, G + W, H, Dh)."""
        return np.zeros(self.tail_shape, _F16)

    def new_seq(self, pages, n_kv: int = 0) -> "KVSeq":
        """A KVSeq with the given page ids and length, a new zeroed tail and
        (S > 0) new zeroed sink rows."""
        return KVSeq(pages, n_kv, self.new_tail(), self.new_sink())


@dataclass(eq=False)
class KVSeq:
    """One sequence of one layer (``kvc_kvfmt_seq``).

    Attributes:
        pages: int32 page ids of positions ``[0, n_kv)``: at least
            ``ceil(n_kv / page_size)`` entries (more are allowed and not
            read). Converted to a C-contiguous int32 array (copied if needed).
        n_kv: tokens stored, *counting those of the current append*: before
            :func:`append`, add the rows it brings (the caller owns it).
        tail: float16 numpy array (2, G + W, H, Dh), C-contiguous; updated in
            place by :func:`append` (never copied).
        sink: float16 numpy array (2, S, H, Dh), C-contiguous, when the
            format keeps sink rows (S > 0), else None; :func:`append` writes
            row i when it stores position i. Sequences that share their first
            page must share (or hold equal) sink rows.
    """

    pages: np.ndarray
    n_kv: int
    tail: np.ndarray
    sink: np.ndarray | None = None

    def __post_init__(self):
        self.pages = _pages_ids(self.pages)
        self.n_kv = _n_kv(self.n_kv)


def _pages_ids(x) -> np.ndarray:
    arr = _lib.int32_array(x, "KVSeq.pages")
    if arr.ndim != 1:
        raise InvalidArgumentError(f"KVSeq.pages must be 1-D, got shape {arr.shape}")
    return arr


def _n_kv(x) -> int:
    try:
        n = operator.index(x)
    except TypeError as exc:
        raise InvalidArgumentError(f"KVSeq.n_kv must be an integer, got {x!r}") from exc
    if n < 0 or n >= 2**62:
        raise InvalidArgumentError(f"KVSeq.n_kv must be >= 0, got {n}")
    return n


def _check_fmt(fmt) -> KVFormat:
    if not isinstance(fmt, KVFormat):
        raise InvalidArgumentError(f"fmt must be a KVFormat, got {type(fmt).__name__}")
    return fmt


def _seqs(fmt: KVFormat, seqs, writable: bool):
    """(ctypes array of kvc_kvfmt_seq, arrays to keep alive, n) for seqs."""
    if isinstance(seqs, KVSeq):
        seqs = [seqs]
    try:
        seqs = list(seqs)
    except TypeError as exc:
        raise InvalidArgumentError(f"seqs must be a list of KVSeq, got "
                                   f"{type(seqs).__name__}") from exc
    n = len(seqs)
    arr = (_lib.KvFmtSeq * max(n, 1))()
    keep = []
    P = fmt.page_size
    shape = fmt.tail_shape
    for i, s in enumerate(seqs):
        if not isinstance(s, KVSeq):
            raise InvalidArgumentError(f"seqs[{i}] must be a KVSeq, got {type(s).__name__}")
        n_kv = _n_kv(s.n_kv)
        pages = _pages_ids(s.pages)
        need = -(-n_kv // P)
        if pages.shape[0] < need:
            raise InvalidArgumentError(f"seqs[{i}]: {pages.shape[0]} page ids for n_kv {n_kv} "
                                       f"(page_size {P}: {need} needed)")
        tail = s.tail
        if not isinstance(tail, np.ndarray):
            raise InvalidArgumentError(f"seqs[{i}].tail must be a numpy float16 array "
                                       f"{shape}, got {type(tail).__name__}")
        if tail.dtype != _F16 or tail.shape != shape:
            raise InvalidArgumentError(f"seqs[{i}].tail must be float16 {shape}, got "
                                       f"{tail.dtype} {tail.shape}")
        if not (tail.flags.c_contiguous and tail.flags.aligned):
            raise InvalidArgumentError(f"seqs[{i}].tail must be C-contiguous and aligned (it is "
                                       f"{'updated' if writable else 'read'} in place)")
        if writable and not tail.flags.writeable:
            raise InvalidArgumentError(f"seqs[{i}].tail is not writeable (it is updated in "
                                       f"place)")
        keep += [pages, tail]
        arr[i].pages = ctypes.cast(_lib.data_ptr(pages), ctypes.POINTER(ctypes.c_int32))
        arr[i].n_kv = n_kv
        arr[i].tail = ctypes.cast(_lib.data_ptr(tail), ctypes.POINTER(ctypes.c_uint16))
        sink = s.sink
        if fmt.sink == 0:
            if sink is not None:
                raise InvalidArgumentError(f"seqs[{i}].sink must be None: the format keeps no "
                                           f"sink rows")
            continue
        sshape = fmt.sink_shape
        if not isinstance(sink, np.ndarray) or sink.dtype != _F16 or sink.shape != sshape:
            raise InvalidArgumentError(f"seqs[{i}].sink must be float16 {sshape} (the format "
                                       f"keeps position 0 in float16), got "
                                       f"{getattr(sink, 'dtype', type(sink).__name__)} "
                                       f"{getattr(sink, 'shape', '')}")
        if not (sink.flags.c_contiguous and sink.flags.aligned) or \
                (writable and not sink.flags.writeable):
            raise InvalidArgumentError(f"seqs[{i}].sink must be C-contiguous, aligned and "
                                       f"{'writeable' if writable else 'readable'} in place")
        keep.append(sink)
        arr[i].sink = ctypes.cast(_lib.data_ptr(sink), ctypes.POINTER(ctypes.c_uint16))
    return arr, keep, n


def _pages_tensor(fmt: KVFormat, pages, writable: bool):
    a, t = _lib.inplace_tensor(pages, "pages", writable)
    if a.dtype != _U8 or a.ndim != 2 or a.shape[1] != fmt.page_bytes:
        raise InvalidArgumentError(f"pages must be uint8 (num_pages, {fmt.page_bytes}) (the "
                                   f"format's page_bytes), got {a.dtype} {a.shape}")
    return a, t


def append(fmt, pages, seqs, row_indptr, key, value, num_threads=None) -> None:
    """Stores K/V rows of several sequences (``kvc_kvfmt_append``).

    Rows ``[row_indptr[b], row_indptr[b+1])`` of key/value are positions
    ``n_kv - count .. n_kv - 1`` of ``seqs[b]`` (``count`` the rows of b,
    ``seqs[b].n_kv`` already counting them). Each row goes to the tail
    (float16, V rotated first when the format rotates), rows of positions
    below S also to the sink rows; each K group the rows complete is
    quantized into its pages.

    Args:
        fmt: a :class:`KVFormat`.
        pages: uint8 (num_pages, page_bytes), updated in place.
        seqs: list of :class:`KVSeq` (or one); their tails are updated in
            place. Distinct sequences must not share a page of a group they
            complete.
        row_indptr: (len(seqs) + 1) ints, starts at 0, non-decreasing.
        key, value: (row_indptr[-1], H, Dh) float32, float16 or bfloat16,
            same dtype; row and head strides free.
        num_threads: worker threads (None: all CPUs); the bytes do not depend
            on it.

    Raises:
        InvalidArgumentError: bad shapes, page ids outside [0, num_pages),
            a NaN, an infinity or a value beyond float16's range (after the
            rotation). Nothing is written then.
    """
    fmt = _check_fmt(fmt)
    pa, pt = _pages_tensor(fmt, pages, True)
    sarr, keep, n = _seqs(fmt, seqs, True)
    rows = _store_args(n, row_indptr, key, value, keep)
    _lib.call_pooled(_lib.kvc_kvfmt_append, (_byref(fmt._c), _byref(pt), sarr, n) + rows,
                     num_threads)
    del pa, keep


def _store_args(n, row_indptr, key, value, keep):
    """(row_indptr pointer, key tensor, value tensor) of a store over n
    sequences; the arrays behind them go to keep."""
    indptr = _lib.int64_array(row_indptr, "row_indptr")
    if indptr.shape != (n + 1,):
        raise InvalidArgumentError(f"row_indptr must be 1-D (len(seqs) + 1) = ({n + 1},), got "
                                   f"shape {indptr.shape}")
    ka, kt = _lib.input_tensor(key, "key", _lib.FLOAT_CODES)
    va, vt = _lib.input_tensor(value, "value", _lib.FLOAT_CODES)
    keep += [indptr, ka, va]
    return indptr.ctypes.data_as(_lib._i64p), _byref(kt), _byref(vt)


def attention(fmt, pages, seqs, q, q_seq, q_pos, sm_scale=None, return_lse=False,
              num_threads=None):
    """Attention over sequences stored in format fmt (``kvc_kvfmt_attention``).

    Query row i of ``seqs[q_seq[i]]`` at position ``p = q_pos[i]`` attends
    keys ``[0, p]`` of it (causal) as a decode step at p would: positions
    before ``max(0, (p + 1) // G * G - W)`` from the pages, dequantized (the
    sink positions ``[0, S)`` from the sink rows), the rest in float16 from
    the tail. So p must still have them in the tail:
    ``p + 1 >= n_kv // G * G`` (use :func:`append_attention` for the rows of
    a store). Query head h reads KV
    head ``h // (Hq // H)``. Scores and softmax in float32 (or wider); with
    rotate_v the output is rotated back.

    Args:
        fmt: a :class:`KVFormat`.
        pages: uint8 (num_pages, page_bytes) (read only).
        seqs: list of :class:`KVSeq` (or one) (read only).
        q: (nq, Hq, Dh) float32, float16 or bfloat16 (converted to float32,
            exactly). Hq % H == 0.
        q_seq: (nq) ints in [0, len(seqs)); q_pos: (nq) ints in
            [max(0, n_kv // G * G - 1), n_kv) of their sequence.
        sm_scale: None (1/sqrt(Dh)) or a finite positive number.
        return_lse: also return lse.
        num_threads: worker threads (None: all CPUs); the result does not
            depend on it.

    Returns:
        o (nq, Hq, Dh) of q's dtype (computed in float32), and with
        return_lse, lse (nq, Hq) float32: log2 of the softmax denominator of
        the scaled scores.
    """
    return _attend(fmt, pages, seqs, None, None, None, q, q_seq, q_pos, sm_scale, return_lse,
                   num_threads)


def append_attention(fmt, pages, seqs, row_indptr, key, value, q, q_seq, q_pos,
                     sm_scale=None, return_lse=False, num_threads=None):
    """:func:`append`, then :func:`attention`, in one call
    (``kvc_kvfmt_append_attention``), as a model's forward step does: each
    query reads what a decode at its position would, its float16 values
    coming from these rows and the tail as it was before the store. A query
    may be at any position p of its sequence with ``p + 1 >= pos0 // G * G``
    (pos0 the sequence's first appended position): every appended position
    qualifies. Nothing is written when either part would fail."""
    return _attend(fmt, pages, seqs, row_indptr, key, value, q, q_seq, q_pos, sm_scale,
                   return_lse, num_threads)


def _attend(fmt, pages, seqs, row_indptr, key, value, q, q_seq, q_pos, sm_scale, return_lse,
            num_threads):
    fmt = _check_fmt(fmt)
    store = key is not None
    return_lse = _lib.flag(return_lse, "return_lse")
    pa, pt = _pages_tensor(fmt, pages, store)
    sarr, keep, n = _seqs(fmt, seqs, store)
    rows = _store_args(n, row_indptr, key, value, keep) if store else None
    qa = _lib.input_array(q, "q", _lib.FLOAT_CODES)
    if qa.ndim != 3:
        raise InvalidArgumentError(f"q must be (nq, Hq, Dh), got shape {qa.shape}")
    q32 = qa if qa.dtype == _F32 else qa.astype(_F32)
    nq = q32.shape[0]
    qs = _lib.int32_array(q_seq, "q_seq")
    qp = _lib.int32_array(q_pos, "q_pos")
    for name, a in (("q_seq", qs), ("q_pos", qp)):
        if a.shape != (nq,):
            raise InvalidArgumentError(f"{name} must be 1-D (nq) = ({nq},), got shape "
                                       f"{a.shape}")
    params = _attn_params(sm_scale, None, -1)
    out = np.empty(q32.shape, _F32)
    lse = np.empty(q32.shape[:2], _F32) if return_lse else None
    mt = _lib.make_tensor
    qt, ot = mt(q32), mt(out)
    lt = mt(lse) if return_lse else None
    i32p = ctypes.POINTER(ctypes.c_int32)
    tail = (_byref(qt), qs.ctypes.data_as(i32p), qp.ctypes.data_as(i32p), _byref(params),
            _byref(ot), _byref(lt) if lt is not None else None)
    if store:
        _lib.call_pooled(_lib.kvc_kvfmt_append_attention,
                         (_byref(fmt._c), _byref(pt), sarr, n) + rows + tail, num_threads)
    else:
        _lib.call_pooled(_lib.kvc_kvfmt_attention, (_byref(fmt._c), _byref(pt), sarr, n) + tail,
                         num_threads)
    del pa, keep
    if qa.dtype != _F32:
        out = out.astype(qa.dtype)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------
# FlashInfer-style entry points (paged.append_paged_kv_cache and the batch
# decode wrapper take a compressed cache as a ``(pages, tails)`` pair, or a
# ``(pages, tails, sinks)`` triple for a format with sink rows)


def is_compressed_cache(paged_kv_cache) -> bool:
    """Whether paged_kv_cache is a compressed-format ``(pages, tails)`` pair
    or ``(pages, tails, sinks)`` triple: pages uint8 (max_pages, page_bytes),
    tails float16 (B, 2, G + W, H, Dh), sinks float16 (B, 2, S, H, Dh)."""
    if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) not in (2, 3):
        return False
    a, b = paged_kv_cache[:2]
    return (isinstance(a, np.ndarray) and a.dtype == _U8 and a.ndim == 2 and
            isinstance(b, np.ndarray) and b.dtype == _F16 and b.ndim == 5 and
            (len(paged_kv_cache) == 2 or (isinstance(paged_kv_cache[2], np.ndarray) and
                                          paged_kv_cache[2].ndim == 5)))


def cache_parts(fmt, paged_kv_cache):
    """(pages, tails, sinks) of a compressed cache for fmt: sinks None for a
    format without sink rows; a format with them needs the triple."""
    parts = tuple(paged_kv_cache)
    if fmt.sink and len(parts) != 3:
        raise InvalidArgumentError(f"a {fmt.name} cache is a (pages, tails, sinks) triple: "
                                   f"{fmt.name} keeps position 0 in float16, sinks float16 "
                                   f"(B, {', '.join(map(str, fmt.sink_shape))})")
    if not fmt.sink and len(parts) != 2:
        raise InvalidArgumentError(f"a {fmt.name} cache is a (pages, tails) pair (the format "
                                   f"keeps no sink rows)")
    return parts[0], parts[1], parts[2] if fmt.sink else None


def seqs_from_table(fmt, tails, kv_indptr, kv_indices, kv_last_page_len, sinks=None):
    """KVSeqs of a CSR page table (request b: pages kv_indices[kv_indptr[b]:
    kv_indptr[b+1]], length page_size * (pages - 1) + kv_last_page_len[b]) over
    tails (B, 2, G + W, H, Dh) float16, tails[b] request b's (updated in place),
    and for a format with sink rows sinks (B, 2, S, H, Dh) float16."""
    fmt = _check_fmt(fmt)
    ip = _lib.int64_array(kv_indptr, "kv_indptr").reshape(-1)
    ix = _lib.int32_array(kv_indices, "kv_indices").reshape(-1)
    last = _lib.int64_array(kv_last_page_len, "kv_last_page_len").reshape(-1)
    B = last.shape[0]
    if ip.shape != (B + 1,) or (B and ip[0] != 0) or np.any(np.diff(ip) < 0) or \
            (B and ip[-1] != ix.shape[0]):
        raise InvalidArgumentError(f"kv_indptr must be ({B + 1},), start at 0, not decrease "
                                   f"and end at len(kv_indices) = {ix.shape[0]}")
    if not isinstance(tails, np.ndarray) or tails.shape != (B,) + fmt.tail_shape or \
            tails.dtype != _F16:
        raise InvalidArgumentError(f"tails must be float16 {(B,) + fmt.tail_shape}, got "
                                   f"{getattr(tails, 'dtype', type(tails))} "
                                   f"{getattr(tails, 'shape', '')}")
    if fmt.sink and (not isinstance(sinks, np.ndarray) or sinks.dtype != _F16 or
                     sinks.shape != (B,) + fmt.sink_shape):
        raise InvalidArgumentError(f"sinks must be float16 {(B,) + fmt.sink_shape}, got "
                                   f"{getattr(sinks, 'dtype', type(sinks))} "
                                   f"{getattr(sinks, 'shape', '')}")
    P = fmt.page_size
    seqs = []
    for b in range(B):
        n_pages = int(ip[b + 1] - ip[b])
        lp = int(last[b])
        if (n_pages == 0 and lp != 0) or (n_pages > 0 and not 1 <= lp <= P):
            raise InvalidArgumentError(f"kv_last_page_len[{b}] = {lp} outside [1, {P}] "
                                       f"(request {b} has {n_pages} pages)")
        n = P * (n_pages - 1) + lp if n_pages else 0
        seqs.append(KVSeq(ix[ip[b]:ip[b + 1]], n, tails[b], sinks[b] if fmt.sink else None))
    return seqs


def page_size_of(name, num_kv_heads, head_dim, page_bytes) -> int:
    """The page size of member ``name`` whose pages are ``page_bytes`` long."""
    one = KVFormat.member(name, num_kv_heads, head_dim, 64)  # a valid geometry
    per_token = one.page_bytes // 64
    if page_bytes % per_token:
        raise InvalidArgumentError(f"pages of {page_bytes} bytes are not {name} pages of "
                                   f"{num_kv_heads} heads x {head_dim} ({per_token} bytes "
                                   f"per token)")
    return page_bytes // per_token

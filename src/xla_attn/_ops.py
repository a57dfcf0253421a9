"""Framework-neutral checks and normalisation for every op.

Each `*_spec` function looks only at shapes, dtypes and Python arguments (anything
with `.shape` and `.dtype`: jax arrays and tracers, torch tensors, numpy arrays),
raises a ValueError/TypeError that names the argument and what was expected, and
returns the static attributes of the XLA custom call (docs/xla-targets.md).
Device-side index data (cu_seqlens, block tables, slots) cannot be checked here;
the kernels treat it as untrusted.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import numpy as np

MAX_HEAD_DIM = 256
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3",
                   "fp8_e5m2": "fp8_e5m2"}
FP8_FORMAT_DTYPE = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def dtype_name(x) -> str:
    """'bfloat16', 'float8_e4m3fn', ... for jax, numpy and torch dtypes alike."""
    return str(x.dtype).removeprefix("torch.")


def shape(x) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


# Static arguments (attributes of the custom call) as Python values: numpy scalars
# (np.int32 from `lens.max()`, np.float32, np.bool_) are taken and converted; arrays,
# jax or torch scalars included, are not (they may be traced).
def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_bool(x) -> bool:
    return isinstance(x, (bool, np.bool_))


def _type_name(x) -> str:
    t = x.type if isinstance(x, _ArrayMeta) else type(x)  # cached(): the array's own type
    return f"{t.__module__}.{t.__name__}" if t.__module__ == "numpy" else t.__name__


class _Check:
    def __init__(self, op: str):
        self.op = op

    def value(self, ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(f"{self.op}: {message}")

    def type(self, ok: bool, message: str) -> None:
        if not ok:
            raise TypeError(f"{self.op}: {message}")

    def arrays(self, **named) -> None:
        """Each of these (None: absent) is an array: it has a shape and a dtype."""
        for name, x in named.items():
            self.type(x is None or (hasattr(x, "shape") and hasattr(x, "dtype")),
                      f"{name} must be an array, got {_type_name(x)}")

    def rank(self, name: str, x, rank: int, layout: str) -> tuple[int, ...]:
        s = shape(x)
        self.value(len(s) == rank, f"{name} must have shape {layout}, got shape {s}")
        return s

    def dtype(self, name: str, x, allowed: tuple[str, ...]) -> str:
        d = dtype_name(x)
        self.type(d in allowed, f"{name} must be {_one_of(allowed)}, got {d}")
        return d

    def scalar(self, name: str, x, dtype: str = "float32") -> None:
        if x is None:
            return
        self.type(hasattr(x, "shape"), f"{name} must be a {dtype} array of shape () or (1,), "
                                       f"got {type(x).__name__}")
        self.value(shape(x) in ((), (1,)), f"{name} must have shape () or (1,), got {shape(x)}")
        self.dtype(name, x, (dtype,))

    def static_int(self, name: str, value, minimum: int) -> int:
        """An int >= minimum that the native attributes hold (int32)."""
        self.type(_is_int(value), f"{name} must be an int, got {_type_name(value)}")
        value = int(value)
        self.value(value >= minimum, f"{name} must be >= {minimum}, got {value}")
        self.value(value < 2**31, f"{name} must be < 2**31, got {value}")
        return value

    def flag(self, name: str, value) -> bool:
        self.type(_is_bool(value), f"{name} must be a bool, got {_type_name(value)}")
        return bool(value)

    def heads(self, num_heads: int, num_heads_k: int) -> None:
        self.value(num_heads >= 1 and num_heads_k >= 1,
                   f"num_heads and num_heads_k must be >= 1, got {num_heads} and {num_heads_k}")
        self.value(num_heads % num_heads_k == 0,
                   f"num_heads ({num_heads}) must be a multiple of num_heads_k ({num_heads_k})")


def _offsets_on_host(c: _Check, name: str, cu, total: int, longest_name: str, longest: int,
                     lengths=None) -> None:
    """Sequence offsets the caller holds as a numpy array (as built on the host, or closed
    over in a jitted function) are checked here: non-decreasing within [0, total], and no
    sequence longer than its max_seqlen (the GPU kernels size their grid by it and would
    leave the rows past it unwritten). `lengths` (numpy, or None: the offsets' differences)
    are what max_seqlen bounds; where seqused_k is on the device they are unknown here and
    only the offsets are checked. Device arrays and tracers are not pulled back to check."""
    if not isinstance(cu, np.ndarray):
        return
    step = np.diff(cu.astype(np.int64))
    c.value(cu.size == 0 or (int(cu[0]) >= 0 and bool(np.all(step >= 0))
                             and int(cu[-1]) <= total),
            f"{name} must be non-decreasing offsets in [0, {total}], got {cu.tolist()[:8]}"
            f"{' ...' if cu.size > 8 else ''}")
    if lengths is not None and not isinstance(lengths, np.ndarray):
        return
    lengths = step if lengths is None else lengths.astype(np.int64)
    most = int(lengths.max()) if lengths.size else 0
    c.value(most <= longest, f"{longest_name} ({longest}) must be >= the longest sequence "
                             f"({most}): a GPU computes no row or key past it")


class _ArrayMeta(tuple):
    """An array's shape and dtype, all a spec function reads of it, and its type (for
    _type_name's messages): hashable."""

    __slots__ = ()
    shape = property(lambda self: self[0])
    dtype = property(lambda self: self[1])
    type = property(lambda self: self[2])


class _Uncached(Exception):
    pass


def _key(x):
    """x as a cache key: an array as its shape and dtype (_ArrayMeta), None as None, any
    other value with the type of each of its parts (1, 1.0 and True are equal keys
    otherwise, and the spec functions tell them apart: a bool is not an int)."""
    if x is None:
        return None
    if type(x) is np.ndarray:
        raise _Uncached  # its values are checked (_offsets_on_host)
    shape = getattr(x, "shape", None)
    if shape is not None and hasattr(x, "dtype"):
        return _ArrayMeta((tuple(shape), x.dtype, type(x)))
    if type(x) is tuple:
        return tuple, tuple(_key(e) for e in x), x
    return type(x), x


def _from_key(k):
    return k if k is None or type(k) is _ArrayMeta else k[-1]


def cached(spec):
    """`spec` (a *_spec function) remembered by its arguments' shapes, dtypes and values,
    for the eager frontends, which check every call: the torch frontend's flash call
    spent ~50 of its ~170 us of host time in flash_varlen_spec, called twice. Arguments
    that cannot be keyed (numpy arrays, whose values are checked; lists; symbolic shapes;
    other unhashable values) take the uncached call. Errors are raised anew each call."""
    @functools.lru_cache(maxsize=256)
    def run(args, kwargs):
        return spec(*map(_from_key, args), **{name: _from_key(k) for name, k in kwargs})

    @functools.wraps(spec)
    def call(*args, **kwargs):
        try:
            keys = (tuple(map(_key, args)),
                    tuple(sorted((name, _key(v)) for name, v in kwargs.items())))
            hash(keys)
        except (_Uncached, TypeError):
            return spec(*args, **kwargs)
        return run(*keys)
    return call


def _one_of(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _float(c: _Check, name: str, value, minimum: float | None = None) -> float:
    c.type(isinstance(value, numbers.Real) and not isinstance(value, bool),
           f"{name} must be a float, got {_type_name(value)}")
    value = float(value)
    c.value(math.isfinite(value), f"{name} must be finite, got {value}")
    if minimum is not None:
        c.value(value >= minimum, f"{name} must be >= {minimum}, got {value}")
    return value


def _window(c: _Check, window_size, causal: bool) -> tuple[int, int]:
    ok = (isinstance(window_size, (tuple, list)) and len(window_size) == 2
          and all(_is_int(w) and w >= -1 for w in window_size))
    c.value(ok, f"window_size must be a pair of ints >= -1 (-1 = unbounded), got {window_size!r}")
    left, right = (int(w) for w in window_size)
    c.value(max(left, right) < 2**31, f"window_size must be < 2**31 each, got {window_size!r}")
    if c.flag("causal", causal):
        right = 0  # causal is a window with no look-ahead (flash-attn's convention)
    return left, right


@dataclasses.dataclass(frozen=True)
class FlashSpec:
    """Static attributes of xla_attn_flash_fwd_v1 / _bwd_v1 (hashable: custom_vjp
    takes it as a non-differentiable argument)."""

    softmax_scale: float
    softcap: float
    window_left: int
    window_right: int
    max_seqlen_q: int
    max_seqlen_k: int
    out_dtype: str
    paged: bool
    # The backward without atomics (xla_attn_flash_bwd_v1 on the tensor-core family);
    # not an attribute of the call: it picks the target.
    deterministic: bool = False

    def attributes(self) -> dict:
        return {"softmax_scale": self.softmax_scale, "softcap": self.softcap,
                "window_left": self.window_left, "window_right": self.window_right,
                "max_seqlen_q": self.max_seqlen_q, "max_seqlen_k": self.max_seqlen_k}


def flash_varlen_spec(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, causal, window_size, softcap, alibi_slopes, seqused_k,
                      block_table, q_descale, k_descale, v_descale,
                      op: str = "flash_attn_varlen", deterministic: bool = False) -> FlashSpec:
    c = _Check(op)
    c.arrays(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
             alibi_slopes=alibi_slopes, seqused_k=seqused_k, block_table=block_table)
    total_q, num_heads, head_dim = c.rank("q", q, 3, "(total_q, num_heads, head_dim)")
    paged = block_table is not None
    if paged:
        ks = c.rank("k", k, 4, "(num_blocks, block_size, num_heads_k, head_dim) with block_table")
        c.value(ks[1] >= 1, f"k's block_size must be >= 1, got {ks[1]}")
        total_k = ks[0] * ks[1]
    else:
        ks = c.rank("k", k, 3, "(total_k, num_heads_k, head_dim)")
        total_k = ks[0]
    c.value(shape(v) == ks, f"v must have k's shape {ks}, got {shape(v)}")
    q_dtype = c.dtype("q", q, FLOAT_DTYPES + ("float8_e4m3fn",))
    fp8 = q_dtype == "float8_e4m3fn"
    c.type(dtype_name(k) == q_dtype and dtype_name(v) == q_dtype,
           f"k and v must have q's dtype {q_dtype}, got {dtype_name(k)} and {dtype_name(v)}")
    num_heads_k = ks[-2]
    c.value(ks[-1] == head_dim, f"k's head_dim ({ks[-1]}) must equal q's ({head_dim})")
    c.value(1 <= head_dim <= MAX_HEAD_DIM,
            f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    c.heads(num_heads, num_heads_k)

    c.rank("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)")
    c.dtype("cu_seqlens_q", cu_seqlens_q, ("int32",))
    batch = shape(cu_seqlens_q)[0] - 1
    c.value(batch >= 0, "cu_seqlens_q must have at least one entry (batch + 1 >= 1)")
    c.value(shape(cu_seqlens_k) == (batch + 1,),
            f"cu_seqlens_k must have cu_seqlens_q's shape ({batch + 1},), got {shape(cu_seqlens_k)}")
    c.dtype("cu_seqlens_k", cu_seqlens_k, ("int32",))
    if seqused_k is not None:
        c.value(shape(seqused_k) == (batch,), f"seqused_k must have shape (batch,) = ({batch},), "
                                              f"got {shape(seqused_k)}")
        c.dtype("seqused_k", seqused_k, ("int32",))
    if paged:
        bt = c.rank("block_table", block_table, 2, "(batch, max_blocks_per_seq)")
        c.value(bt[0] == batch, f"block_table must have batch = {batch} rows, got {bt[0]}")
        c.dtype("block_table", block_table, ("int32",))
    if alibi_slopes is not None:
        c.value(shape(alibi_slopes) in ((num_heads,), (batch, num_heads)),
                f"alibi_slopes must have shape (num_heads,) = ({num_heads},) or (batch, num_heads)"
                f" = ({batch}, {num_heads}), got {shape(alibi_slopes)}")
        c.dtype("alibi_slopes", alibi_slopes, ("float32",))
    for name, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        c.value(x is None or fp8, f"{name} applies to float8_e4m3fn inputs only (q is {q_dtype})")
        c.scalar(name, x)

    max_seqlen_q = total_q if max_seqlen_q is None else c.static_int("max_seqlen_q", max_seqlen_q, 0)
    max_seqlen_k = total_k if max_seqlen_k is None else c.static_int("max_seqlen_k", max_seqlen_k, 0)
    _offsets_on_host(c, "cu_seqlens_q", cu_seqlens_q, total_q, "max_seqlen_q", max_seqlen_q)
    if not paged:  # a paged call's keys are counted by seqused_k, its cache is total_k
        _offsets_on_host(c, "cu_seqlens_k", cu_seqlens_k, total_k, "max_seqlen_k", max_seqlen_k,
                         seqused_k)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else _float(c, "softmax_scale",
                                                                          softmax_scale)
    left, right = _window(c, window_size, causal)
    deterministic = c.flag("deterministic", deterministic)
    return FlashSpec(softmax_scale=scale, softcap=_float(c, "softcap", softcap, 0.0),
                     window_left=left, window_right=right, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, out_dtype="bfloat16" if fp8 else q_dtype,
                     paged=paged, deterministic=deterministic)


def flash_dense_check(q, k, v) -> tuple[int, int, int]:
    """(batch, seqlen_q, seqlen_k) of the dense layout; the rest is checked as varlen."""
    c = _Check("flash_attn")
    c.arrays(q=q, k=k, v=v)
    b, sq, _, _ = c.rank("q", q, 4, "(batch, seqlen_q, num_heads, head_dim)")
    ks = c.rank("k", k, 4, "(batch, seqlen_k, num_heads_k, head_dim)")
    c.value(ks[0] == b, f"k's batch ({ks[0]}) must equal q's ({b})")
    c.value(shape(v) == ks, f"v must have k's shape {ks}, got {shape(v)}")
    # the sequences' offsets (cu_seqlens) are int32
    longest = max(sq, ks[1])
    c.value(b * longest < 2**31,
            f"batch x seqlen must be < 2**31 (int32 offsets), got {b} x {longest}")
    return b, sq, ks[1]


@dataclasses.dataclass(frozen=True)
class PagedSpec:
    """Static attributes of xla_attn_paged_attention_v2."""

    scale: float
    soft_cap: float
    sliding_window: int
    kv_cache_dtype: str
    max_query_len: int = 0  # 0: unknown

    def attributes(self) -> dict:
        return {"scale": self.scale, "soft_cap": self.soft_cap,
                "sliding_window": self.sliding_window, "kv_cache_dtype": self.kv_cache_dtype,
                "max_query_len": self.max_query_len}


def _cache_format(c: _Check, kv_cache_dtype, cache, src_dtype: str | None) -> str:
    c.value(kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
            f"got {kv_cache_dtype!r}")
    fmt = KV_CACHE_DTYPES[kv_cache_dtype]
    stored = dtype_name(cache)
    if fmt == "auto":
        c.type(stored != "uint8", "a uint8 cache needs kv_cache_dtype 'fp8_e4m3' or 'fp8_e5m2'")
        if src_dtype is not None and stored not in FP8_DTYPES:
            c.type(stored == src_dtype, f"key_cache must have key's dtype {src_dtype} "
                                        f"(or be fp8), got {stored}")
    else:
        c.type(stored in ("uint8", FP8_FORMAT_DTYPE[fmt]),
               f"kv_cache_dtype {kv_cache_dtype!r} needs a uint8 or {FP8_FORMAT_DTYPE[fmt]} "
               f"cache, got {stored}")
    return fmt


def _cache_pair(c: _Check, key_cache, value_cache, allowed: tuple[str, ...]):
    cs = c.rank("key_cache", key_cache, 4, "(num_blocks, block_size, num_heads_k, head_dim)")
    c.value(shape(value_cache) == cs,
            f"value_cache must have key_cache's shape {cs}, got {shape(value_cache)}")
    c.value(cs[1] >= 1, f"key_cache's block_size must be >= 1, got {cs[1]}")
    c.dtype("key_cache", key_cache, allowed)
    c.type(dtype_name(value_cache) == dtype_name(key_cache),
           f"value_cache must have key_cache's dtype {dtype_name(key_cache)}, "
           f"got {dtype_name(value_cache)}")
    return cs


def paged_attention_spec(query, key_cache, value_cache, seq_lens, block_tables, query_start_loc,
                         scale, sliding_window, soft_cap, k_scale, v_scale, num_seqs,
                         kv_cache_dtype="auto", alibi_slopes=None,
                         max_query_len=None) -> PagedSpec:
    """max_query_len: None, or a bound (>= 1) on every sequence's query count, which
    sizes the GPU launch (a decode batch: 1). A bound below a real count is an error on
    the Host, and here where query_start_loc is a numpy array (without num_seqs); on a GPU
    the rows of that sequence are NaN or left unwritten."""
    c = _Check("paged_attention")
    c.arrays(query=query, key_cache=key_cache, value_cache=value_cache, seq_lens=seq_lens,
             block_tables=block_tables, query_start_loc=query_start_loc)
    _, num_heads, head_dim = c.rank("query", query, 3, "(total_q, num_heads, head_dim)")
    q_dtype = c.dtype("query", query, FLOAT_DTYPES)
    cs = _cache_pair(c, key_cache, value_cache, (q_dtype, "uint8") + FP8_DTYPES)
    c.value(cs[3] == head_dim, f"key_cache's head_dim ({cs[3]}) must equal query's ({head_dim})")
    c.value(1 <= head_dim <= MAX_HEAD_DIM,
            f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    c.heads(num_heads, cs[2])
    (n,) = c.rank("seq_lens", seq_lens, 1, "(num_seqs,)")
    c.dtype("seq_lens", seq_lens, ("int32",))
    bt = c.rank("block_tables", block_tables, 2, "(num_seqs, max_blocks_per_seq)")
    c.value(bt[0] == n, f"block_tables must have {n} rows like seq_lens, got {bt[0]}")
    c.dtype("block_tables", block_tables, ("int32",))
    c.value(shape(query_start_loc) == (n + 1,),
            f"query_start_loc must have shape (num_seqs + 1,) = ({n + 1},), "
            f"got {shape(query_start_loc)}")
    c.dtype("query_start_loc", query_start_loc, ("int32",))
    c.scalar("k_scale", k_scale)
    c.scalar("v_scale", v_scale)
    c.scalar("num_seqs", num_seqs, "int32")
    if alibi_slopes is not None:
        c.type(hasattr(alibi_slopes, "shape"), f"alibi_slopes must be a float32 array of shape "
                                               f"(num_heads,), got {type(alibi_slopes).__name__}")
        c.value(shape(alibi_slopes) == (num_heads,),
                f"alibi_slopes must have shape (num_heads,) = ({num_heads},), "
                f"got {shape(alibi_slopes)}")
        c.dtype("alibi_slopes", alibi_slopes, ("float32",))
    window = 0 if sliding_window is None else c.static_int("sliding_window", sliding_window, 1)
    max_q = 0 if max_query_len is None else c.static_int("max_query_len", max_query_len, 1)
    if num_seqs is None:  # with num_seqs, the offsets past its sequences are not read
        _offsets_on_host(c, "query_start_loc", query_start_loc, shape(query)[0],
                         "max_query_len", max_q or shape(query)[0])
    cap = 0.0 if soft_cap is None else _float(c, "soft_cap", soft_cap, 0.0)
    fmt = _cache_format(c, kv_cache_dtype, key_cache, None)
    return PagedSpec(scale=_float(c, "scale", scale), soft_cap=cap, sliding_window=window,
                     kv_cache_dtype=fmt, max_query_len=max_q)


def reshape_and_cache_flash_spec(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                     k_scale, v_scale) -> str:
    """Returns the normalised kv_cache_dtype attribute."""
    c = _Check("reshape_and_cache_flash")
    c.arrays(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
             slot_mapping=slot_mapping)
    ks = c.rank("key", key, 3, "(num_tokens, num_heads_k, head_dim)")
    c.value(shape(value) == ks, f"value must have key's shape {ks}, got {shape(value)}")
    src = c.dtype("key", key, FLOAT_DTYPES)
    c.type(dtype_name(value) == src, f"value must have key's dtype {src}, got {dtype_name(value)}")
    cs = _cache_pair(c, key_cache, value_cache, FLOAT_DTYPES + FP8_DTYPES + ("uint8",))
    c.value(cs[2:] == ks[1:], f"key_cache's (num_heads_k, head_dim) = {cs[2:]} must match key's "
                              f"{ks[1:]}")
    c.value(shape(slot_mapping) == (ks[0],),
            f"slot_mapping must have shape (num_tokens,) = ({ks[0]},), got {shape(slot_mapping)}")
    c.dtype("slot_mapping", slot_mapping, ("int32", "int64"))
    c.scalar("k_scale", k_scale)
    c.scalar("v_scale", v_scale)
    return _cache_format(c, kv_cache_dtype, key_cache, src)


# ---------------------------------------------------------------- segment ids (dense API)
# Packed documents in one row, as torch_xla's TPU flash attention takes them: token i
# of a row attends to key j of the same row iff their segment ids are equal. The
# kernels are varlen kernels, so a segment must be a contiguous run of one id in q
# and in kv, and the runs of a row must come in the same order in both (the usual
# packing: self-attention with q_segment_ids == kv_segment_ids). Each run pair is then
# one varlen sequence; causal masking is per segment, bottom-right aligned (the same
# as a global causal mask when a segment has as many queries as keys).
def segment_ids_check(q_segment_ids, kv_segment_ids, batch: int, seqlen_q: int, seqlen_k: int,
                      max_segments=None) -> int:
    """Checks the ids' shapes and dtypes; returns the per-row bound on segments."""
    c = _Check("flash_attn")
    c.value((q_segment_ids is None) == (kv_segment_ids is None),
            "q_segment_ids and kv_segment_ids must be given together")
    c.arrays(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    c.value(shape(q_segment_ids) == (batch, seqlen_q),
            f"q_segment_ids must have shape (batch, seqlen_q) = ({batch}, {seqlen_q}), "
            f"got {shape(q_segment_ids)}")
    c.value(shape(kv_segment_ids) == (batch, seqlen_k),
            f"kv_segment_ids must have shape (batch, seqlen_k) = ({batch}, {seqlen_k}), "
            f"got {shape(kv_segment_ids)}")
    for name, x in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
        c.dtype(name, x, ("int32", "int64"))
    bound = max(1, min(seqlen_q, seqlen_k))
    if max_segments is None:
        return bound
    return min(c.static_int("max_segments", max_segments, 1), bound)


def segment_ids_to_cu_seqlens(q_segment_ids, kv_segment_ids):
    """Host conversion of (batch, seqlen) segment ids (numpy-convertible) into compact
    varlen arguments `(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)` (int32
    arrays of runs + 1 entries). Raises ValueError for ids that are not one contiguous
    run per segment, or whose runs differ between q and kv."""
    import numpy as np

    c = _Check("flash_attn")
    q_ids, kv_ids = np.asarray(q_segment_ids), np.asarray(kv_segment_ids)
    lens_q, lens_k = [], []
    for row in range(q_ids.shape[0]):
        q_runs, kv_runs = _runs(q_ids[row]), _runs(kv_ids[row])
        for name, runs in (("q_segment_ids", q_runs), ("kv_segment_ids", kv_runs)):
            ids = [seg for seg, _ in runs]
            c.value(len(set(ids)) == len(ids),
                    f"{name} row {row}: a segment id appears in more than one run {ids}; each "
                    "segment must be one contiguous run")
        c.value([s for s, _ in q_runs] == [s for s, _ in kv_runs],
                f"row {row}: q segments {[s for s, _ in q_runs]} and kv segments "
                f"{[s for s, _ in kv_runs]} must be the same ids in the same order")
        lens_q += [n for _, n in q_runs]
        lens_k += [n for _, n in kv_runs]
    cu_q = np.concatenate([[0], np.cumsum(lens_q, dtype=np.int64)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k, dtype=np.int64)]).astype(np.int32)
    return cu_q, cu_k, max(lens_q, default=0), max(lens_k, default=0)


def _runs(ids) -> list[tuple[int, int]]:
    """[(segment id, run length)] of a 1-D sequence of ids."""
    runs: list[tuple[int, int]] = []
    for seg in ids.tolist():
        if runs and runs[-1][0] == seg:
            runs[-1] = (seg, runs[-1][1] + 1)
        else:
            runs.append((seg, 1))
    return runs

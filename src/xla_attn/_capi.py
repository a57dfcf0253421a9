"""ctypes mirrors of the four params structs (kernels/<op>/params.h) and thin wrappers
of the C ABI calls that run them (kernels/capi/xla_attn.h). Framework-neutral: the
caller fills the struct with raw addresses (e.g. `tensor.data_ptr()`) and sizes.

The struct layouts are checked against `xla_attn_params_size` when a struct is first
used, so a library from another build cannot be driven with a stale layout."""

from __future__ import annotations

import ctypes
import functools

from xla_attn import _native

# kernels/common/types.h
HOST = 0
CUDA = 1
DTYPE_CODES = _native.DTYPE_CODES

_void_p = ctypes.c_void_p
# Typed pointer fields are addresses to ctypes (the pointee is the C header's): a
# POINTER(c_float) field takes a ctypes.cast an assignment, and the eager frontends fill
# 10 such a flash call (the torch one, kernel stubbed out, on a CPU: 61 -> 48 us a call).
_float_p = _int32_p = _void_p
_dtype = ctypes.c_int32  # xla_attn_dtype
_ERROR_LEN = 2048


class _Params(ctypes.Structure):
    """A params struct; `fill(name=value, ...)` takes addresses as ints (0 or None:
    a null pointer) for the pointer fields and plain numbers for the rest."""

    op: str  # the name xla_attn_params_size / xla_attn_workspace_size know it by

    def fill(self, **values) -> "_Params":
        kinds = type(self).__dict__.get("_kinds")
        if kinds is None:  # once a struct type: the eager frontends fill one every call
            kinds = type(self)._kinds = dict(self._fields_)
        for name, value in values.items():
            kind = kinds.get(name)
            if kind is None:
                raise AttributeError(f"{type(self).__name__} has no field {name!r}")
            setattr(self, name, (value or None) if kind is _void_p else value)
        return self


class FlashFwdParams(_Params):
    op = "flash_fwd"
    _fields_ = [
        ("q", _void_p),
        ("k", _void_p),
        ("v", _void_p),
        ("out", _void_p),
        ("softmax_lse", _float_p),
        ("cu_seqlens_q", _int32_p),
        ("cu_seqlens_k", _int32_p),
        ("seqused_k", _int32_p),
        ("block_table", _int32_p),
        ("alibi_slopes", _float_p),
        ("q_descale", _float_p),
        ("k_descale", _float_p),
        ("v_descale", _float_p),
        ("batch_used", _int32_p),
        ("workspace", _void_p),
        ("total_q", ctypes.c_int64),
        ("total_k", ctypes.c_int64),
        ("workspace_bytes", ctypes.c_int64),
        ("batch", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_heads_k", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("max_seqlen_q", ctypes.c_int32),
        ("max_seqlen_k", ctypes.c_int32),
        ("num_blocks", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("max_blocks_per_seq", ctypes.c_int32),
        ("alibi_batch_stride", ctypes.c_int32),
        ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32),
        ("softmax_scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("q_dtype", _dtype),
        ("kv_dtype", _dtype),
        ("out_dtype", _dtype),
        ("num_splits", ctypes.c_int32),
        ("decode_max_q", ctypes.c_int32),
    ]


class FlashBwdParams(_Params):
    op = "flash_bwd"
    _fields_ = [
        ("dout", _void_p),
        ("q", _void_p),
        ("k", _void_p),
        ("v", _void_p),
        ("out", _void_p),
        ("softmax_lse", _float_p),
        ("dq", _void_p),
        ("dk", _void_p),
        ("dv", _void_p),
        ("workspace", _void_p),
        ("cu_seqlens_q", _int32_p),
        ("cu_seqlens_k", _int32_p),
        ("seqused_k", _int32_p),
        ("alibi_slopes", _float_p),
        ("total_q", ctypes.c_int64),
        ("total_k", ctypes.c_int64),
        ("workspace_bytes", ctypes.c_int64),
        ("batch", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_heads_k", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("max_seqlen_q", ctypes.c_int32),
        ("max_seqlen_k", ctypes.c_int32),
        ("alibi_batch_stride", ctypes.c_int32),
        ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32),
        ("softmax_scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("dtype", _dtype),
        ("dlse", _float_p),
    ]


class PagedAttentionParams(_Params):
    op = "paged_attention"
    _fields_ = [
        ("query", _void_p),
        ("key_cache", _void_p),
        ("value_cache", _void_p),
        ("out", _void_p),
        ("seq_lens", _int32_p),
        ("block_tables", _int32_p),
        ("query_start_loc", _int32_p),
        ("num_seqs", _int32_p),
        ("k_scale", _float_p),
        ("v_scale", _float_p),
        ("alibi_slopes", _float_p),
        ("workspace", _void_p),
        ("total_q", ctypes.c_int64),
        ("workspace_bytes", ctypes.c_int64),
        ("max_num_seqs", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_heads_k", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("num_blocks", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("max_blocks_per_seq", ctypes.c_int32),
        ("sliding_window", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("soft_cap", ctypes.c_float),
        ("q_dtype", _dtype),
        ("cache_dtype", _dtype),
        ("max_query_len", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
    ]


class CacheWriteParams(_Params):
    op = "reshape_and_cache_flash"
    _fields_ = [
        ("key", _void_p),
        ("value", _void_p),
        ("key_cache", _void_p),
        ("value_cache", _void_p),
        ("slot_mapping", _void_p),
        ("k_scale", _float_p),
        ("v_scale", _float_p),
        ("num_tokens", ctypes.c_int64),
        ("num_slots", ctypes.c_int64),
        ("num_heads_k", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("num_blocks", ctypes.c_int32),
        ("src_dtype", _dtype),
        ("cache_dtype", _dtype),
        ("slot_dtype", _dtype),
        ("reserved0", ctypes.c_int32),
    ]


PARAMS = {cls.op: cls for cls in (FlashFwdParams, FlashBwdParams, PagedAttentionParams,
                                  CacheWriteParams)}
_RUN_SYMBOLS = {"flash_fwd": "xla_attn_flash_fwd", "flash_bwd": "xla_attn_flash_bwd",
                "paged_attention": "xla_attn_paged_attention",
                "reshape_and_cache_flash": "xla_attn_reshape_and_cache_flash"}


@functools.cache
def _functions() -> dict:
    """The C ABI entry points with their prototypes, checked against this build.
    `lib()[name]` gives private function objects, so these prototypes do not touch
    the ones other modules set on the shared handle."""
    lib = _native.lib()
    size = lib["xla_attn_params_size"]
    size.argtypes, size.restype = [ctypes.c_char_p], ctypes.c_size_t
    for op, cls in PARAMS.items():
        native = size(op.encode())
        if native != ctypes.sizeof(cls):
            raise ImportError(
                f"xla_attn: the native library's {op} params struct is {native} bytes, this "
                f"package's ctypes mirror is {ctypes.sizeof(cls)}; reinstall so both come from "
                "one build")
    fns = {}
    for op, symbol in _RUN_SYMBOLS.items():
        fn = lib[symbol]
        fn.argtypes = [ctypes.POINTER(PARAMS[op]), ctypes.c_int, ctypes.c_void_p,
                       ctypes.c_char_p, ctypes.c_size_t]
        fn.restype = ctypes.c_int
        fns[op] = fn
    ws = lib["xla_attn_workspace_size"]
    ws.argtypes, ws.restype = [ctypes.c_char_p, ctypes.c_void_p], ctypes.c_size_t
    fns["workspace_size"] = ws
    return fns


def check_layouts() -> None:
    """Raises ImportError when the library is missing or a mirror's size differs from
    the library's struct."""
    _functions()


def _run(op: str, params: _Params, platform: int, stream: int | None) -> None:
    if not isinstance(params, PARAMS[op]):
        raise TypeError(f"xla_attn_{op} takes {PARAMS[op].__name__}, got {type(params).__name__}")
    error = ctypes.create_string_buffer(_ERROR_LEN)
    status = _functions()[op](ctypes.byref(params), platform, stream or None, error, len(error))
    if status:
        raise RuntimeError(error.value.decode(errors="replace") or
                           f"xla_attn_{op} failed with status {status}")


def flash_fwd(params: FlashFwdParams, platform: int, stream: int | None = None) -> None:
    """xla_attn_flash_fwd: raises RuntimeError with the library's message on failure."""
    _run("flash_fwd", params, platform, stream)


def flash_bwd(params: FlashBwdParams, platform: int, stream: int | None = None) -> None:
    _run("flash_bwd", params, platform, stream)


def paged_attention(params: PagedAttentionParams, platform: int, stream: int | None = None) -> None:
    _run("paged_attention", params, platform, stream)


def reshape_and_cache_flash(params: CacheWriteParams, platform: int, stream: int | None = None) -> None:
    _run("reshape_and_cache_flash", params, platform, stream)


def workspace_size(params: _Params) -> int:
    """Device scratch bytes the CUDA path needs for these params (0: none)."""
    return int(_functions()["workspace_size"](params.op.encode(), ctypes.byref(params)))


check_layouts()  # at load: a stale or foreign library fails the import, not a later call

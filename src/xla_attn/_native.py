"""Loads libxla_attn.so (no Python in it) and wraps the few C ABI calls Python needs."""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import pathlib

ABI_VERSION = 3
LIBRARY = pathlib.Path(__file__).parent / "lib" / "libxla_attn.so"

# FFI handler symbols, per target: (host symbol, CUDA symbol).
HANDLERS = {
    "xla_attn_flash_fwd_v1": ("XlaAttnFlashFwdV1Host", "XlaAttnFlashFwdV1Cuda"),
    "xla_attn_flash_bwd_v1": ("XlaAttnFlashBwdV1Host", "XlaAttnFlashBwdV1Cuda"),
    "xla_attn_flash_bwd_v2": ("XlaAttnFlashBwdV2Host", "XlaAttnFlashBwdV2Cuda"),
    "xla_attn_flash_bwd_v3": ("XlaAttnFlashBwdV3Host", "XlaAttnFlashBwdV3Cuda"),
    "xla_attn_paged_attention_v1": ("XlaAttnPagedAttentionV1Host", "XlaAttnPagedAttentionV1Cuda"),
    "xla_attn_paged_attention_v2": ("XlaAttnPagedAttentionV2Host", "XlaAttnPagedAttentionV2Cuda"),
    "xla_attn_reshape_and_cache_flash_v1": (
        "XlaAttnReshapeAndCacheFlashV1Host", "XlaAttnReshapeAndCacheFlashV1Cuda"),
}

# kernels/common/types.h
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "float8_e4m3fn": 3, "float8_e5m2": 4,
               "int32": 5, "int64": 6, "uint8": 7}


@functools.cache
def lib() -> ctypes.CDLL:
    path = pathlib.Path(os.environ.get("XLA_ATTN_LIBRARY", LIBRARY))
    if not path.exists():
        raise ImportError(f"xla_attn: native library not found at {path}; reinstall the package "
                          "(pip install xla-attn-cu12) or build it (pip install .)")
    handle = ctypes.CDLL(str(path))
    handle.xla_attn_abi_version.restype = ctypes.c_int
    handle.xla_attn_version.restype = ctypes.c_char_p
    handle.xla_attn_build_info.restype = ctypes.c_char_p
    handle.xla_attn_select_variant.argtypes = [
        ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint, ctypes.c_int,
        ctypes.c_char_p, ctypes.c_size_t]
    handle.xla_attn_device_arch.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    i32, i64 = ctypes.c_int32, ctypes.c_int64
    handle.xla_attn_flash_fwd_workspace_size.argtypes = [i64, i32, i32, i32, i32, i32]
    handle.xla_attn_flash_fwd_workspace_size.restype = ctypes.c_size_t
    handle.xla_attn_flash_fwd_workspace_size_v2.argtypes = [i64, i64] + [i32] * 8
    handle.xla_attn_flash_fwd_workspace_size_v2.restype = ctypes.c_size_t
    handle.xla_attn_flash_bwd_workspace_size.argtypes = [i64, i32, i32, i32, i32]
    handle.xla_attn_flash_bwd_workspace_size.restype = ctypes.c_size_t
    handle.xla_attn_paged_attention_workspace_size.argtypes = [i64, i32, i32, i32, i32, i32, i32]
    handle.xla_attn_paged_attention_workspace_size.restype = ctypes.c_size_t
    abi = handle.xla_attn_abi_version()
    if abi != ABI_VERSION:
        raise ImportError(f"xla_attn: native library {path} has C ABI {abi}, this package needs "
                          f"{ABI_VERSION}; reinstall so both come from one build")
    return handle


def build_info() -> dict:
    return json.loads(lib().xla_attn_build_info().decode())


def select_variant(op: str, dtype0: str, dtype1: str, head_dim: int, arch: int,
                   features: int = 0) -> str:
    """Kernel the dispatcher would pick on compute capability `arch` (e.g. 90);
    raises RuntimeError with the dispatcher's message when there is none."""
    out = ctypes.create_string_buffer(2048)
    status = lib().xla_attn_select_variant(op.encode(), DTYPE_CODES[dtype0], DTYPE_CODES[dtype1],
                                           head_dim, features, arch, out, len(out))
    if status:
        raise RuntimeError(out.value.decode())
    return out.value.decode()


def flash_fwd_workspace_size(total_q: int, batch: int, num_heads: int, head_dim: int,
                             max_seqlen_q: int, max_seqlen_k: int, k_shape: tuple[int, ...],
                             kv_dtype: str, paged: bool) -> int:
    """Bytes of the `workspace` result of xla_attn_flash_fwd_v1 (split-KV partials, the
    Hopper walk's item counter, fp8's V^T). k_shape: K's, (total_k, heads_k, head_dim) or a
    paged cache's (blocks, block_size, heads_k, head_dim): its rows are all but the last two
    dimensions."""
    return lib().xla_attn_flash_fwd_workspace_size_v2(
        total_q, math.prod(k_shape[:-2]), batch, num_heads, k_shape[-2], head_dim,
        min(max_seqlen_q, 2**31 - 1), min(max_seqlen_k, 2**31 - 1), DTYPE_CODES[kv_dtype],
        int(paged))


def flash_bwd_workspace_size(total_q: int, batch: int, num_heads: int, head_dim: int,
                             dtype: str) -> int:
    """Bytes of the `workspace` result of xla_attn_flash_bwd_v2 (delta = dO . O and the
    f32 dQ accumulator of the tensor-core backward; 0 for float32)."""
    return lib().xla_attn_flash_bwd_workspace_size(total_q, batch, num_heads, head_dim,
                                                   DTYPE_CODES[dtype])


def paged_attention_workspace_size(total_q: int, max_num_seqs: int, num_heads: int,
                                   head_dim: int, max_blocks_per_seq: int, block_size: int,
                                   max_query_len: int = 0) -> int:
    """Bytes of the `workspace` result of xla_attn_paged_attention_v2 (v1: max_query_len
    0). The hint bounds the flash grid, whose split plan, and so the size, depends on it."""
    return lib().xla_attn_paged_attention_workspace_size(total_q, max_num_seqs, num_heads,
                                                         head_dim, max_blocks_per_seq, block_size,
                                                         max_query_len)


def device_arch() -> tuple[int, str]:
    """(compute capability of the current CUDA device, "") or (-1, why not)."""
    err = ctypes.create_string_buffer(512)
    arch = lib().xla_attn_device_arch(err, len(err))
    return arch, err.value.decode()


def capsule(symbol: str):
    """A PyCapsule of an FFI handler, as jax.ffi.register_ffi_target takes it."""
    import jax

    return jax.ffi.pycapsule(getattr(lib(), symbol))

"""xla_attn: flash attention, paged attention and KV-cache kernels as XLA custom calls.

The top-level functions take jax arrays (or numpy arrays, run through JAX), torch
tensors on CPU or CUDA, or torch tensors on an XLA device (torch_xla), and route to the
matching frontend; `xla_attn.jax`, `xla_attn.torch` and `xla_attn.torch_xla` can also
be used directly.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["flash_attn_varlen", "flash_attn", "paged_attention", "reshape_and_cache_flash"]


def _frontend(op: str, first):
    module = type(first).__module__ or ""
    if module.startswith("torch"):
        device = getattr(getattr(first, "device", None), "type", None)
        if device in ("cpu", "cuda", "meta"):
            from xla_attn import torch as frontend

            return frontend
        if device == "xla":
            from xla_attn import torch_xla as frontend

            return frontend
        raise NotImplementedError(
            f"xla_attn.{op}: torch tensors on device type {device!r} are not supported; "
            "xla_attn.torch takes CPU and CUDA tensors, xla_attn.torch_xla XLA tensors")
    if module.startswith(("jax", "jaxlib", "numpy")):
        from xla_attn import jax as frontend

        return frontend
    raise TypeError(f"xla_attn.{op}: expected jax arrays (or numpy arrays), "
                    f"got {type(first).__name__}")


def flash_attn_varlen(q, *args, **kwargs):
    """See xla_attn.jax.flash_attn_varlen."""
    return _frontend("flash_attn_varlen", q).flash_attn_varlen(q, *args, **kwargs)


def flash_attn(q, *args, **kwargs):
    """See xla_attn.jax.flash_attn."""
    return _frontend("flash_attn", q).flash_attn(q, *args, **kwargs)


def paged_attention(query, *args, **kwargs):
    """See xla_attn.jax.paged_attention."""
    return _frontend("paged_attention", query).paged_attention(query, *args, **kwargs)


def reshape_and_cache_flash(key, *args, **kwargs):
    """See xla_attn.jax.reshape_and_cache_flash."""
    return _frontend("reshape_and_cache_flash", key).reshape_and_cache_flash(key, *args, **kwargs)

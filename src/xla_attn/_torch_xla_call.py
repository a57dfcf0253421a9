"""Emits one of our custom calls into a torch_xla graph.

Two flavours, picked by the device torch_xla runs on:
- CPU (torch_xla 2.9): the typed FFI target (api_version 4), attributes as an MLIR
  dictionary in backend_config, the Host handler registered in torch_xla's XLA through
  `_xla_ffi_registry`.
- CUDA (torch_xla <= 2.8, which registers only untyped targets): the legacy target
  (api_version 2) with the descriptor of `_xla_legacy`, registered with
  `_xla_register_custom_call_target`.

torch_xla 2.9.0 hashes a custom-call node by its target name alone, so two calls that
differ only in attributes would share one compiled program. Every target name is
therefore salted with a hash of its attributes (the same handler is registered under
each salted name on first use), which makes such calls distinct nodes."""

from __future__ import annotations

import ctypes
import functools
import hashlib

import torch

from xla_attn import _hlo_module, _native, _ops, _xla_ffi_registry, _xla_legacy

TYPED_FFI, STATUS_RETURNING = 4, 2


@functools.cache
def flavour() -> str:
    """"typed" (CPU) or "legacy" (CUDA); anything else cannot run our handlers."""
    import torch_xla.runtime as xr

    device = xr.device_type()
    if device == "CPU":
        return "typed"
    if device in ("CUDA", "GPU"):
        return "legacy"
    raise NotImplementedError(
        f"xla_attn.torch_xla: the XLA device is {device}; our custom calls run on the CPU "
        "(torch_xla's PJRT_DEVICE=CPU) and on NVIDIA GPUs (torch_xla <= 2.8, PJRT_DEVICE=CUDA)")


def mlir_attributes(attributes: dict) -> str:
    """An MLIR attribute dictionary (what XLA parses typed-FFI attributes from): floats
    as f32 in exponent form (XLA rejects "1e-05"), ints as i64, strings quoted."""
    parts = []
    for name, value in attributes.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError(f"attribute {name}: unsupported type {type(value).__name__}")
        if isinstance(value, float):
            parts.append(f"{name} = {value:.9e} : f32")
        elif isinstance(value, int):
            parts.append(f"{name} = {value} : i64")
        else:
            escaped = value.replace("\\", "\\\\").replace('"', '\\"')
            parts.append(f'{name} = "{escaped}"')
    return "{" + ", ".join(parts) + "}"


def salted(target: str, config: bytes) -> str:
    return f"{target}_{hashlib.sha256(config).hexdigest()[:16]}"


def _capsule(address: int):
    """A PyCapsule around a function pointer (what _xla_register_custom_call_target takes)."""
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                   ctypes.c_void_p]
    return new(address, None, None)


@functools.cache
def _legacy_status_hook() -> None:
    """Hands the handlers XLA's XlaCustomCallStatusSetFailure from torch_xla's library,
    so a refused call fails with our message (else they look the name up themselves)."""
    lib = _native.lib()
    try:
        path = _xla_ffi_registry._xla_library()
        value = _xla_ffi_registry._symbol_value(path, "XlaCustomCallStatusSetFailure")
        address = _xla_ffi_registry._load_bias(path) + value if value else 0
    except _xla_ffi_registry.RegistrationError:
        address = 0
    fn = lib["xla_attn_legacy_set_status_function"]
    fn.argtypes, fn.restype = [ctypes.c_void_p], None
    fn(address or None)


_legacy_registered: set[str] = set()


def _register_legacy(name: str, op: str) -> None:
    if name in _legacy_registered:
        return
    import torch_xla

    _legacy_status_hook()
    symbol = _xla_legacy.OPS[op][1]
    address = ctypes.cast(getattr(_native.lib(), symbol), ctypes.c_void_p).value
    torch_xla._XLAC._xla_register_custom_call_target(name, _capsule(address), "CUDA")
    _legacy_registered.add(name)


def _dtype(x) -> torch.dtype:
    return x if isinstance(x, torch.dtype) else getattr(torch, x)


def emit(op: str, target: str, operands, results, attributes: dict, legacy_fields: dict,
         aliases=None, operand_order=None):
    """Results of `target` (e.g. xla_attn_flash_fwd_v1) on `operands` (XLA tensors; an
    absent optional operand is a zero-element tensor) as a list of XLA tensors.

    results: [(shape, torch dtype)]. legacy_fields: the scalar fields of `op`'s legacy
    descriptor. aliases {result: operand}: results written in place over operands;
    the call then goes through a one-instruction HLO computation (see _hlo_module),
    whose parameters torch_xla receives in `operand_order` (default: operand order)."""
    import torch_xla
    from torch_xla.experimental.stablehlo_custom_call import stablehlo_custom_call

    if flavour() == "typed":
        config = mlir_attributes(attributes).encode()
        name = salted(target, config)
        _xla_ffi_registry.register(name, target, "Host")
        api_version = TYPED_FFI
    else:
        config = _xla_legacy.encode(op, _xla_legacy.present_mask(*operands), **legacy_fields)
        name = salted(target + "_legacy", config)
        _register_legacy(name, op)
        api_version = STATUS_RETURNING
    shapes = [[int(d) for d in shape] for shape, _ in results]
    dtypes = [_dtype(dtype) for _, dtype in results]
    if not aliases:
        out = stablehlo_custom_call(list(operands), name, shapes, dtypes, False, config,
                                    api_version)
        return [out] if len(results) == 1 else list(out)
    order = list(operand_order or range(len(operands)))
    params = [(_ops.dtype_name(operands[i]), _ops.shape(operands[i])) for i in order]
    computation = _computation(
        name, tuple(params), tuple(order.index(j) for j in range(len(operands))),
        tuple((str(d).removeprefix("torch."), tuple(s)) for s, d in zip(shapes, dtypes)),
        config, api_version, tuple(sorted(aliases.items())))
    return list(torch_xla._XLAC._xla_user_computation(
        f"xla_attn::{name}", [operands[i] for i in order], computation))


@functools.lru_cache(maxsize=512)
def _computation(name, params, operand_params, results, config, api_version, aliases):
    import torch_xla

    proto = _hlo_module.custom_call_module("xla_attn_call", name, params, operand_params,
                                           results, config, api_version, dict(aliases))
    return torch_xla._XLAC._xla_op_computation_from_module_proto(f"xla_attn::{name}", proto)

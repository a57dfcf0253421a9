"""Registers our typed FFI handlers inside torch_xla's own XLA, which has no call for it
on the CPU (`_xla_register_custom_call_target` serves only untyped CUDA targets).

XLA keeps its handler registry behind `xla::ffi::GetXlaFfiApi()`, whose
`XLA_FFI_Handler_Register` is what `jax.ffi.register_ffi_target` ends in. torch_xla
links XLA statically into `_XLAC*.so` and does not export that function, but its
symbol table (`.symtab`, present because the library is not stripped) names it; its
address is the library's load bias plus the symbol's value. The native library then
registers the handler through that api pointer (`xla_attn_ffi_register`)."""

from __future__ import annotations

import ctypes
import functools
import os
import struct

from xla_attn import _native

# xla::ffi::GetXlaFfiApi(), Itanium-mangled.
_GET_API = "_ZN3xla3ffi12GetXlaFfiApiEv"


class RegistrationError(RuntimeError):
    """Our handlers cannot be registered in this torch_xla (the message says why)."""


def _xla_library() -> str:
    import torch_xla

    path = getattr(torch_xla._XLAC, "__file__", None)
    if not path:
        raise RegistrationError("xla_attn: cannot locate torch_xla's native library (_XLAC)")
    return os.path.realpath(path)


def _symbol_value(path: str, name: str) -> int:
    """st_value of `name` in the ELF symbol table of `path` (0: absent).

    pyelftools parses the headers; the half-million-entry table is scanned with
    `struct` (pyelftools' per-symbol objects take tens of seconds there)."""
    try:
        from elftools.elf.elffile import ELFFile
    except ImportError as e:
        raise RegistrationError(
            "xla_attn: registering custom calls in torch_xla needs pyelftools "
            "(pip install pyelftools)") from e
    with open(path, "rb") as f:
        elf = ELFFile(f)
        if elf.elfclass != 64 or not elf.little_endian:
            raise RegistrationError(f"xla_attn: {path} is not a 64-bit little-endian ELF file")
        symtab = elf.get_section_by_name(".symtab")
        if symtab is None:
            raise RegistrationError(
                f"xla_attn: {path} has no symbol table (stripped), so XLA's FFI registry "
                f"({_GET_API}) cannot be found; use an unstripped torch_xla wheel from PyPI")
        strtab = elf.get_section(symtab["sh_link"]).data()
        table = symtab.data()
    key = b"\0" + name.encode() + b"\0"
    at = strtab.find(key)
    if at < 0:
        return 0
    name_offset = at + 1
    for st_name, _, _, _, st_value, _ in struct.iter_unpack("<IBBHQQ", table):
        if st_name == name_offset and st_value:
            return st_value
    return 0


class _PhdrInfo(ctypes.Structure):
    _fields_ = [("dlpi_addr", ctypes.c_uint64), ("dlpi_name", ctypes.c_char_p)]


_PHDR_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_PhdrInfo), ctypes.c_size_t,
                                  ctypes.c_void_p)


def _load_bias(path: str) -> int:
    """Where the dynamic loader put `path` (dl_iterate_phdr's dlpi_addr)."""
    found = []

    def visit(info, _size, _data):
        name = info.contents.dlpi_name
        if name and os.path.realpath(name.decode()) == path:
            found.append(info.contents.dlpi_addr)
            return 1
        return 0

    libc = ctypes.CDLL(None)
    libc.dl_iterate_phdr(_PHDR_CALLBACK(visit), None)
    if not found:
        raise RegistrationError(f"xla_attn: {path} is not loaded in this process")
    return found[0]


@functools.cache
def ffi_api() -> int:
    """Address of torch_xla's XLA_FFI_Api (what xla::ffi::GetXlaFfiApi() returns)."""
    path = _xla_library()
    value = _symbol_value(path, _GET_API)
    if not value:
        raise RegistrationError(
            f"xla_attn: {path} does not contain {_GET_API} (XLA's FFI registry), so typed "
            "custom calls cannot be registered in this torch_xla build")
    get_api = ctypes.CFUNCTYPE(ctypes.c_void_p)(_load_bias(path) + value)
    api = get_api()
    if not api:
        raise RegistrationError("xla_attn: torch_xla's GetXlaFfiApi() returned null")
    return api


@functools.cache
def _native_register():
    fn = _native.lib()["xla_attn_ffi_register"]
    fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                   ctypes.c_char_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_registered: set[tuple[str, str]] = set()


def register(name: str, target: str, platform: str = "Host") -> None:
    """Registers the handler of `target` (e.g. xla_attn_flash_fwd_v1) under `name` for
    `platform` ("Host" or "CUDA") in torch_xla's XLA; a name is registered once."""
    if (name, platform) in _registered:
        return
    error = ctypes.create_string_buffer(2048)
    if _native_register()(ffi_api(), name.encode(), target.encode(), platform.encode(), error,
                          len(error)):
        raise RegistrationError(error.value.decode(errors="replace"))
    _registered.add((name, platform))

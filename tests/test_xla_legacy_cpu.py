"""The legacy (untyped, api_version 2) custom calls that torch_xla <= 2.8 on CUDA can
register: the opaque descriptor written by src/xla_attn/_xla_legacy.py and read by
kernels/ffi/legacy.cc. The CUDA handlers cannot run without a GPU; the same decoding
runs on the Host through the C ABI (`xla_attn_legacy_run`), and the CUDA handlers'
refusals of a bad descriptor (which happen before any GPU work) report through the
XlaCustomCallStatus function they are given."""

import ctypes
import struct

import numpy as np
import pytest

from xla_attn import _native, _xla_legacy
from xla_attn.testing import reference as ref

CODES = _native.DTYPE_CODES


def _lib():
    lib = _native.lib()
    run = lib["xla_attn_legacy_run"]
    run.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                    ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    run.restype = ctypes.c_int
    size = lib["xla_attn_legacy_descriptor_size"]
    size.argtypes, size.restype = [ctypes.c_int], ctypes.c_size_t
    return lib, run, size


def legacy_run(descriptor: bytes, arrays, platform: int = 0,
               address=lambda a: a.ctypes.data) -> str:
    """Runs a descriptor over buffers (None: absent): numpy arrays on the Host (platform
    0), or any buffers whose device `address` the caller gives (CUDA: 1, on the null
    stream); returns the error message ("" on success)."""
    _, run, _ = _lib()
    pointers = (ctypes.c_void_p * len(arrays))(
        *[None if a is None else address(a) for a in arrays])
    error = ctypes.create_string_buffer(1024)
    status = run(platform, None, pointers, descriptor, len(descriptor), error, len(error))
    assert (status == 0) == (error.value == b"")
    return error.value.decode()


@pytest.mark.parametrize("op", list(_xla_legacy.OPS))
def test_descriptor_layout_matches_the_library(op):
    code = _xla_legacy.OPS[op][0]
    assert _xla_legacy.size(op) == _lib()[2](code)
    fields = {name: i + 1 for i, (name, _) in enumerate(_xla_legacy.OPS[op][2])}
    data = _xla_legacy.encode(op, 0b101, **fields)
    assert data[:4] == b"XATL" and len(data) == _xla_legacy.size(op)
    decoded = _xla_legacy.decode(op, data)
    assert decoded["op"] == code and decoded["present"] == 0b101
    assert all(decoded[name] == value for name, value in fields.items())
    with pytest.raises(TypeError, match="missing"):
        _xla_legacy.encode(op, 0)


def flash_descriptor(q, k, cu, out_dtype, present, **over):
    fields = dict(total_q=q.shape[0], total_k=k.shape[0], workspace_bytes=0,
                  batch=len(cu) - 1, num_heads=q.shape[1], num_heads_k=k.shape[1],
                  head_dim=q.shape[2], max_seqlen_q=16, max_seqlen_k=16, num_blocks=0,
                  block_size=0, max_blocks_per_seq=0, alibi_batch_stride=0, window_left=-1,
                  window_right=0, softmax_scale=0.25, softcap=0.0, q_dtype=CODES["float32"],
                  kv_dtype=CODES["float32"], out_dtype=CODES[out_dtype])
    return _xla_legacy.encode("flash_fwd", present, **(fields | over))


def test_flash_fwd_and_bwd_through_descriptors(rng, mk):
    q, k, v, cu, _ = mk.varlen_inputs(rng, "float32", [5, 9], [5, 9])
    alibi = mk.alibi(rng, 4)
    out = np.full(q.shape, np.nan, np.float32)
    lse = np.full((4, q.shape[0]), np.nan, np.float32)
    buffers = [q, k, v, cu, cu, None, None, alibi, None, None, None, out, lse,
               np.zeros(1, np.uint8)]
    present = _xla_legacy.present_mask(*[None if b is None else b for b in buffers[:11]])
    assert present == 0b00010011111
    assert legacy_run(flash_descriptor(q, k, cu, "float32", present), buffers) == ""
    out_ref, lse_ref = ref.flash_attn_varlen_ref(q, k, v, cu, cu, 0.25, causal=True,
                                                 alibi_slopes=alibi)
    assert ref.rel_error(out, out_ref) < 1e-5 and ref.rel_error(lse, lse_ref) < 1e-5

    dout = mk.random_array(rng, q.shape, "float32")
    grads = [np.full(x.shape, np.nan, np.float32) for x in (q, k, v)]
    fields = dict(total_q=q.shape[0], total_k=k.shape[0], batch=2, num_heads=4, num_heads_k=2,
                  head_dim=32, max_seqlen_q=9, max_seqlen_k=9, alibi_batch_stride=0,
                  window_left=-1, window_right=0, softmax_scale=0.25, softcap=0.0,
                  dtype=CODES["float32"])
    bwd = _xla_legacy.encode("flash_bwd", 1 << 9, **fields)
    assert legacy_run(bwd, [dout, q, k, v, out, lse, cu, cu, None, alibi, *grads]) == ""
    expected = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu, cu, 0.25, causal=True,
                                             alibi_slopes=alibi)
    for g, e in zip(grads, expected):
        assert ref.rel_error(g, e) < 1e-5

    # v3: softmax_lse's cotangent as buffer 10, a 0-byte workspace after dq dk dv
    dlse = mk.random_array(rng, lse.shape, "float32")
    grads = [np.full(x.shape, np.nan, np.float32) for x in (q, k, v)]
    bwd = _xla_legacy.encode("flash_bwd_v3", (1 << 9) | (1 << 10), **fields, workspace_bytes=0)
    assert legacy_run(bwd, [dout, q, k, v, out, lse, cu, cu, None, alibi, dlse, *grads,
                            np.zeros(1, np.uint8)]) == ""
    expected = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu, cu, 0.25, causal=True,
                                             alibi_slopes=alibi, dlse=dlse)
    for g, e in zip(grads, expected):
        assert ref.rel_error(g, e) < 1e-5


def test_paged_attention_and_cache_write_through_descriptors(rng, mk):
    lens, qlens = [9, 6], [3, 1]
    query = mk.random_array(rng, (4, 4, 32), "float32")
    kc, vc, table = mk.paged_kv(rng, "float32", lens, 4)
    qsl, seq_lens = mk.cu_seqlens(qlens), np.asarray(lens, np.int32)
    out = np.full(query.shape, np.nan, np.float32)
    desc = _xla_legacy.encode(
        "paged_attention", 0, total_q=4, workspace_bytes=0, max_num_seqs=2, num_heads=4,
        num_heads_k=2, head_dim=32, num_blocks=kc.shape[0], block_size=4,
        max_blocks_per_seq=table.shape[1], sliding_window=0, scale=0.2, soft_cap=0.0,
        q_dtype=CODES["float32"], cache_dtype=CODES["float32"])
    assert legacy_run(desc, [query, kc, vc, seq_lens, table, qsl, None, None, None, out,
                             np.zeros(1, np.uint8)]) == ""
    expected = ref.paged_attention_ref(query, kc, vc, seq_lens, table, qsl, 0.2)
    assert ref.rel_error(out, expected) < 1e-5

    key, value = (mk.random_array(rng, (5, 2, 32), "float32") for _ in range(2))
    slots = np.asarray([3, -1, 7, 0, 12], np.int64)
    new_k, new_v = kc.copy(), vc.copy()  # results apart from the operands: copied over
    desc = _xla_legacy.encode(
        "reshape_and_cache_flash", 0, num_tokens=5, num_slots=kc.shape[0] * 4, num_heads_k=2,
        head_dim=32, block_size=4, num_blocks=kc.shape[0], src_dtype=CODES["float32"],
        cache_dtype=CODES["float32"], slot_dtype=CODES["int64"])
    new_k[:] = np.nan
    assert legacy_run(desc, [key, value, kc, vc, slots, None, None, new_k, new_v]) == ""
    k_ref, v_ref = ref.reshape_and_cache_flash_ref(key, value, kc, vc, slots)
    ref.assert_bits_equal(new_k, k_ref)
    ref.assert_bits_equal(new_v, v_ref)


def paged_v2_descriptor(query, kc, table, present, **over):
    fields = dict(total_q=query.shape[0], workspace_bytes=0, max_num_seqs=table.shape[0],
                  num_heads=query.shape[1], num_heads_k=kc.shape[2], head_dim=query.shape[2],
                  num_blocks=kc.shape[0], block_size=kc.shape[1],
                  max_blocks_per_seq=table.shape[1], sliding_window=0, scale=0.2, soft_cap=0.0,
                  q_dtype=CODES["float32"], cache_dtype=CODES["float32"], max_query_len=0)
    return _xla_legacy.encode("paged_attention_v2", present, **(fields | over))


def test_paged_attention_v2_descriptor_carries_alibi_and_max_query_len(rng, mk):
    """Op 5 (xla_attn_paged_attention_v2's body): buffer 9 is alibi_slopes, the body
    ends with max_query_len, which the Host checks against query_start_loc. The v1 body
    (op 3) is unchanged and still decodes (test above)."""
    lens, qlens = [9, 6, 13], [3, 1, 2]
    query = mk.random_array(rng, (7, 4, 32), "float32")
    kc, vc, table = mk.paged_kv(rng, "float32", lens, 4)
    qsl, seq_lens = mk.cu_seqlens(qlens), np.asarray(lens, np.int32)
    alibi = mk.alibi(rng, 4)
    out = np.full(query.shape, np.nan, np.float32)
    buffers = [query, kc, vc, seq_lens, table, qsl, None, None, None, alibi, out,
               np.zeros(1, np.uint8)]
    present = _xla_legacy.present_mask(*buffers[:10])
    assert present == 0b1000111111
    assert _xla_legacy.size("paged_attention_v2") == _xla_legacy.size("paged_attention") + 4
    desc = paged_v2_descriptor(query, kc, table, present, sliding_window=5, soft_cap=4.0,
                               max_query_len=3)
    assert legacy_run(desc, buffers) == ""
    expected = ref.paged_attention_ref(query, kc, vc, seq_lens, table, qsl, 0.2,
                                       sliding_window=5, soft_cap=4.0, alibi_slopes=alibi)
    assert ref.rel_error(out, expected) < 1e-5
    plain = ref.paged_attention_ref(query, kc, vc, seq_lens, table, qsl, 0.2, sliding_window=5,
                                    soft_cap=4.0)
    assert ref.rel_error(out, plain) > 0.05
    # alibi_slopes absent (its present bit clear): no bias even with a buffer in the slot
    assert legacy_run(paged_v2_descriptor(query, kc, table, present & ~(1 << 9), sliding_window=5,
                                          soft_cap=4.0), buffers) == ""
    assert ref.rel_error(out, plain) < 1e-5
    message = legacy_run(paged_v2_descriptor(query, kc, table, present, max_query_len=2), buffers)
    assert message == ("paged_attention: sequence 0 has 3 queries (query_start_loc), more than "
                       "max_query_len = 2")
    # a v1 descriptor handed to the v2 op code's layout is refused by size
    v1 = _xla_legacy.encode("paged_attention", 0, **{
        n: v for n, v in _xla_legacy.decode("paged_attention_v2", desc).items()
        if n not in ("magic", "version", "op", "size", "present", "max_query_len")})
    wrong = v1[:6] + struct.pack("<H", 5) + v1[8:]
    assert "op 5 takes 84 bytes, got 80" in legacy_run(wrong, buffers)


def _valid():
    q = np.zeros((4, 2, 8), np.float32)
    return flash_descriptor(q, q, [0, 4], "float32", 0)


@pytest.mark.parametrize("corrupt,message", [
    (lambda d: b"NOPE" + d[4:], "bad magic"),
    (lambda d: d[:4] + struct.pack("<H", 2) + d[6:], "version 2, this library reads version 1"),
    (lambda d: d[:-4], "takes 108 bytes, got 104"),
    (lambda d: d[:8] + struct.pack("<I", 100) + d[12:], "header says 100"),
    (lambda d: d[:6] + struct.pack("<H", 9) + d[8:], "unknown op 9"),
    (lambda d: d[:10], "shorter than its header"),
])
def test_descriptor_mismatch_is_refused(corrupt, message):
    buffers = [np.zeros(64, np.float32) for _ in range(14)]
    assert message in legacy_run(corrupt(_valid()), buffers)


def test_cuda_handler_reports_a_bad_descriptor_through_the_status():
    """No GPU needed: the handler refuses the descriptor before touching the device."""
    lib = _lib()[0]
    messages = []
    callback_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)
    callback = callback_type(lambda status, msg, n: messages.append(ctypes.string_at(msg, n)))
    set_status = lib["xla_attn_legacy_set_status_function"]
    set_status.argtypes, set_status.restype = [ctypes.c_void_p], None
    set_status(ctypes.cast(callback, ctypes.c_void_p))
    try:
        handler = lib["XlaAttnPagedAttentionV1Legacy"]
        handler.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                            ctypes.c_void_p]
        handler.restype = None
        descriptor = _valid()  # a flash_fwd descriptor handed to the paged handler
        status = ctypes.c_int(0)
        handler(None, None, descriptor, len(descriptor), ctypes.addressof(status))
    finally:
        set_status(None)
    assert messages == [b"xla_attn legacy descriptor: written for op 1, passed to the handler "
                        b"of op 3"]

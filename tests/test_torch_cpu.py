"""The PyTorch frontend (xla_attn.torch) on CPU tensors: every op against the float64
NumPy reference, gradients, the in-place cache write, torch.library.opcheck,
torch.compile(fullgraph=True), errors and routing.

The `check_*` functions take the device, so tests/gpu/test_torch_gpu.py runs the very
same cases on CUDA tensors."""

import contextlib
import ctypes
import re

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xla_attn  # noqa: E402
from xla_attn import _capi  # noqa: E402
from xla_attn import torch as xt  # noqa: E402

from xla_attn.testing import reference as ref  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

LSE_BOUND = 1e-5  # softmax_lse is float32 whatever the input dtype
_VIEWS = {"bfloat16": (np.uint16, torch.bfloat16), "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn),
          "float8_e5m2": (np.uint8, torch.float8_e5m2)}
_NP_OF_TORCH = {torch.bfloat16: ml_dtypes.bfloat16, torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
                torch.float8_e5m2: ml_dtypes.float8_e5m2}


# ------------------------------------------------------------------ numpy <-> torch
def tt(x, device="cpu"):
    """A numpy array (ml_dtypes for bf16/fp8) as a fresh torch tensor, bits kept."""
    if x is None:
        return None
    x = np.ascontiguousarray(x)
    view = _VIEWS.get(x.dtype.name)
    t = torch.from_numpy(x.view(view[0])).view(view[1]) if view else torch.from_numpy(x)
    return t.to(device).clone()


def nn(t):
    """A torch tensor as numpy (ml_dtypes for bf16/fp8), bits kept."""
    t = t.detach().cpu().contiguous()
    if t.dtype in _NP_OF_TORCH:
        bits = t.view(torch.uint16 if t.dtype == torch.bfloat16 else torch.uint8).numpy()
        return bits.view(_NP_OF_TORCH[t.dtype])
    return t.numpy()


def assert_close(out, expected, bound, what="out"):
    err = ref.rel_error(nn(out), expected)
    assert err < bound, f"{what}: relative error {err:.3g} >= {bound:g}"


# ------------------------------------------------------------------ flash attention
FLASH_CASES = {
    "plain": dict(lens_q=[5, 9], lens_k=[5, 9]),
    "causal_gqa_padded": dict(lens_q=[3, 8, 0], lens_k=[7, 8, 4], pad_q=3, pad_k=2, causal=True),
    "window_softcap": dict(lens_q=[6, 10], lens_k=[9, 10], window_size=(3, 2), softcap=5.0),
    "alibi_seqused": dict(lens_q=[4, 6], lens_k=[8, 9], alibi=(2, 4), seqused_k=[5, 9],
                          causal=True),
    "mqa_empty_rows": dict(lens_q=[7], lens_k=[4], heads_k=1, causal=True, alibi=(4,)),
}
GRAD_CASES = ("causal_gqa_padded", "window_softcap", "alibi_seqused")


def flash_case(rng, mk, device, dtype, case):
    """(numpy inputs for the reference, torch inputs, keyword arguments)."""
    c = dict(FLASH_CASES[case])
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, c["lens_q"], c["lens_k"],
                                           heads_k=c.get("heads_k", 2), pad_q=c.get("pad_q", 0),
                                           pad_k=c.get("pad_k", 0))
    kw = dict(causal=c.get("causal", False), window_size=c.get("window_size", (-1, -1)),
              softcap=c.get("softcap", 0.0))
    arrays = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                  alibi_slopes=mk.alibi(rng, *c["alibi"]) if "alibi" in c else None,
                  seqused_k=np.asarray(c["seqused_k"], np.int32) if "seqused_k" in c else None)
    tensors = {name: tt(x, device) for name, x in arrays.items()}
    return arrays, tensors, kw


def check_flash_varlen(rng, mk, device, dtype, case):
    a, t, kw = flash_case(rng, mk, device, dtype, case)
    out, lse = xt.flash_attn_varlen(**t, max_seqlen_q=10, max_seqlen_k=10, softmax_scale=0.3,
                                    return_softmax_lse=True, **kw)
    assert out.dtype == t["q"].dtype and out.shape == t["q"].shape and out.device == t["q"].device
    assert lse.dtype == torch.float32 and lse.shape == (t["q"].shape[1], t["q"].shape[0])
    out_ref, lse_ref = ref.flash_attn_varlen_ref(**a, softmax_scale=0.3, **kw)
    assert_close(out, out_ref, ref.BOUNDS[dtype])
    assert_close(lse, lse_ref, LSE_BOUND, "softmax_lse")
    # rows past cu_seqlens_q[-1] are padding: zero out, +inf lse
    total = int(a["cu_seqlens_q"][-1])
    assert not out[total:].any() and torch.isinf(lse[:, total:]).all()


def check_flash_paged(rng, mk, device, dtype):
    lens_q, lens_k = [3, 5, 1], [7, 13, 4]
    q = mk.random_array(rng, (sum(lens_q) + 2, 4, 32), dtype)
    k, v, table = mk.paged_kv(rng, dtype, lens_k, block_size=4)
    cu_q, cu_k = mk.cu_seqlens(lens_q), mk.cu_seqlens(lens_k)
    out = xt.flash_attn_varlen(tt(q, device), tt(k, device), tt(v, device), tt(cu_q, device),
                               tt(cu_k, device), 5, 13, causal=True,
                               block_table=tt(table, device))
    out_ref, _ = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True,
                                           block_table=table)
    assert_close(out, out_ref, ref.BOUNDS[dtype])


def check_flash_fp8(rng, mk, device):
    lens = [5, 7]
    q, k, v = (mk.fp8_cache(rng, (12, 4, 32), "float8_e4m3fn", scale=2.0) for _ in range(3))
    cu = mk.cu_seqlens(lens)
    scales = [mk.f32(s) for s in (0.5, 0.25, 2.0)]
    out = xt.flash_attn_varlen(tt(q, device), tt(k, device), tt(v, device), tt(cu, device),
                               tt(cu, device), 7, 7, causal=True,
                               q_descale=tt(scales[0], device), k_descale=tt(scales[1], device),
                               v_descale=tt(scales[2], device))
    assert out.dtype == torch.bfloat16
    out_ref, _ = ref.flash_attn_varlen_ref(q, k, v, cu, cu, None, causal=True, q_descale=scales[0],
                                           k_descale=scales[1], v_descale=scales[2])
    # on an sm_90 GPU the Hopper fp8 kernel runs, which rounds P to e4m3
    hopper = str(device).startswith("cuda") and torch.cuda.get_device_capability() == (9, 0)
    assert_close(out, out_ref, ref.FP8_P_BOUND if hopper else ref.BOUNDS["bfloat16"])


def check_flash_dense(rng, mk, device, dtype):
    q = mk.random_array(rng, (2, 5, 4, 32), dtype)
    k = mk.random_array(rng, (2, 7, 2, 32), dtype)
    v = mk.random_array(rng, (2, 7, 2, 32), dtype)
    kw = dict(causal=True, softcap=4.0)
    out, lse = xt.flash_attn(tt(q, device), tt(k, device), tt(v, device), return_softmax_lse=True,
                             **kw)
    assert out.shape == q.shape and lse.shape == (2, 4, 5) and lse.is_contiguous()
    out_ref, lse_ref = ref.flash_attn_ref(q, k, v, **kw)
    assert_close(out, out_ref, ref.BOUNDS[dtype])
    assert_close(lse, lse_ref, LSE_BOUND, "softmax_lse")
    only = xt.flash_attn(tt(q, device), tt(k, device), tt(v, device), **kw)
    assert torch.equal(only, out)


class _OpCalls(TorchDispatchMode):
    """The names of the dispatcher ops run inside it (the backward's included)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def check_flash_grad(rng, mk, device, dtype, case, deterministic=False, with_lse=False):
    """with_lse: the loss weighs softmax_lse too (rows without a key, lse = +inf, left out)."""
    a, t, kw = flash_case(rng, mk, device, dtype, case)
    for name in ("q", "k", "v"):
        t[name].requires_grad_(True)
    dout = mk.random_array(rng, a["q"].shape, dtype)
    out, lse = xt.flash_attn_varlen(**t, max_seqlen_q=10, max_seqlen_k=10,
                                    deterministic=deterministic, return_softmax_lse=True, **kw)
    dlse = None
    with _OpCalls() as calls:
        if with_lse:
            w = rng.standard_normal(tuple(lse.shape))
            lse_ref = ref.flash_attn_varlen_ref(**a, softmax_scale=None, **kw)[1]
            dlse = np.where(np.isfinite(lse_ref), w, 0.0)
            loss = (out.float() * tt(dout, device).float()).sum() + (
                torch.where(torch.isfinite(lse), lse, 0.0) * tt(w, device).float()).sum()
            loss.backward()
        else:
            out.backward(tt(dout, device))
    assert calls.names.count("xla_attn::flash_bwd") == 1  # lse's cotangent rides the same call
    grads_ref = ref.flash_attn_varlen_bwd_ref(dout, a["q"], a["k"], a["v"], a["cu_seqlens_q"],
                                              a["cu_seqlens_k"], None, **kw,
                                              alibi_slopes=a["alibi_slopes"],
                                              seqused_k=a["seqused_k"], dlse=dlse)
    for name, g_ref in zip("qkv", grads_ref):
        g = t[name].grad
        assert g.dtype == t[name].dtype and g.shape == t[name].shape
        assert_close(g, g_ref, ref.BOUNDS[dtype], f"d{name}")


def check_flash_dense_grad(rng, mk, device, dtype):
    q = mk.random_array(rng, (2, 6, 4, 16), dtype)
    k = mk.random_array(rng, (2, 9, 1, 16), dtype)
    v = mk.random_array(rng, (2, 9, 1, 16), dtype)
    dout = mk.random_array(rng, q.shape, dtype)
    tq, tk, tv = (tt(x, device).requires_grad_(True) for x in (q, k, v))
    xt.flash_attn(tq, tk, tv, causal=True).backward(tt(dout, device))
    for name, g, g_ref in zip("qkv", (tq.grad, tk.grad, tv.grad),
                              ref.flash_attn_bwd_ref(dout, q, k, v, causal=True)):
        assert_close(g, g_ref, ref.BOUNDS[dtype], f"d{name}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", list(FLASH_CASES))
def test_flash_varlen(rng, mk, dtype, case):
    check_flash_varlen(rng, mk, "cpu", dtype, case)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flash_paged(rng, mk, dtype):
    check_flash_paged(rng, mk, "cpu", dtype)


def test_flash_fp8(rng, mk):
    check_flash_fp8(rng, mk, "cpu")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_flash_dense(rng, mk, dtype):
    check_flash_dense(rng, mk, "cpu", dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", GRAD_CASES)
def test_flash_grad(rng, mk, dtype, case):
    check_flash_grad(rng, mk, "cpu", dtype, case)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", GRAD_CASES)
def test_flash_grad_through_softmax_lse(rng, mk, dtype, case):
    """softmax_lse is differentiable (as in xla_attn.jax): its cotangent adds p_ij dlse_i
    to dS, against the float64 backward with that term."""
    check_flash_grad(rng, mk, "cpu", dtype, case, with_lse=True)


def test_flash_bwd_op_checks_dlse(rng, mk):
    """The flash_bwd op's dlse (softmax_lse's cotangent) must be softmax_lse's shape and
    float32; given, it changes dq and dk against the op without it."""
    a, t, kw = flash_case(rng, mk, "cpu", "float32", GRAD_CASES[0])
    q, k, v = t["q"], t["k"], t["v"]
    out, lse = torch.ops.xla_attn.flash_fwd(q, k, v, t["cu_seqlens_q"], t["cu_seqlens_k"],
                                            None, None, None, None, None, None, 0.2, 0.0, -1, 0,
                                            10, 10)
    dout = tt(mk.random_array(rng, a["q"].shape, "float32"), "cpu")
    args = (dout, q, k, v, out, lse, t["cu_seqlens_q"], t["cu_seqlens_k"], None, None, 0.2, 0.0,
            -1, 0, 10, 10, False)
    with pytest.raises(ValueError, match=r"dlse must have softmax_lse's shape"):
        torch.ops.xla_attn.flash_bwd(*args, lse.t().contiguous())
    with pytest.raises(TypeError, match="dlse"):
        torch.ops.xla_attn.flash_bwd(*args, lse.double())
    plain = torch.ops.xla_attn.flash_bwd(*args)
    with_lse = torch.ops.xla_attn.flash_bwd(*args, torch.randn_like(lse))
    assert not torch.equal(plain[0], with_lse[0]) and torch.equal(plain[2], with_lse[2])


def test_flash_grad_deterministic(rng, mk):
    """deterministic=True reaches flash_bwd through autograd (its 18 inputs)."""
    check_flash_grad(rng, mk, "cpu", "bfloat16", GRAD_CASES[0], deterministic=True)


def test_flash_dense_grad(rng, mk):
    check_flash_dense_grad(rng, mk, "cpu", "float32")


def test_flash_non_contiguous_inputs(rng, mk):
    a, t, kw = flash_case(rng, mk, "cpu", "float32", "causal_gqa_padded")
    expected = xt.flash_attn_varlen(**t, **kw)
    strided = dict(t, q=t["q"].transpose(0, 1).contiguous().transpose(0, 1))
    assert not strided["q"].is_contiguous()
    assert torch.equal(xt.flash_attn_varlen(**strided, **kw), expected)


def test_no_grad_through_paged_kv(rng, mk):
    k, v, table = mk.paged_kv(rng, "float32", [5], block_size=4)
    q = torch.randn(3, 4, 32, requires_grad=True)
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32) for n in (3, 5))
    out = xt.flash_attn_varlen(q, tt(k), tt(v), cu_q, cu_k, block_table=tt(table))
    with pytest.raises(NotImplementedError, match="block_table"):
        out.sum().backward()


# ------------------------------------------------------------------ paged attention
PAGED_CASES = {
    "decode_gqa": dict(),
    "window_softcap": dict(sliding_window=5, soft_cap=8.0),
    "padded_batch": dict(num_seqs=3, pad_q=2),
    "mqa": dict(heads_k=1, sliding_window=3),
    "alibi_max_query_len": dict(alibi=True, max_query_len=3),
    "alibi_window_softcap": dict(alibi=True, sliding_window=5, soft_cap=8.0, num_seqs=3, pad_q=2),
}


def paged_extras(rng, mk, case):
    """alibi_slopes (numpy or None) and max_query_len of a PAGED_CASES entry."""
    c = PAGED_CASES[case]
    return (mk.alibi(rng, 4) if c.get("alibi") else None), c.get("max_query_len")


def check_paged(rng, mk, device, dtype, case, cache=None, kv_cache_dtype="auto"):
    """`cache`: None (query's dtype), "float8_e4m3fn"/"float8_e5m2", or "uint8:<format>"."""
    c = PAGED_CASES[case]
    lens, qlens, block_size, heads_k = [9, 1, 17, 6], [3, 1, 2, 2], 4, c.get("heads_k", 2)
    query = mk.random_array(rng, (sum(qlens) + c.get("pad_q", 0), 4, 32), dtype)
    kc, vc, table = mk.paged_kv(rng, dtype, lens, block_size, heads_k=heads_k)
    k_scale = v_scale = None
    if cache is not None:
        fp8 = "float8_e5m2" if kv_cache_dtype == "fp8_e5m2" else "float8_e4m3fn"
        fp8 = cache if cache.startswith("float8") else fp8
        kc, vc = (mk.fp8_cache(rng, kc.shape, fp8) for _ in range(2))
        if cache == "uint8":
            kc, vc = kc.view(np.uint8), vc.view(np.uint8)
        k_scale, v_scale = mk.f32(0.5), mk.f32(1.5)
    qsl = mk.cu_seqlens(qlens)
    seq_lens = np.asarray(lens, np.int32)
    num_seqs = np.asarray(c["num_seqs"], np.int32) if "num_seqs" in c else None
    alibi, max_query_len = paged_extras(rng, mk, case)
    kw = dict(scale=0.2, sliding_window=c.get("sliding_window"), soft_cap=c.get("soft_cap"),
              kv_cache_dtype=kv_cache_dtype)
    out = xt.paged_attention(tt(query, device), tt(kc, device), tt(vc, device),
                             tt(seq_lens, device), tt(table, device), tt(qsl, device),
                             k_scale=tt(k_scale, device), v_scale=tt(v_scale, device),
                             num_seqs=tt(num_seqs, device), alibi_slopes=tt(alibi, device),
                             max_query_len=max_query_len, **kw)
    assert out.dtype == tt(query).dtype and out.shape == query.shape
    expected = ref.paged_attention_ref(query, kc, vc, seq_lens, table, qsl, **kw,
                                       k_scale=k_scale, v_scale=v_scale, num_seqs=num_seqs,
                                       alibi_slopes=alibi)
    assert_close(out, expected, ref.BOUNDS[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", list(PAGED_CASES))
def test_paged_attention(rng, mk, dtype, case):
    check_paged(rng, mk, "cpu", dtype, case)


@pytest.mark.parametrize("dtype,cache,fmt", [("bfloat16", "float8_e4m3fn", "auto"),
                                             ("float32", "float8_e5m2", "fp8_e5m2"),
                                             ("float16", "uint8", "fp8"),
                                             ("bfloat16", "uint8", "fp8_e5m2")])
def test_paged_attention_fp8(rng, mk, dtype, cache, fmt):
    check_paged(rng, mk, "cpu", dtype, "padded_batch", cache=cache, kv_cache_dtype=fmt)


# ------------------------------------------------------------------ cache write
CACHE_CASES = [  # (source dtype, cache dtype, kv_cache_dtype, slot dtype)
    ("float32", "float32", "auto", "int64"),
    ("bfloat16", "bfloat16", "auto", "int32"),
    ("float16", "float16", "auto", "int64"),
    ("bfloat16", "float8_e4m3fn", "auto", "int32"),
    ("float16", "float8_e5m2", "fp8_e5m2", "int64"),
    ("float32", "uint8", "fp8", "int32"),
    ("bfloat16", "uint8", "fp8_e5m2", "int64"),
]


def check_reshape_and_cache_flash(rng, mk, device, src, cache, fmt, slot_dtype, strided=False):
    num_blocks, block_size, heads_k, head_dim, tokens = 5, 4, 2, 16, 9
    shape = (num_blocks, block_size, heads_k, head_dim)
    key = mk.random_array(rng, (tokens, heads_k, head_dim), src, scale=100.0)
    value = mk.random_array(rng, (tokens, heads_k, head_dim), src, scale=100.0)
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(slot_dtype)
    slots[[1, 5]] = -1                                  # padding
    slots[7] = num_blocks * block_size + 3              # out of range: skipped too
    k_cache, v_cache = mk.random_bits(rng, shape, cache), mk.random_bits(rng, shape, cache)
    scales = (mk.f32(0.25), mk.f32([2.0])) if cache in ("uint8", "float8_e4m3fn",
                                                         "float8_e5m2") else (None, None)
    if strided:  # the two halves of one stacked (num_blocks, 2, ...) K/V tensor
        both = tt(np.stack([k_cache, v_cache], axis=1), device)
        tk, tv = both[:, 0], both[:, 1]
        assert not tk.is_contiguous()
    else:
        tk, tv = tt(k_cache, device), tt(v_cache, device)
    ptrs = tk.data_ptr(), tv.data_ptr()
    result = xt.reshape_and_cache_flash(tt(key, device), tt(value, device), tk, tv,
                                        tt(slots, device), fmt, tt(scales[0], device),
                                        tt(scales[1], device))
    assert result is None
    assert (tk.data_ptr(), tv.data_ptr()) == ptrs        # in place
    k_ref, v_ref = ref.reshape_and_cache_flash_ref(key, value, k_cache, v_cache, slots, fmt,
                                                   *(1.0 if s is None else s for s in scales))
    ref.assert_bits_equal(nn(tk), k_ref)               # untouched slots keep their bits
    ref.assert_bits_equal(nn(tv), v_ref)


@pytest.mark.parametrize("src,cache,fmt,slot_dtype", CACHE_CASES,
                         ids=["-".join(c) for c in CACHE_CASES])
def test_reshape_and_cache_flash(rng, mk, src, cache, fmt, slot_dtype):
    check_reshape_and_cache_flash(rng, mk, "cpu", src, cache, fmt, slot_dtype)


def test_reshape_and_cache_flash_strided_cache(rng, mk):
    check_reshape_and_cache_flash(rng, mk, "cpu", "bfloat16", "bfloat16", "auto", "int64", strided=True)


# ------------------------------------------------------------------ torch.library checks
def small_inputs(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return dict(q=r(10, 4, 32), k=r(12, 2, 32), v=r(12, 2, 32), cu_q=i32([0, 4, 10]),
                cu_k=i32([0, 5, 12]), kc=r(4, 4, 2, 32), vc=r(4, 4, 2, 32),
                slots=torch.randperm(16, generator=g)[:12].to(device),
                lens=i32([5, 7]), table=i32([[0, 1], [2, 3]]), alibi=torch.rand(2, 4).to(device))


def opcheck_case(case, device="cpu"):
    """(op overload, small arguments) for torch.library.opcheck."""
    s = small_inputs(device)
    ops = torch.ops.xla_attn
    fwd_attrs = (0.2, 0.0, -1, 0, 6, 7)
    u8 = (s["kc"] * 8).to(torch.float8_e4m3fn).view(torch.uint8)
    scale = torch.tensor(0.5, device=device)
    if case == "flash_fwd":
        q, k, v = (s[n].clone().requires_grad_(True) for n in "qkv")
        return ops.flash_fwd.default, (q, k, v, s["cu_q"], s["cu_k"], None, None, s["alibi"],
                                       None, None, None, *fwd_attrs)
    if case == "flash_fwd_paged":
        return ops.flash_fwd.default, (s["q"], s["kc"], s["vc"], s["cu_q"], s["cu_k"], s["lens"],
                                       s["table"], None, None, None, None, 0.2, 3.0, 2, -1, 6, 7)
    if case in ("flash_bwd", "flash_bwd_dlse"):
        out, lse = ops.flash_fwd(s["q"], s["k"], s["v"], s["cu_q"], s["cu_k"], None, None,
                                 s["alibi"], None, None, None, *fwd_attrs)
        dlse = (False, torch.randn_like(lse)) if case == "flash_bwd_dlse" else ()
        return ops.flash_bwd.default, (torch.randn_like(out), s["q"], s["k"], s["v"], out, lse,
                                       s["cu_q"], s["cu_k"], None, s["alibi"], *fwd_attrs, *dlse)
    if case == "paged_attention":
        return ops.paged_attention.default, (s["q"], u8, u8.clone(), s["lens"], s["table"],
                                             s["cu_q"], None, scale, scale, s["alibi"][0], 0.2,
                                             0.0, 4, "fp8_e4m3", 6)
    if case == "reshape_and_cache_flash":
        return ops.reshape_and_cache_flash.default, (s["k"], s["v"], s["kc"], s["vc"], s["slots"],
                                                     None, None, "auto")
    assert case == "reshape_and_cache_flash_fp8"
    return ops.reshape_and_cache_flash.default, (s["k"], s["v"], u8.clone(), u8.clone(),
                                                 s["slots"].to(torch.int32), scale, scale,
                                                 "fp8_e4m3")


OPCHECK_CASES = ["flash_fwd", "flash_fwd_paged", "flash_bwd", "flash_bwd_dlse",
                 "paged_attention", "reshape_and_cache_flash", "reshape_and_cache_flash_fp8"]


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case):
    op, args = opcheck_case(case, "cpu")
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"}, result


def attention_step(q, k, v, cu_q, cu_k, kc, vc, slots, lens, table):
    """What a serving step does: prefill attention, write K/V into the cache, then
    attend over the cache (through the top-level, routing functions)."""
    out = xla_attn.flash_attn_varlen(q, k, v, cu_q, cu_k, 6, 7, causal=True, softcap=3.0)
    xla_attn.reshape_and_cache_flash(k, v, kc, vc, slots)
    paged = xla_attn.paged_attention(q, kc, vc, lens, table, cu_q, 0.2, sliding_window=6)
    return out * 2, paged


def check_compile(device, backend):
    import torch._dynamo.testing  # not imported by torch itself (a lone run had no such module)

    torch._dynamo.reset()
    s = small_inputs(device, seed=1)
    args = [s[n] for n in ("q", "k", "v", "cu_q", "cu_k", "kc", "vc", "slots", "lens", "table")]
    eager_args = [a.clone() for a in args]
    cache_before = args[5].clone()
    expected = attention_step(*eager_args)
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(attention_step, fullgraph=True, backend=counter)
    got = compiled(*args)
    assert counter.frame_count == 1  # one graph, no breaks
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert torch.equal(args[5], eager_args[5]) and torch.equal(args[6], eager_args[6])
    assert not torch.equal(args[5], cache_before)  # the compiled write landed in place


def check_compile_grad(device, backend):
    torch._dynamo.reset()
    s = small_inputs(device, seed=2)

    def loss(q, k, v):
        return (xt.flash_attn_varlen(q, k, v, s["cu_q"], s["cu_k"], 6, 7, causal=True,
                                     alibi_slopes=s["alibi"]) ** 2).sum()

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend=backend)):
        q, k, v = (s[n].clone().requires_grad_(True) for n in "qkv")
        fn(q, k, v).backward()
        grads.append((q.grad, k.grad, v.grad))
    for g, e in zip(*grads):
        assert torch.equal(g, e)


def test_compile_fullgraph():
    check_compile("cpu", "aot_eager")


def test_compile_grad():
    check_compile_grad("cpu", "aot_eager")


# ------------------------------------------------------------------ errors, routing, C ABI
def test_errors_come_from_ops():
    s = small_inputs()
    with pytest.raises(ValueError) as info:
        xt.flash_attn_varlen(s["q"], s["k"][..., :16], s["v"][..., :16], s["cu_q"], s["cu_k"])
    assert str(info.value) == "flash_attn_varlen: k's head_dim (16) must equal q's (32)"
    with pytest.raises(TypeError) as info:
        xt.reshape_and_cache_flash(s["k"], s["v"], s["kc"].to(torch.uint8),
                                   s["vc"].to(torch.uint8), s["slots"])
    assert str(info.value) == ("reshape_and_cache_flash: a uint8 cache needs kv_cache_dtype "
                               "'fp8_e4m3' or 'fp8_e5m2'")


def test_direct_op_calls_are_checked_too():
    """torch.ops.xla_attn.* called without the public wrappers still refuse bad shapes
    before any pointer reaches the native code."""
    s = small_inputs()
    with pytest.raises(ValueError, match=r"^xla_attn::flash_fwd: v must have k's shape"):
        torch.ops.xla_attn.flash_fwd(s["q"], s["k"], s["v"][:5], s["cu_q"], s["cu_k"], None, None,
                                     None, None, None, None, 0.2, 0.0, -1, -1, 6, 7)
    with pytest.raises(ValueError, match="must have shape .num_tokens,."):
        torch.ops.xla_attn.reshape_and_cache_flash(s["k"], s["v"], s["kc"], s["vc"],
                                                   s["slots"][:3], None, None, "auto")
    with pytest.raises(ValueError, match="softmax_lse must have shape"):
        torch.ops.xla_attn.flash_bwd(s["q"], s["q"], s["k"], s["v"], s["q"], s["lens"].float(),
                                     s["cu_q"], s["cu_k"], None, None, 0.2, 0.0, -1, -1, 6, 7)


def test_paged_alibi_and_max_query_len_errors():
    """Bad alibi_slopes and max_query_len are refused by name; a max_query_len below a
    sequence's query count (query_start_loc [0, 4, 10]: 6 queries) is refused by the
    Host, which reads the counts."""
    s = small_inputs()
    args = (s["q"], s["kc"], s["vc"], s["lens"], s["table"], s["cu_q"], 0.2)
    with pytest.raises(ValueError) as info:
        xt.paged_attention(*args, alibi_slopes=s["alibi"])
    assert str(info.value) == ("paged_attention: alibi_slopes must have shape (num_heads,) = "
                               "(4,), got (2, 4)")
    with pytest.raises(TypeError) as info:
        xt.paged_attention(*args, alibi_slopes=s["alibi"][0].double())
    assert str(info.value) == "paged_attention: alibi_slopes must be float32, got float64"
    with pytest.raises(ValueError) as info:
        xt.paged_attention(*args, max_query_len=0)
    assert str(info.value) == "paged_attention: max_query_len must be >= 1, got 0"
    with pytest.raises(TypeError) as info:
        xt.paged_attention(*args, max_query_len=6.0)
    assert str(info.value) == "paged_attention: max_query_len must be an int, got float"
    with pytest.raises(RuntimeError) as info:
        xt.paged_attention(*args, max_query_len=5)
    assert str(info.value) == ("paged_attention: sequence 1 has 6 queries (query_start_loc), "
                               "more than max_query_len = 5")
    assert torch.equal(xt.paged_attention(*args, max_query_len=6), xt.paged_attention(*args))


def test_native_errors_raise_runtime_error():
    """A struct the library refuses comes back as RuntimeError(message)."""
    p = _capi.FlashFwdParams().fill(batch=1, num_heads=4, num_heads_k=3, head_dim=32)
    with pytest.raises(RuntimeError, match="num_heads .4. must be a multiple of num_heads_k .3."):
        _capi.flash_fwd(p, _capi.HOST)


def test_params_layout_is_checked(monkeypatch):
    class Short(ctypes.Structure):
        op = "reshape_and_cache_flash"
        _fields_ = [("key", ctypes.c_void_p)]

    monkeypatch.setitem(_capi.PARAMS, "reshape_and_cache_flash", Short)
    _capi._functions.cache_clear()
    try:
        with pytest.raises(ImportError, match="reshape_and_cache_flash params struct is 104 bytes"):
            _capi.check_layouts()
    finally:
        monkeypatch.undo()
        _capi._functions.cache_clear()
    _capi.check_layouts()


def test_routing_to_torch(rng, mk):
    s = small_inputs()
    out = xla_attn.flash_attn_varlen(s["q"], s["k"], s["v"], s["cu_q"], s["cu_k"], 6, 7)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, xt.flash_attn_varlen(s["q"], s["k"], s["v"], s["cu_q"], s["cu_k"], 6, 7))
    dense = xla_attn.flash_attn(s["q"][None], s["k"][None], s["v"][None])
    assert isinstance(dense, torch.Tensor) and dense.shape == (1, 10, 4, 32)
    kc = s["kc"].clone()
    assert xla_attn.reshape_and_cache_flash(s["k"], s["v"], kc, s["vc"].clone(), s["slots"]) is None
    assert torch.equal(kc.reshape(16, 2, 32)[s["slots"]], s["k"])
    paged = xla_attn.paged_attention(s["q"], kc, kc, s["lens"], s["table"], s["cu_q"], 0.2)
    assert isinstance(paged, torch.Tensor)


def test_routing_of_xla_tensors_needs_torch_xla():
    import importlib.util

    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("torch_xla is installed (tests/test_torch_xla_cpu.py covers the routing)")

    class FakeXlaTensor:  # stands in for a torch tensor on torch_xla's device
        __module__ = "torch"
        device = torch.device("xla")

    with pytest.raises(ImportError, match="xla_attn.torch_xla needs torch_xla"):
        xla_attn.paged_attention(FakeXlaTensor())


# ------------------------------------------------------------------ segment ids (dense API)
def test_segment_ids_pack_documents(rng, mk):
    """Packed documents in dense rows equal varlen attention over the segments; the
    device conversion (static slots, no sync) agrees with the host one."""
    from xla_attn import _ops, _torch_segments

    seg = np.asarray([[7, 7, 7, 2, 2, 2, 2, 2], [3, 3, 4, 4, 4, 4, 5, 5]], np.int32)
    q = mk.random_array(rng, (2, 8, 4, 16), "float32")
    k, v = (mk.random_array(rng, (2, 8, 2, 16), "float32") for _ in range(2))
    cu, _, max_q, _ = _ops.segment_ids_to_cu_seqlens(seg, seg)
    assert cu.tolist() == [0, 3, 8, 10, 14, 16] and max_q == 5
    out = xt.flash_attn(tt(q), tt(k), tt(v), causal=True, q_segment_ids=tt(seg),
                        kv_segment_ids=tt(seg))
    expected, _ = ref.flash_attn_varlen_ref(q.reshape(16, 4, 16), k.reshape(16, 2, 16),
                                            v.reshape(16, 2, 16), cu, cu, None, causal=True)
    assert_close(out.reshape(16, 4, 16), expected, ref.BOUNDS["float32"])
    on_device = _torch_segments._run_table(tt(seg), slots=6)[0]
    assert on_device.tolist() == cu.tolist() + [16]  # the unused slot is empty
    with pytest.raises(ValueError, match="same ids in the same order"):
        xt.flash_attn(tt(q), tt(k), tt(v), q_segment_ids=tt(seg), kv_segment_ids=tt(seg[:, ::-1]))
    with pytest.raises(ValueError, match="given together"):
        xt.flash_attn(tt(q), tt(k), tt(v), q_segment_ids=tt(seg))
    with pytest.raises(ValueError, match=re.escape(
            "q_segment_ids must have shape (batch, seqlen_q) = (2, 8), got (2, 7)")):
        xt.flash_attn(tt(q), tt(k), tt(v), q_segment_ids=tt(seg[:, :7]), kv_segment_ids=tt(seg))
    with pytest.raises(ValueError, match=re.escape(
            "kv_segment_ids must have shape (batch, seqlen_k) = (2, 8), got (1, 8)")):
        xt.flash_attn(tt(q), tt(k), tt(v), q_segment_ids=tt(seg), kv_segment_ids=tt(seg[:1]))
    with pytest.raises(ValueError, match="appears in more than one run"):
        split = np.asarray([[7, 7, 2, 2, 7, 7, 2, 2]] * 2, np.int32)
        xt.flash_attn(tt(q), tt(k), tt(v), q_segment_ids=tt(split), kv_segment_ids=tt(split))


# ------------------------------------------------------------------ eager calls past the dispatcher
class _NoTorchFunction(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_direct_calls_only_where_nothing_watches():
    """xt._direct: an eager call runs an op's work itself only on plain tensors with no
    gradient asked, outside torch function / dispatch modes, functorch and the profiler."""
    s = small_inputs()
    q, k = s["q"], s["k"]
    assert xt._direct((q, k, None))
    grad_q = q.clone().requires_grad_(True)
    assert not xt._direct((grad_q, k), differentiable=(grad_q,))
    with torch.no_grad():
        assert xt._direct((grad_q, k), differentiable=(grad_q,))
    assert xt._direct((grad_q, k))  # a gradient the op does not give is none asked
    with _OpCalls():
        assert not xt._direct((q, k))
    with _NoTorchFunction():
        assert not xt._direct((q, k))
    with torch.profiler.profile():
        assert not xt._direct((q, k))
    seen = []
    torch.func.vmap(lambda x: seen.append(xt._direct((x,))) or x)(q)
    assert seen == [False]

    class Sub(torch.Tensor):
        pass
    assert not xt._direct((q.as_subclass(Sub), k))
    # another device's tensors (torch_xla's; meta here) take the op, which has their kernel
    meta = torch.empty(q.shape, device="meta")
    assert not xt._direct((meta, k))
    assert xt._signature("v", (meta, k), ()) is None


def test_direct_and_op_calls_agree(rng, mk):
    """The same calls through the dispatcher (a dispatch mode watching) and past it: the
    same bits; the cache write bumps the caches' autograd versions either way."""
    s = small_inputs()
    lens = s["lens"]
    qd = torch.randn(2, 4, 32)
    runs = {
        "xla_attn::flash_fwd": lambda: xt.flash_attn_varlen(
            s["q"], s["k"], s["v"], s["cu_q"], s["cu_k"], 6, 7, causal=True, softcap=3.0,
            return_softmax_lse=True),
        "xla_attn::paged_attention": lambda: xt.paged_attention(
            qd, s["kc"], s["vc"], lens, s["table"], torch.arange(3, dtype=torch.int32), 0.3,
            max_query_len=1),
    }
    for name, run in runs.items():
        direct = run()
        with _OpCalls() as calls:
            via_op = run()
        assert name in calls.names
        for a, b in zip(torch.utils._pytree.tree_leaves(direct),
                        torch.utils._pytree.tree_leaves(via_op)):
            assert torch.equal(a, b), name
    written = []
    for watched in (False, True):
        kc, vc = s["kc"].clone(), s["vc"].clone()
        versions = kc._version, vc._version
        with (_OpCalls() if watched else contextlib.nullcontext()):
            xt.reshape_and_cache_flash(s["k"], s["v"], kc, vc, s["slots"])
        assert kc._version > versions[0] and vc._version > versions[1]
        written.append((kc, vc))
    assert all(torch.equal(a, b) for a, b in zip(*written))


def test_dense_offsets_made_once_a_shape():
    cpu = torch.device("cpu")
    a = xt._dense_offsets(3, 5, cpu)
    assert a is xt._dense_offsets(3, 5, cpu)
    assert a.dtype == torch.int32 and a.tolist() == [0, 5, 10, 15]
    assert xt._dense_offsets(3, 6, cpu).tolist() == [0, 6, 12, 18]


def test_direct_gradients_agree_with_the_op():
    """Eager gradients through the autograd.Function over the ops' work (_FlashEager) and
    through the custom op's autograd (a torch function mode watching): the same bits,
    softmax_lse's cotangent included."""
    s = small_inputs()
    dout, dlse = torch.randn_like(s["q"]), torch.randn(4, 10)
    grads = {}
    for watched in (False, True):
        q, k, v = (s[n].clone().requires_grad_(True) for n in "qkv")
        with (_NoTorchFunction() if watched else contextlib.nullcontext()):
            out, lse = xt.flash_attn_varlen(q, k, v, s["cu_q"], s["cu_k"], 6, 7, causal=True,
                                            return_softmax_lse=True)
            grads[watched] = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(),
                                                 (q, k, v))
        assert (type(out.grad_fn).__name__ == "_FlashEagerBackward") != watched
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)


def test_direct_calls_under_inference_mode():
    """A serving loop's pattern: caches and queries made under torch.inference_mode, the
    write and the attention run direct there, and on those tensors outside it."""
    s = small_inputs()
    with torch.inference_mode():
        kc, vc = s["kc"].clone(), s["vc"].clone()
        xt.reshape_and_cache_flash(s["k"], s["v"], kc, vc, s["slots"])
        out = xt.paged_attention(s["q"][:2], kc, vc, s["lens"], s["table"],
                                 torch.arange(3, dtype=torch.int32), 0.3, max_query_len=1)
    assert torch.equal(kc.reshape(16, 2, 32)[s["slots"]], s["k"])
    assert torch.equal(vc.reshape(16, 2, 32)[s["slots"]], s["v"])
    again = xt.paged_attention(s["q"][:2], kc, vc, s["lens"], s["table"],
                               torch.arange(3, dtype=torch.int32), 0.3, max_query_len=1)
    assert torch.isfinite(out).all() and torch.equal(out, again)


def _plan_runs(monkeypatch):
    """Counts the flash checks an eager call makes (none where a plan takes it)."""
    checks = []
    real = xt._flash_spec
    monkeypatch.setattr(xt, "_flash_spec", lambda *a, **k: checks.append(1) or real(*a, **k))
    return checks


def test_plans_take_repeated_calls_with_their_own_data(monkeypatch):
    """An eager call's plan (xt._Plan) runs the next calls of its signature without the
    checks, on those calls' own tensors: the same results as the checked call on them,
    and each call's outputs its own; a change of shape, dtype, value or value type is
    another signature, checked anew."""
    monkeypatch.setattr(xt, "_plans", {})
    checks = _plan_runs(monkeypatch)
    s = small_inputs()
    cu_q, cu_k = s["cu_q"], s["cu_k"]
    varlen = lambda seed, **kw: xt.flash_attn_varlen(  # noqa: E731
        *(small_inputs(seed=seed)[n] for n in "qkv"), cu_q, cu_k, 6, 7, causal=True,
        return_softmax_lse=True, **kw)
    dense = lambda q, **kw: xt.flash_attn(q, q[:, :5], q[:, :5], causal=True, **kw)  # noqa: E731
    first = varlen(1)
    assert len(checks) == 1
    outs = [varlen(seed) for seed in (2, 3)]
    assert len(checks) == 1  # both planned
    monkeypatch.setattr(xt, "_plans", {})
    for seed, (out, lse) in zip((2, 3), outs):
        checked_out, checked_lse = varlen(seed)
        assert torch.equal(out, checked_out) and torch.equal(lse, checked_lse)
    assert not torch.equal(outs[0][0], outs[1][0]) and outs[0][0] is not first[0]
    n = len(checks)
    varlen(1, softcap=2.0)
    varlen(1, softcap=2)  # an int where a float was: another signature
    varlen(1, window_size=(3, 0))
    assert len(checks) == n + 3
    g = torch.Generator().manual_seed(4)
    qs = [torch.randn(2, 8, 4, 32, generator=g) for _ in range(3)]
    planned = [dense(q) for q in qs]
    n = len(checks)
    assert n == len(checks) and [dense(q).shape for q in qs] == [(2, 8, 4, 32)] * 3
    monkeypatch.setattr(xt, "_plans", {})
    for q, out in zip(qs, planned):
        assert torch.equal(out, dense(q))
    out, lse = dense(qs[0], return_softmax_lse=True)
    assert lse.shape == (2, 4, 8) and torch.equal(out, planned[0])


def test_plans_only_for_plain_contiguous_calls_without_gradients(monkeypatch):
    """No plan where the call is not one _direct runs, asks for gradients, or takes a
    strided tensor; bad arguments are refused on every call, planned signatures or not."""
    monkeypatch.setattr(xt, "_plans", {})
    s = small_inputs()
    q, k, v, cu_q, cu_k = (s[n] for n in ("q", "k", "v", "cu_q", "cu_k"))
    values = (6, 7, None, True, (-1, -1), 0.0, False)
    tensors = (q, k, v, cu_q, cu_k) + (None,) * 6
    assert xt._signature("v", tensors, values, (q, k, v)) is not None
    grad_q = q.clone().requires_grad_(True)
    assert xt._signature("v", (grad_q,) + tensors[1:], values, (grad_q, k, v)) is None
    strided = torch.randn(10, 4, 64)[..., ::2]
    assert xt._signature("v", (strided,) + tensors[1:], values) is None
    assert xt._signature("v", tensors, values[:4] + ([-1, -1],) + values[5:]) is None
    with _NoTorchFunction():
        assert xt._signature("v", tensors, values) is None
    checks = _plan_runs(monkeypatch)
    expected = xt.flash_attn_varlen(strided.contiguous(), k, v, cu_q, cu_k, 6, 7, causal=True)
    for _ in range(2):
        assert torch.equal(xt.flash_attn_varlen(strided, k, v, cu_q, cu_k, 6, 7, causal=True),
                           expected)
    assert len(checks) == 3 and len(xt._plans) == 1  # the strided calls checked each time
    for _ in range(2):
        with pytest.raises(ValueError, match="v must have k's shape"):
            xt.flash_attn_varlen(q, k, v[:5], cu_q, cu_k, 6, 7, causal=True)
    assert len(xt._plans) == 1


def test_plans_start_over_past_their_bound(monkeypatch):
    monkeypatch.setattr(xt, "_plans", {})
    monkeypatch.setattr(xt, "_MAX_PLANS", 2)
    s = small_inputs()
    for scale in (0.1, 0.2, 0.3):
        xt.flash_attn_varlen(s["q"], s["k"], s["v"], s["cu_q"], s["cu_k"], 6, 7,
                             softmax_scale=scale)
    assert len(xt._plans) == 1


def _graph_names(t, depth=3):
    """The names of the autograd nodes within `depth` of t's."""
    names, nodes = set(), [t.grad_fn]
    for _ in range(depth):
        nodes = [n for n in nodes if n is not None]
        names |= {type(n).__name__ for n in nodes}
        nodes = [m for n in nodes for m, _ in n.next_functions]
    return names


def test_planned_gradients_agree_with_the_op(monkeypatch):
    """Gradients asked of planned calls (the forward's plan under _FlashEager, the
    backward's plan kept beside it from the second backward on), varlen and dense: the
    same bits as through the custom op's autograd, softmax_lse's cotangent included."""
    monkeypatch.setattr(xt, "_plans", {})
    s = small_inputs()
    g = torch.Generator().manual_seed(5)
    dense_q = torch.randn(2, 8, 4, 32, generator=g)
    calls = {
        "varlen": (lambda q, k, v: xt.flash_attn_varlen(q, k, v, s["cu_q"], s["cu_k"], 6, 7,
                                                        causal=True, return_softmax_lse=True),
                   (s["q"], s["k"], s["v"])),
        "dense": (lambda q, k, v: xt.flash_attn(q, k, v, causal=True, return_softmax_lse=True),
                  (dense_q, dense_q[:, :5] * 0.5, dense_q[:, :5] + 1.0)),
    }
    for name, (call, inputs) in calls.items():
        results = []
        for watched in (True, False, False, False):  # the op; then planned: miss, hit, hit
            q, k, v = (x.clone().requires_grad_(True) for x in inputs)
            with (_NoTorchFunction() if watched else contextlib.nullcontext()):
                out, lse = call(q, k, v)
                dout, dlse = torch.randn_like(out), torch.randn_like(lse)
                grads = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v))
            results.append((out, dout, dlse, grads))
            assert ("_FlashEagerBackward" in _graph_names(out)) != watched, name
        plan = next(p for sig, p in xt._plans.items() if sig[0] == (
            "flash_attn" if name == "dense" else "flash_attn_varlen"))
        assert plan.backward is not None, name
        for out, dout, dlse, grads in results[1:]:  # each against the op on its cotangents
            q, k, v = (x.clone().requires_grad_(True) for x in inputs)
            with _NoTorchFunction():
                ref_out, ref_lse = call(q, k, v)
                ref = torch.autograd.grad((ref_out * dout).sum() + (ref_lse * dlse).sum(),
                                          (q, k, v))
            assert torch.equal(out, ref_out), name
            for a, b in zip(grads, ref):
                assert a.shape == b.shape and torch.equal(a, b), name

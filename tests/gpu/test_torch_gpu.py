"""The PyTorch frontend on CUDA tensors: the cases of tests/test_torch_cpu.py run on
torch's current stream through the C ABI (XLA_ATTN_CUDA). Where this build has no
CUDA kernel for an op yet, the op must say so ("no CUDA kernel ...") and the case is
skipped with that message; once the kernel exists the same case compares against
the float64 reference. Skipped where torch sees no CUDA device."""

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import test_torch_cpu as cases  # noqa: E402
from xla_attn import torch as xt  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")]
DEVICE = "cuda"


def on_cuda(check, *args, **kwargs):
    """Runs a CPU-suite check on CUDA tensors; a missing kernel skips, with its message."""
    try:
        check(*args, **kwargs)
    except RuntimeError as e:
        if "no CUDA kernel" in str(e):
            pytest.skip(str(e))
        raise
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", list(cases.FLASH_CASES))
def test_flash_varlen(rng, mk, dtype, case):
    on_cuda(cases.check_flash_varlen, rng, mk, DEVICE, dtype, case)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flash_paged(rng, mk, dtype):
    on_cuda(cases.check_flash_paged, rng, mk, DEVICE, dtype)


def test_flash_fp8(rng, mk):
    on_cuda(cases.check_flash_fp8, rng, mk, DEVICE)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_flash_dense(rng, mk, dtype):
    on_cuda(cases.check_flash_dense, rng, mk, DEVICE, dtype)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", cases.GRAD_CASES)
def test_flash_grad(rng, mk, dtype, case, deterministic):
    """The eager backward with its workspace (bf16: the atomic-dQ path) and without."""
    on_cuda(cases.check_flash_grad, rng, mk, DEVICE, dtype, case, deterministic)


def test_flash_dense_grad(rng, mk):
    on_cuda(cases.check_flash_dense_grad, rng, mk, DEVICE, "float32")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", cases.GRAD_CASES)
def test_legacy_flash_bwd_v3_on_cuda(rng, mk, case, deterministic):
    """torch_xla's CUDA route (the untyped legacy call of xla_attn_flash_bwd_v3, op 6) run
    through the C ABI on CUDA buffers: bf16 with softmax_lse's cotangent, with the workspace
    (atomic dQ, poisoned too) or a 0-byte one, against the float64 reference; results poisoned
    first."""
    import test_xla_legacy_cpu as legacy
    from xla_attn import _capi, _native, _xla_legacy
    from xla_attn.testing import reference as ref

    a, t, kw = cases.flash_case(rng, mk, DEVICE, "bfloat16", case)
    out, lse = xt.flash_attn_varlen(**t, max_seqlen_q=10, max_seqlen_k=10, softmax_scale=0.3,
                                    return_softmax_lse=True, **kw)
    dout = mk.random_array(rng, a["q"].shape, "bfloat16")
    dlse = rng.standard_normal(tuple(lse.shape)).astype(np.float32)
    _, lse_ref = ref.flash_attn_varlen_ref(**a, softmax_scale=0.3, **kw)
    dlse = np.where(np.isfinite(lse_ref), dlse, 0.0).astype(np.float32)
    q, k = t["q"], t["k"]
    total_q, heads, dim = q.shape
    batch = len(a["cu_seqlens_q"]) - 1
    workspace = 0 if deterministic else _native.flash_bwd_workspace_size(
        total_q, batch, heads, dim, "bfloat16")
    window = kw["window_size"]
    alibi = t["alibi_slopes"]
    fields = dict(total_q=total_q, total_k=k.shape[0], batch=batch, num_heads=heads,
                  num_heads_k=k.shape[1], head_dim=dim, max_seqlen_q=10, max_seqlen_k=10,
                  alibi_batch_stride=heads if alibi is not None and alibi.dim() == 2 else 0,
                  window_left=window[0], window_right=0 if kw["causal"] else window[1],
                  softmax_scale=0.3, softcap=kw["softcap"], dtype=_native.DTYPE_CODES["bfloat16"],
                  workspace_bytes=workspace)
    grads = [torch.full_like(x, float("nan")) for x in (q, k, t["v"])]
    operands = [cases.tt(dout, DEVICE), q, k, t["v"], out, lse, t["cu_seqlens_q"],
                t["cu_seqlens_k"], t["seqused_k"], alibi, cases.tt(dlse, DEVICE)]
    # The workspace all 0xff bytes (NaN floats): the dQ accumulator's rows that the delta
    # pass leaves unzeroed would show in dq.
    buffers = operands + grads + [torch.full((max(workspace, 1),), 255, dtype=torch.uint8,
                                             device=DEVICE)]
    descriptor = _xla_legacy.encode("flash_bwd_v3", _xla_legacy.present_mask(*operands),
                                    **fields)
    torch.cuda.synchronize()  # the legacy stream (null) after torch's work
    platform = _capi.CUDA if DEVICE == "cuda" else _capi.HOST
    assert legacy.legacy_run(descriptor, buffers, platform, lambda t: t.data_ptr()) == ""
    torch.cuda.synchronize()
    expected = ref.flash_attn_varlen_bwd_ref(
        dout, a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 0.3, **kw,
        alibi_slopes=a["alibi_slopes"], seqused_k=a["seqused_k"], dlse=dlse)
    for name, g, e in zip("qkv", grads, expected):
        cases.assert_close(g, e, ref.BOUNDS["bfloat16"], f"d{name}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", list(cases.PAGED_CASES))
def test_paged_attention(rng, mk, dtype, case):
    on_cuda(cases.check_paged, rng, mk, DEVICE, dtype, case)


@pytest.mark.parametrize("dtype,cache,fmt", [("bfloat16", "float8_e4m3fn", "auto"),
                                             ("float32", "float8_e5m2", "fp8_e5m2"),
                                             ("float16", "uint8", "fp8"),
                                             ("bfloat16", "uint8", "fp8_e5m2")])
def test_paged_attention_fp8(rng, mk, dtype, cache, fmt):
    on_cuda(cases.check_paged, rng, mk, DEVICE, dtype, "padded_batch", cache=cache,
            kv_cache_dtype=fmt)


@pytest.mark.parametrize("src,cache,fmt,slot_dtype", cases.CACHE_CASES,
                         ids=["-".join(c) for c in cases.CACHE_CASES])
def test_reshape_and_cache_flash(rng, mk, src, cache, fmt, slot_dtype):
    on_cuda(cases.check_reshape_and_cache_flash, rng, mk, DEVICE, src, cache, fmt, slot_dtype)


def test_reshape_and_cache_flash_strided_cache(rng, mk):
    on_cuda(cases.check_reshape_and_cache_flash, rng, mk, DEVICE, "bfloat16", "bfloat16", "auto", "int64",
            strided=True)


def test_reshape_and_cache_flash_on_a_side_stream(rng, mk):
    """The write is ordered on torch's current stream, not the default one."""
    stream = torch.cuda.Stream()
    s = cases.small_inputs(DEVICE)
    key = s["k"].repeat(64, 1, 1)                       # (768, 2, 32)
    slots = torch.randperm(1024, device=DEVICE)[:768]
    kc = torch.randn(256, 4, 2, 32, device=DEVICE)
    vc = kc.clone()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        xt.reshape_and_cache_flash(key, key, kc, vc, slots)
        got = kc.reshape(1024, 2, 32)[slots].clone()    # same stream: sees the write
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(got, key)


def test_reshape_and_cache_flash_in_a_cuda_graph():
    """Captured once, replayed with new keys and slots (what a vLLM decode step does)."""
    s = cases.small_inputs(DEVICE)
    key, slots = s["k"].clone(), s["slots"].clone()
    kc, vc = s["kc"].clone(), s["vc"].clone()
    scale = torch.ones((), device=DEVICE)
    xt.reshape_and_cache_flash(key, key, kc, vc, slots, "auto", scale, scale)  # warm up (loads)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        xt.reshape_and_cache_flash(key, key, kc, vc, slots, "auto", scale, scale)
    key.copy_(torch.randn_like(key))
    slots.copy_(torch.randperm(16, device=DEVICE)[:12])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kc.reshape(16, 2, 32)[slots], key)
    assert torch.equal(vc.reshape(16, 2, 32)[slots], key)


@pytest.mark.parametrize("seen_before", [False, True])
def test_flash_dense_in_a_cuda_graph(rng, mk, seen_before):
    """The dense layout's offsets inside a capture: made there for a shape first met
    there (a host copy cannot run in a capture), the remembered ones for a shape met
    before; the graph replayed on new inputs, its output poisoned first."""
    b, s, h, d = 3, 70 + seen_before, 2, 64  # shapes no other test meets
    shape = (b, s, h, d)
    q, k, v = (cases.tt(mk.random_array(rng, shape, "bfloat16"), DEVICE) for _ in range(3))
    # warm up (module load); only the seen shape's offsets are remembered
    xt.flash_attn(q if seen_before else q[:1], k if seen_before else k[:1],
                  v if seen_before else v[:1], causal=True)
    torch.cuda.synchronize()
    remembered = xt._remembered_offsets.cache_info().currsize
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = xt.flash_attn(q, k, v, causal=True)
    assert xt._remembered_offsets.cache_info().currsize == remembered
    new = [mk.random_array(rng, shape, "bfloat16") for _ in range(3)]
    for t, x in zip((q, k, v), new):
        t.copy_(cases.tt(x, DEVICE))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected, _ = cases.ref.flash_attn_ref(*new, causal=True)
    cases.assert_close(out, expected, cases.ref.BOUNDS["bfloat16"])


@pytest.fixture
def workspace_sizes(monkeypatch):
    """Records what xla_attn_workspace_size asked for on each CUDA call (no plans kept
    from earlier tests: a plan asks once, on its signature's first call)."""
    sizes = []
    real = xt._capi.workspace_size
    monkeypatch.setattr(xt, "_plans", {})

    def spy(params):
        sizes.append(real(params))
        return sizes[-1]

    monkeypatch.setattr(xt._capi, "workspace_size", spy)
    return sizes


def long_decode(rng, mk, dtype="bfloat16", lens=(2000, 1500, 777)):
    """Decode (one query a sequence) over long contexts: the kernels split the keys
    and need the workspace torch allocates."""
    heads, heads_k, head_dim, block_size = 8, 2, 64, 16
    query = mk.random_array(rng, (len(lens), heads, head_dim), dtype)
    kc, vc, table = mk.paged_kv(rng, dtype, list(lens), block_size, heads_k=heads_k,
                                head_dim=head_dim)
    qsl = np.arange(len(lens) + 1, dtype=np.int32)
    return query, kc, vc, np.asarray(lens, np.int32), table, qsl


def test_paged_attention_split_kv_workspace(rng, mk, workspace_sizes):
    query, kc, vc, lens, table, qsl = long_decode(rng, mk)
    args = [cases.tt(x, DEVICE) for x in (query, kc, vc, lens, table, qsl)]
    try:
        out = xt.paged_attention(*args, 0.125)
    except RuntimeError as e:
        if "no CUDA kernel" in str(e):
            pytest.skip(str(e))
        raise
    assert max(workspace_sizes) > 0
    expected = cases.ref.paged_attention_ref(query, kc, vc, lens, table, qsl, 0.125)
    cases.assert_close(out, expected, cases.ref.BOUNDS["bfloat16"])
    # flash_attn_varlen over the same paged cache takes the same path
    cu_k = mk.cu_seqlens(lens)
    out2 = xt.flash_attn_varlen(args[0], args[1], args[2], args[5], cases.tt(cu_k, DEVICE), 1,
                                int(lens.max()), softmax_scale=0.125, causal=True,
                                block_table=args[4])
    cases.assert_close(out2, expected, cases.ref.BOUNDS["bfloat16"])


def test_paged_attention_in_a_cuda_graph(rng, mk):
    """A decode step captured once and replayed on new queries; the split-KV
    workspace comes from the graph's memory pool."""
    query, kc, vc, lens, table, qsl = long_decode(rng, mk)
    q, kct, vct, lt, tt_, qt = (cases.tt(x, DEVICE) for x in (query, kc, vc, lens, table, qsl))
    try:
        xt.paged_attention(q, kct, vct, lt, tt_, qt, 0.125)  # warm up (module load)
    except RuntimeError as e:
        if "no CUDA kernel" in str(e):
            pytest.skip(str(e))
        raise
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = xt.paged_attention(q, kct, vct, lt, tt_, qt, 0.125)
    query2 = mk.random_array(rng, query.shape, "bfloat16")
    q.copy_(cases.tt(query2, DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    expected = cases.ref.paged_attention_ref(query2, kc, vc, lens, table, qsl, 0.125)
    cases.assert_close(out, expected, cases.ref.BOUNDS["bfloat16"])


def test_missing_kernels_say_so():
    """Each op either runs or fails with the dispatcher's "no CUDA kernel" message,
    and the process keeps working either way."""
    s = cases.small_inputs(DEVICE)
    calls = {
        "flash_fwd": lambda: xt.flash_attn_varlen(s["q"], s["k"], s["v"], s["cu_q"], s["cu_k"]),
        "paged_attention": lambda: xt.paged_attention(s["q"], s["kc"], s["vc"], s["lens"],
                                                      s["table"], s["cu_q"], 0.2),
        "reshape_and_cache_flash": lambda: xt.reshape_and_cache_flash(s["k"], s["v"], s["kc"], s["vc"],
                                                          s["slots"]),
    }
    for call in calls.values():
        try:
            call()
        except RuntimeError as e:
            assert "no CUDA kernel for" in str(e)
        torch.cuda.synchronize()
    assert s["kc"].isfinite().all()


@pytest.mark.parametrize("case", cases.OPCHECK_CASES)
def test_opcheck(case):
    try:
        op, args = cases.opcheck_case(case, DEVICE)
        result = torch.library.opcheck(op, args)
    except Exception as e:  # opcheck wraps the op's RuntimeError in its own error
        if "no CUDA kernel" in str(e) or "no CUDA kernel" in str(e.__cause__):
            pytest.skip(str(e.__cause__ or e))
        raise
    assert set(result.values()) == {"SUCCESS"}, result


def test_compile_fullgraph():
    on_cuda(cases.check_compile, DEVICE, "inductor")


def test_compile_grad():
    on_cuda(cases.check_compile_grad, DEVICE, "inductor")


def test_compile_reshape_and_cache_flash():
    """The one op with a CUDA kernel today, compiled with inductor (in place)."""
    torch._dynamo.reset()
    s = cases.small_inputs(DEVICE, seed=3)

    def step(k, v, kc, vc, slots):
        cases.xla_attn.reshape_and_cache_flash(k * 2, v, kc, vc, slots)
        return kc.sum()

    eager_caches = s["kc"].clone(), s["vc"].clone()
    expected = step(s["k"], s["v"], *eager_caches, s["slots"])
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    got = torch.compile(step, fullgraph=True, backend=counter)(s["k"], s["v"], s["kc"], s["vc"],
                                                               s["slots"])
    assert counter.frame_count == 1
    assert torch.equal(got, expected)
    assert torch.equal(s["kc"], eager_caches[0]) and torch.equal(s["vc"], eager_caches[1])

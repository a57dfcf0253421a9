"""The torch_xla frontend (xla_attn.torch_xla) on torch_xla's CPU device (PJRT_DEVICE=CPU):
the cases of tests/test_torch_cpu.py on XLA tensors against the float64 reference,
handler registration, attribute salting, the in-place cache write (aliasing and
donation), torch.compile(backend="openxla") and AOTAutograd capture, segment ids,
errors, the legacy emission, and SPMD on four CPU devices (in a subprocess: torch_xla
fixes its device count when it starts). Skipped where torch_xla is not installed."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch = pytest.importorskip("torch")
torch_xla = pytest.importorskip("torch_xla")

import torch_xla.core.xla_model as xm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_torch_cpu as cases  # noqa: E402
import test_xla_legacy_cpu as legacy  # noqa: E402
import xla_attn  # noqa: E402
from xla_attn import _torch_xla_call, _xla_ffi_registry, _xla_legacy  # noqa: E402
from xla_attn import torch as xt  # noqa: E402
from xla_attn import torch_xla as xx  # noqa: E402
from xla_attn.testing import reference as ref  # noqa: E402

DEV = torch_xla.device()
# Subprocesses import the xla_attn this process imported (a source tree or an install).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(xla_attn.__file__)))


def hlo(*tensors) -> str:
    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))


def buffers(*tensors):
    xm.wait_device_ops()
    return [torch_xla._XLAC._unsafe_buffer_pointer(t) for t in tensors]


# ------------------------------------------------------------------ the shared cases
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(cases.FLASH_CASES))
def test_flash_varlen(rng, mk, dtype, case):
    cases.check_flash_varlen(rng, mk, DEV, dtype, case)


@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out and lse"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", cases.GRAD_CASES)
def test_flash_grad(rng, mk, case, dtype, deterministic, with_lse):
    """Through xla_attn_flash_bwd_v3 (bf16 with its workspace unless deterministic), a
    loss on softmax_lse too."""
    cases.check_flash_grad(rng, mk, DEV, dtype, case, deterministic, with_lse)


def test_flash_paged_dense_fp8(rng, mk):
    cases.check_flash_paged(rng, mk, DEV, "float32")
    cases.check_flash_fp8(rng, mk, DEV)
    cases.check_flash_dense(rng, mk, DEV, "float32")
    cases.check_flash_dense_grad(rng, mk, DEV, "float32")


@pytest.mark.parametrize("case", list(cases.PAGED_CASES))
def test_paged_attention(rng, mk, case):
    cases.check_paged(rng, mk, DEV, "float32", case)


def test_paged_attention_uint8_fp8_cache(rng, mk):
    cases.check_paged(rng, mk, DEV, "bfloat16", "padded_batch", cache="uint8",
                      kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize("src,cache,fmt,slot_dtype",
                         [("float32", "float32", "auto", "int64"),
                          ("bfloat16", "uint8", "fp8", "int32")])
def test_reshape_and_cache_flash(rng, mk, src, cache, fmt, slot_dtype):
    tokens, shape = 9, (5, 4, 2, 16)
    key, value = (mk.random_array(rng, (tokens, 2, 16), src, scale=100.0) for _ in range(2))
    slots = rng.permutation(20)[:tokens].astype(slot_dtype)
    slots[[1, 5]] = -1
    k_cache, v_cache = mk.random_bits(rng, shape, cache), mk.random_bits(rng, shape, cache)
    scales = (mk.f32(0.25), mk.f32(2.0)) if cache == "uint8" else (None, None)
    tk, tv = cases.tt(k_cache, DEV), cases.tt(v_cache, DEV)
    assert xla_attn.reshape_and_cache_flash(
        cases.tt(key, DEV), cases.tt(value, DEV), tk, tv, cases.tt(slots, DEV), fmt,
        *(cases.tt(s, DEV) for s in scales)) is None
    k_ref, v_ref = ref.reshape_and_cache_flash_ref(key, value, k_cache, v_cache, slots, fmt,
                                                   *(1.0 if s is None else s for s in scales))
    ref.assert_bits_equal(cases.nn(tk), k_ref)
    ref.assert_bits_equal(cases.nn(tv), v_ref)


# ------------------------------------------------------------------ registration, salting
def test_registration_through_torch_xla_ffi_api():
    assert _xla_ffi_registry.ffi_api() != 0
    _xla_ffi_registry.register("xla_attn_test_twice", "xla_attn_flash_fwd_v1")
    _xla_ffi_registry.register("xla_attn_test_twice", "xla_attn_flash_fwd_v1")  # idempotent
    with pytest.raises(_xla_ffi_registry.RegistrationError, match="unknown target nope"):
        _xla_ffi_registry.register("xla_attn_test_unknown", "nope")
    with pytest.raises(_xla_ffi_registry.RegistrationError, match="platform must be Host or CUDA"):
        _xla_ffi_registry.register("xla_attn_test_platform", "xla_attn_flash_fwd_v1", "TPU")


def test_attributes_are_an_mlir_dictionary():
    text = _torch_xla_call.mlir_attributes({"a": 1e-5, "b": -1, "c": 'x"y'})
    assert text == '{a = 1.000000000e-05 : f32, b = -1 : i64, c = "x\\"y"}'


def test_calls_differing_only_in_attributes_stay_distinct():
    """torch_xla 2.9.0 hashes a custom call by its target name only: without salted
    names the second scale would reuse the first's compiled program."""
    s = cases.small_inputs()
    x = {n: s[n].to(DEV) for n in ("q", "k", "v", "cu_q", "cu_k")}
    args = (x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], 6, 7)
    outs = [xla_attn.flash_attn_varlen(*args, softmax_scale=scale) for scale in (0.1, 0.3)]
    assert len({line.split('custom_call_target="')[1].split('"')[0]
                for line in hlo(*outs).splitlines() if "custom_call_target" in line}) == 2
    for scale in (0.1, 0.3, 0.5):  # one graph each, one after the other
        got = xla_attn.flash_attn_varlen(*args, softmax_scale=scale).cpu()
        expected = xt.flash_attn_varlen(s["q"], s["k"], s["v"], s["cu_q"], s["cu_k"], 6, 7,
                                        softmax_scale=scale)
        assert torch.equal(got, expected), scale
    assert not torch.equal(outs[0].cpu(), outs[1].cpu())


# ------------------------------------------------------------------ in-place cache write
def _cache_inputs(seed=0):
    s = cases.small_inputs(seed=seed)
    return (s["k"].to(DEV), s["v"].to(DEV), s["kc"].to(DEV), s["vc"].to(DEV),
            s["slots"].to(DEV)), s


def test_cache_write_aliases_and_donated_caches_stay_in_place():
    (k, v, kc, vc, slots), s = _cache_inputs()
    torch_xla.sync()
    before = buffers(kc, vc)
    for step in range(2):
        xx.donate(kc, vc)  # a donation covers the next execution only
        xla_attn.reshape_and_cache_flash(k * (step + 1), v, kc, vc, slots)
        if step == 0:
            text = hlo(kc, vc)
            assert "output_to_operand_aliasing={{0}: (2, {}), {1}: (3, {})}" in text, text
        torch_xla.sync()
        assert buffers(kc, vc) == before  # written in place, no new buffer
    kc_ref, vc_ref = s["kc"].clone(), s["vc"].clone()
    xt.reshape_and_cache_flash(s["k"] * 2, s["v"], kc_ref, vc_ref, s["slots"])
    assert torch.equal(kc.cpu(), kc_ref) and torch.equal(vc.cpu(), vc_ref)


def test_cache_write_without_donation_is_a_correct_copy():
    (k, v, kc, vc, slots), s = _cache_inputs(seed=3)
    old = kc.clone()
    xla_attn.reshape_and_cache_flash(k, v, kc, vc, slots)
    kc_ref, vc_ref = s["kc"].clone(), s["vc"].clone()
    xt.reshape_and_cache_flash(s["k"], s["v"], kc_ref, vc_ref, s["slots"])
    assert torch.equal(kc.cpu(), kc_ref) and torch.equal(old.cpu(), s["kc"])


def test_cache_write_into_views_reaches_their_base():
    """K and V caches that are halves of one stacked (num_blocks, 2, ...) tensor: the
    write lands in the views and in the tensor they view, eagerly and compiled."""
    import torch._dynamo

    s = cases.small_inputs(seed=6)
    both = torch.stack([s["kc"], s["vc"]], dim=1)
    expected = both.clone()
    xt.reshape_and_cache_flash(s["k"], s["v"], expected[:, 0], expected[:, 1], s["slots"])
    assert not torch.equal(expected, both)
    k, v, slots = s["k"].to(DEV), s["v"].to(DEV), s["slots"].to(DEV)
    base = both.to(DEV)
    key_cache, value_cache = base[:, 0], base[:, 1]
    xla_attn.reshape_and_cache_flash(k, v, key_cache, value_cache, slots)
    assert torch.equal(key_cache.cpu(), expected[:, 0])
    assert torch.equal(value_cache.cpu(), expected[:, 1])
    assert torch.equal(base.cpu(), expected)

    def step(k, v, both, slots):
        xla_attn.reshape_and_cache_flash(k, v, both[:, 0], both[:, 1], slots)

    torch._dynamo.reset()
    base = both.to(DEV)
    torch.compile(step, backend="openxla", fullgraph=True)(k, v, base, slots)
    assert torch.equal(base.cpu(), expected)


def test_direct_op_call_mutates():
    (k, v, kc, vc, slots), s = _cache_inputs(seed=4)
    torch.ops.xla_attn.reshape_and_cache_flash(k, v, kc, vc, slots, None, None, "auto")
    kc_ref, vc_ref = s["kc"].clone(), s["vc"].clone()
    xt.reshape_and_cache_flash(s["k"], s["v"], kc_ref, vc_ref, s["slots"])
    assert torch.equal(kc.cpu(), kc_ref)


# ------------------------------------------------------------------ torch.compile, AOTAutograd
def model_step(q, k, v, cu_q, cu_k, kc, vc, slots, lens, table):
    """cases.attention_step plus a loss: all three ops in one step."""
    out, paged = cases.attention_step(q, k, v, cu_q, cu_k, kc, vc, slots, lens, table)
    return (out * paged).sum(dim=-1)


def test_compile_openxla_one_graph_in_place():
    import torch._dynamo

    s = cases.small_inputs(seed=5)
    names = ("q", "k", "v", "cu_q", "cu_k", "kc", "vc", "slots", "lens", "table")
    eager = [s[n].clone() for n in names]
    expected = model_step(*eager)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(model_step)(*[s[n].to(DEV) for n in names])
    assert (explain.graph_count, explain.graph_break_count) == (1, 0), explain.break_reasons
    torch._dynamo.reset()
    args = [s[n].to(DEV) for n in names]
    xx.donate(args[5], args[6])
    torch_xla.sync()
    step = torch.compile(model_step, backend="openxla", fullgraph=True)
    got = step(*args)
    before = buffers(args[5], args[6])
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(args[5].cpu(), eager[5]) and torch.equal(args[6].cpu(), eager[6])
    step(*args)  # second step: same compiled graph, caches updated in their buffers
    assert buffers(args[5], args[6]) == before


def test_aot_autograd_capture_and_gradients(rng, mk, capsys):
    from functorch.compile import aot_function, make_boxed_func

    captured = []

    def print_graph(gm, example_inputs):
        captured.append(gm.code)
        print(gm.code)
        return make_boxed_func(gm.forward)

    a, t, kw = cases.flash_case(rng, mk, DEV, "float32", "causal_gqa_padded")
    dout = mk.random_array(rng, a["q"].shape, "float32")

    def attention(q, k, v, cu_q, cu_k):
        return xla_attn.flash_attn_varlen(q, k, v, cu_q, cu_k, 10, 10, **kw)

    compiled = aot_function(attention, fw_compiler=print_graph, bw_compiler=print_graph)
    q, k, v = (t[n].requires_grad_(True) for n in "qkv")
    out = compiled(q, k, v, t["cu_seqlens_q"], t["cu_seqlens_k"])
    out.backward(cases.tt(dout, DEV))
    assert len(captured) == 2
    assert "xla_attn.flash_fwd" in captured[0] and "xla_attn.flash_bwd" in captured[1]
    assert "flash_bwd" in capsys.readouterr().out
    expected = ref.flash_attn_varlen_bwd_ref(dout, a["q"], a["k"], a["v"], a["cu_seqlens_q"],
                                             a["cu_seqlens_k"], None, **kw)
    for name, x, g_ref in zip("qkv", (q, k, v), expected):
        cases.assert_close(x.grad, g_ref, ref.BOUNDS["float32"], f"d{name}")


def test_compile_openxla_backward(rng, mk):
    import torch._dynamo

    torch._dynamo.reset()
    a, t, kw = cases.flash_case(rng, mk, DEV, "float32", "window_softcap")

    def loss(q, k, v, cu_q, cu_k):
        return (xla_attn.flash_attn_varlen(q, k, v, cu_q, cu_k, 10, 10, **kw) ** 2).sum()

    q, k, v = (t[n].requires_grad_(True) for n in "qkv")
    step = torch.compile(loss, backend="openxla", fullgraph=True)
    step(q, k, v, t["cu_seqlens_q"], t["cu_seqlens_k"]).backward()
    out, _ = ref.flash_attn_varlen_ref(a["q"], a["k"], a["v"], a["cu_seqlens_q"],
                                       a["cu_seqlens_k"], None, **kw)
    expected = ref.flash_attn_varlen_bwd_ref(2 * out, a["q"], a["k"], a["v"], a["cu_seqlens_q"],
                                             a["cu_seqlens_k"], None, **kw)
    for name, x, g_ref in zip("qkv", (q, k, v), expected):
        cases.assert_close(x.grad, g_ref, ref.BOUNDS["float32"], f"d{name}")


# ------------------------------------------------------------------ segment ids
SEGMENTS = [[1, 1, 1, 2, 2, 2, 2, 2], [3, 3, 4, 4, 4, 4, 5, 5]]


def test_segment_ids_match_varlen(rng, mk):
    q = mk.random_array(rng, (2, 8, 4, 16), "float32")
    k = mk.random_array(rng, (2, 8, 2, 16), "float32")
    v = mk.random_array(rng, (2, 8, 2, 16), "float32")
    seg = np.asarray(SEGMENTS, np.int32)
    cu, _, _, _ = xla_attn._ops.segment_ids_to_cu_seqlens(seg, seg)
    assert cu.tolist() == [0, 3, 8, 10, 14, 16]
    out_ref, _ = ref.flash_attn_varlen_ref(q.reshape(16, 4, 16), k.reshape(16, 2, 16),
                                           v.reshape(16, 2, 16), cu, cu, None, causal=True)
    ids = cases.tt(seg, DEV)
    out = xla_attn.flash_attn(*(cases.tt(x, DEV) for x in (q, k, v)), causal=True,
                              q_segment_ids=ids, kv_segment_ids=ids, max_segments=3)
    cases.assert_close(out.reshape(16, 4, 16), out_ref, ref.BOUNDS["float32"])
    host = xt.flash_attn(*(cases.tt(x) for x in (q, k, v)), causal=True,
                         q_segment_ids=cases.tt(seg), kv_segment_ids=cases.tt(seg))
    torch.testing.assert_close(out.cpu(), host)


def test_segment_ids_breaking_the_rules():
    bad = np.asarray([[1, 1, 2, 2, 1, 1, 3, 3]], np.int32)
    with pytest.raises(ValueError, match="more than one run"):
        xla_attn._ops.segment_ids_to_cu_seqlens(bad, bad)
    q_ids, kv_ids = np.asarray([[1, 1, 2, 2]], np.int32), np.asarray([[2, 2, 1, 1]], np.int32)
    with pytest.raises(ValueError, match="same ids in the same order"):
        xla_attn._ops.segment_ids_to_cu_seqlens(q_ids, kv_ids)
    x = torch.randn(1, 4, 2, 8)
    out = xla_attn.flash_attn(x.to(DEV), x.to(DEV), x.to(DEV),
                              q_segment_ids=torch.from_numpy(q_ids).to(DEV),
                              kv_segment_ids=torch.from_numpy(kv_ids).to(DEV))
    assert torch.isnan(out.cpu()).all()  # device ids cannot raise: the output says it


# ------------------------------------------------------------------ errors and routing
def test_shape_errors_name_the_argument():
    s = cases.small_inputs()
    q, k, v = s["q"].to(DEV), s["k"].to(DEV), s["v"].to(DEV)
    with pytest.raises(ValueError, match=r"k's head_dim \(16\) must equal q's \(32\)"):
        xla_attn.flash_attn_varlen(q, k[..., :16], v[..., :16], s["cu_q"].to(DEV),
                                   s["cu_k"].to(DEV))
    with pytest.raises(ValueError, match="partition_spec may shard only the heads"):
        xx.flash_attn_varlen(q, k, v, s["cu_q"].to(DEV), s["cu_k"].to(DEV),
                             partition_spec=("x", None, None))


HANDLER_ERROR = textwrap.dedent("""
    import torch, torch_xla
    from xla_attn import _torch_xla_call
    q = torch.randn(4, 2, 8).to(torch_xla.device())
    cu = torch.tensor([0, 4], dtype=torch.int32).to(q.device)
    absent = torch.zeros(0).to(q.device)
    outs = _torch_xla_call.emit(
        "flash_fwd", "xla_attn_flash_fwd_v1",
        [q, q, q, cu, cu, cu[:0], cu[:0], absent, absent, absent, absent],
        [((4, 2, 8), torch.float32), ((3, 4), torch.float32), ((0,), torch.uint8)],
        dict(softmax_scale=1.0, softcap=0.0, window_left=-1, window_right=-1,
             max_seqlen_q=4, max_seqlen_k=4), {})
    try:
        outs[0].cpu()
    except RuntimeError as e:
        print("raised:", e)
    try:
        torch_xla.sync()  # torch_xla raises a failed execution's error once more
    except RuntimeError:
        pass
    print("still alive:", (q * 2).sum().item() == (q.cpu() * 2).sum().item())
""")


def _run_python(code: str, **env) -> str:
    env = dict(os.environ, PJRT_DEVICE="CPU", **env)
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_handler_errors_raise_and_the_process_goes_on():
    """A call the handler refuses (here a softmax_lse of the wrong shape, past the
    Python checks) raises the handler's message; in a subprocess, because torch_xla
    re-raises a failed execution's error at the next sync."""
    out = _run_python(HANDLER_ERROR)
    assert "raised:" in out and "softmax_lse must be float32 [num_heads, total_q]" in out, out
    assert "still alive:" in out


def test_legacy_emission_builds_an_untyped_call(monkeypatch):
    """The torch_xla <= 2.8 CUDA route cannot run here; its HLO can be built: an
    api_version 2 call whose backend_config is the binary descriptor."""
    monkeypatch.setattr(_torch_xla_call, "flavour", lambda: "legacy")
    monkeypatch.setattr(_torch_xla_call, "_register_legacy", lambda name, op: None)
    s = cases.small_inputs()
    out = xla_attn.flash_attn_varlen(s["q"].to(DEV), s["k"].to(DEV), s["v"].to(DEV),
                                     s["cu_q"].to(DEV), s["cu_k"].to(DEV), 6, 7)
    text = hlo(out)
    assert "api_version=API_VERSION_STATUS_RETURNING" in text
    assert 'custom_call_target="xla_attn_flash_fwd_v1_legacy_' in text
    assert 'backend_config="XATL\\001\\000\\001\\000' in text, text


@pytest.fixture
def legacy_calls(monkeypatch):
    """Forces the legacy (torch_xla <= 2.8 CUDA) emission and records each call's
    (op, descriptor). The lazy graph holding those calls is never executed here; the
    descriptors are run on the Host through the C ABI instead (legacy_host)."""
    calls = []
    encode = _xla_legacy.encode

    def recording_encode(op, present, **fields):
        calls.append((op, encode(op, present, **fields)))
        return calls[-1][1]

    monkeypatch.setattr(_torch_xla_call, "flavour", lambda: "legacy")
    monkeypatch.setattr(_torch_xla_call, "_register_legacy", lambda name, op: None)
    monkeypatch.setattr(_xla_legacy, "encode", recording_encode)
    return calls


def legacy_host(call, operands, results):
    """Runs a recorded (op, descriptor) on the Host over numpy `operands` (None:
    absent) and `results` [(shape, numpy dtype)], poisoned first (all bits set: NaNs);
    returns the results."""
    op, descriptor = call
    fields = _xla_legacy.decode(op, descriptor)
    outs = [np.full((*shape, np.dtype(dtype).itemsize), 0xFF, np.uint8).view(dtype)
            .reshape(shape) for shape, dtype in results]
    workspace = [np.zeros(max(fields.get("workspace_bytes", 0), 1), np.uint8)]
    buffers = [None if x is None else np.ascontiguousarray(x) for x in operands]
    assert legacy.legacy_run(descriptor, buffers + outs + workspace) == "", fields
    return outs


def assert_same_bits(got: np.ndarray, expected, what):
    expected = cases.nn(expected)
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    assert got.tobytes() == expected.tobytes(), f"{what}: the legacy call's result differs"


@pytest.mark.parametrize("case", list(cases.FLASH_CASES))
def test_legacy_flash_descriptors_run_on_the_host(rng, mk, legacy_calls, case):
    """The descriptors the frontend writes for the legacy route carry the right fields:
    run on the Host they give the torch CPU frontend's very bits (forward and backward)."""
    a, t, kw = cases.flash_case(rng, mk, DEV, "float32", case)
    c = {name: cases.tt(x) for name, x in a.items()}
    grad = case in cases.GRAD_CASES
    for x in (t, c):
        for name in "qkv":
            x[name].requires_grad_(grad)
    args = dict(max_seqlen_q=10, max_seqlen_k=10, softmax_scale=0.3, **kw)
    out = xla_attn.flash_attn_varlen(**t, **args)
    out_cpu, lse_cpu = xt.flash_attn_varlen(**c, return_softmax_lse=True, **args)
    dout = mk.random_array(rng, a["q"].shape, "float32")
    if grad:
        out.backward(cases.tt(dout, DEV))
        out_cpu.backward(cases.tt(dout))
    assert [op for op, _ in legacy_calls] == ["flash_fwd"] + ["flash_bwd_v3"] * grad
    q, k, v, cu_q, cu_k = (a[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
    h_out, h_lse = legacy_host(
        legacy_calls[0], [q, k, v, cu_q, cu_k, a["seqused_k"], None, a["alibi_slopes"], None,
                          None, None],
        [(q.shape, np.float32), ((q.shape[1], q.shape[0]), np.float32)])
    assert_same_bits(h_out, out_cpu, "out")
    assert_same_bits(h_lse, lse_cpu, "softmax_lse")
    if grad:
        grads = legacy_host(
            legacy_calls[1], [dout, q, k, v, h_out, h_lse, cu_q, cu_k, a["seqused_k"],
                              a["alibi_slopes"], None],
            [(x.shape, np.float32) for x in (q, k, v)])
        for name, g in zip("qkv", grads):
            assert_same_bits(g, c[name].grad, f"d{name}")


def test_legacy_paged_flash_and_fp8_descriptors_run_on_the_host(rng, mk, legacy_calls):
    lens_q, lens_k = [3, 5, 1], [7, 13, 4]
    q = mk.random_array(rng, (sum(lens_q) + 2, 4, 32), "float32")
    k, v, table = mk.paged_kv(rng, "float32", lens_k, block_size=4)
    cu_q, cu_k = mk.cu_seqlens(lens_q), mk.cu_seqlens(lens_k)
    arrays = (q, k, v, cu_q, cu_k)
    xla_attn.flash_attn_varlen(*(cases.tt(x, DEV) for x in arrays), 5, 13, causal=True,
                               block_table=cases.tt(table, DEV))
    expected = xt.flash_attn_varlen(*map(cases.tt, arrays), 5, 13, causal=True,
                                    block_table=cases.tt(table))
    (out,) = legacy_host(legacy_calls[0], [*arrays, None, table] + [None] * 4,
                         [(q.shape, np.float32), ((4, q.shape[0]), np.float32)])[:1]
    assert_same_bits(out, expected, "paged out")

    q8, k8, v8 = (mk.fp8_cache(rng, (12, 4, 32), "float8_e4m3fn") for _ in range(3))
    cu = mk.cu_seqlens([5, 7])
    scales = [mk.f32(s) for s in (0.5, 0.25, 2.0)]
    arrays = (q8, k8, v8, cu, cu)
    xla_attn.flash_attn_varlen(*(cases.tt(x, DEV) for x in arrays), 7, 7, causal=True,
                               q_descale=cases.tt(scales[0], DEV),
                               k_descale=cases.tt(scales[1], DEV),
                               v_descale=cases.tt(scales[2], DEV))
    expected = xt.flash_attn_varlen(*map(cases.tt, arrays), 7, 7, causal=True,
                                    q_descale=cases.tt(scales[0]), k_descale=cases.tt(scales[1]),
                                    v_descale=cases.tt(scales[2]))
    (out,) = legacy_host(legacy_calls[1], [*arrays, None, None, None, *scales],
                         [((12, 4, 32), mk.NP_DTYPES["bfloat16"]), ((4, 12), np.float32)])[:1]
    assert_same_bits(out, expected, "fp8 out")


@pytest.mark.parametrize("case,cache,fmt", [(case, None, "auto") for case in cases.PAGED_CASES]
                         + [("padded_batch", "uint8", "fp8_e5m2")])
def test_legacy_paged_attention_descriptors_run_on_the_host(rng, mk, legacy_calls, case, cache,
                                                            fmt):
    c = cases.PAGED_CASES[case]
    lens, qlens = [9, 1, 17, 6], [3, 1, 2, 2]
    query = mk.random_array(rng, (sum(qlens) + c.get("pad_q", 0), 4, 32), "bfloat16")
    kc, vc, table = mk.paged_kv(rng, "bfloat16", lens, 4, heads_k=c.get("heads_k", 2))
    scales = [None, None]
    if cache:
        kc, vc = (mk.fp8_cache(rng, kc.shape, "float8_e5m2").view(np.uint8) for _ in range(2))
        scales = [mk.f32(0.5), mk.f32(1.5)]
    qsl, seq_lens = mk.cu_seqlens(qlens), np.asarray(lens, np.int32)
    num_seqs = np.asarray(c["num_seqs"], np.int32) if "num_seqs" in c else None
    alibi, max_query_len = cases.paged_extras(rng, mk, case)
    arrays = [query, kc, vc, seq_lens, table, qsl]
    kw = dict(sliding_window=c.get("sliding_window"), soft_cap=c.get("soft_cap"),
              kv_cache_dtype=fmt, max_query_len=max_query_len)
    xla_attn.paged_attention(*(cases.tt(x, DEV) for x in arrays), 0.2, **kw,
                             num_seqs=cases.tt(num_seqs, DEV), k_scale=cases.tt(scales[0], DEV),
                             v_scale=cases.tt(scales[1], DEV),
                             alibi_slopes=cases.tt(alibi, DEV))
    expected = xt.paged_attention(*map(cases.tt, arrays), 0.2, **kw,
                                  num_seqs=cases.tt(num_seqs), k_scale=cases.tt(scales[0]),
                                  v_scale=cases.tt(scales[1]), alibi_slopes=cases.tt(alibi))
    assert [op for op, _ in legacy_calls] == ["paged_attention_v2"]
    fields = _xla_legacy.decode("paged_attention_v2", legacy_calls[0][1])
    assert fields["max_query_len"] == (max_query_len or 0)
    (out,) = legacy_host(legacy_calls[0], arrays + [num_seqs, *scales, alibi],
                         [(query.shape, query.dtype)])
    assert_same_bits(out, expected, "paged_attention out")


@pytest.mark.parametrize("src,cache,fmt,slot_dtype",
                         [("float32", "float32", "auto", "int64"),
                          ("bfloat16", "uint8", "fp8", "int32")])
def test_legacy_cache_write_descriptors_run_on_the_host(rng, mk, legacy_calls, src, cache, fmt,
                                                        slot_dtype):
    tokens, shape = 9, (5, 4, 2, 16)
    key, value = (mk.random_array(rng, (tokens, 2, 16), src, scale=100.0) for _ in range(2))
    slots = rng.permutation(20)[:tokens].astype(slot_dtype)
    slots[[1, 5]] = -1
    k_cache, v_cache = mk.random_bits(rng, shape, cache), mk.random_bits(rng, shape, cache)
    scales = [mk.f32(0.25), mk.f32(2.0)] if cache == "uint8" else [None, None]
    arrays = [key, value, k_cache, v_cache, slots]
    xla_attn.reshape_and_cache_flash(*(cases.tt(x, DEV) for x in arrays), fmt,
                                     *(cases.tt(s, DEV) for s in scales))
    kc, vc = cases.tt(k_cache), cases.tt(v_cache)
    xt.reshape_and_cache_flash(cases.tt(key), cases.tt(value), kc, vc, cases.tt(slots), fmt,
                               *map(cases.tt, scales))
    new_k, new_v = legacy_host(legacy_calls[0], arrays + scales,
                               [(shape, k_cache.dtype), (shape, v_cache.dtype)])
    assert_same_bits(new_k, kc, "key_cache")
    assert_same_bits(new_v, vc, "value_cache")


def test_routing_to_torch_xla():
    s = cases.small_inputs()
    out = xla_attn.paged_attention(s["q"].to(DEV), s["kc"].to(DEV), s["vc"].to(DEV),
                                   s["lens"].to(DEV), s["table"].to(DEV), s["cu_q"].to(DEV), 0.2)
    assert out.device.type == "xla"
    assert torch.equal(out.cpu(), xt.paged_attention(s["q"], s["kc"], s["vc"], s["lens"],
                                                     s["table"], s["cu_q"], 0.2))


# ------------------------------------------------------------------ SPMD
SPMD = textwrap.dedent("""
    import numpy as np, torch, torch_xla
    import torch_xla.runtime as xr
    import torch_xla.distributed.spmd as xs
    xr.use_spmd()
    import xla_attn.torch_xla as xx
    from xla_attn import torch as xt
    assert xr.global_runtime_device_count() == 4
    mesh = xs.Mesh(np.arange(4), (4,), ("model",))
    dev = torch_xla.device()
    torch.manual_seed(0)
    heads = (None, "model", None)
    q, k, v = torch.randn(10, 8, 16), torch.randn(12, 4, 16), torch.randn(12, 4, 16)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    qx, kx, vx = (t.to(dev).requires_grad_() for t in (q, k, v))
    out = xx.flash_attn_varlen(qx, kx, vx, cu_q.to(dev), cu_k.to(dev), 6, 7, causal=True,
                               partition_spec=heads, mesh=mesh)
    text = torch_xla._XLAC._get_xla_tensors_hlo([out])
    # per shard: the call sees 2 of the 8 heads, and nothing is gathered
    print("local call:", "custom-call(f32[10,2,16]" in text, "all-gather" not in text)
    (out * out).sum().backward()
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    expected = xt.flash_attn_varlen(qc, kc, vc, cu_q, cu_k, 6, 7, causal=True)
    (expected * expected).sum().backward()
    print("fwd equal:", torch.equal(out.detach().cpu(), expected.detach()))
    print("grads equal:", all(torch.equal(a.grad.cpu(), b.grad)
                              for a, b in ((qx, qc), (kx, kc), (vx, vc))))
    kcache, vcache = torch.randn(4, 4, 4, 16), torch.randn(4, 4, 4, 16)
    slots = torch.randperm(16)[:12].to(torch.int32)
    kxc, vxc = kcache.to(dev), vcache.to(dev)
    xx.reshape_and_cache_flash(k.to(dev), v.to(dev), kxc, vxc, slots.to(dev),
                               partition_spec=heads, mesh=mesh)
    xt.reshape_and_cache_flash(k, v, kcache, vcache, slots)
    print("cache equal:", torch.equal(kxc.cpu(), kcache) and torch.equal(vxc.cpu(), vcache))
    lens = torch.tensor([5, 7], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    slopes = torch.rand(8)  # split with the query heads
    p = xx.paged_attention(q.to(dev), kxc, vxc, lens.to(dev), table.to(dev), cu_q.to(dev), 0.2,
                           alibi_slopes=slopes.to(dev), max_query_len=6,
                           partition_spec=heads, mesh=mesh)
    print("paged equal:", torch.equal(p.cpu(), xt.paged_attention(q, kcache, vcache, lens, table,
                                                                  cu_q, 0.2,
                                                                  alibi_slopes=slopes)))
    qd, kd, vd = torch.randn(4, 8, 8, 16), torch.randn(4, 8, 4, 16), torch.randn(4, 8, 4, 16)
    seg = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2], [3, 3, 4, 4, 4, 4, 5, 5]] * 2,
                       dtype=torch.int32)
    mesh2 = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    d = xx.flash_attn(qd.to(dev), kd.to(dev), vd.to(dev), causal=True,
                      q_segment_ids=seg.to(dev), kv_segment_ids=seg.to(dev),
                      partition_spec=("data", None, "model", None), mesh=mesh2)
    print("dense equal:", torch.allclose(d.cpu(), xt.flash_attn(
        qd, kd, vd, causal=True, q_segment_ids=seg, kv_segment_ids=seg), atol=1e-6))
""")


def test_spmd_heads_sharded_on_four_cpu_devices():
    out = _run_python(SPMD, CPU_NUM_DEVICES="4")
    for line in ("local call: True True", "fwd equal: True", "grads equal: True",
                 "cache equal: True", "paged equal: True", "dense equal: True"):
        assert line in out, out

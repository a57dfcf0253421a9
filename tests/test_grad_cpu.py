"""Gradients of flash_attn_varlen and flash_attn (jax.grad through the custom_vjp and
the backward custom call) against the analytic float64 backward of the reference:
fp32 and bf16 (and fp16), causal, windows, softcap, ALiBi, GQA/MQA, seqused_k,
empty sequences and padding (zero gradients there), jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_attn
from xla_attn import jax as xj
from xla_attn.testing import reference as ref


def varlen_grads(q, k, v, cu_q, cu_k, dout, fn=None, **kw):
    """jax.grad of sum(out * dout) wrt q, k, v (dout already in q's dtype)."""
    fn = fn or xla_attn.flash_attn_varlen
    extra = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    mq = max([int(x) for x in np.diff(cu_q)] + [0])
    mk_ = max([int(x) for x in np.diff(cu_k)] + [0])
    jcu_q, jcu_k = jnp.asarray(cu_q), jnp.asarray(cu_k)
    jd = jnp.asarray(dout).astype(jnp.float32)

    def loss(q_, k_, v_):
        out = fn(q_, k_, v_, jcu_q, jcu_k, mq, mk_, **extra)
        return jnp.sum(out.astype(jnp.float32) * jd)

    grads = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    return [np.asarray(g) for g in grads]


def check_grads(got, want, dtype):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        err = ref.rel_error(g, w)
        assert err < ref.BOUNDS[dtype], f"{name}: relative error {err:.3g} ({dtype})"


VARLEN_CASES = {
    "plain": dict(),
    "causal lq<lk": dict(causal=True),
    "causal lq>lk": dict(causal=True, lens=([7, 5], [4, 2])),
    "window": dict(window_size=(3, 2)),
    "causal window": dict(causal=True, window_size=(2, -1)),
    "softcap": dict(softcap=1.5),
    "alibi(H)": dict(alibi="h", causal=True),
    "alibi(B,H)": dict(alibi="bh"),
    "everything": dict(causal=True, window_size=(6, -1), softcap=4.0, alibi="bh"),
    "mqa": dict(heads=(4, 1), causal=True),
    "mha": dict(heads=(2, 2)),
    "seqused_k": dict(seqused=True, causal=True),
    "empty and padding": dict(lens=([0, 4, 3, 0], [3, 0, 5, 0]), causal=True),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", VARLEN_CASES.values(), ids=VARLEN_CASES.keys())
def test_varlen_grads(rng, mk, dtype, case):
    case = dict(case)
    lens_q, lens_k = case.pop("lens", ([3, 6, 1], [7, 6, 4]))
    heads = case.pop("heads", (4, 2))
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, lens_q, lens_k, *heads, head_dim=32,
                                           pad_q=2, pad_k=2)
    dout = mk.random_array(rng, q.shape, dtype)
    alibi = case.pop("alibi", None)
    if alibi:
        case["alibi_slopes"] = mk.alibi(rng, heads[0]) if alibi == "h" else \
            mk.alibi(rng, len(lens_q), heads[0])
    if case.pop("seqused", False):
        case["seqused_k"] = np.array([5, 2, 4], np.int32)
    got = varlen_grads(q, k, v, cu_q, cu_k, dout, **case)
    want = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, None, **case)
    check_grads(got, want, dtype)
    # no gradient flows into padding rows of q or keys no sequence uses
    assert np.all(got[0][int(cu_q[-1]):].astype(np.float64) == 0)
    unused = np.ones(k.shape[0], bool)
    for b in range(len(lens_q)):
        n = lens_k[b] if "seqused_k" not in case else case["seqused_k"][b]
        unused[cu_k[b]:cu_k[b] + n] = False
    assert np.all(got[1][unused].astype(np.float64) == 0)
    assert np.all(got[2][unused].astype(np.float64) == 0)


@pytest.mark.parametrize("case", ["plain", "causal lq>lk", "softcap", "alibi(B,H)"])
def test_varlen_grads_float16(rng, mk, case):
    test_varlen_grads(rng, mk, "float16", VARLEN_CASES[case])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_varlen_grads_head_dims(rng, mk, head_dim):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", [4, 5], [6, 5], 2, 1, head_dim)
    dout = mk.random_array(rng, q.shape, "float32")
    got = varlen_grads(q, k, v, cu_q, cu_k, dout, causal=True)
    check_grads(got, ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, None, causal=True),
                "float32")


def test_varlen_grads_under_jit_and_value(rng, mk):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", [5, 3], [5, 8], 4, 2, 32, pad_q=1)
    dout = mk.random_array(rng, q.shape, "float32")
    jd = jnp.asarray(dout)

    @jax.jit
    def value_and_grads(q_, k_, v_, cu_q_, cu_k_):
        def loss(a, b, c):
            out, _ = xj.flash_attn_varlen(a, b, c, cu_q_, cu_k_, 5, 8, causal=True, softcap=3.0,
                                          return_softmax_lse=True)
            return jnp.sum(out * jd)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q_, k_, v_)

    value, grads = value_and_grads(*map(jnp.asarray, (q, k, v, cu_q, cu_k)))
    out, _ = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True, softcap=3.0)
    assert abs(float(value) - float((out * dout).sum())) < 1e-5 * np.abs(out * dout).sum()
    want = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, None, causal=True,
                                         softcap=3.0)
    check_grads([np.asarray(g) for g in grads], want, "float32")


@pytest.mark.parametrize("dense", [False, True])
def test_deterministic_picks_the_backward_target(rng, mk, dense):
    """deterministic=True lowers the backward to xla_attn_flash_bwd_v1 (no workspace,
    no atomics on the tensor-core family), the default to v2 (with its workspace); both
    give the reference's gradients here, and a non-bool is refused by name."""
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "bfloat16", [6, 3], [6, 9], 4, 2, 32)
    dout = mk.random_array(rng, q.shape, "bfloat16")
    if dense:
        q, k, v, dout = (x[None, :6] for x in (q, k[:6], v[:6], dout))
        fn = lambda q_, k_, v_, **kw: xj.flash_attn(q_, k_, v_, causal=True, **kw)  # noqa: E731
    else:
        fn = lambda q_, k_, v_, **kw: xj.flash_attn_varlen(  # noqa: E731
            q_, k_, v_, cu_q, cu_k, 6, 9, causal=True, **kw)
    want = None
    for deterministic, target in ((True, "xla_attn_flash_bwd_v1"), (False, "xla_attn_flash_bwd_v2")):
        grads = jax.jit(lambda q_, k_, v_, do, d=deterministic: jax.vjp(
            lambda a, b, c: fn(a, b, c, deterministic=d), q_, k_, v_)[1](do))
        text = grads.lower(q, k, v, dout).as_text()
        assert f"@{target}(" in text and text.count("@xla_attn_flash_bwd_v") == 1
        got = [np.asarray(g, np.float64) for g in grads(q, k, v, dout)]
        want = want or got
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)  # the Host runs one backward for both
    with pytest.raises(TypeError, match="deterministic must be a bool, got int"):
        fn(q, k, v, deterministic=1)


def test_grad_of_one_argument(rng, mk):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "bfloat16", [4, 2], [4, 6], 2, 2, 32)
    dout = mk.random_array(rng, q.shape, "bfloat16")
    jd = jnp.asarray(dout).astype(jnp.float32)
    dv = jax.grad(lambda v_: jnp.sum(xla_attn.flash_attn_varlen(
        jnp.asarray(q), jnp.asarray(k), v_, jnp.asarray(cu_q), jnp.asarray(cu_k), 4, 6)
        .astype(jnp.float32) * jd))(jnp.asarray(v))
    want = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, None)[2]
    assert ref.rel_error(np.asarray(dv), want) < 1e-2


# ------------------------------------------------------------------ dense layout
DENSE_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(2, 3)),
    "softcap": dict(softcap=2.0, causal=True),
    "alibi(H)": dict(alibi="h"),
    "alibi(B,H)": dict(alibi="bh", causal=True),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", DENSE_CASES.values(), ids=DENSE_CASES.keys())
@pytest.mark.parametrize("shape", [(2, 5, 7, 4, 2), (2, 6, 4, 2, 1)], ids=["gqa", "mqa sq>sk"])
def test_dense_grads(rng, mk, dtype, case, shape):
    b, sq, sk, h, hk = shape
    d = 32
    q = mk.random_array(rng, (b, sq, h, d), dtype)
    k = mk.random_array(rng, (b, sk, hk, d), dtype)
    v = mk.random_array(rng, (b, sk, hk, d), dtype)
    dout = mk.random_array(rng, q.shape, dtype)
    case = dict(case)
    alibi = case.pop("alibi", None)
    if alibi:
        case["alibi_slopes"] = mk.alibi(rng, h) if alibi == "h" else mk.alibi(rng, b, h)
    extra = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in case.items()}
    jd = jnp.asarray(dout).astype(jnp.float32)

    def loss(q_, k_, v_):
        return jnp.sum(xla_attn.flash_attn(q_, k_, v_, **extra).astype(jnp.float32) * jd)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jnp.asarray(q), jnp.asarray(k),
                                                     jnp.asarray(v))
    want = ref.flash_attn_bwd_ref(dout, q, k, v, None, **case)
    check_grads([np.asarray(g) for g in got], want, dtype)


def test_dense_grads_match_jax_nn(rng, mk):
    """A second opinion on the gradient: XLA's own attention, differentiated by jax."""
    q = mk.random_array(rng, (2, 6, 4, 32), "float32")
    k = mk.random_array(rng, (2, 6, 2, 32), "float32")
    v = mk.random_array(rng, (2, 6, 2, 32), "float32")
    dout = jnp.asarray(mk.random_array(rng, q.shape, "float32"))
    ours = jax.grad(lambda *a: jnp.sum(xj.flash_attn(*a, causal=True) * dout),
                    argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    theirs = jax.grad(lambda *a: jnp.sum(jax.nn.dot_product_attention(*a, is_causal=True) * dout),
                      argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    for a, b in zip(ours, theirs):
        assert ref.rel_error(a, b) < 1e-5


LSE_CASES = {
    "causal gqa": dict(causal=True),
    "everything": dict(causal=True, window_size=(4, -1), softcap=3.0, alibi="bh"),
    "empty and padding": dict(lens=([0, 4, 3], [3, 0, 5]), causal=True),
}


@pytest.mark.parametrize("with_out", [True, False], ids=["out and lse", "lse alone"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", LSE_CASES.values(), ids=LSE_CASES.keys())
def test_varlen_grads_through_softmax_lse(rng, mk, dtype, case, with_out):
    """A loss on softmax_lse (as ring attention merges blocks by it, or a z-loss) gets
    its gradient: lse_i = log sum_j exp(s_ij) adds p_ij dlse_i to dS. Against the float64
    backward with that term; rows without a key (lse = +inf) are kept out of the loss."""
    case = dict(case)
    lens_q, lens_k = case.pop("lens", ([3, 6, 1], [7, 6, 4]))
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, lens_q, lens_k, 4, 2, head_dim=32,
                                           pad_q=2)
    if case.pop("alibi", None):
        case["alibi_slopes"] = mk.alibi(rng, len(lens_q), 4)
    dout = mk.random_array(rng, q.shape, dtype) if with_out else np.zeros(q.shape, dtype)
    w = rng.standard_normal((4, q.shape[0]))  # the loss's weights of lse
    extra = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in case.items()}
    jcu_q, jcu_k, jd, jw = map(jnp.asarray, (cu_q, cu_k, dout, w))

    def loss(q_, k_, v_):
        out, lse = xla_attn.flash_attn_varlen(q_, k_, v_, jcu_q, jcu_k, max(lens_q), max(lens_k),
                                              return_softmax_lse=True, **extra)
        lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * jw)
        return lse_term + jnp.sum(out.astype(jnp.float32) * jd) if with_out else lse_term

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jnp.asarray(q), jnp.asarray(k),
                                                     jnp.asarray(v))
    _, lse_ref = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, **case)
    dlse = np.where(np.isfinite(lse_ref), w, 0.0)
    want = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, None, dlse=dlse, **case)
    check_grads([np.asarray(g) for g in got], want, dtype)
    assert np.all(np.asarray(got[0], np.float64)[int(cu_q[-1]):] == 0)


def test_dense_grads_through_softmax_lse(rng, mk):
    """The same through the dense layout (softmax_lse (B, H, Sq))."""
    q = mk.random_array(rng, (2, 5, 4, 32), "float32")
    k = mk.random_array(rng, (2, 7, 2, 32), "float32")
    v = mk.random_array(rng, (2, 7, 2, 32), "float32")
    w = rng.standard_normal((2, 4, 5))

    def loss(q_, k_, v_):
        _, lse = xla_attn.flash_attn(q_, k_, v_, causal=True, return_softmax_lse=True)
        return jnp.sum(lse * jnp.asarray(w))

    got = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    cu_q, cu_k = np.array([0, 5, 10], np.int32), np.array([0, 7, 14], np.int32)
    dlse = w.transpose(1, 0, 2).reshape(4, 10)  # (B, H, Sq) -> (H, B * Sq)
    want = ref.flash_attn_varlen_bwd_ref(np.zeros(flat(q).shape), flat(q), flat(k), flat(v),
                                         cu_q, cu_k, None, causal=True, dlse=dlse)
    check_grads([np.asarray(g).reshape(-1, *g.shape[2:]) for g in got], want, "float32")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("with_out", [True, False], ids=["out and lse", "lse alone"])
def test_softmax_lse_cotangent_rides_one_backward_call(rng, mk, dense, deterministic, with_out):
    """A loss on softmax_lse lowers to one xla_attn_flash_bwd_v3 call (the cotangent as its
    dlse operand; bf16's workspace, or 0 bytes when deterministic), not a second backward."""
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "bfloat16", [6, 3], [6, 9], 4, 2, 32)
    if dense:  # one sequence of 6
        q, k, v = (x[None, :6] for x in (q, k[:6], v[:6]))
        cu_q = cu_k = np.array([0, 6], np.int32)
    flat = (lambda x: x.reshape(-1, *x.shape[2:])) if dense else (lambda x: x)  # noqa: E731

    def loss(q_, k_, v_):
        if dense:
            out, lse = xj.flash_attn(q_, k_, v_, causal=True, return_softmax_lse=True,
                                     deterministic=deterministic)
        else:
            out, lse = xj.flash_attn_varlen(q_, k_, v_, cu_q, cu_k, 6, 9, causal=True,
                                            return_softmax_lse=True, deterministic=deterministic)
        lse_term = jnp.sum(lse * lse)
        return lse_term + jnp.sum(out.astype(jnp.float32)) if with_out else lse_term

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = grads.lower(q, k, v).as_text()
    assert text.count("@xla_attn_flash_bwd_v") == 1 and "@xla_attn_flash_bwd_v3(" in text
    call = text.split("@xla_attn_flash_bwd_v3(")[1].split("\n")[0]
    assert call.endswith("tensor<0xui8>)") == deterministic
    _, lse = ref.flash_attn_varlen_ref(flat(q), flat(k), flat(v), cu_q, cu_k, None, causal=True)
    dout = np.ones(flat(q).shape) if with_out else np.zeros(flat(q).shape)
    want = ref.flash_attn_varlen_bwd_ref(dout, flat(q), flat(k), flat(v), cu_q, cu_k, None,
                                         causal=True, dlse=2 * lse)
    check_grads([flat(np.asarray(g)) for g in grads(q, k, v)], want, "bfloat16")


def test_second_order_derivatives_name_what_is_missing(rng, mk):
    """Differentiating the backward (grad of grad) raises xla_attn's own message rather
    than the partitioner's; first-order gradients under remat are unchanged."""
    q = jnp.asarray(mk.random_array(rng, (1, 8, 2, 16), "float32"))
    k = jnp.asarray(mk.random_array(rng, (1, 8, 2, 16), "float32"))

    def f(q_):
        out, lse = xla_attn.flash_attn(q_, k, k, causal=True, return_softmax_lse=True)
        return jnp.sum(out ** 2) + jnp.sum(lse)

    np.testing.assert_array_equal(np.asarray(jax.grad(jax.checkpoint(f))(q)),
                                  np.asarray(jax.grad(f)(q)))
    with pytest.raises(NotImplementedError, match="flash attention is differentiable once"):
        jax.grad(lambda q_: jnp.sum(jax.grad(f)(q_)))(q)

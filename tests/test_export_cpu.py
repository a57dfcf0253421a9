"""Serialized programs keep working: jax.export round trip of every op and target (the
target names carry the version, docs/xla-targets.md; a raw xla_attn_paged_attention_v1
call stands for a program serialized before v2), and vmap over a leading batch axis
(equal to a Python loop; every op's vmap is in test_vmap_cpu.py)."""

import re

import jax
from jax import export as jax_export
import jax.numpy as jnp
import numpy as np
import pytest

import xla_attn
from xla_attn import _native
from xla_attn import jax as xj
from xla_attn.testing import reference as ref

TARGETS = list(_native.HANDLERS)


def _inputs(rng):
    q = jnp.asarray(rng.standard_normal((12, 4, 32)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((14, 2, 32)), jnp.float32)
    cu_q, cu_k = jnp.array([0, 5, 12], jnp.int32), jnp.array([0, 6, 14], jnp.int32)
    cache = jnp.asarray(rng.standard_normal((4, 8, 2, 32)), jnp.float32)
    return q, k, cu_q, cu_k, cache


def _program(q, k, cu_q, cu_k, cache):
    out = xla_attn.flash_attn_varlen(q, k, k + 1, cu_q, cu_k, 7, 8, causal=True)
    grad = jax.grad(lambda q: xla_attn.flash_attn_varlen(q, k, k, cu_q, cu_k, 7, 8).sum())(q)
    kc, vc = xla_attn.reshape_and_cache_flash(q[:3, :2], q[:3, :2], cache, cache,
                                              jnp.array([1, -1, 30], jnp.int32))
    paged_args = (q[:2], kc, vc, jnp.array([9, 20], jnp.int32),
                  jnp.array([[0, 1, 2], [3, 2, 1]], jnp.int32), jnp.array([0, 1, 2], jnp.int32))
    paged = xla_attn.paged_attention(*paged_args, 0.2, alibi_slopes=jnp.full((4,), 0.3),
                                     max_query_len=1)
    # deterministic=True: the backward's v1 target (the default is v2)
    grad_v1 = jax.grad(lambda q: xla_attn.flash_attn_varlen(q, k, k, cu_q, cu_k, 7, 8,
                                                            deterministic=True).sum())(q)
    # a loss on softmax_lse: the v3 target (its cotangent as an operand)
    grad_v3 = jax.grad(lambda q: xla_attn.flash_attn_varlen(
        q, k, k, cu_q, cu_k, 7, 8, return_softmax_lse=True)[1].sum())(q)
    return out, grad, kc, paged, _paged_v1(*paged_args), grad_v1, grad_v3


def _paged_v1(*args):
    """What programs serialized before xla_attn_paged_attention_v2 call."""
    xj._register()
    absent_i, absent_f = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
    results = (jax.ShapeDtypeStruct(args[0].shape, args[0].dtype),
               jax.ShapeDtypeStruct((0,), jnp.uint8))
    out, _ = jax.ffi.ffi_call("xla_attn_paged_attention_v1", results)(
        *args, absent_i, absent_f, absent_f, scale=np.float32(0.2), soft_cap=np.float32(0),
        sliding_window=0, kv_cache_dtype="auto")
    return out


def test_export_round_trip(rng):
    args = _inputs(rng)
    exported = jax_export.export(
        jax.jit(_program),
        disabled_checks=[jax_export.DisabledSafetyCheck.custom_call(t) for t in TARGETS])(*args)
    text = exported.mlir_module()
    for target in TARGETS:
        assert target in text, target
    again = jax_export.deserialize(exported.serialize())
    for got, want in zip(again.call(*args), jax.jit(_program)(*args)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    results = again.call(*args)
    kc = np.asarray(results[2])
    want = ref.paged_attention_ref(np.asarray(args[0][:2]), kc, kc, [9, 20],
                                   np.array([[0, 1, 2], [3, 2, 1]]), [0, 1, 2], 0.2)
    assert ref.rel_error(np.asarray(results[4]), want) < 1e-5
    want = ref.paged_attention_ref(np.asarray(args[0][:2]), kc, kc, [9, 20],
                                   np.array([[0, 1, 2], [3, 2, 1]]), [0, 1, 2], 0.2,
                                   alibi_slopes=np.full(4, 0.3))
    assert ref.rel_error(np.asarray(results[3]), want) < 1e-5


def test_vmap_matches_a_loop(rng):
    q = jnp.asarray(rng.standard_normal((3, 2, 10, 4, 32)), jnp.float32)  # vmapped axis first
    k = jnp.asarray(rng.standard_normal((3, 2, 12, 2, 32)), jnp.float32)
    f = lambda q, k: xla_attn.flash_attn(q, k, k, causal=True)  # noqa: E731
    batched = jax.vmap(f)(q, k)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(batched[i]), np.asarray(f(q[i], k[i])))


@pytest.mark.parametrize("target", TARGETS)
def test_target_names_are_versioned(target):
    assert re.fullmatch(r"xla_attn_[a-z_]+_v[1-9][0-9]*", target)

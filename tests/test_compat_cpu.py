"""The one native library (FFI API 0.1) registers and runs every op under whichever
jax is installed; CI runs this under the newest jax and under jax 0.7.2."""

import jax
import jax.numpy as jnp
import numpy as np

import xla_attn
from xla_attn import _native


def test_library_and_abi():
    info = _native.build_info()
    assert info["abi"] == _native.ABI_VERSION
    assert {"reshape_and_cache_flash_portable", "flash_fwd_portable"} <= {m["name"] for m in info["modules"]}
    archs = info["modules"][0]["archs"].split(";")
    assert len(archs) >= 1 and all(a.isdigit() for a in archs)


def test_every_target_runs_on_this_jax():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((6, 2, 16)), jnp.float32)
    cu = jnp.array([0, 6], jnp.int32)
    out = jax.jit(lambda q: xla_attn.flash_attn_varlen(q, q, q, cu, cu, 6, 6, causal=True))(q)
    grad = jax.grad(lambda q: xla_attn.flash_attn_varlen(q, q, q, cu, cu, 6, 6).sum())(q)
    cache = jnp.asarray(rng.standard_normal((2, 4, 2, 16)), jnp.float32)
    paged = xla_attn.paged_attention(q[:2], cache, cache, jnp.array([5], jnp.int32),
                                     jnp.array([[1, 0]], jnp.int32), jnp.array([0, 2], jnp.int32),
                                     0.25)
    kc, _ = xla_attn.reshape_and_cache_flash(q[:1], q[:1], cache, cache, jnp.array([3], jnp.int32))
    for x in (out, grad, paged, kc):
        assert np.isfinite(np.asarray(x)).all()
    np.testing.assert_array_equal(np.asarray(kc).reshape(8, 2, 16)[3], np.asarray(q[0]))
